"""The plan of dilated attention over a 1-D device mesh (SPEC section 4): what travels between
ranks, and the branch plans (lowering/plans.py) on which a lowering computes one rank's rows.

The sequence of global length N = P * n is cut into P contiguous shards; rank i owns positions
[i*n, (i+1)*n). For a branch (w, r), a segment lies either inside one shard ("interior": it
needs no communication at all) or across several ("cross"). A shard boundary cuts at most one
segment per branch, so a rank meets at most two cross segments per branch unless w > n.

What travels. For a cross segment j and query head h (offset o = h % r, key/value head
c = h // (Hq / Hkv)), rank i needs the rows of the selected set positions[o, j] that other ranks
own. Since the set is kept in ascending order and shards are contiguous, each rank's share of it
is a contiguous slice. What travels from rank src to rank dst is, for every cross segment they
share and every *unit* (c, o) used by some query head, src's slice of that unit's rows: only
selected rows, each at most once per (unit, segment) even when several query heads (GQA) read
it. Under is_causal only lower ranks send to higher ones (keys from higher ranks all lie in the
queries' future). One message per peer and direction (`Step`).

What a rank computes: every set (branch, offset o, segment j) that holds some of its positions,
as two calls of a lowering's forward (or backward), whose results are merged by log-sum-exp on
the rows the second call covers:

- `local_plans`, over the shard's n rows: every set none of whose members comes from a peer
  (interior segments, and the slices of cross segments that receive nothing, as rank 0's under
  is_causal). It needs no message, so it runs while the rows travel. When nothing is received
  this is `shard_branch_plans`, which where the shard's edges fall on segment edges is the
  single-device plan of a sequence of n positions (strided: the kernels reach rows by
  arithmetic).
- `cross_plans`, over an *extended row*: every set with members from peers, whole, its members
  listed in ascending global position order, so that causal attention is the order within the
  set as on one device. The extended row is `cross_rows` (the local rows of those sets,
  ascending) followed by every distinct global position received (ascending); its keys and
  values are those rows of k, v and of the received messages, its queries those rows of q (the
  received rows' queries are zeros: their outputs are dropped, see below). `ext_positions` gives
  each extended row's global position, which dropout hashes (lowering/dropout.py).

A lowering's set makes every member both a query and a key, so in the second call the received
rows are queries too unless the lowering takes `query_rows` (rows from there on are keys and
values only), as the SDPA lowering does. Otherwise their results, which are not this rank's, are
computed and dropped (the backward gives them dout 0, which makes their share of every gradient
0): per cross set, (members received) x (members) query-key pairs beyond the (local members) x
(members) needed, i.e. the set's work times (ranks sharing it - 1) when shares are equal. That
is small where the cross segments are those of high dilation (a branch's work per head is
N w / r^2), as in the benchmark's branch that spans every GPU. The local members are one
contiguous run of each set's order, so kernels can skip the others by that run alone.

The extended row serves every head: where each head has an offset of its own, a head reads only
1/H of it, and the copies into and out of it cost more than the cross sets' attention.
`Folded` lays the same sets out with the query heads folded into the row (one head, rows
(query head, position)), each head carrying only its own members; the ring uses it except with
dropout (whose keep bits hash the head index).

Gradients of received rows go back to their owners (`Step` in reverse), one row per row
received: a (kv head, global position) that arrived more than once (two branches select it)
carries its total on its first arrival (`recv_first`) and 0 on the others, so the owner's sum
over what comes back is the row's gradient. `grad_heads/grad_rows` number the rows this rank
sent, once each, so that what comes back is added on those rows only.

Everything here is a pure function of (N, P, branches, heads, causal), so every rank computes the
same plan and both sides of every message agree on its size and layout without exchanging it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .plans import BranchPlan, branch_plan


def _longs(values=()) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long)


def _cat(parts) -> torch.Tensor:
    return torch.cat(parts) if parts else _longs()


@dataclass
class Step:
    """Ring step s: rank i sends to (i + s) % P and receives from (i - s) % P."""
    offset: int
    send_to: int
    send_heads: torch.Tensor  # [M_send] kv head of each row sent
    send_rows: torch.Tensor  # [M_send] local row of each row sent
    recv_from: int
    recv_rows: int  # M_recv
    recv_offset: int  # where its rows start among all the rows received (steps in order)
    grad_slot: torch.Tensor  # [M_send] index of each sent row in RingPlan.grad_rows
    send_flat: torch.Tensor  # [M_send] send_heads * n + send_rows: rows of k, v viewed [B, Hkv*n]

    @property
    def send_count(self) -> int:
        return int(self.send_rows.numel())


@dataclass
class RingPlan:
    world: int
    rank: int
    n: int  # local length
    seq_len: int  # global length N
    num_heads: int
    num_kv_heads: int
    steps: list[Step]
    recv_total: int  # rows received from all peers together: M
    local_plans: tuple  # BranchPlans over the shard's n rows (see the module docstring)
    cross_plans: tuple  # BranchPlans over the extended row
    local_positions: torch.Tensor  # [n] global position of each local row
    cross_rows: torch.Tensor  # [T_loc] local rows at the head of the extended row, ascending
    ext_positions: torch.Tensor  # [T] global position of each extended row
    recv_heads: torch.Tensor  # [M] kv head of each received row (steps in order)
    recv_ext: torch.Tensor  # [M] its extended row
    recv_first: torch.Tensor  # [M] bool: the first arrival of its (kv head, extended row)
    # (kv head, local row) of every row sent to some peer (its gradient comes back), no repeats
    grad_heads: torch.Tensor
    grad_rows: torch.Tensor
    # local_plans cut in two runs of about equal work (a backward may run one while gradients
    # travel); (local_plans, ()) when they cannot be cut
    local_halves: tuple
    folded: "Folded | None" = None  # the cross call with the heads folded into the row

    @property
    def ext_len(self) -> int:
        return int(self.ext_positions.numel())

    @property
    def rows_sent(self) -> int:
        return sum(s.send_count for s in self.steps)

    @property
    def rows_received(self) -> int:
        return sum(s.recv_rows for s in self.steps)

    @property
    def talks(self) -> bool:
        """Whether this rank sends or receives any row."""
        return bool(self.rows_sent or self.recv_total)


@dataclass
class Folded:
    """The cross call's sets with the query heads folded into the row: one head, each folded
    row one (query head h, global position p) that a set of h holds, so that each head carries
    only its own members (the extended row carries every head's members for every head: H
    times the rows a head reads, when each head has its own offset).

    Rows [0, queries) are the local pairs, rows [queries, length) the received ones; each list
    is sorted by (h, p). Set (h, branch, segment) is one segment of that branch's plan (rate 1),
    its members in ascending global position, so that causal attention is, as on one device,
    the order within the set. A received row holds the key/value row of (kv head of h, p) as it
    first arrived (`recv_index`); its query is zero and its results are not this rank's."""
    length: int  # R
    queries: int  # R_loc
    q_index: torch.Tensor  # [R_loc] h * n + local row: rows of q, out, lse, dq viewed [B, Hq*n]
    # the local rows' key/value rows, (kv head of h) * n + local row of k, v, dk, dv viewed
    # [B, Hkv*n], as kv_unique[kv_inverse] (the query heads of a group may share a row)
    kv_unique: torch.Tensor  # [U]
    kv_inverse: torch.Tensor  # [R_loc]
    recv_index: torch.Tensor  # [R - R_loc] the received row (steps in order) of each such row
    plans: tuple  # BranchPlans over the R rows, one per branch with sets across ranks
    kv_index: torch.Tensor  # [R_loc] kv_unique[kv_inverse]: each local row's key/value row


@dataclass
class _Cross:
    """One cross segment of a branch: per offset, the slice bounds of each rank."""
    j: int
    pos: torch.Tensor  # [r, L] ascending, padded with N
    bounds: torch.Tensor  # [r, P + 1]: rank p owns pos[o, bounds[o, p]:bounds[o, p + 1]]
    first: int  # ranks first..last hold part of it
    last: int

    def count(self, o: int, p: int) -> int:
        return int(self.bounds[o, p + 1] - self.bounds[o, p])


def _units(num_heads: int, num_kv_heads: int, r: int):
    """Sorted distinct (kv head, offset) pairs read by the query heads."""
    group = num_heads // num_kv_heads
    return sorted({(h // group, h % r) for h in range(num_heads)})


def _cross_segments(glob: BranchPlan, n: int, world: int) -> list[_Cross]:
    w, r, seq_len = glob.segment_length, glob.dilation_rate, glob.seq_len
    out = []
    edges = torch.arange(world + 1) * n
    for j in range(glob.num_segments):
        start, end = j * w, min((j + 1) * w, seq_len)
        first, last = start // n, (end - 1) // n
        if first == last:
            continue
        pos = glob.positions[:, j, :]
        bounds = torch.searchsorted(pos.contiguous(), edges.expand(r, world + 1).contiguous())
        out.append(_Cross(j, pos, bounds, first, last))
    return out


def _message_items(crosses, branch_units, src: int, dst: int, is_causal: bool):
    """What src sends dst: a list of (branch, cross index, (kv head, offset), start, count), in
    order. A unit's slice goes only where dst has a member of that set."""
    items = []
    if src == dst or (is_causal and src > dst):
        return items
    for b, (cross_list, units) in enumerate(zip(crosses, branch_units)):
        for ci, cr in enumerate(cross_list):
            if not (cr.first <= src <= cr.last and cr.first <= dst <= cr.last):
                continue
            for c, o in units:
                cnt = cr.count(o, src)
                if cnt == 0 or cr.count(o, dst) == 0:
                    continue
                items.append((b, ci, (c, o), int(cr.bounds[o, src]), cnt))
    return items


def _local_sets(glob: BranchPlan, n: int, rank: int, exclude=frozenset(),
                offsets=None) -> BranchPlan | None:
    """Branch `glob` restricted to rank's shard [rank*n, (rank+1)*n), in local rows, less the
    sets (segment, offset) in `exclude` and, when `offsets` is given, the sets of other offsets
    (those no query head reads).

    Its segments are the global segments that meet the shard, each cut to the shard: set
    (o, segment) holds the members of the global set that lie in the shard, ascending (a
    contiguous run of the global set, since shards are contiguous), minus rank*n, padded with n;
    segments of which it keeps no member are left out. Causal attention within such a part is
    the lower triangle over it, as in the global set. Not strided: the kernels read positions
    (segment starts vary from shard to shard). None when it keeps no member."""
    w, r = glob.segment_length, glob.dilation_rate
    lo, hi = rank * n, (rank + 1) * n
    j0, j1 = lo // w, min(-(-hi // w), glob.num_segments)
    pos = glob.positions[:, j0:j1, :]
    inside = (pos >= lo) & (pos < hi)
    for j, o in exclude:
        inside[o, j - j0] = False
    if offsets is not None:
        inside[[o for o in range(r) if o not in offsets]] = False
    local, _ = torch.where(inside, pos - lo, torch.full_like(pos, n)).sort(dim=-1)
    counts = inside.sum(-1)  # [r, S']
    used = counts.sum(0) > 0
    if not bool(used.any()):
        return None
    length = int(counts.max())
    local = local[:, used, :length].contiguous()
    counts = counts[:, used].contiguous()
    return BranchPlan(w, r, n, local, counts, strided=False, complete=_covers(local, n))


def _covers(positions: torch.Tensor, rows: int) -> bool:
    """Whether every row 0 .. rows - 1 is a member of some set (BranchPlan.complete)."""
    seen = torch.zeros(rows + 1, dtype=torch.bool)
    seen[positions.reshape(-1).clamp(max=rows)] = True
    return bool(seen[:rows].all())


def _aligned(seq_len: int, n: int, rank: int, w: int) -> bool:
    lo, hi = rank * n, (rank + 1) * n
    return lo % w == 0 and (hi % w == 0 or hi == seq_len)


def _shard_plan(glob: BranchPlan, n: int, rank: int, hilbert: bool,
                device: str) -> BranchPlan | None:
    """Every set of branch `glob` cut to rank's shard (_local_sets). When the shard's edges fall
    on segment edges (or its end is the sequence's end) this is the single-device plan of a
    sequence of n positions, and that cached plan is returned (the kernels then reach rows by
    strides)."""
    if _aligned(glob.seq_len, n, rank, glob.segment_length):
        return branch_plan(n, glob.segment_length, glob.dilation_rate, hilbert, device)
    return _on(_local_sets(glob, n, rank), device)


def _on(plan: BranchPlan | None, device: str) -> BranchPlan | None:
    if plan is None or str(plan.positions.device) == device:
        return plan
    return BranchPlan(plan.segment_length, plan.dilation_rate, plan.seq_len,
                      plan.positions.to(device), plan.counts.to(device), strided=plan.strided,
                      complete=plan.complete)


def _segments(plan: BranchPlan, a: int, b: int) -> BranchPlan:
    return BranchPlan(plan.segment_length, plan.dilation_rate, plan.seq_len,
                      plan.positions[:, a:b].contiguous(), plan.counts[:, a:b].contiguous(),
                      strided=False, complete=False)


def _halves(plans: list[BranchPlan]) -> tuple:
    """The plans as two runs of about equal work (pairs per set, summed): whole plans where
    there are several, else the one plan's segments cut in two."""
    work = [(p.counts.cpu().double() ** 2).sum(0) for p in plans]  # per segment
    if len(plans) == 1 and plans[0].num_segments > 1:
        cut = int(torch.searchsorted(work[0].cumsum(0), work[0].sum() / 2)) + 1
        cut = min(max(cut, 1), plans[0].num_segments - 1)
        return (_segments(plans[0], 0, cut),), (_segments(plans[0], cut, plans[0].num_segments),)
    work = [float(x.sum()) for x in work]
    half, acc = sum(work) / 2, 0.0
    for i, x in enumerate(work):
        if acc + x >= half:
            cut = i + 1 if acc + x - half < half - acc else i
            return tuple(plans[:cut]), tuple(plans[cut:])
        acc += x
    return tuple(plans), ()


def _first_arrivals(heads: torch.Tensor, ext: torch.Tensor, length: int) -> torch.Tensor:
    key = heads * (length + 1) + ext
    _, inverse = torch.unique(key, return_inverse=True)
    index = torch.arange(key.numel())
    first = torch.full((int(inverse.max()) + 1 if key.numel() else 0,), key.numel(),
                       dtype=torch.long).scatter_reduce(0, inverse, index, "amin")
    return first[inverse] == index


def _build(seq_len: int, world: int, rank: int, segment_lengths, dilation_rates, hilbert: bool,
           is_causal: bool, num_heads: int, num_kv_heads: int, device: str) -> RingPlan:
    n = seq_len // world
    lo, hi = rank * n, (rank + 1) * n
    globs = [branch_plan(seq_len, w, r, hilbert, "cpu")
             for w, r in zip(segment_lengths, dilation_rates)]
    crosses = [_cross_segments(g, n, world) if world > 1 else [] for g in globs]
    branch_units = [_units(num_heads, num_kv_heads, g.dilation_rate) for g in globs]

    steps = []
    recv_heads, recv_pos = [], []
    senders: dict = {}  # (branch, segment, offset) -> ranks whose members of that set arrive
    recv_offset = 0
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        send_heads, send_rows = [], []
        for b, ci, (c, o), start, cnt in _message_items(crosses, branch_units, rank, dst,
                                                        is_causal):
            rows = crosses[b][ci].pos[o, start:start + cnt] - lo
            send_rows.append(rows)
            send_heads.append(torch.full_like(rows, c))
        total = 0
        for b, ci, (c, o), start, cnt in _message_items(crosses, branch_units, src, rank,
                                                        is_causal):
            cr = crosses[b][ci]
            recv_pos.append(cr.pos[o, start:start + cnt])
            recv_heads.append(torch.full((cnt,), c, dtype=torch.long))
            senders.setdefault((b, cr.j, o), set()).add(src)
            total += cnt
        heads, rows = _cat(send_heads), _cat(send_rows)
        steps.append(Step(s, dst, heads, rows, src, total, recv_offset, _longs(),
                          heads * n + rows))
        recv_offset += total
    recv_heads, recv_pos = _cat(recv_heads), _cat(recv_pos)

    # the members of every set with members from peers: this rank's and the senders'
    members: dict = {}  # branch -> {(segment, offset): ascending global positions}
    for (b, j, o), ranks in senders.items():
        sel = globs[b].positions[o, j]
        sel = sel[sel < seq_len]
        owner = sel // n
        keep = owner == rank
        for src in ranks:
            keep |= owner == src
        members.setdefault(b, {})[(j, o)] = sel[keep]
    local = [p[(p >= lo) & (p < hi)] for sets in members.values() for p in sets.values()]
    cross_rows = torch.unique(_cat(local)) - lo
    distinct = torch.unique(recv_pos)
    t_loc = cross_rows.numel()
    ext_len = t_loc + distinct.numel()

    def ext_of(p: torch.Tensor) -> torch.Tensor:
        inside = (p >= lo) & (p < hi)
        return torch.where(inside, torch.searchsorted(cross_rows, (p - lo).contiguous()),
                           t_loc + torch.searchsorted(distinct, p.contiguous()))

    local_plans, cross_plans = [], []
    for b, glob in enumerate(globs):
        sets = members.get(b, {})
        if not sets:
            plan = _shard_plan(glob, n, rank, hilbert, device)
        else:
            used = {h % glob.dilation_rate for h in range(num_heads)}
            plan = _on(_local_sets(glob, n, rank, frozenset(sets), used), device)
            cross_plans.append(_on(_cross_plan(glob, sets, ext_of, ext_len), device))
        if plan is not None:
            local_plans.append(plan)

    recv_ext = ext_of(recv_pos) if recv_pos.numel() else _longs()
    folded = _folded(globs, members, n, rank, num_heads, num_kv_heads, recv_heads, recv_pos,
                     device) if members else None
    sent = [s.send_heads * (n + 1) + s.send_rows for s in steps]
    unique = torch.unique(_cat(sent))
    for step, keys in zip(steps, sent):
        step.grad_slot = torch.searchsorted(unique, keys.contiguous())
    local_halves = _halves(local_plans)

    def mv(x):
        return x.to(device)
    steps = [Step(s.offset, s.send_to, mv(s.send_heads), mv(s.send_rows), s.recv_from,
                  s.recv_rows, s.recv_offset, mv(s.grad_slot), mv(s.send_flat)) for s in steps]
    return RingPlan(
        world, rank, n, seq_len, num_heads, num_kv_heads, steps, recv_offset, tuple(local_plans),
        tuple(cross_plans), mv(torch.arange(lo, hi)), mv(cross_rows),
        mv(torch.cat([cross_rows + lo, distinct])), mv(recv_heads), mv(recv_ext),
        mv(_first_arrivals(recv_heads, recv_ext, ext_len)), mv(unique // (n + 1)),
        mv(unique % (n + 1)), local_halves, folded)


def _folded(globs, members: dict, n: int, rank: int, num_heads: int, num_kv_heads: int,
            recv_heads: torch.Tensor, recv_pos: torch.Tensor, device: str) -> Folded:
    """The cross call's sets over folded rows (Folded): keys h * N + p, local ones first."""
    seq_len, group = globs[0].seq_len, num_heads // num_kv_heads
    lo, hi = rank * n, (rank + 1) * n
    sets = []  # (branch, [(h, ascending global positions)])
    for b in sorted(members):
        r = globs[b].dilation_rate
        sets.append((b, [(h, p) for (j, o), p in sorted(members[b].items())
                         for h in range(num_heads) if h % r == o]))
    keys = _cat([h * seq_len + p for _, hp in sets for h, p in hp])
    local = (keys % seq_len >= lo) & (keys % seq_len < hi)
    loc_keys, rem_keys = torch.unique(keys[local]), torch.unique(keys[~local])
    t = loc_keys.numel()
    length = t + rem_keys.numel()

    def row_of(h: int, p: torch.Tensor) -> torch.Tensor:
        key = h * seq_len + p
        inside = (p >= lo) & (p < hi)
        return torch.where(inside, torch.searchsorted(loc_keys, key),
                           t + torch.searchsorted(rem_keys, key))

    plans = []
    for b, hp in sets:
        width = max(p.numel() for _, p in hp)
        positions = torch.full((1, len(hp), width), length, dtype=torch.long)
        counts = torch.tensor([[p.numel() for _, p in hp]], dtype=torch.long)
        for s, (h, p) in enumerate(hp):
            positions[0, s, :p.numel()] = row_of(h, p)
        plans.append(_on(BranchPlan(globs[b].segment_length, 1, length, positions, counts,
                                    strided=False, complete=_covers(positions, length)), device))
    loc_h, loc_p = loc_keys // seq_len, loc_keys % seq_len - lo
    # the first arrival of each received (kv head, position)
    arrived = recv_heads * seq_len + recv_pos
    order = torch.argsort(arrived, stable=True)
    uniq, first = torch.unique_consecutive(arrived[order], return_counts=True)
    starts = order[torch.cumsum(first, 0) - first]
    wanted = (rem_keys // seq_len) // group * seq_len + rem_keys % seq_len
    recv_index = starts[torch.searchsorted(uniq, wanted)]
    kv_unique, kv_inverse = torch.unique((loc_h // group) * n + loc_p, return_inverse=True)
    return Folded(length, t, (loc_h * n + loc_p).to(device), kv_unique.to(device),
                  kv_inverse.to(device), recv_index.to(device), tuple(plans),
                  kv_unique[kv_inverse].to(device))


def _cross_plan(glob: BranchPlan, sets: dict, ext_of, ext_len: int) -> BranchPlan:
    """Branch `glob`'s sets with members from peers, over the extended row: set (o, segment)
    lists the extended rows of its members in ascending global position order, padded with the
    extended row's length. Segments are those of the sets, in order."""
    w, r = glob.segment_length, glob.dilation_rate
    segs = sorted({j for j, _ in sets})
    length = max(p.numel() for p in sets.values())
    positions = torch.full((r, len(segs), length), ext_len, dtype=torch.long)
    counts = torch.zeros(r, len(segs), dtype=torch.long)
    for (j, o), p in sets.items():
        s = segs.index(j)
        positions[o, s, :p.numel()] = ext_of(p)
        counts[o, s] = p.numel()
    return BranchPlan(w, r, ext_len, positions, counts, strided=False,
                      complete=_covers(positions, ext_len))


@functools.lru_cache(maxsize=64)
def _cached(seq_len, world, rank, segment_lengths, dilation_rates, hilbert, is_causal, num_heads,
            num_kv_heads, device) -> RingPlan:
    return _build(seq_len, world, rank, segment_lengths, dilation_rates, hilbert, is_causal,
                  num_heads, num_kv_heads, device)


def ring_plan(n_local: int, world: int, rank: int, segment_lengths, dilation_rates, hilbert: bool,
              is_causal: bool, num_heads: int, num_kv_heads: int,
              device: torch.device | str = "cpu") -> RingPlan:
    """The cached plan of `rank` among `world` ranks holding n_local positions each."""
    return _cached(int(n_local) * int(world), int(world), int(rank),
                   tuple(int(w) for w in segment_lengths), tuple(int(r) for r in dilation_rates),
                   bool(hilbert), bool(is_causal), int(num_heads), int(num_kv_heads),
                   str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _cached_shard_plans(seq_len, world, rank, segment_lengths, dilation_rates, hilbert, device):
    n = seq_len // world
    plans = [_shard_plan(branch_plan(seq_len, w, r, hilbert, "cpu"), n, rank, hilbert, device)
             for w, r in zip(segment_lengths, dilation_rates)]
    return tuple(p for p in plans if p is not None)


def shard_branch_plans(n_local: int, world: int, rank: int, segment_lengths, dilation_rates,
                       hilbert: bool, device: torch.device | str = "cpu") -> list[BranchPlan]:
    """Every set of every branch cut to `rank`'s shard, in local rows: run through a lowering on
    the shard, they compute every pair of positions that both lie in the shard. The ring's
    `local_plans` are these where the rank receives nothing."""
    return list(_cached_shard_plans(int(n_local) * int(world), int(world), int(rank),
                                    tuple(int(w) for w in segment_lengths),
                                    tuple(int(r) for r in dilation_rates), bool(hilbert),
                                    str(torch.device(device))))


def plan_bytes(n_local: int, world: int, segment_lengths, dilation_rates, *, hilbert: bool,
               is_causal: bool, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
               v_head_dim: int | None = None, element_size: int = 2,
               grad_element_size: int = 4) -> list[dict]:
    """Bytes each rank sends, per rank, next to what a dense ring would send.

    forward: the selected key/value rows. backward: the same rows again (they are not kept
    between forward and backward) plus their gradients (in float32: grad_element_size).
    dense ring: every rank passes its whole K and V shard to each of the P - 1 others, forward;
    backward, K and V again plus dK and dV in float32 (as ring-flash-attention does)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    per_row = batch * (head_dim + dv)
    dense_rows = (world - 1) * num_kv_heads * n_local
    result = []
    for rank in range(world):
        plan = ring_plan(n_local, world, rank, segment_lengths, dilation_rates, hilbert, is_causal,
                         num_heads, num_kv_heads)
        rows = plan.rows_sent
        grad_rows = plan.rows_received  # gradients go back to the owners of what was received
        result.append({
            "rank": rank,
            "rows_sent": rows,
            "forward_bytes": rows * per_row * element_size,
            "backward_bytes": rows * per_row * element_size + grad_rows * per_row * grad_element_size,
            "dense_forward_bytes": dense_rows * per_row * element_size,
            "dense_backward_bytes": dense_rows * per_row * (element_size + grad_element_size),
        })
    return result
