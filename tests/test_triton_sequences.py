"""The Triton lowering on plans of several sequences in one row (SPEC section 5): sets partial in
any segment, empty sets (count 0), rows in no set (padding), built here by hand from each
document's own plan so that lowering/sequences.py is not needed to make them.

Each layout is checked three ways: against the SDPA lowering on the same plans, against each
document run alone through the op (padding rows: output 0, lse -inf, gradients 0), with the
lowering's float32 buffers poisoned with NaN where nothing wrote them (a read of a row no branch
wrote shows as NaN)."""
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hilbert_fx  # noqa: E402
from hilbert_fx.lowering import gluon_forward, sdpa_lowering, tuning  # noqa: E402
from hilbert_fx.lowering.plans import BranchPlan, branch_plan, whole_sets  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_op_exact import _PoisonedTorch, assert_matches, common_scale, require_lowering  # noqa: E402

NEG_INF = float("-inf")


def packed_plans(n: int, documents, segs, rates, hilbert: bool) -> list[BranchPlan]:
    """The plans of a row of n tokens holding `documents` [(start, length)]: each document's own
    plan shifted to its start, its padding value (its length) remapped to n; rows outside every
    document are in no set."""
    covered = sum(length for _, length in documents)
    plans = []
    for w, r in zip(segs, rates):
        pos, cnt = [], []
        for start, length in documents:
            p = branch_plan(length, w, r, hilbert)
            pos.append(torch.where(p.positions < length, p.positions + start, n))
            cnt.append(p.counts)
        plans.append(BranchPlan(w, r, n, torch.cat(pos, 1).contiguous(),
                                torch.cat(cnt, 1).contiguous(), strided=False,
                                complete=covered == n))
    return plans


# (rows, documents, branches): documents 37 and 50 long with padding between and after them
# (partial sets in the middle of the row, count-0 sets where a document's last segment is
# shorter than r, an r == 1 branch that does not cover the row), and two documents filling the
# row (complete: the r == 1 branch writes the final result in place)
LAYOUTS = {
    "padded": (100, [(0, 37), (43, 50)], [8, 16, 32], [1, 2, 4]),
    "padded-no-r1": (100, [(5, 37), (45, 50)], [16, 64], [2, 4]),
    "complete": (100, [(0, 37), (37, 63)], [8, 16, 32], [2, 1, 4]),
}


def _inputs(b, hq, hkv, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv, hq))
    return q, k, v, dout


def _alone(q, k, v, dout, documents, segs, rates, hilbert, causal, scale):
    """(out, dq, dk, dv): each document alone through the op (float64, SDPA lowering), zero on
    rows outside every document."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    pieces = []
    for start, length in documents:
        rows = slice(start, start + length)
        o = hilbert_fx.dilated_attention(*(x[:, :, rows] for x in leaves), segs, rates,
                                         hilbert=hilbert, is_causal=causal, scale=scale,
                                         enable_gqa=True, lowering="sdpa")
        out[:, :, rows] = o.detach()
        pieces.append((o * dout[:, :, rows].double()).sum())
    grads = torch.autograd.grad(sum(pieces), leaves)
    return (out, *grads)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hilbert", [False, True], ids=["identity", "hilbert"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_plans(layout, hilbert, causal, gqa, monkeypatch):
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    n, documents, segs, rates = LAYOUTS[layout]
    hq, hkv, d = (4, 2, 8) if gqa else (2, 2, 8)
    q, k, v, dout = _inputs(2, hq, hkv, n, d)
    scale = 1 / math.sqrt(d)
    plans = packed_plans(n, documents, segs, rates, hilbert)
    kw = dict(is_causal=causal, attn_mask=None, scale=scale)

    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    grads = triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)

    # the SDPA lowering on the same plans (it repeats k, v for GQA itself)
    ref_out, ref_lse = sdpa_lowering.forward(q, k, v, plans, **kw)
    ref_grads = sdpa_lowering.backward(dout, q, k, v, ref_out, ref_lse, plans, **kw)
    assert_matches(out, ref_out, "out vs sdpa")
    assert torch.equal(lse == NEG_INF, ref_lse == NEG_INF)
    live = lse > NEG_INF
    assert_matches(lse[live], ref_lse[live].float(), "lse vs sdpa")
    sc = common_scale(*ref_grads)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_matches(a, b, f"d{name} vs sdpa", scale=sc)

    # each document alone
    alone = _alone(q, k, v, dout, documents, segs, rates, hilbert, causal, scale)
    assert_matches(out, alone[0].float(), "out vs documents alone")
    sc = common_scale(*alone[1:])
    for name, a, b in zip("qkv", grads, alone[1:]):
        assert_matches(a, b.float(), f"d{name} vs documents alone", scale=sc)
    padding = torch.ones(n, dtype=torch.bool)
    for start, length in documents:
        padding[start:start + length] = False
    assert (out[:, :, padding] == 0).all() and (lse[:, :, padding] == NEG_INF).all()
    for g in grads:
        assert (g[:, :, padding] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_new_layouts_of_one_size_run_the_first_layouts_programs(causal, monkeypatch):
    """Sequence plans come new with each batch (lowering/sequences.py); a program built for one
    batch takes the next one's plan tensors as it takes q, k, v, so batches of one size build
    one forward and one backward program between them, each batch equal to its documents alone
    (float32 buffers poisoned with NaN where nothing wrote them)."""
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering
    from hilbert_fx.lowering.sequences import sequence_plans
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    n, segs, rates = 100, [8, 16, 32], [1, 2, 4]
    layouts = [[(0, 37), (43, 50)], [(3, 90)], [(0, 5), (5, 11), (20, 7), (30, 70)]]
    q, k, v, dout = _inputs(1, 4, 2, n, 8, seed=3)
    kw = dict(is_causal=causal, attn_mask=None, scale=0.3)
    for i, documents in enumerate(layouts):
        positions = torch.full((1, n), -1)
        for start, length in documents:
            positions[0, start:start + length] = torch.arange(length)
        plans = sequence_plans(positions, segs, rates, True)
        out, lse = triton_lowering.forward(q, k, v, plans, **kw)
        grads = triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
        assert len(triton_lowering._programs) == 2, f"layout {i} built programs of its own"
        alone = _alone(q, k, v, dout, documents, segs, rates, True, causal, 0.3)
        assert_matches(out, alone[0].float(), f"out of layout {i} vs documents alone")
        sc = common_scale(*alone[1:])
        for name, a, b in zip("qkv", grads, alone[1:]):
            assert_matches(a, b.float(), f"d{name} of layout {i} vs documents alone", scale=sc)


@pytest.mark.parametrize("atomic_dq", ["0", "1"])
def test_packed_plans_atomic_dq(atomic_dq, monkeypatch):
    """dq summed in a zeroed buffer (by atomics in the dK/dV kernel) on a padded layout."""
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    monkeypatch.setenv("HILBERT_FX_TRITON_ATOMIC_DQ", atomic_dq)
    monkeypatch.setattr(tuning, "_current", None)  # the knobs are read once: read them again
    n, documents, segs, rates = LAYOUTS["padded"]
    q, k, v, dout = _inputs(1, 4, 2, n, 8, seed=1)
    plans = packed_plans(n, documents, segs, rates, True)
    kw = dict(is_causal=True, attn_mask=None, scale=0.3)
    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    grads = triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
    alone = _alone(q, k, v, dout, documents, segs, rates, True, True, 0.3)
    sc = common_scale(*alone[1:])
    for name, a, b in zip("qkv", grads, alone[1:]):
        assert_matches(a, b.float(), f"d{name}", scale=sc)


def test_forward_order_writes_in_place_only_what_covers_every_real_row():
    """The final result is written in place by a complete r == 1 plan, or by the r == 1 plans
    built together for one branch of packed rows (all of them: they hold every real row between
    them), into buffers zeroed for the padding rows; a part alone never."""
    from hilbert_fx.lowering.triton_lowering import _forward_order
    from hilbert_fx.lowering.sequences import sequence_plans
    n, documents, segs, rates = LAYOUTS["padded"]
    positions = torch.full((1, n), -1)
    for start, length in documents:
        positions[0, start:start + length] = torch.arange(length)
    plans = sequence_plans(positions, segs, rates, False)
    parts = [p for p in plans if p.dilation_rate == 1]
    assert len(parts) == 2 and parts[0].part_of == parts[1].part_of
    order, last, zeroed = _forward_order(plans)
    assert last == 2 and zeroed and order[-2:] == parts
    assert sorted(id(p) for p in order) == sorted(id(p) for p in plans)
    order, last, zeroed = _forward_order([p for p in plans if p is not parts[1]])
    assert last == 0 and not zeroed
    full = branch_plan(n, 8, 1, False)
    order, last, zeroed = _forward_order(plans + [full])
    assert last == 1 and not zeroed and order[-1] is full


def test_hopper_refuses_incomplete_plans_from_fields():
    """The Hopper kernels need whole sets; a plan with padding is refused from its fields, and a
    plan's counts are never read on the host to decide (here they live on the meta device, where
    reading them would raise)."""
    n, w, r = 256, 128, 1
    base = branch_plan(n, w, r, False)
    meta = BranchPlan(w, r, n, base.positions.to("meta"), base.counts.to("meta"), strided=True)
    assert whole_sets(meta)
    padded = BranchPlan(w, r, n, base.positions.to("meta"), base.counts.to("meta"),
                        strided=False, complete=False)
    assert not whole_sets(padded)


@pytest.mark.parametrize("n", [96, 100, 128, 200, 256])
@pytest.mark.parametrize("w,r", [(32, 1), (32, 2), (64, 4), (16, 8)])
@pytest.mark.parametrize("hilbert", [False, True])
def test_whole_sets_from_fields_agree_with_counts(n, w, r, hilbert):
    """The fields' rule (complete, N / w segments of w / r slots) is the counts' rule on the
    plans of lowering/plans.py, on ring shards, and on packed plans."""
    from hilbert_fx.lowering.ring_plan import shard_branch_plans

    def by_counts(p):
        return (p.seq_len % p.segment_length == 0 and p.num_segments == p.seq_len // p.segment_length
                and p.set_size == p.segment_length // p.dilation_rate
                and bool((p.counts == p.segment_length // p.dilation_rate).all())
                and getattr(p, "complete", True))

    plans = [branch_plan(n, w, r, hilbert)]
    plans += shard_branch_plans(n // 2, 2, 1, [w], [r], hilbert) if n % 2 == 0 else []
    plans += packed_plans(n, [(0, n // 2), (n // 2, n - n // 2)], [w], [r], hilbert)
    plans += packed_plans(n, [(0, n // 2 - 3), (n // 2, n - n // 2)], [w], [r], hilbert)
    for p in plans:
        assert whole_sets(p) == by_counts(p)
