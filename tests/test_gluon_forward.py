"""The Hopper forward's host side (lowering/gluon_forward.py), on CPU.

The kernel itself needs an sm_90 GPU: scripts/gpu_check.py's "hopper" cases check it against
the float64 reference there (BENCHMARKS.md). Here: that the TMA views reach exactly the rows of
each selected set, and when the kernel is not used.
"""
import pytest
import torch

from hilbert_fx.lowering import gluon_forward, tuning
from hilbert_fx.lowering.plans import branch_plan


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("r", [1, 2, 4])
def test_view_reaches_each_set_member(layout, r):
    b, hx, n, d, w = 2, 3, 96, 8, 32
    if layout == "contiguous":
        x = torch.randn(b, hx, n, d)
    else:
        x = torch.randn(b, n, hx, d).transpose(1, 2)
    view, rb, rh, ch, co = gluon_forward._view(x, r)
    assert view.data_ptr() == x.data_ptr()  # a view, no copy
    for bi in range(b):
        for h in range(hx):
            for o in range(r):
                for j in range(n // w):
                    for m in range(w // r):
                        row = bi * rb + h * rh + j * (w // r) + m
                        col = o * co + h * ch
                        assert torch.equal(view[row, col:col + d], x[bi, h, j * w + o + m * r]), \
                            (bi, h, o, j, m)


def test_view_refuses_other_layouts():
    x = torch.randn(1, 2, 64, 16)
    assert gluon_forward._view(x[:, :, ::2], 1) is None
    assert gluon_forward._view(x.transpose(2, 3), 1) is None


def test_not_used_on_cpu_or_when_turned_off(monkeypatch):
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    plan = branch_plan(256, 256, 1, False)
    why = gluon_forward.unsupported(q, q, q, plan, is_causal=False, mask_kind=0, dropout=False,
                                    scale=0.125)
    assert why == "not a compute capability 9.x GPU"
    assert "(256, 1) forward: Triton kernel (not a compute capability 9.x GPU)" in gluon_forward.kernel_choices()
    monkeypatch.setenv("HILBERT_FX_GLUON", "0")
    monkeypatch.setattr(tuning, "_current", None)  # the knobs are read once: read them again
    why = gluon_forward.unsupported(q, q, q, plan, is_causal=False, mask_kind=0, dropout=False,
                                    scale=0.125)
    assert why == "HILBERT_FX_GLUON=0"


def test_whole_sets_only():
    """The kernel's grid assumes N / w segments of w / r members each: a partial last segment or
    a ring shard's part of a segment runs on the Triton kernels."""
    from hilbert_fx.lowering.ring_plan import shard_branch_plans
    assert gluon_forward._whole_sets(branch_plan(4096, 1024, 2, True))
    assert not gluon_forward._whole_sets(branch_plan(4000, 1024, 2, True))
    for plan in shard_branch_plans(3000, 2, 0, [2048, 4096], [1, 2], True):
        assert not gluon_forward._whole_sets(plan)


def test_other_triton_versions_refused(monkeypatch):
    """Gluon's API differs between Triton releases: an untested one runs the Triton kernels."""
    import triton
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    monkeypatch.setattr(gluon_forward, "_kernels", None)
    monkeypatch.setattr(gluon_forward, "_import_error", None)
    assert gluon_forward._load() is None
    assert "Triton 3.9.0" in gluon_forward._import_error
