"""Dilated attention over a device mesh (SPEC section 4), on CPU with gloo.

Two launches of worker processes (tests/ring_worker.py), one of 2 ranks and one of 4, run every
case; each rank returns its shards of the output and of dq, dk, dv, which are compared here with
the float64 reference (tests/reference.py) computed on the whole sequence in this process.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import ring_worker  # noqa: E402
from reference import reference_dilated_attention, selected_sets  # noqa: E402

from hilbert_fx.lowering.dropout import keep_mask  # noqa: E402
from hilbert_fx.lowering.ring_plan import plan_bytes, ring_plan  # noqa: E402

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)


def attention_case(name, world, n, segs, rates, *, hilbert=False, causal=False, B=1, Hq=4,
                   Hkv=None, D=8, dtype="float32", seed=0, **extra):
    case = dict(kind="attention", name=name, world=world, n=n, segs=list(segs),
                rates=list(rates), hilbert=hilbert, causal=causal, B=B, Hq=Hq, Hkv=Hkv or Hq,
                D=D, dtype=dtype, seed=seed)
    case.update(extra)
    return case


# n = positions per rank. With P = 2, n = 24: w = 8 lies inside a shard, w = 24 equals a shard,
# w = 48 spans both. With P = 4, n = 16: w = 8 inside one shard, 32 spans two, 64 spans all four.
CASES_2 = [
    attention_case("p2_one_and_all_shards", 2, 24, (8, 24, 48), (1, 2, 4)),
    attention_case("p2_hilbert_straddling", 2, 24, (16, 48), (2, 4), hilbert=True, seed=1),
    attention_case("p2_causal_hilbert", 2, 24, (12, 48), (1, 3), hilbert=True, causal=True,
                   seed=2, front="public"),
    attention_case("p2_gqa_ragged_causal", 2, 20, (6, 16, 64), (1, 2, 4), hilbert=True,
                   causal=True, Hq=4, Hkv=2, B=2, seed=3),
    attention_case("p2_float64_batch", 2, 24, (8, 32), (2, 4), hilbert=True, B=2,
                   dtype="float64", seed=4, scale=0.3),
    attention_case("p2_dropout", 2, 24, (8, 48), (1, 2), dropout_p=0.3, dropout_seed=1234,
                   seed=5),
]
CASES_4 = [
    attention_case("p4_one_two_all_shards", 4, 16, (8, 32, 64), (1, 2, 4), hilbert=True),
    attention_case("p4_causal_gqa", 4, 16, (8, 32, 64), (1, 2, 4), hilbert=True, causal=True,
                   Hkv=2, seed=1, front="public"),
    attention_case("p4_ragged", 4, 10, (6, 24, 40), (1, 2, 4), hilbert=True, seed=2),
    attention_case("p4_ragged_causal_noncubic", 4, 10, (6, 24, 40), (1, 2, 4), causal=True,
                   seed=3),
    attention_case("p4_heads_fewer_than_rate", 4, 16, (64,), (4,), causal=True, Hq=2, seed=4),
]

# lowering="triton" (interpreted on CPU): both calls of the ring (the rank's sets alone, the sets
# with peers' rows) run on the Triton kernels. Shapes that are not multiples of the
# interpreter's tiles (32 x 16) or of the segments; D = 12 is not a power of two; "bnhd": q, k, v
# are strided views of [B, N, H, D] tensors.
# P = 2, n = 21 (N = 42): w = 6 inside a shard (and cut by the shard edge at 21), w = 16 has
# segments inside rank 0, across both, and a ragged last one inside rank 1, w = 42 spans both.
# P = 2, n = 40: sets of 40 rows per shard cross tile edges; w = 36 straddles the edge at 40.
TRITON_2 = [
    attention_case("p2_triton_hilbert_ragged", 2, 21, (6, 16, 42), (1, 2, 3), hilbert=True, D=12,
                   lowering="triton", seed=11, layout="bnhd"),
    attention_case("p2_triton_causal_gqa", 2, 20, (6, 16, 64), (1, 2, 4), hilbert=True,
                   causal=True, Hq=4, Hkv=2, B=2, lowering="triton", seed=12, front="public"),
    attention_case("p2_triton_tiles_causal", 2, 40, (12, 36, 80), (1, 2, 1), causal=True,
                   Hq=2, lowering="triton", seed=13),
    # dropout on the Triton kernels (the keep bits of global positions: dropout_rows); float64
    # on the SDPA lowering (the Triton kernels take no float64)
    attention_case("p2_triton_dropout", 2, 24, (8, 48), (1, 2), dropout_p=0.3,
                   dropout_seed=99, lowering="triton", seed=14),
    attention_case("p2_triton_float64", 2, 12, (8, 24), (1, 2), dtype="float64",
                   lowering="triton", seed=15),
]
# P = 4, n = 10: w = 6 inside one shard or across two, w = 24 across two or three, w = 40 all
TRITON_4 = [
    attention_case("p4_triton_ragged_causal_gqa", 4, 10, (6, 24, 40), (1, 2, 4), hilbert=True,
                   causal=True, Hkv=2, lowering="triton", seed=21),
    attention_case("p4_triton_heads_fewer_than_rate", 4, 13, (8, 52), (1, 4), Hq=2, D=12,
                   lowering="triton", seed=22),
]


def error_case(name, common, per_rank, expect):
    return dict(kind="error", name=name, common=common, per_rank=per_rank, expect=expect)


BASE = dict(n=8, segs=(4, 16), rates=(1, 2))
ERROR_CASES = [
    error_case("err_unequal_shards", BASE, {1: dict(n=10)}, r"unequal length"),
    error_case("err_segments_differ", BASE, {1: dict(segs=(4, 8))}, r"differs across"),
    error_case("err_causal_differs", BASE, {0: dict(causal=True)}, r"differs across"),
    error_case("err_mask_everywhere", dict(BASE, mask=True), {}, r"attn_mask"),
    error_case("err_mask_on_one_rank", BASE, {1: dict(mask=True)}, r"attn_mask"),
    error_case("err_invalid_on_one_rank", dict(BASE, front="checked"),
               {1: dict(segs=(4, 6), rates=(1, 4))}, r"multiple of its dilation rate"),
]
# on 4 processes, first 2 ranks alone on a group of their own, then everything on all 4
SUBGROUP = attention_case("p2_of_4_subgroup", 2, 16, (8, 32), (1, 2), hilbert=True, causal=True,
                          seed=7)
SUBGROUP["kind"] = "subgroup"

# the order of posts, waits and block computations (communication overlaps computation)
OVERLAP = attention_case("p2_overlap", 2, 24, (8, 48), (1, 4), hilbert=True, seed=6)
OVERLAP["kind"] = "overlap"
OVERLAP_TRITON = attention_case("p2_overlap_triton", 2, 24, (8, 48), (1, 4), hilbert=True,
                                lowering="triton", seed=16)
OVERLAP_TRITON["kind"] = "overlap"

# after the errors the same processes must still compute correctly: a last case checks it
AFTER_ERRORS = attention_case("p2_after_errors", 2, 8, (4, 16), (1, 2), seed=9)

COMPILED = dict(kind="compiled", name="compiled_model", world=2, n=24, B=2, segs=[8, 48],
                rates=[1, 4], hilbert=True, seed=0,
                model=dict(width=32, heads=4, layers=1, causal=True, kv_heads=2))
# four ranks of 12 positions: w = 24 spans two shards, w = 48 all four
COMPILED_4 = dict(COMPILED, name="compiled_model_4", world=4, n=12, B=1, segs=[6, 24, 48],
                  rates=[1, 2, 4], seed=1)


@pytest.fixture(scope="module")
def results2():
    return ring_worker.launch(2, ERROR_CASES + [AFTER_ERRORS] + CASES_2 + [OVERLAP, COMPILED]
                              + TRITON_2 + [OVERLAP_TRITON], timeout=300)


@pytest.fixture(scope="module")
def results4():
    return ring_worker.launch(4, [SUBGROUP] + CASES_4 + ERROR_CASES[:2] + [COMPILED_4] + TRITON_4,
                              timeout=300)


def assert_close(got, ref, what, rel):
    got = torch.as_tensor(got).double()
    ref = ref.detach().double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err, nrm = (got - ref).norm().item(), ref.norm().item()
    assert err <= rel * nrm + rel * math.sqrt(ref.numel()), \
        f"{what}: ||got-ref||={err:.3g}, ||ref||={nrm:.3g}"
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    torch.testing.assert_close(got, ref, atol=rel * scale, rtol=rel, msg=lambda m: f"{what}: {m}")


def reference(case):
    q, k, v, dout = ring_worker.full_inputs(case)
    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    keep = None
    if case.get("dropout_p", 0.0) > 0:
        b, h, n = case["B"], case["Hq"], case["world"] * case["n"]
        pos = torch.arange(n)
        keep = keep_mask(torch.tensor(case["dropout_seed"]),  # rank 0's seed
                         torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
                         pos.view(1, 1, n, 1), pos.view(1, 1, 1, n), case["dropout_p"])
    out = reference_dilated_attention(
        q, k, v, case["segs"], case["rates"], hilbert=case["hilbert"], is_causal=case["causal"],
        scale=case.get("scale"), enable_gqa=case["Hq"] != case["Hkv"],
        dropout_p=case.get("dropout_p", 0.0), dropout_keep=keep)
    out.backward(dout.double())
    return out, q.grad, k.grad, v.grad


def check_case(case, results):
    assert case["name"] in results, f"no result for {case['name']}"
    per_rank = results[case["name"]]
    for rank in range(case["world"]):
        res = per_rank[rank]
        assert "error" not in res, f"rank {rank}: {res.get('traceback', res['error'])}"
    out, dq, dk, dv = reference(case)
    rel = 1e-10 if case["dtype"] == "float64" else 2e-5
    n = case["n"]
    for rank in range(case["world"]):
        sl = slice(rank * n, (rank + 1) * n)
        res = per_rank[rank]
        for key, ref in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert_close(res[key], ref[:, :, sl], f"{case['name']} rank {rank} {key}", rel)


@pytest.mark.parametrize("case", CASES_2 + [AFTER_ERRORS], ids=lambda c: c["name"])
def test_two_ranks_match_reference(case, results2):
    check_case(case, results2)


@pytest.mark.parametrize("case", [SUBGROUP] + CASES_4, ids=lambda c: c["name"])
def test_four_ranks_match_reference(case, results4):
    check_case(case, results4)


@pytest.mark.parametrize("case", TRITON_2, ids=lambda c: c["name"])
def test_two_ranks_triton_match_reference(case, results2):
    check_case(case, results2)


@pytest.mark.parametrize("case", TRITON_4, ids=lambda c: c["name"])
def test_four_ranks_triton_match_reference(case, results4):
    check_case(case, results4)


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: c["name"])
def test_bad_input_raises_on_every_rank(case, results2):
    import re
    per_rank = results2[case["name"]]
    assert sorted(per_rank) == [0, 1]
    for rank, res in per_rank.items():
        assert "error" in res, f"rank {rank} did not raise"
        assert res["error"].startswith("ValueError"), res.get("traceback", res["error"])
        assert re.search(case["expect"], res["error"]), f"rank {rank}: {res['error']}"


@pytest.mark.parametrize("case", ERROR_CASES[:2], ids=lambda c: c["name"])
def test_bad_input_raises_on_every_rank_of_four(case, results4):
    import re
    per_rank = results4[case["name"]]
    assert sorted(per_rank) == [0, 1, 2, 3]
    for rank, res in per_rank.items():
        assert res.get("error", "").startswith("ValueError"), f"rank {rank}: {res}"
        assert re.search(case["expect"], res["error"]), f"rank {rank}: {res['error']}"


def rows_from_the_reference(case):
    """Rows each rank must send and receive, counted from the reference's selected sets alone
    (tests/reference.py, not the plan): for every branch, segment and (kv head, offset) that some
    query head reads, the sender's selected rows of that segment go to every other rank that holds
    a selected position of it (under is_causal, only to later ranks). Also the distinct
    (receiver, kv head, position) triples: the least any scheme could send."""
    world, n, hq, hkv = case["world"], case["n"], case["Hq"], case["Hkv"]
    sent, received = [0] * world, [0] * world
    distinct = [set() for _ in range(world)]
    for w, r in zip(case["segs"], case["rates"]):
        units = {}
        for h in range(hq):
            units.setdefault((h // (hq // hkv), h % r), h)
        for (c, _), h in units.items():
            for sel in selected_sets(world * n, w, r, h, case["hilbert"]):
                owners = {p // n for p in sel}
                for src in owners:
                    rows = [p for p in sel if p // n == src]
                    for dst in owners - {src}:
                        if case["causal"] and src > dst:
                            continue
                        sent[src] += len(rows)
                        received[dst] += len(rows)
                        distinct[src] |= {(dst, c, p) for p in rows}
    return sent, received, [len(d) for d in distinct]


BYTES_CASES = [(CASES_2[0], 2), (CASES_2[2], 2), (CASES_4[0], 4), (CASES_4[1], 4), (CASES_4[2], 4),
               (TRITON_2[0], 2), (TRITON_4[1], 4)]  # the Triton path sends the same rows


@pytest.mark.parametrize("case", [c for c, _ in BYTES_CASES], ids=lambda c: c["name"])
def test_bytes_sent_are_only_the_selected_rows(case, results2, results4):
    """The bytes each rank measured (ring.comm_stats) equal the rows counted from the reference's
    selected sets, which is also the plan's count, and stay far below a dense ring's."""
    results = results2 if case["world"] == 2 else results4
    elem = 4  # float32 cases; gradients travel in float32 as well
    row = case["B"] * 2 * case["D"] * elem  # one k row and one v row
    sent, received, distinct = rows_from_the_reference(case)
    plan = plan_bytes(case["n"], case["world"], case["segs"], case["rates"],
                      hilbert=case["hilbert"], is_causal=case["causal"], batch=case["B"],
                      num_heads=case["Hq"], num_kv_heads=case["Hkv"], head_dim=case["D"],
                      element_size=elem, grad_element_size=elem)
    dense = (case["world"] - 1) * case["Hkv"] * case["n"] * row
    total = 0
    for rank in range(case["world"]):
        got = results[case["name"]][rank]
        assert "error" not in got, got.get("traceback")
        assert got["forward_bytes"] == sent[rank] * row == plan[rank]["forward_bytes"], rank
        # backward: the rows again, then the gradients of what was received go back
        assert got["backward_bytes"] == (sent[rank] + received[rank]) * row \
            == plan[rank]["backward_bytes"], rank
        assert plan[rank]["dense_forward_bytes"] == dense
        assert got["forward_bytes"] < dense, (rank, got["forward_bytes"], dense)
        # a row goes at most once per branch that selects it (never once per query head)
        assert distinct[rank] <= sent[rank] <= len(case["segs"]) * distinct[rank]
        total += got["forward_bytes"]
    assert total > 0


# --------------------------------------------------------------------------------------------
# The communication plan alone (no processes).

def peers_sent_to(n, world, segs, rates, hilbert=False, causal=False, hq=4, hkv=4):
    sent = {}
    for rank in range(world):
        plan = ring_plan(n, world, rank, segs, rates, hilbert, causal, hq, hkv)
        sent[rank] = sorted(s.send_to for s in plan.steps if s.send_count)
    return sent


def test_segments_inside_shards_send_nothing():
    for rank in range(4):
        plan = ring_plan(16, 4, rank, (4, 8, 16), (1, 2, 4), True, False, 4, 4)
        assert plan.rows_sent == 0 and plan.rows_received == 0


def test_only_ranks_sharing_a_segment_talk():
    # w = 32 over shards of 16: ranks {0, 1} and {2, 3} share segments
    assert peers_sent_to(16, 4, (32,), (2,)) == {0: [1], 1: [0], 2: [3], 3: [2]}
    # w = 24 over shards of 10 (N = 40): [0, 24) spans ranks 0-2, [24, 40) ranks 2-3
    assert peers_sent_to(10, 4, (24,), (1,)) == {0: [1, 2], 1: [0, 2], 2: [0, 1, 3], 3: [2]}


def test_causal_sends_only_to_later_ranks():
    assert peers_sent_to(16, 4, (64,), (4,), causal=True) == {0: [1, 2, 3], 1: [2, 3], 2: [3],
                                                             3: []}


@pytest.mark.parametrize("hilbert", [False, True])
def test_only_selected_rows_travel(hilbert):
    # one branch over everything, r = 4, one kv head per query head: each head reads 1/4 of
    # the rows, so each rank sends (P - 1) * Hq * n / 4 rows instead of (P - 1) * Hkv * n
    n, world, r = 64, 4, 4
    res = plan_bytes(n, world, (n * world,), (r,), hilbert=hilbert, is_causal=False, batch=1,
                     num_heads=4, num_kv_heads=4, head_dim=8)
    for rank_res in res:
        assert rank_res["rows_sent"] == (world - 1) * 4 * n // r
        assert rank_res["forward_bytes"] * r == rank_res["dense_forward_bytes"]


def test_gqa_sends_each_row_once_per_offset():
    # 4 query heads over 1 kv head, r = 2: offsets {0, 1} of the one kv head -> n rows per peer,
    # not 2n (as if sent per query head)
    n, world = 16, 2
    plan = ring_plan(n, world, 0, (32,), (2,), False, False, 4, 1)
    assert plan.rows_sent == n


# --------------------------------------------------------------------------------------------
# The pass: a model compiled with a mesh equals the same model compiled in one process.

@pytest.mark.parametrize("case", [COMPILED, COMPILED_4], ids=lambda c: c["name"])
def test_compiled_model_with_mesh_equals_one_process(case, results2, results4):
    import hilbert_fx
    from models import TinyTransformer
    per_rank = (results2 if case["world"] == 2 else results4)[case["name"]]
    for rank in range(case["world"]):
        assert "error" not in per_rank[rank], per_rank[rank].get("traceback")
    graph = "\n".join(per_rank[0]["graph_after"])
    assert "torch.ops.hilbert_fx.ring_dilated_attention.default" in graph, graph
    assert repr(per_rank[0]["group_name"]) in graph

    torch.manual_seed(case["seed"])
    model = TinyTransformer(**case["model"])
    tokens, weight = ring_worker.compiled_inputs(case)
    be = hilbert_fx.backend(case["segs"], case["rates"], hilbert=case["hilbert"],
                            lowering="sdpa")
    y = torch.compile(model, backend=be)(tokens)
    (y * weight).sum().backward()
    n = case["n"]
    for rank in range(case["world"]):
        assert_close(per_rank[rank]["out"], y[:, rank * n:(rank + 1) * n],
                     f"compiled output rank {rank}", 2e-5)
    for name, p in model.named_parameters():
        assert_close(per_rank[0]["grads"][name], p.grad, f"grad of {name}", 2e-5)


def test_messages_are_posted_before_compute_and_overlap_it(results2):
    """Forward: every message is posted before the first block is computed, and local blocks
    are computed before the first wait. Backward: the same for the key/value rows, and some local
    blocks are computed after the gradients are posted, while they travel back."""
    check_case(OVERLAP, results2)
    for rank in (0, 1):
        res = results2[OVERLAP["name"]][rank]
        fwd, bwd = res["events_forward"], res["events_backward"]
        assert fwd.count("post") == 1 and fwd.index("post") == 0, fwd
        assert "compute" in fwd[:fwd.index("wait")], fwd
        assert bwd.index("post") == 0 and "compute" in bwd[:bwd.index("wait")], bwd
        last_post = len(bwd) - 1 - bwd[::-1].index("post")  # the gradients' post
        assert bwd.count("post") == 2 and "compute" in bwd[last_post:], bwd



def test_triton_computes_every_set_on_the_kernels_while_rows_travel(results2):
    """lowering="triton": the sets of the rank alone are one call of the Triton lowering, made
    after every message is posted and before the first wait, forward and backward; the sets with
    rows from peers are a second call, after those rows arrived; no set runs on the SDPA
    kernels ("compute")."""
    check_case(OVERLAP_TRITON, results2)
    for rank in (0, 1):
        res = results2[OVERLAP_TRITON["name"]][rank]
        for events in (res["events_forward"], res["events_backward"]):
            assert events.count("triton") == 2 and "compute" not in events, events
            assert events.index("post") == 0 and events.index("triton") < events.index("wait"), \
                events
            assert "triton" in events[events.index("wait"):], events


# --------------------------------------------------------------------------------------------
# Shard plans: every set of every branch cut to one rank's shard.

def _pairs_on_the_rank(plan, heads):
    """The (head, query, key) pairs of positions of the rank that the ring's two calls compute:
    its local call's sets, and the local members of its cross call's sets."""
    lo = plan.rank * plan.n
    pairs = set()
    for plans, global_of in ((plan.local_plans, lambda rows: rows + lo),
                             (plan.cross_plans, lambda rows: plan.ext_positions[rows])):
        for branch in plans:
            for h in range(heads):
                o = h % branch.dilation_rate
                for s in range(branch.num_segments):
                    sel = global_of(branch.positions[o, s, :branch.counts[o, s]])
                    sel = sel[(sel >= lo) & (sel < lo + plan.n)].tolist()
                    pairs |= {(h, a, b) for a in sel for b in sel}
    return pairs


@pytest.mark.parametrize("n,world,segs,rates", [
    (21, 2, (6, 16, 42), (1, 2, 3)), (10, 4, (6, 24, 40), (1, 2, 4)),
    (7, 3, (5, 9, 21, 40), (1, 3, 3, 8)), (16, 4, (8, 32, 64), (1, 2, 4))])
@pytest.mark.parametrize("hilbert", [False, True])
def test_shard_plans_hold_each_selected_position_once(n, world, segs, rates, hilbert):
    """Per branch and offset, the shard plan's sets hold exactly the branch's selected positions
    in the shard (in local rows), each once, grouped as the global segments group them; together
    they cover the same (head, query, key) pairs as the ring's two calls on the rank's own
    positions."""
    from hilbert_fx.lowering.plans import branch_plan
    from hilbert_fx.lowering.ring_plan import shard_branch_plans
    heads = 4
    for rank in range(world):
        lo = rank * n
        plans = shard_branch_plans(n, world, rank, segs, rates, hilbert)
        assert len(plans) == len(segs)
        pairs = set()
        for plan, w, r in zip(plans, segs, rates):
            glob = branch_plan(n * world, w, r, hilbert)
            for o in range(r):
                got = []
                for s in range(plan.num_segments):
                    sel = plan.positions[o, s, :plan.counts[o, s]]
                    assert bool((sel < n).all()) and bool((plan.positions[o, s, plan.counts[o, s]:]
                                                          == n).all())
                    assert len({int(p + lo) // w for p in sel}) <= 1  # one global segment
                    got += sel.tolist()
                want = glob.positions[o]
                want = want[(want >= lo) & (want < lo + n)] - lo
                assert sorted(got) == sorted(want.tolist()), (rank, w, r, o)
            for h in range(heads):
                o = h % r
                for s in range(plan.num_segments):
                    sel = (plan.positions[o, s, :plan.counts[o, s]] + lo).tolist()
                    pairs |= {(h, a, b) for a in sel for b in sel}
        ring = ring_plan(n, world, rank, segs, rates, hilbert, False, heads, heads)
        assert pairs == _pairs_on_the_rank(ring, heads)


def test_aligned_shard_plans_are_the_single_device_plans():
    """Where the shard's edges fall on segment edges, the shard plan is the single-device plan
    of a sequence of n positions (the same cached object: strided, no position loads)."""
    from hilbert_fx.lowering.plans import branch_plan
    from hilbert_fx.lowering.ring_plan import shard_branch_plans
    plans = shard_branch_plans(16, 4, 1, (8, 16, 64), (1, 2, 4), False)
    assert plans[0] is branch_plan(16, 8, 1, False) and plans[0].is_strided
    assert plans[1] is branch_plan(16, 16, 2, False)
    assert plans[2] is not branch_plan(16, 64, 4, False) and not plans[2].is_strided
    # rank 3 of 4 holds [30, 40), the end of the sequence: aligned for w = 15 and w = 6 (their
    # segments start at 30 and are cut at 40 either way), not for w = 4 (a segment starts at 28)
    last = shard_branch_plans(10, 4, 3, (15, 6, 4), (1, 1, 1), True)
    assert last[0] is branch_plan(10, 15, 1, True) and last[1] is branch_plan(10, 6, 1, True)
    assert last[2] is not branch_plan(10, 4, 1, True)


# --------------------------------------------------------------------------------------------
# The SDPA lowering's query_rows and dropout_rows, on the plans of a ring's cross call.

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_sdpa_query_rows_compute_only_the_queries(causal, dropout_p):
    """With query_rows, the SDPA lowering computes the rows before it as without (out, lse, dq;
    dk and dv as when the other rows' dout is 0) and gives the other rows out 0, lse -inf, dq 0;
    dropout_rows makes the keep bits those of the positions given."""
    from hilbert_fx.lowering import sdpa_lowering
    n, world, hq, hkv = 10, 4, 4, 2
    for rank in (1, 3):
        plan = ring_plan(n, world, rank, (6, 24, 40), (1, 2, 4), True, causal, hq, hkv)
        t, rows = plan.cross_rows.numel(), plan.ext_len
        g = torch.Generator().manual_seed(rank)
        q, dout = (torch.randn(2, hq, rows, 8, generator=g, dtype=torch.float64) for _ in "ab")
        k, v = (torch.randn(2, hkv, rows, 8, generator=g, dtype=torch.float64) for _ in "ab")
        dout[:, :, t:] = 0
        kw = dict(is_causal=causal, attn_mask=None, scale=0.4, dropout_p=dropout_p,
                  seed=torch.tensor(7), dropout_rows=plan.ext_positions)
        plans = list(plan.cross_plans)
        out, lse = sdpa_lowering.forward(q, k, v, plans, **kw)
        out_q, lse_q = sdpa_lowering.forward(q, k, v, plans, query_rows=t, **kw)
        torch.testing.assert_close(out_q[:, :, :t], out[:, :, :t])
        torch.testing.assert_close(lse_q[:, :, :t], lse[:, :, :t])
        assert bool((out_q[:, :, t:] == 0).all()) and bool((lse_q[:, :, t:] == -math.inf).all())
        grads = sdpa_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
        grads_q = sdpa_lowering.backward(dout, q, k, v, out_q, lse_q, plans, query_rows=t, **kw)
        torch.testing.assert_close(grads_q[0][:, :, :t], grads[0][:, :, :t])
        assert bool((grads_q[0][:, :, t:] == 0).all())
        for a, b in zip(grads_q[1:], grads[1:]):
            torch.testing.assert_close(a, b)
    if dropout_p:  # the keep bits follow dropout_rows: other positions give another output
        kw["dropout_rows"] = plan.ext_positions + 1
        other = sdpa_lowering.forward(q, k, v, plans, **kw)
        assert not torch.allclose(other[0][:, :, :t], out[:, :, :t])


# --------------------------------------------------------------------------------------------
# Dropout on the Triton lowering.

def test_triton_lowering_runs_the_ring_calls_with_dropout():
    """The Triton lowering's forward and backward take dropout_rows (the keep bits at the global
    positions of a call's rows, tests/test_triton_dropout_rows.py), so lowering="triton" with
    dropout keeps both calls on it: p2_triton_dropout runs on the Triton kernels."""
    from hilbert_fx.lowering import ring, triton_lowering
    q = torch.zeros(1, 4, 24, 8)
    assert ring._lowering(q, "triton", 0.3) == (triton_lowering, "triton")
