"""What the Triton lowering's kernels read of the branch plans, made once per plan: each plan's
positions and counts on the kernels' device, padded so that a tile of positions loads without
a mask (`plan_tensors`); the order the branches run in, which decides who writes the final
result in place (`forward_order`); and the gradient rows a backward's earlier branches wrote,
the only rows a later one reads back (`seen_rows`).

lowering/triton_lowering.py builds its programs from these; nothing here launches a kernel.
Plans are frozen (lowering/plans.py), so what is made from one is kept while it lives.
"""
from __future__ import annotations

import torch

from .plans import BranchPlan, whole_sets
from .tuning import PlanCache

__all__ = ["POSITION_PAD", "plan_tensors", "forward_order", "seen_rows"]

POSITION_PAD = 256  # the largest BLOCK_M / BLOCK_N: a tile past a set's last may be prefetched

# What the kernels read of each plan, per plan object and device (plans are frozen; most are
# cached by their makers, so this runs once per plan, not per call)
_plan_cache = PlanCache()


def plan_tensors(plan: BranchPlan, device):
    """(positions, counts, strided, groups) of a plan for the kernels on `device`, made once per
    plan; groups (int32 [2, r, S, as positions], -1 past each count) or None.

    Strided plans (identity order) of whole sets reach rows by arithmetic and pass their
    positions unused. Otherwise (the Triton kernels still reach a strided plan's rows by
    arithmetic; the Hopper kernels gather partial sets of either order through the positions)
    the positions go as int32, each set padded with 0 (a real row) from its count on,
    to a whole number of POSITION_PAD members plus one more POSITION_PAD: the kernels load a
    tile of positions, and the next tile's ahead of time, without a mask. On an H200 this took
    the Hilbert order's forward at N = 64K from 5.21 to 5.04 ms and from 5.25 to 5.08 ms, timed
    in one process against int64 positions and masked loads (BENCHMARKS.md)."""
    device = torch.device(device)

    def make():
        cnt = plan.counts.to(device)
        pos = plan.positions.to(device)
        if not plan.is_strided or not whole_sets(plan):
            r, s, m = pos.shape
            valid = torch.arange(m, device=device) < cnt.unsqueeze(-1)
            padded = torch.zeros(r, s, -(-m // POSITION_PAD) * POSITION_PAD + POSITION_PAD,
                                 dtype=torch.int32, device=device)
            padded[:, :, :m] = torch.where(valid, pos, 0).to(torch.int32)
            pos = padded
        groups = None
        if plan.groups is not None:  # never strided: laid out as the padded positions
            groups = torch.full((2, *pos.shape), -1, dtype=torch.int32, device=device)
            groups[..., :plan.set_size] = plan.groups.to(device)
        return pos, cnt, plan.is_strided, groups

    return _plan_cache.get(plan, str(device), make)


def complete(plan: BranchPlan) -> bool:
    """Whether every row is in some set of the plan (False where rows are padding)."""
    return bool(getattr(plan, "complete", True))


def forward_order(plans):
    """(order, last, zeroed): branches with r > 1 first, then those with r == 1; the `last`
    plans at the end write the final result in place, each its own rows. They are a complete
    plan with r == 1 (it selects every row), or else the r == 1 plans built together for one
    branch of rows that hold several sequences (BranchPlan.part_of), which between them select
    every row but padding: then `zeroed`, the final buffers start at 0 for the padding rows that
    nobody writes. last is 0 where no plan or group selects every row."""
    final = next(([p] for p in plans if p.dilation_rate == 1 and complete(p)), None)
    if final is None:
        final = _parts_of_a_branch(plans)
    rest = [p for p in plans if all(p is not f for f in final)]
    order = [p for p in rest if p.dilation_rate != 1] + [p for p in rest if p.dilation_rate == 1]
    return order + final, len(final), bool(final) and not complete(final[0])


def _parts_of_a_branch(plans) -> list:
    """The plans of the first branch with r == 1 built in parts, if all its parts are here."""
    for plan in plans:
        part = getattr(plan, "part_of", None)
        if plan.dilation_rate == 1 and part is not None:
            parts = [p for p in plans if getattr(p, "part_of", None) == part]
            if len(parts) == part[1]:
                return parts
    return []


_seen_cache: dict = {}


def selected_rows(plan: BranchPlan, num_heads: int) -> torch.Tensor:
    """[num_heads, N] bool: the positions query head h selects in this branch (offset h % r)."""
    r, n = plan.dilation_rate, plan.seq_len
    pos = plan.positions.reshape(r, -1, plan.set_size)
    valid = torch.arange(plan.set_size, device=pos.device) < plan.counts.unsqueeze(-1)
    pos = torch.where(valid, pos, n)  # past a set's count: column N, dropped below
    sel = torch.zeros(r, n + 1, dtype=torch.bool, device=pos.device)
    sel.scatter_(1, pos.reshape(r, -1), True)
    heads = torch.arange(num_heads, device=sel.device) % r
    return sel[:, :n].index_select(0, heads)


def seen_rows(before, hq: int, hkv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows [Hq, N], key rows [Hkv, N]) uint8: 1 where a branch of `before` (launched
    earlier) wrote a gradient row, which a later branch adds to; its other rows are not
    initialised. Made once per sequence of plans and head counts (the entry holds the plans, so
    their ids stay theirs while it lives)."""
    key = (tuple(id(p) for p in before), hq, hkv, str(device))
    hit = _seen_cache.get(key)
    if hit is None:
        # from the rows of all but the last plan where they were made (a backward asks for each
        # prefix of its order in turn, and per-call plans ask again at every batch)
        shorter = _seen_cache.get((key[0][:-1], *key[1:]))
        if shorter is not None:
            rows = (shorter[1] != 0) | selected_rows(before[-1], hq).to(device)
        else:
            rows = torch.zeros(hq, before[0].seq_len, dtype=torch.bool, device=device)
            for plan in before:
                rows |= selected_rows(plan, hq).to(device)
        kv_rows = rows.view(hkv, hq // hkv, -1).any(1)
        if len(_seen_cache) > 64:
            _seen_cache.clear()
        hit = _seen_cache[key] = (tuple(before), rows.to(torch.uint8), kv_rows.to(torch.uint8))
    return hit[1], hit[2]
