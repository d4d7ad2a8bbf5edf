"""The ring's row kernels (lowering/triton_rows.py) against the torch ops they replace on GPUs:
block_attention.merge at scattered rows, and the addition of gradients in float32. Run on CPU
tensors under the Triton interpreter."""
import pytest
import torch

from hilbert_fx.lowering import block_attention

triton = pytest.importorskip("triton")

from hilbert_fx.lowering import triton_rows  # noqa: E402
from hilbert_fx.lowering.triton_lowering import interpreter_active  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="needs TRITON_INTERPRET=1")


def _merged_by_torch(out, lse, index, o, lse_o):
    out, lse = out.clone(), lse.clone()
    l1 = lse[:, index]
    o1 = out[:, index].float().masked_fill((l1 == float("-inf")).unsqueeze(-1), 0.0)
    o2 = o.float().masked_fill((lse_o == float("-inf")).unsqueeze(-1), 0.0)
    merged, lse[:, index] = block_attention.merge(o1, l1, o2, lse_o.float())
    out[:, index] = merged.to(out.dtype)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 40])
def test_merge_rows_equals_the_torch_merge(dtype, d):
    g = torch.Generator().manual_seed(d)
    b, rows, t = 2, 97, 37
    out = torch.randn(b, rows, d, generator=g).to(dtype)
    lse = torch.randn(b, rows, generator=g) * 3
    index = torch.randperm(rows, generator=g)[:t]
    # o read through a slice with a row stride of its own, as the ring's folded results are
    o = torch.randn(b, t + 5, d, generator=g).to(dtype)[:, :t]
    lse_o = torch.randn(b, t + 5, generator=g)[:, :t] * 3
    # rows with no key on one side or both (lse -inf; their out may hold anything)
    lse[0, index[:4]] = float("-inf")
    out[0, index[:4]] = float("nan")
    lse_o[0, 2:6] = float("-inf")
    o[0, 2:6] = float("nan")
    lse_o[1, :3] = 1e4  # a dominant side
    want_out, want_lse = _merged_by_torch(out, lse, index, o, lse_o)
    triton_rows.merge_rows_(out, lse, index, o, lse_o)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol,
                               equal_nan=False)
    assert torch.isneginf(lse[0, index[2:4]]).all() and (out[0, index[2:4]] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rows_adds_in_float32(dtype):
    g = torch.Generator().manual_seed(1)
    b, rows, t, d = 2, 50, 21, 24
    x = torch.randn(b, rows, d, generator=g).to(dtype)
    index = torch.randperm(rows, generator=g)[:t]
    delta = torch.randn(b, t, d, generator=g)
    want = x.clone()
    want[:, index] = (want[:, index].float() + delta).to(dtype)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[index] = False
    before = x[:, untouched].clone()
    triton_rows.add_rows_(x, index, delta)
    assert torch.equal(x[:, untouched], before)
    # one rounding to dtype (the interpreter may round bfloat16 toward zero, the GPU to nearest)
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(x.float(), want.float(), rtol=ulp, atol=ulp)


def test_usable_only_on_cuda_without_float64():
    x = torch.zeros(1, 4, 8)
    assert not triton_rows.usable(x)
