"""The Hopper kernels' host side on CPU: the backward's place in the Triton lowering, and the TMA
copies of stride-r runs.

The kernels need an sm_90 GPU (scripts/gpu_check.py's "hopper" cases check them against the
float64 reference there, BENCHMARKS.md). Here:
- lowering/triton_lowering.backward mixes branches whose gradients come from the Hopper kernel
  with branches on the Triton kernels. The kernel's contract (lowering/gluon_backward.launch:
  dq added into a zeroed float32 buffer, dK/dV added to what earlier branches left at the rows
  Seen marks, a LAST branch writing the inputs' dtype) is emulated in torch, and the lowering's
  result compared with the float64 reference, its buffers poisoned with NaN where unwritten;
- the addressing of runs: each box the producer copies holds exactly the run's rows.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_op_exact import (TRITON_ORDERS, _cfg, _PoisonedTorch, assert_matches,  # noqa: E402
                           common_scale, require_lowering, run_both)

from reference import reference_dilated_attention  # noqa: E402

from hilbert_fx.lowering import dropout, gluon_backward, gluon_forward, tuning  # noqa: E402
from hilbert_fx.lowering.plans import branch_plan  # noqa: E402

LOG2E = 1.4426950408889634


def keep_bits(seed, b, h, rows, cols, threshold):
    """Dropout's keep bits of entries (rows x cols) of batch b, head h: lowering/dropout.py's
    hash, with the threshold the kernels take."""
    mix, m32 = dropout._mix32, 0xFFFFFFFF
    x = mix((seed.long() & m32) ^ mix(torch.tensor((b << 16) + h) & m32))
    x = mix(x ^ rows.long()[:, None])
    x = mix(x ^ cols.long()[None, :])
    return (x >> 8) >= threshold


def emulated_launch(q, k, v, dout, dq, dk, dv, dk_final, dv_final, seen, lse2, delta, plan,
                    positions, *, is_causal, scale, first, last, mask=None, seed=None,
                    dropout_rows=None, keep_threshold=0, drop_scale=1.0):
    """What lowering/gluon_backward_kernels.py's _bwd_kernel leaves behind, in torch (mask:
    [B, H, N, N], uint8 for a boolean one; seed: dropout's, with its threshold and scale)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    group, r = hq // hkv, plan.dilation_rate
    grads = [torch.zeros(b, hkv, n, x.shape[-1]) for x in (k, v)]
    written = torch.zeros(hkv, n, dtype=torch.bool)
    for h in range(hq):
        o, g = h % r, h // group
        for j in range(plan.num_segments):
            p = plan.positions[o, j, :plan.counts[o, j]]
            qs, ks, vs, dos = q[:, h, p].float(), k[:, g, p].float(), v[:, g, p].float(), \
                dout[:, h, p].float()
            s = qs @ ks.transpose(-1, -2) * (scale * LOG2E)
            if mask is not None and mask.dtype == torch.uint8:
                s = s.masked_fill(mask[:, h][:, p][:, :, p] == 0, float("-inf"))
            elif mask is not None:
                s = s + mask[:, h][:, p][:, :, p].float() * LOG2E
            prob = torch.exp2(s - lse2[:, h, p, None])
            if is_causal:
                prob = prob.tril()  # members in ascending position order
            dp = dos @ vs.transpose(-1, -2)
            kept = prob
            if seed is not None:
                hashed = p if dropout_rows is None else dropout_rows[p]
                keep = torch.stack([keep_bits(seed, bi, h, hashed, hashed, keep_threshold)
                                    for bi in range(b)])
                kept = torch.where(keep, prob * drop_scale, 0.0)
                dp = torch.where(keep, dp * drop_scale, 0.0)
            ds = prob * (dp - delta[:, h, p, None])
            dq[:, h, p] += scale * ds @ ks
            grads[0][:, g, p] += scale * ds.transpose(-1, -2) @ qs
            grads[1][:, g, p] += kept.transpose(-1, -2) @ dos
            written[g, p] = True
    for grad, buf, final in zip(grads, (dk, dv), (dk_final, dv_final)):
        rows = written.expand(b, hkv, n)
        if not first:
            earlier = (seen != 0).expand(b, hkv, n).unsqueeze(-1)
            grad += torch.where(earlier, buf, 0.0)
        if last:
            final[rows] = grad[rows].to(final.dtype)
        else:
            buf[rows] = grad[rows]


# whole sets in the Hilbert order gathered row by row (no runs), and six branches, causal
WHOLE_GATHERED = [
    _cfg(N=64, segs=[16, 32, 64], rates=[1, 2, 4], B=2, Hq=4, Hkv=2, gqa=True, D=8),
    _cfg(N=256, segs=[16, 32, 64, 128, 256, 64], rates=[2, 2, 4, 4, 8, 1], B=1, Hq=8, Hkv=8,
         gqa=False, D=8, causal=True),
]


@pytest.mark.parametrize("hopper_rates", ["all", "r == 1", "r > 1"])
@pytest.mark.parametrize("cfg", TRITON_ORDERS + WHOLE_GATHERED,
                         ids=lambda c: f"N{c['N']}-{c['segs']}-{c['rates']}")
def test_backward_mixes_hopper_and_triton_branches(cfg, hopper_rates, monkeypatch):
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering

    def unsupported(q, k, v, plan, **kw):
        r = plan.dilation_rate
        picked = {"all": True, "r == 1": r == 1, "r > 1": r > 1}[hopper_rates]
        return None if picked else "test: Triton kernels"

    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    monkeypatch.setattr(gluon_backward, "unsupported", unsupported)
    monkeypatch.setattr(gluon_backward, "launch", emulated_launch)
    monkeypatch.setenv("HILBERT_FX_TRITON_ATOMIC_DQ", "0")
    monkeypatch.setattr(tuning, "_current", None)  # the knobs are read once: read them again
    out, ref, g_out, g_ref = run_both(cfg, lowering="triton")
    sc = common_scale(ref, *g_ref)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name}", scale=sc)


@pytest.mark.parametrize("hopper_rates", ["all", "r == 1"])
def test_backward_with_dropout_mixes_hopper_and_triton_branches(hopper_rates, monkeypatch):
    """Dropout's gradients where the Hopper kernel (emulated) and the Triton kernels share a
    call, against the float64 reference given the same keep bits (the op's seed drawn again)."""
    require_lowering("triton")
    from hilbert_fx.lowering import dilated_attention, triton_lowering

    def unsupported(q, k, v, plan, **kw):
        return None if hopper_rates == "all" or plan.dilation_rate == 1 else "test: Triton"

    monkeypatch.setattr(gluon_backward, "unsupported", unsupported)
    monkeypatch.setattr(gluon_backward, "launch", emulated_launch)
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    b, h, n, d, p = 2, 4, 40, 8, 0.3
    segs, rates = [16, 40], [1, 2]
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    mask = torch.rand(b, 1, n, n) > 0.2
    mask[0, 0, 7] = False  # a query with no key
    torch.manual_seed(3)
    out = dilated_attention(q, k, v, segs, rates, hilbert=True, attn_mask=mask, dropout_p=p,
                            lowering="triton")
    torch.manual_seed(3)
    seed = dropout.new_seed(torch.device("cpu"))
    ar = torch.arange(n)
    keep = dropout.keep_mask(seed, torch.arange(b).view(b, 1, 1, 1),
                             torch.arange(h).view(1, h, 1, 1), ar.view(1, 1, n, 1),
                             ar.view(1, 1, 1, n), p)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_dilated_attention(q64, k64, v64, segs, rates, hilbert=True, attn_mask=mask,
                                      dropout_p=p, dropout_keep=keep)
    g = torch.randn(out.shape, dtype=torch.float64)
    g_out = torch.autograd.grad(out, (q, k, v), g.float())
    g_ref = torch.autograd.grad(ref, (q64, k64, v64), g)
    assert_matches(out, ref, "out")
    sc = common_scale(ref, *g_ref)
    for name, a, b_ in zip("qkv", g_out, g_ref):
        assert_matches(a, b_, f"d{name}", scale=sc)


def test_backward_hashes_the_dropout_rows_it_is_given(monkeypatch):
    """dropout_rows (the positions a ring shard's rows stand for) reach the Hopper backward
    (emulated) beside the Triton kernels: the gradients are the reference's under the keep bits
    of those positions."""
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering
    from hilbert_fx.lowering.plans import branch_plans

    monkeypatch.setattr(gluon_backward, "unsupported",
                        lambda q, k, v, plan, **kw: None if plan.dilation_rate == 1 else "test")
    monkeypatch.setattr(gluon_backward, "launch", emulated_launch)
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    b, h, n, d, p, scale = 1, 4, 32, 8, 0.3, 0.35
    segs, rates = [16, 32], [1, 2]
    q, k, v, g = (torch.randn(b, h, n, d) for _ in range(4))
    rows, seed = torch.arange(n) * 3 + 1000, torch.tensor(11)
    plans = branch_plans(n, segs, rates, True, q.device)
    kw = dict(is_causal=False, attn_mask=None, scale=scale, dropout_p=p, seed=seed,
              dropout_rows=rows)
    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    grads = triton_lowering.backward(g, q, k, v, out, lse, plans, **kw)
    keep = dropout.keep_mask(seed, torch.arange(b).view(b, 1, 1, 1),
                             torch.arange(h).view(1, h, 1, 1), rows.view(1, 1, n, 1),
                             rows.view(1, 1, 1, n), p)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_dilated_attention(q64, k64, v64, segs, rates, hilbert=True, scale=scale,
                                      dropout_p=p, dropout_keep=keep)
    g_ref = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    assert_matches(out, ref, "out")
    sc = common_scale(ref, *g_ref)
    for name, a, b_ in zip("qkv", grads, g_ref):
        assert_matches(a, b_, f"d{name}", scale=sc)


def test_refused_on_cpu_and_under_deterministic_algorithms(monkeypatch):
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    plan = branch_plan(256, 256, 1, False)
    why = gluon_backward.unsupported(q, q, q, plan, is_causal=False, mask_kind=0, dropout=False,
                                     scale=0.125, deterministic=False)
    assert why == "not a compute capability 9.x GPU"
    assert "(256, 1) backward: Triton kernel (not a compute capability 9.x GPU)" in \
        gluon_forward.kernel_choices()
    monkeypatch.setattr(gluon_forward, "_unsupported", lambda *a: None)  # as on an H100
    assert gluon_backward.unsupported(q, q, q, plan, is_causal=False, mask_kind=0, dropout=False,
                                      scale=0.125, deterministic=False) is None
    why = gluon_backward.unsupported(q, q, q, plan, is_causal=False, mask_kind=0, dropout=False,
                                     scale=0.125, deterministic=True)
    assert "deterministic" in why
    # offsets within a head are int32 in the kernel: N * D must stay under 2**31
    huge = torch.empty(1, 1, 2**24, 128, dtype=torch.bfloat16, device="meta")
    why = gluon_backward.unsupported(huge, huge, huge, plan, is_causal=False, mask_kind=0,
                                     dropout=False, scale=0.125, deterministic=False)
    assert "2**31" in why


def test_run_lengths():
    """Hilbert's r = 2 sets come in runs of a grid row's half; r = 4 has none; strided plans
    need none (their whole tiles are one box)."""
    assert gluon_forward.plan_run(branch_plan(65536, 4096, 2, True)) == 32
    assert gluon_forward.plan_run(branch_plan(65536, 8192, 2, True)) == 64
    assert gluon_forward.plan_run(branch_plan(65536, 8192, 4, True)) == 0
    assert gluon_forward.plan_run(branch_plan(65536, 4096, 2, False)) == 0


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("w, r", [(1024, 2), (2048, 2), (1024, 4), (512, 1)])
def test_run_lengths_from_the_order_equal_those_of_the_positions(w, r, hilbert):
    """A plan that names its order has its runs found from the order's table on the host (no
    read of its positions from the GPU): the same runs as its positions have, for one row's
    plans and for the plans of packed rows whose documents fill whole segments."""
    from dataclasses import replace

    from hilbert_fx.lowering.sequences import sequence_plans
    pos = torch.cat([torch.arange(3 * w), torch.arange(w), torch.arange(2 * w)]).view(2, 3 * w)
    for plan in (branch_plan(6 * w, w, r, hilbert), *sequence_plans(pos, (w,), (r,), hilbert)):
        assert plan.hilbert == hilbert
        from_positions = gluon_forward._longest_run(replace(plan, hilbert=None))
        assert gluon_forward._longest_run(plan) == from_positions


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_run_boxes_hold_exactly_the_runs_rows(layout):
    """The producer copies RUN members Pos[first + i] as one box at row row0 + p // r, column
    col0 + (p % r) * CO of the 2-D view (p = Pos[first]); that box must hold their rows."""
    b, hx, d, n, w, r = 2, 3, 8, 2048, 1024, 2
    plan = branch_plan(n, w, r, True)
    run = gluon_forward.plan_run(plan)
    assert run == 16
    x = torch.randn(b, hx, n, d) if layout == "contiguous" else \
        torch.randn(b, n, hx, d).transpose(1, 2)
    view, rb, rh, ch, co = gluon_forward._view(x, r)
    pos = plan.positions
    for bi in range(b):
        for h in range(hx):
            o = h % r
            for j in range(plan.num_segments):
                for c in range(plan.set_size // run):
                    p = int(pos[o, j, c * run])
                    row, col = bi * rb + h * rh + p // r, (p % r) * co + h * ch
                    box = view[row:row + run, col:col + d]
                    assert torch.equal(box, x[bi, h, pos[o, j, c * run:(c + 1) * run]]), (h, j, c)


def test_causal_launches_schedule_sets_in_chunks_that_divide_them():
    """gluon_kernels._work reads the grid as chunks of chunk_sets(...) sets, a constant
    divisor: it must divide the number of sets (segments * third grid dimension), be a power of
    two up to CHUNK_SETS, and be 1 where tiles are alike (not causal)."""
    gf = gluon_forward
    for tiles, segments, third in [(16, 16, 16), (4, 3, 3), (8, 2, 6), (16, 1, 1), (2, 5, 64)]:
        chunk = gf.chunk_sets((tiles, segments, third), True)
        sets = segments * third
        assert sets % chunk == 0 and chunk & (chunk - 1) == 0 and chunk <= gf.CHUNK_SETS
        assert chunk == gf.CHUNK_SETS or sets % (2 * chunk) or 2 * chunk > gf.CHUNK_SETS
        assert gf.chunk_sets((tiles, segments, third), False) == 1
    assert gf.chunk_sets((16, 16, 16), True) == 16 and gf.chunk_sets((4, 3, 3), True) == 1
    assert gf.chunk_sets((8, 2, 6), True) == 4


@pytest.mark.parametrize("d", [64, 128])
def test_backward_launch_by_head_dim(d):
    """The backward's launch: at D = 64 a persistent grid of one CTA an SM with the causal
    schedule's table (gluon_forward.persistent_schedule, whose items are its key tiles), dK's
    product reading dS^T from registers; at D = 128 one CTA a work item (the persistent loop
    ran slower there) and dS^T read from shared memory (faster there, slower at D = 64)."""
    n, w, r = 32768, 4096, 2
    q = torch.randn(1, 4, n, d, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n, d, dtype=torch.bfloat16) for _ in range(2))
    plan = branch_plan(n, w, r, False)
    pos = gluon_backward.plan_tensors(plan, "cpu")[0]
    lse = torch.empty(q.shape[:3])
    _, grid, args, kwargs = gluon_backward.prepare(
        q, k, v, q.clone(), plan, pos, is_causal=True, scale=0.1, first=True, last=False,
        refs=(q, k, v, q.clone(), torch.zeros(q.shape), torch.empty(k.shape), torch.empty(v.shape),
              k.clone(), v.clone(), torch.zeros(2, n, dtype=torch.uint8), lse.clone(), lse.clone()))
    # items: 16 key tiles of 128 in each of 8 segments, for 2 kv heads of 2 offset classes
    items = 16 * 8 * 2 * 2
    table, rounds = args[-2], args[-1]
    assert tuple(args[-5:-2]) == (16, 8, 4)
    if d == 64:
        assert kwargs["PERSISTENT"] and kwargs["TABLE"] and grid == (132, )
        assert sorted(table[table >= 0].tolist()) == list(range(items))
        assert rounds == table.shape[0]
        assert not kwargs["DS_SHARED"]
    else:
        assert not kwargs["PERSISTENT"] and not kwargs["TABLE"] and grid == (items, )
        assert rounds == 1
        assert kwargs["DS_SHARED"]


@pytest.mark.parametrize("hilbert,r,n", [(False, 2, 32768), (True, 2, 65536), (True, 4, 65536),
                                         (False, 2, 30000)])
def test_backward_dq_reduction_by_copy_path(hilbert, r, n):
    """dq's tiles go out by TMA reductions wherever the producer copies by TMA: strided sets a
    box of BLOCK_M rows a tile, the Hilbert order's runs a box a run (DQ_BOX its rows, the dq
    buffer's descriptor with those boxes); gathered sets (no runs, partial sets) by atomics."""
    d, w = 64, 4096
    q = torch.randn(1, 2, n, d, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n, d, dtype=torch.bfloat16) for _ in range(2))
    plan = branch_plan(n, w, r, hilbert)
    pos = gluon_backward.plan_tensors(plan, "cpu")[0]
    lse = torch.empty(q.shape[:3])
    dq = torch.zeros(q.shape)
    _, _, args, kwargs = gluon_backward.prepare(
        q, k, v, q.clone(), plan, pos, is_causal=False, scale=0.1, first=True, last=False,
        refs=(q, k, v, q.clone(), dq, torch.empty(k.shape), torch.empty(v.shape), k.clone(),
              v.clone(), torch.zeros(2, n, dtype=torch.uint8), lse.clone(), lse.clone()))
    run = gluon_forward.plan_run(plan)  # the Hilbert order's r = 2 sets are runs, no others
    assert (run in (8, 16, 32, 64)) if (hilbert, r) == (True, 2) else run == 0
    expected = {(False, 2, 32768): 64, (True, 2, 65536): run, (True, 4, 65536): 0,
                (False, 2, 30000): 0}[(hilbert, r, n)]
    assert kwargs["DQ_BOX"] == expected
    if expected:
        assert isinstance(args[5], gluon_forward.Descriptor) and args[5].source is dq
        assert args[5].box == [expected, d // 2]
    else:
        assert args[5] is dq
