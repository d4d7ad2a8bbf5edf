"""The ring's cross call with the query heads folded into the row (RingPlan.folded): the same
(head, query, key) pairs as the extended row's sets, each folded row's key/value row from the
right kv head, and the causal order within each set the global one."""
from __future__ import annotations

import pytest
import torch

from hilbert_fx.lowering.ring_plan import ring_plan


def _extended_pairs(plan, heads):
    """(h, query, key) in global positions, queries on the rank: the extended row's sets."""
    lo, pairs = plan.rank * plan.n, set()
    for branch in plan.cross_plans:
        for h in range(heads):
            o = h % branch.dilation_rate
            for s in range(branch.num_segments):
                sel = plan.ext_positions[branch.positions[o, s, :branch.counts[o, s]]].tolist()
                pairs |= {(h, a, b) for a in sel if lo <= a < lo + plan.n for b in sel}
    return pairs


def _folded_pairs(plan, heads, kv_heads):
    f, lo, n = plan.folded, plan.rank * plan.n, plan.n
    group = heads // kv_heads
    kv_index = f.kv_unique[f.kv_inverse]
    pairs, causal_orders = set(), []
    for branch in f.plans:
        assert branch.dilation_rate == 1 and branch.seq_len == f.length
        for s in range(branch.num_segments):
            rows = branch.positions[0, s, :branch.counts[0, s]]
            local = rows[rows < f.queries]
            assert local.numel(), "a set with no query of this rank"
            h = {int(x) // n for x in f.q_index[local]}
            assert len(h) == 1
            h = h.pop()
            # each local row's key/value row is its own position on the kv head of h
            assert bool((kv_index[local] == (h // group) * n + f.q_index[local] % n).all())
            glob = []
            for r in rows.tolist():
                if r < f.queries:
                    glob.append(int(f.q_index[r]) % n + lo)
                else:
                    m = int(f.recv_index[r - f.queries])
                    assert int(plan.recv_heads[m]) == h // group
                    glob.append(int(plan.ext_positions[plan.recv_ext[m]]))
            causal_orders.append(glob)
            pairs |= {(h, a, b) for a in glob if lo <= a < lo + n for b in glob}
    return pairs, causal_orders


@pytest.mark.parametrize("n,world,segs,rates,heads,kv_heads", [
    (21, 2, (6, 16, 42), (1, 2, 3), 4, 4), (10, 4, (6, 24, 40), (1, 2, 4), 4, 2),
    (7, 3, (5, 9, 21, 40), (1, 3, 3, 8), 6, 3), (16, 4, (8, 32, 64), (1, 2, 4), 2, 1),
    (13, 4, (8, 52), (1, 4), 2, 2)])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_folded_sets_are_the_extended_sets(n, world, segs, rates, heads, kv_heads, hilbert,
                                           causal):
    folded = 0
    for rank in range(world):
        plan = ring_plan(n, world, rank, segs, rates, hilbert, causal, heads, kv_heads)
        if not plan.cross_plans:
            assert plan.folded is None
            continue
        folded += 1
        pairs, orders = _folded_pairs(plan, heads, kv_heads)
        assert pairs == _extended_pairs(plan, heads), rank
        assert all(order == sorted(order) for order in orders)  # members in global order
        # every received row a folded row reads arrived on its first arrival
        assert bool(plan.recv_first[plan.folded.recv_index].all())
    assert folded, "no rank has cross sets: nothing was checked"
