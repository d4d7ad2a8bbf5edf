"""The Hopper forward's host side (lowering/gluon_forward.py), on CPU.

The kernel itself needs an sm_90 GPU: scripts/gpu_check.py's "hopper" cases check it against
the float64 reference there (BENCHMARKS.md). Here: that the TMA views reach exactly the rows of
each selected set, and when the kernel is not used.
"""
import types

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


def test_masks_and_dropout_run_the_hopper_kernels(monkeypatch):
    """A user's mask and dropout run the Hopper kernels (checked against the float64 reference
    by scripts/gpu_check.py's "hopper ... mask" and "hopper dropout" cases), except dropout's
    forward at D = 64, which the Triton kernel runs faster, and masks whose offsets within a
    head reach 2**31 (the kernels' per-tile offsets are int32)."""
    from hilbert_fx.lowering import gluon_backward
    # as on an H100 with Triton 3.6, the sets' layout checks passed
    monkeypatch.setattr(gluon_forward, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(gluon_forward, "_load", lambda: object())
    monkeypatch.setattr(gluon_forward, "_sets_unsupported", lambda *a: None)
    plan = branch_plan(4096, 1024, 2, True)

    def reasons(d, mask_kind=0, dropout=False, mask_strides=(0, 0, 0, 0)):
        q = _CudaStandIn((1, 2, 4096, d))
        kw = dict(is_causal=False, mask_kind=mask_kind, dropout=dropout, scale=0.1,
                  mask_strides=mask_strides)
        return (gluon_forward.unsupported(q, q, q, plan, **kw),
                gluon_backward.unsupported(q, q, q, plan, deterministic=False, **kw))

    contiguous = (0, 0, 4096, 1)
    for d in (64, 128):
        assert reasons(d) == (None, None)
        assert reasons(d, mask_kind=1, mask_strides=contiguous) == (None, None)
        assert reasons(d, mask_kind=2, mask_strides=contiguous) == (None, None)
    assert reasons(128, dropout=True) == (None, None)
    assert reasons(64, dropout=True) == (gluon_forward.DROPOUT_AT_64, None)
    forward, backward = reasons(128, mask_kind=2, mask_strides=(0, 0, 1, 2**20))
    assert "2**31" in forward and "2**31" in backward


class _CudaStandIn:
    """What the eligibility checks read of a CUDA tensor: shape, dtype, device."""
    def __init__(self, shape):
        self.shape, self.dtype, self.device = shape, torch.bfloat16, torch.device("cuda", 0)


def test_partial_sets_are_gathered():
    """Sets with fewer than w / r members (a partial last segment in either order, packed
    documents, padding, a ring shard's) run the Hopper kernels through the gather (each set's
    count read by the kernel); whole sets keep TMA."""
    from hilbert_fx.lowering.ring_plan import shard_branch_plans
    from hilbert_fx.lowering.sequences import sequence_plans
    whole = branch_plan(4096, 1024, 2, True)
    assert not gluon_forward.partial_sets(whole)
    assert gluon_forward.partial_sets(branch_plan(4000, 1024, 2, True))
    shards = shard_branch_plans(3000, 2, 0, [2048, 4096], [1, 2], True)
    for plan in shards:
        assert gluon_forward.partial_sets(plan)
    packed = sequence_plans(torch.cat([torch.arange(700), torch.arange(324)]).view(1, -1),
                            (256, 512), (1, 2), True)
    assert all(gluon_forward.partial_sets(p) for p in packed)

    x = torch.randn(1, 2, 4096, 64, dtype=torch.bfloat16)
    assert gluon_forward._sets_unsupported(x, x, x, whole) is None
    y = x[:, :, :4000]
    assert gluon_forward._sets_unsupported(y, y, y, branch_plan(4000, 1024, 2, True)) is None
    assert gluon_forward._sets_unsupported(y, y, y, branch_plan(4000, 1024, 2, False)) is None
    z = x[:, :, :1024]
    for plan in packed:  # a set per segment; the bins' groups are left to the Triton kernels
        reason = gluon_forward._sets_unsupported(z, z, z, plan)
        assert reason is None if plan.groups is None else "groups" in reason
    # a gather copies 16 bytes a row at a time: rows of 20 bf16 elements are not aligned
    odd = torch.randn(1, 2, 1024, 20, dtype=torch.bfloat16)[..., :16]
    assert "16-byte" in gluon_forward._sets_unsupported(odd, odd, odd, packed[0])
    s = x[:, :, :1500]
    assert gluon_forward._sets_unsupported(s, s, s, shards[1]) is None
    assert "multiple of 128" in gluon_forward._sets_unsupported(
        x, x, x, branch_plan(4096, 1024, 16, True))


def test_other_triton_versions_refused(monkeypatch):
    """Gluon's API differs between Triton releases: an untested one runs the Triton kernels."""
    import triton
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    monkeypatch.setattr(gluon_forward, "_kernels", None)
    monkeypatch.setattr(gluon_forward, "_import_error", None)
    assert gluon_forward._load() is None
    assert "Triton 3.9.0" in gluon_forward._import_error


def _causal_rank(i, tiles, segments, thirds, chunk):
    """The rank of item i in gluon_kernels._work's causal order (chunks of `chunk` sets, each
    chunk's items rank by rank), written out here from that order's definition."""
    chunk_items = chunk * tiles
    return (i - (i // chunk_items) * chunk_items) // chunk


@pytest.mark.parametrize("work", [(16, 8, 16), (16, 1, 16), (8, 4, 6), (2, 3, 5)])
def test_persistent_schedule_covers_each_item_once(work):
    tiles, segments, thirds = work
    items = tiles * segments * thirds
    chunk = gluon_forward.chunk_sets(work, True)
    grid, table, rounds = gluon_forward.persistent_schedule(
        work, is_causal=True, one_each=False, chunk=chunk, third_first=False, ctas=132,
        device=torch.device("cpu"))
    if items <= 132:  # one CTA an item
        assert grid == (items, ) and table is None and rounds == 1
        return
    assert grid == (132, ) and table.shape == (rounds, 132)
    taken = table[table >= 0].tolist()
    assert sorted(taken) == list(range(items))
    loads = []
    for cta in range(132):
        mine = [i for i in table[:, cta].tolist() if i >= 0]
        assert mine == sorted(mine)  # each CTA runs its items in the launch's order
        assert all(i == -1 for i in table[len(mine):, cta].tolist())  # padding only at the end
        loads.append(sum(tiles - _causal_rank(i, *work, chunk) + 1.5 for i in mine))
    # list scheduling: no CTA ends more than one longest item past the average, and none later
    # than the last of a round-robin share (CTA p taking items p, p + 132, ...) would
    assert max(loads) <= sum(loads) / 132 + tiles + 1.5
    shared = [sum(tiles - _causal_rank(i, *work, chunk) + 1.5 for i in range(cta, items, 132))
              for cta in range(132)]
    assert max(loads) <= max(shared)
    if work == (16, 1, 16):  # 256 items of 1 to 16 key tiles: the share leaves SMs idle
        assert max(loads) < 0.9 * max(shared)


@pytest.mark.parametrize("third_first", [False, True])
@pytest.mark.parametrize("work", [(16, 8, 16), (8, 4, 6), (3, 5, 7), (32, 2, 40)])
def test_persistent_schedule_is_list_scheduling(work, third_first):
    """The table is list scheduling by the cost model, item by item with a heap of the CTAs'
    free times (ties to the lowest CTA), as written here: the same items on the same CTAs."""
    import heapq
    tiles, segments, thirds = work
    items, chunk, ctas = tiles * segments * thirds, gluon_forward.chunk_sets(work, True), 20
    free = [(0.0, cta) for cta in range(ctas)]
    lists = [[] for _ in range(ctas)]
    for i in range(items):
        rank = (i // thirds) % tiles if third_first else _causal_rank(i, *work, chunk)
        at, cta = heapq.heappop(free)
        lists[cta].append(i)
        heapq.heappush(free, (at + tiles - rank + gluon_forward.ITEM_OVERHEAD_TILES, cta))
    _, table, rounds = gluon_forward.persistent_schedule(
        work, is_causal=True, one_each=False, chunk=chunk, third_first=third_first, ctas=ctas,
        device=torch.device("cpu"))
    assert rounds == max(len(x) for x in lists)
    for cta in range(ctas):
        assert table[:, cta].tolist() == lists[cta] + [-1] * (rounds - len(lists[cta]))


def test_persistent_schedule_shares_items_alike_round_robin():
    kw = dict(chunk=1, third_first=False, ctas=132, device=torch.device("cpu"))
    assert gluon_forward.persistent_schedule((16, 8, 16), is_causal=False, one_each=False,
                                             **kw) == ((132, ), None, 16)
    assert gluon_forward.persistent_schedule((16, 1, 4), is_causal=False, one_each=False,
                                             **kw) == ((64, ), None, 1)
    # partial sets: each item its CTA, whatever their number (their work is read on the GPU)
    assert gluon_forward.persistent_schedule((16, 8, 16), is_causal=True, one_each=True,
                                             **kw) == ((2048, ), None, 1)


def test_persistent_grid_takes_any_number_of_heads_below_2_31_items():
    """The kernels' grid is 1-D (work items), so batch * heads past 65535, the old limit of a
    grid dimension, runs them; 2**31 items or more do not (int32 item indices)."""
    def reason(bh, n):
        q = torch.empty(bh, 1, n, 64, dtype=torch.bfloat16, device="meta")
        return gluon_forward._sets_unsupported(q, q, q, branch_plan(n, n, 1, False))
    assert reason(70000, 256) is None
    assert "2**31 work items" in reason(2**24, 16384)  # 2**24 * 128 tiles


def test_persistent_schedule_under_graph_capture_goes_round_robin(monkeypatch):
    """A causal launch first planned while a CUDA graph is captured cannot copy its table to the
    GPU there: its items go round-robin (the kernel's other order), and nothing is cached."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(gluon_forward, "_schedules", {})
    got = gluon_forward.persistent_schedule((16, 8, 16), is_causal=True, one_each=False, chunk=16,
                                            third_first=False, ctas=132,
                                            device=torch.device("cuda", 0))
    assert got == ((132, ), None, 16) and gluon_forward._schedules == {}


@pytest.mark.parametrize("r", [1, 2])
def test_identity_order_partial_sets_go_to_the_gather(r, monkeypatch):
    """N % w != 0 in the identity order (or r = 1 in any order): the plan stays strided, so the
    Triton kernels reach its rows by arithmetic, but its positions go out as the gather reads
    them: int32, member m of set (o, j) at j * w + o + m * r (SPEC section 2) up to the set's
    count, 0 past it, padded to whole tiles; and both Hopper launches take the gather path,
    reading the counts."""
    from hilbert_fx.lowering import gluon_backward
    from hilbert_fx.lowering.triton_plans import POSITION_PAD, plan_tensors
    n, w = 4000, 1024
    plan = branch_plan(n, w, r, r == 1)
    assert plan.is_strided and gluon_forward.partial_sets(plan)
    pos, cnt, strided, _ = plan_tensors(plan, "cpu")
    assert strided and pos.dtype == torch.int32 and pos.shape[-1] % POSITION_PAD == 0
    assert pos.shape[-1] > w // r
    last = n - (n // w) * w  # rows of the partial last segment
    for o in range(r):
        for j in range(-(-n // w)):
            count = w // r if j < n // w else len(range(o, last, r))
            assert int(cnt[o, j]) == count
            assert torch.equal(pos[o, j, :count].long(), j * w + o + r * torch.arange(count))
            assert not pos[o, j, count:].any()

    # the kernels' modules stand in (Gluon imports only with Triton 3.6): the launches' arguments
    monkeypatch.setattr(gluon_forward, "_load", lambda: types.SimpleNamespace(_fwd_kernel=None))
    monkeypatch.setattr(gluon_backward, "_load", lambda: types.SimpleNamespace(_bwd_kernel=None))
    q = torch.randn(1, 4, n, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.empty(q.shape[:3])
    _, _, _, fwd = gluon_forward.prepare(q, k, v, plan, pos, is_causal=True, scale=0.1, first=True,
                                         last=True, refs=(q, k, v, q.clone(), q.float(), lse))
    _, _, _, bwd = gluon_backward.prepare(
        q, k, v, q.clone(), plan, pos, is_causal=True, scale=0.1, first=True, last=True,
        refs=(q, k, v, q.clone(), torch.zeros(q.shape), torch.empty(k.shape), torch.empty(v.shape),
              k.clone(), v.clone(), torch.zeros(2, n, dtype=torch.uint8), lse.clone(), lse.clone()))
    for kwargs in (fwd, bwd):
        assert kwargs["GATHER"] and kwargs["PARTIAL"] and kwargs["RUN"] == 0
