"""Index plans: which positions each branch of dilated attention selects (SPEC section 2).

A branch (w, r) over a sequence of length N cuts [0, N) into S = ceil(N / w) segments. In segment
j, rank t stands for position j*w + pi_w(t); query head h uses offset o = h % r and selects the
ranks t with t % r == o. Attention over a selected set does not depend on the order of its
members, so a plan stores each set in ascending position order, which lets causal attention be a
plain lower triangle over the set.

`BranchPlan.positions[o, j, m]` is the m-th smallest selected position of offset o in segment j,
padded with N (a position that does not exist) past `counts[o, j]`.

Plans of rows that hold several sequences or padding (SPEC section 5) have the same form and are
built in lowering/sequences.py: there a set may be partial in any segment, rows of padding are
in no set (`complete` is False), and a set may hold several segments' members as groups that
do not see each other (`groups`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch


def hilbert_d2xy(n: int, d: int) -> tuple[int, int]:
    """Cell (x, y) visited at step d of the classic Hilbert curve over an n x n grid."""
    x = y = 0
    s = 1
    while s < n:
        rx = 1 & (d // 2)
        ry = 1 & (d ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x += s * rx
        y += s * ry
        d //= 4
        s *= 2
    return x, y


@functools.lru_cache(maxsize=64)
def hilbert_order(w: int) -> torch.Tensor:
    """pi_w as a LongTensor of length w: a permutation of range(w) (SPEC section 2)."""
    if w <= 0:
        raise ValueError(f"segment length must be positive, got {w}")
    side = 1
    while side * side < w:
        side *= 2
    order = [0] * w
    kept = 0
    for d in range(side * side):
        x, y = hilbert_d2xy(side, d)
        cell = y * side + x
        if cell < w:
            order[kept] = cell
            kept += 1
    assert kept == w
    return torch.tensor(order, dtype=torch.long)


@dataclass(frozen=True)
class BranchPlan:
    segment_length: int
    dilation_rate: int
    seq_len: int
    positions: torch.Tensor  # [r, S, w // r] long, ascending, padded with seq_len
    counts: torch.Tensor  # [r, S] long, number of valid entries of positions
    # positions[o, j, m] == j*w + o + m*r wherever valid (identity order over one plain row): the
    # kernels can then reach rows by arithmetic instead of reading positions
    strided: bool = False
    # every row 0 .. seq_len - 1 is in a set of every offset; False where rows are padding
    complete: bool = True
    # the in-segment order the sets were built in (None: not known): every whole segment's set
    # of offset o is then the segment's first row plus class_members(w, r, hilbert)[o], which
    # lets a lowering learn the sets' shape from this table on the host instead of reading
    # positions from the GPU (a synchronisation)
    hilbert: Optional[bool] = None
    # [2, r, S, set_size] long, or None: member m of set (o, j) attends only to the members
    # groups[0, o, j, m] <= m' < groups[1, o, j, m] of its set (its group, a run of slots).
    # Several short segments then share one set, which bounds the number of sets by N
    # (lowering/sequences.py); slots past the count hold -1. None: the whole set is one group.
    groups: Optional[torch.Tensor] = None
    # (branch, parts): one of `parts` plans built together for one branch (lowering/sequences.py),
    # which between them hold every row that is not padding, each row in one of them
    part_of: Optional[tuple] = None

    @property
    def num_segments(self) -> int:
        return self.positions.shape[1]

    @property
    def set_size(self) -> int:
        return self.positions.shape[2]

    @property
    def is_strided(self) -> bool:
        return self.strided

    def for_heads(self, num_heads: int) -> torch.Tensor:
        """[H, S, w // r]: the positions each query head selects (head h uses offset h % r)."""
        offsets = torch.arange(num_heads, device=self.positions.device) % self.dilation_rate
        return self.positions.index_select(0, offsets)


def whole_sets(plan: BranchPlan) -> bool:
    """Whether the plan is N / w segments of w / r members each, from its fields alone (reading
    its counts would synchronise with the GPU). A complete plan has each row in exactly one set
    of the branch (no padding), so its counts add up to N; with N / w segments of w / r slots
    per offset there are exactly N slots, and each count is at most w / r: every set is whole."""
    n, w, r = plan.seq_len, plan.segment_length, plan.dilation_rate
    return (bool(getattr(plan, "complete", True)) and n % w == 0 and w % r == 0
            and plan.num_segments == n // w and plan.set_size == w // r)


@functools.lru_cache(maxsize=256)
def class_members(w: int, r: int, hilbert: bool) -> torch.Tensor:
    """[r, w // r] long: the in-segment positions of offset class o, ascending. Rank t stands
    for in-segment position pi_w(t) and belongs to class t % r."""
    ranks = hilbert_order(w) if hilbert else torch.arange(w)
    return ranks.view(w // r, r).t().sort(dim=-1).values.contiguous()


@functools.lru_cache(maxsize=256)
def class_of(w: int, r: int, hilbert: bool) -> torch.Tensor:
    """[w] long: the offset class of each in-segment position, and [w] its index in that
    class's ascending members (class_members[class_of[c], slot_of[c]] == c)."""
    members = class_members(w, r, hilbert)
    cls = torch.empty(w, dtype=torch.long)
    slot = torch.empty(w, dtype=torch.long)
    cls[members.reshape(-1)] = torch.arange(r).repeat_interleave(w // r)
    slot[members.reshape(-1)] = torch.arange(w // r).repeat(r)
    return torch.stack([cls, slot])


def _build_positions(seq_len: int, w: int, r: int, hilbert: bool) -> torch.Tensor:
    num_segments = -(-seq_len // w)
    ranks = hilbert_order(w) if hilbert else torch.arange(w)
    # ranks[t] is the in-segment position of rank t; rank t belongs to offset t % r.
    by_offset = ranks.view(w // r, r).t()  # [r, w // r]: offset o -> its in-segment positions
    starts = torch.arange(num_segments).view(1, num_segments, 1) * w
    positions = starts + by_offset.view(r, 1, w // r)  # [r, S, w // r]
    positions = torch.where(positions < seq_len, positions, torch.full_like(positions, seq_len))
    positions, _ = positions.sort(dim=-1)
    return positions


@functools.lru_cache(maxsize=256)
def _cached_plan(seq_len: int, w: int, r: int, hilbert: bool, device: str) -> BranchPlan:
    positions = _build_positions(seq_len, w, r, hilbert)
    counts = (positions < seq_len).sum(-1)
    strided = not hilbert or torch.equal(positions, _build_positions(seq_len, w, r, hilbert=False))
    return BranchPlan(w, r, seq_len, positions.to(device), counts.to(device), strided=strided,
                      hilbert=hilbert)


def branch_plan(seq_len: int, segment_length: int, dilation_rate: int, hilbert: bool,
                device: torch.device | str = "cpu") -> BranchPlan:
    """The cached plan of one branch for sequences of length seq_len on `device`."""
    return _cached_plan(int(seq_len), int(segment_length), int(dilation_rate), bool(hilbert),
                        str(torch.device(device)))


def branch_plans(seq_len: int, segment_lengths, dilation_rates, hilbert: bool,
                 device: torch.device | str = "cpu") -> list[BranchPlan]:
    return [branch_plan(seq_len, w, r, hilbert, device) for w, r in zip(segment_lengths, dilation_rates)]
