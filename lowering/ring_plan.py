"""The communication plan of dilated attention over a 1-D device mesh (SPEC section 4).

The sequence of global length N = P * n is cut into P contiguous shards; rank i owns positions
[i*n, (i+1)*n). For a branch (w, r), a segment lies either inside one shard ("interior": it
needs no communication at all) or across several ("cross"). A shard boundary cuts at most one
segment per branch, so a rank meets at most two cross segments per branch.

For a cross segment j and query head h (offset o = h % r, key/value head c = h // (Hq / Hkv)),
rank i needs the rows of the selected set positions[o, j] that other ranks own. Since the set is
kept in ascending order and shards are contiguous, each rank's share of it is a contiguous slice.
What travels from rank src to rank dst is, for every cross segment they share and every *unit*
(c, o) used by some query head, src's slice of that unit's rows: only selected rows, each at most
once per (unit, segment) even when several query heads (GQA) read it. Under is_causal only lower
ranks send to higher ones (keys from higher ranks all lie in the queries' future).

Everything here is a pure function of (N, P, branches, heads, causal), so every rank computes the
same plan and both sides of every message agree on its size and layout without exchanging it.

Blocks the compute runs on rank i:
- LocalBlock: queries and keys are the same selected sets (interior segments, and rank i's part
  of each cross segment), as local rows; padded to the longest set with row n (a spare row).
- PeerBlock: rank i's selected queries of a cross segment against the rows of it received from
  every peer, one peer's after another; keys index the concatenation of all received rows (the
  steps' messages in order), so that each cross segment is one block whatever the number of
  peers.

With the Triton lowering (lowering/ring.py), the local part is not cut into LocalBlocks: it is the
single-device op's kernels run on the shard with *shard plans* (`shard_branch_plans`), one
BranchPlan per branch whose segments are the parts of the global segments that lie in the shard,
in local rows. Where the shard's edges fall on segment edges this is exactly the plan of the
single-device op on a sequence of n positions; otherwise its sets are listed explicitly. Every
position a branch selects in the shard belongs to exactly one set of the shard plan, so a branch
with r == 1 covers every local row (the Triton lowering relies on that). The peer blocks' query
rows are also numbered compactly (`RingPlan.peer_heads/peer_rows`, `PeerBlock.q_slot`), and the
rows whose gradients come back from peers likewise (`RingPlan.grad_heads/grad_rows`,
`Step.grad_slot`), so that the peers' share is merged into the kernels' full-size results in
float32 without a full-size float32 copy.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .plans import BranchPlan, branch_plan


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# Padded key lengths are rounded up to this, so that a key-padding bias needs no re-alignment
# by the CUDA memory-efficient kernel (which wants a bias row stride that is a multiple of 16).
KEY_ALIGN = 16


@dataclass
class LocalBlock:
    rows: torch.Tensor  # [H, S, L] local rows, padded with n
    pos: torch.Tensor  # [H, S, L] global positions (for dropout), padded with N
    valid: torch.Tensor  # [H, S, L] bool
    padded: bool  # some entry is padding: keys need a mask unless causal

    @property
    def shape(self):
        return tuple(self.rows.shape)


@dataclass
class PeerBlock:
    q_rows: torch.Tensor  # [H, 1, Lq] local query rows, padded with n
    q_pos: torch.Tensor  # [H, 1, Lq] global positions
    q_valid: torch.Tensor  # [H, 1, Lq]
    k_idx: torch.Tensor  # [H, 1, Lk] rows of all received rows (steps in order), padded with M
    k_pos: torch.Tensor  # [H, 1, Lk] global positions
    k_valid: torch.Tensor  # [H, 1, Lk]
    key_padded: bool
    has_key: torch.Tensor | None  # [H] bool, None when every head has keys from this peer
    q_slot: torch.Tensor | None = None  # [H, 1, Lq] index into RingPlan.peer_rows, padded with T


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
    grad_slot: torch.Tensor | None = None  # [M_send] index of each sent row in RingPlan.grad_rows

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
    local_blocks: list[LocalBlock]
    steps: list[Step]
    peer_blocks: list[PeerBlock]  # one per cross segment, keys from every peer
    recv_total: int  # rows received from all peers together: M
    # (query head, local row) of every query row of some PeerBlock, T of them, no repeats
    peer_heads: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    peer_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # (kv head, local row) of every row sent to some peer (its gradient comes back), U, no repeats
    grad_heads: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    grad_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def has_peers(self) -> bool:
        """Whether this rank computes any PeerBlock or gets any gradient back."""
        return bool(self.peer_rows.numel() or self.grad_rows.numel())

    @property
    def rows_sent(self) -> int:
        return sum(s.send_count for s in self.steps)

    @property
    def rows_received(self) -> int:
        return sum(s.recv_rows for s in self.steps)


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
    """Sorted distinct (kv head, offset) pairs read by the query heads, and each head's unit."""
    group = num_heads // num_kv_heads
    of_head = [(h // group, h % r) for h in range(num_heads)]
    units = sorted(set(of_head))
    return units, [units.index(u) for u in of_head]


def _cross_segments(seq_len: int, n: int, world: int, w: int, r: int, hilbert: bool) -> list[_Cross]:
    plan = branch_plan(seq_len, w, r, hilbert, "cpu")
    out = []
    edges = torch.arange(world + 1) * n
    for j in range(plan.num_segments):
        start, end = j * w, min((j + 1) * w, seq_len)
        first, last = start // n, (end - 1) // n
        if first == last:
            continue
        pos = plan.positions[:, j, :]
        bounds = torch.searchsorted(pos.contiguous(), edges.expand(r, world + 1).contiguous())
        out.append(_Cross(j, pos, bounds, first, last))
    return out


def _message_items(crosses, branch_units, src: int, dst: int, is_causal: bool):
    """What src sends dst: a list of (branch, cross index, unit, start, count), in order.

    A unit's slice goes only where dst has a query of some head reading that unit."""
    items = []
    if src == dst or (is_causal and src > dst):
        return items
    for b, (cross_list, (units, head_unit, r)) in enumerate(zip(crosses, branch_units)):
        for ci, cr in enumerate(cross_list):
            if not (cr.first <= src <= cr.last and cr.first <= dst <= cr.last):
                continue
            for ui, (c, o) in enumerate(units):
                cnt = cr.count(o, src)
                if cnt == 0 or cr.count(o, dst) == 0:
                    continue
                items.append((b, ci, ui, int(cr.bounds[o, src]), cnt))
    return items


def _slice_block(cr: _Cross, offsets: list[int], p: int, pad_to: int, pad_value: int):
    """Per head: the positions of rank p's slice of cr, padded. Returns (pos, valid, counts)."""
    starts = torch.tensor([int(cr.bounds[o, p]) for o in offsets])
    counts = torch.tensor([cr.count(o, p) for o in offsets])
    m = torch.arange(pad_to)
    valid = m.view(1, -1) < counts.view(-1, 1)
    idx = (starts.view(-1, 1) + m.view(1, -1)).clamp(max=cr.pos.shape[1] - 1)
    pos = cr.pos[torch.tensor(offsets).view(-1, 1), idx]
    pos = torch.where(valid, pos, torch.full_like(pos, pad_value))
    return pos, valid, counts


def _local_interior(seq_len, n, rank, w, r, hilbert, num_heads) -> list[LocalBlock]:
    """Blocks of the segments of branch (w, r) that lie wholly inside rank's shard."""
    plan = branch_plan(seq_len, w, r, hilbert, "cpu")
    lo, hi = rank * n, (rank + 1) * n
    s_total = plan.num_segments
    j_a = -(-lo // w)
    j_b = s_total if hi >= seq_len else hi // w
    if j_a >= j_b:
        return []
    positions = plan.for_heads(num_heads)[:, j_a:j_b]  # [H, S, L], padded with seq_len
    parts = [positions]
    last = positions[:, -1:]
    if j_b == s_total and bool((last >= seq_len).any()):  # the global last segment, cut short
        parts = [positions[:, :-1]] if j_b - j_a > 1 else []
        length = int((last < seq_len).sum(-1).max())
        if length > 0:
            length = _round_up(length, KEY_ALIGN)
            if length <= last.shape[-1]:
                parts.append(last[..., :length])
            else:
                parts.append(torch.nn.functional.pad(last, (0, length - last.shape[-1]),
                                                     value=seq_len))
    blocks = []
    for pos in parts:
        valid = pos < seq_len
        rows = torch.where(valid, pos - lo, torch.full_like(pos, n))
        blocks.append(LocalBlock(rows, pos, valid, not bool(valid.all())))
    return blocks


def _build(seq_len: int, world: int, rank: int, segment_lengths, dilation_rates, hilbert: bool,
           is_causal: bool, num_heads: int, num_kv_heads: int) -> RingPlan:
    n = seq_len // world
    lo = rank * n
    crosses, branch_units = [], []
    local_blocks: list[LocalBlock] = []
    for w, r in zip(segment_lengths, dilation_rates):
        local_blocks += _local_interior(seq_len, n, rank, w, r, hilbert, num_heads)
        cross_list = _cross_segments(seq_len, n, world, w, r, hilbert) if world > 1 else []
        units, head_unit = _units(num_heads, num_kv_heads, r)
        crosses.append(cross_list)
        branch_units.append((units, head_unit, r))
        offsets = [h % r for h in range(num_heads)]
        for cr in cross_list:  # rank's own part of each cross segment: a local block
            if not (cr.first <= rank <= cr.last):
                continue
            lq = max(cr.count(o, rank) for o in offsets)
            if lq == 0:
                continue
            counts = [cr.count(o, rank) for o in offsets]
            length = lq if min(counts) == lq else _round_up(lq, KEY_ALIGN)
            pos, valid, _ = _slice_block(cr, offsets, rank, length, seq_len)
            rows = torch.where(valid, pos - lo, torch.full_like(pos, n))
            local_blocks.append(LocalBlock(rows.unsqueeze(1), pos.unsqueeze(1),
                                           valid.unsqueeze(1), not bool(valid.all())))

    steps = []
    parts: dict = {}  # (branch, cross) -> [(peer, its first row among all received, the
    #                   (branch, cross, unit) of each query head, where each unit's rows start)]
    recv_offset = 0
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        send_items = _message_items(crosses, branch_units, rank, dst, is_causal)
        send_heads, send_rows = [], []
        for b, ci, ui, start, cnt in send_items:
            cr = crosses[b][ci]
            c, o = branch_units[b][0][ui]
            rows = cr.pos[o, start:start + cnt] - lo
            send_rows.append(rows)
            send_heads.append(torch.full_like(rows, c))
        recv_items = _message_items(crosses, branch_units, src, rank, is_causal)
        where = {}  # (b, ci, ui) -> offset in the received message
        total = 0
        for b, ci, ui, start, cnt in recv_items:
            where[(b, ci, ui)] = total
            total += cnt
        for b, cross_list in enumerate(crosses):
            head_unit = branch_units[b][1]
            for ci, cr in enumerate(cross_list):
                key = [(b, ci, head_unit[h]) for h in range(num_heads)]
                if any(x in where for x in key):
                    parts.setdefault((b, ci), []).append((src, recv_offset, key, where))
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))
        steps.append(Step(s, dst, cat(send_heads), cat(send_rows), src, total, recv_offset))
        recv_offset += total
    peer_blocks = [_peer_block(crosses[b][ci], branch_units[b][2], parts[(b, ci)], num_heads,
                               rank, lo, n, seq_len, recv_offset)
                   for b, ci in sorted(parts)]
    plan = RingPlan(world, rank, n, seq_len, num_heads, num_kv_heads, local_blocks, steps,
                    peer_blocks, recv_offset)
    _number_peer_rows(plan)
    return plan


def _peer_block(cr: _Cross, r: int, sources, num_heads: int, rank: int, lo: int, n: int,
                seq_len: int, recv_total: int) -> PeerBlock:
    """Rank's queries of cross segment cr against the rows of it received from every peer, the
    keys of one peer after another (each peer's part padded alone), indexing the concatenation
    of all received rows (padding: recv_total, a spare row)."""
    offsets = [h % r for h in range(num_heads)]
    q_counts = [cr.count(o, rank) for o in offsets]
    lq = max(q_counts)
    lq = lq if min(q_counts) == lq else _round_up(lq, KEY_ALIGN)
    q_pos, q_valid, _ = _slice_block(cr, offsets, rank, lq, seq_len)
    q_rows = torch.where(q_valid, q_pos - lo, torch.full_like(q_pos, n))
    k_pos, k_valid, k_idx, k_count = [], [], [], torch.zeros(num_heads, dtype=torch.long)
    for src, recv_offset, key, where in sources:
        counts = torch.tensor([cr.count(o, src) if x in where else 0
                               for o, x in zip(offsets, key)])
        lk = int(counts.max())
        lk = lk if int(counts.min()) == lk else _round_up(lk, KEY_ALIGN)
        pos, valid, _ = _slice_block(cr, offsets, src, lk, seq_len)
        valid = valid & (torch.arange(lk).view(1, -1) < counts.view(-1, 1))
        base = recv_offset + torch.tensor([where.get(x, 0) for x in key])
        k_idx.append(torch.where(valid, base.view(-1, 1) + torch.arange(lk).view(1, -1),
                                 torch.full_like(valid, recv_total, dtype=torch.long)))
        k_pos.append(pos)
        k_valid.append(valid)
        k_count += counts
    k_valid = torch.cat(k_valid, 1)
    has_key = k_count > 0
    return PeerBlock(q_rows.unsqueeze(1), q_pos.unsqueeze(1), q_valid.unsqueeze(1),
                     torch.cat(k_idx, 1).unsqueeze(1), torch.cat(k_pos, 1).unsqueeze(1),
                     k_valid.unsqueeze(1), not bool(k_valid.all()),
                     None if bool(has_key.all()) else has_key)


def _number_peer_rows(plan: RingPlan) -> None:
    """Compact numbering of the query rows of the PeerBlocks and of the rows sent to peers."""
    n = plan.n
    keys = []  # head * (n + 1) + row of every valid query row of every PeerBlock
    for pb in plan.peer_blocks:
        h = torch.arange(pb.q_rows.shape[0]).view(-1, 1, 1).expand_as(pb.q_rows)
        keys.append((h * (n + 1) + pb.q_rows)[pb.q_valid])
    unique = torch.unique(torch.cat(keys)) if keys else torch.zeros(0, dtype=torch.long)
    plan.peer_heads, plan.peer_rows = unique // (n + 1), unique % (n + 1)
    total = unique.numel()
    for pb in plan.peer_blocks:
        h = torch.arange(pb.q_rows.shape[0]).view(-1, 1, 1).expand_as(pb.q_rows)
        slot = torch.searchsorted(unique, (h * (n + 1) + pb.q_rows).reshape(-1).contiguous())
        pb.q_slot = torch.where(pb.q_valid, slot.view_as(pb.q_rows),
                                torch.full_like(pb.q_rows, total))
    sent = [s.send_heads * (n + 1) + s.send_rows for s in plan.steps]
    unique = torch.unique(torch.cat(sent)) if sent else torch.zeros(0, dtype=torch.long)
    plan.grad_heads, plan.grad_rows = unique // (n + 1), unique % (n + 1)
    for step, keys_sent in zip(plan.steps, sent):
        step.grad_slot = torch.searchsorted(unique, keys_sent.contiguous())


def _to(plan: RingPlan, device: torch.device) -> RingPlan:
    def mv(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x
    blocks = [LocalBlock(mv(b.rows), mv(b.pos), mv(b.valid), b.padded) for b in plan.local_blocks]
    steps = [Step(s.offset, s.send_to, mv(s.send_heads), mv(s.send_rows), s.recv_from,
                  s.recv_rows, s.recv_offset, mv(s.grad_slot)) for s in plan.steps]
    pbs = [PeerBlock(mv(p.q_rows), mv(p.q_pos), mv(p.q_valid), mv(p.k_idx), mv(p.k_pos),
                     mv(p.k_valid), p.key_padded, mv(p.has_key), mv(p.q_slot))
           for p in plan.peer_blocks]
    return RingPlan(plan.world, plan.rank, plan.n, plan.seq_len, plan.num_heads, plan.num_kv_heads,
                    blocks, steps, pbs, plan.recv_total, mv(plan.peer_heads), mv(plan.peer_rows),
                    mv(plan.grad_heads), mv(plan.grad_rows))


@functools.lru_cache(maxsize=64)
def _cached(seq_len, world, rank, segment_lengths, dilation_rates, hilbert, is_causal, num_heads,
            num_kv_heads, device) -> RingPlan:
    plan = _build(seq_len, world, rank, segment_lengths, dilation_rates, hilbert, is_causal,
                  num_heads, num_kv_heads)
    return _to(plan, torch.device(device))


def ring_plan(n_local: int, world: int, rank: int, segment_lengths, dilation_rates, hilbert: bool,
              is_causal: bool, num_heads: int, num_kv_heads: int,
              device: torch.device | str = "cpu") -> RingPlan:
    """The cached plan of `rank` among `world` ranks holding n_local positions each."""
    return _cached(int(n_local) * int(world), int(world), int(rank),
                   tuple(int(w) for w in segment_lengths), tuple(int(r) for r in dilation_rates),
                   bool(hilbert), bool(is_causal), int(num_heads), int(num_kv_heads),
                   str(torch.device(device)))


def _shard_plan(seq_len: int, n: int, rank: int, w: int, r: int, hilbert: bool,
                device: str) -> BranchPlan | None:
    """Branch (w, r) restricted to rank's shard [rank*n, (rank+1)*n), in local rows.

    Its segments are the global segments that meet the shard, each cut to the shard: set
    (o, segment) holds the members of the global set that lie in the shard, ascending (a
    contiguous run of the global set, since shards are contiguous), minus rank*n, padded with n;
    segments of which the shard holds no selected position are left out. Causal attention
    within such a part is the lower triangle over it, as in the global set. When the shard's
    edges fall on segment edges (or its end is the sequence's end) this is the single-device
    plan of a sequence of n positions, and that cached plan is returned (the kernels then reach
    rows by strides). None when no segment of the branch meets the shard (never for n >= 1)."""
    lo, hi = rank * n, (rank + 1) * n
    if lo % w == 0 and (hi % w == 0 or hi == seq_len):
        return branch_plan(n, w, r, hilbert, device)
    glob = branch_plan(seq_len, w, r, hilbert, "cpu")
    j0, j1 = lo // w, min(-(-hi // w), glob.num_segments)
    pos = glob.positions[:, j0:j1, :]
    inside = (pos >= lo) & (pos < hi)
    local, _ = torch.where(inside, pos - lo, torch.full_like(pos, n)).sort(dim=-1)
    counts = inside.sum(-1)  # [r, S']
    used = counts.sum(0) > 0
    if not bool(used.any()):
        return None
    length = int(counts.max())
    local = local[:, used, :length].contiguous()
    counts = counts[:, used].contiguous()
    # not strided: the kernels read positions (segment starts vary from shard to shard)
    plan = BranchPlan(w, r, n, local.to(device), counts.to(device), strided=False)
    return plan


@functools.lru_cache(maxsize=64)
def _cached_shard_plans(seq_len, world, rank, segment_lengths, dilation_rates, hilbert, device):
    n = seq_len // world
    plans = [_shard_plan(seq_len, n, rank, w, r, hilbert, device)
             for w, r in zip(segment_lengths, dilation_rates)]
    return tuple(p for p in plans if p is not None)


def shard_branch_plans(n_local: int, world: int, rank: int, segment_lengths, dilation_rates,
                       hilbert: bool, device: torch.device | str = "cpu") -> list[BranchPlan]:
    """The BranchPlans of the local part of every branch on `rank` (see the module docstring):
    run through the single-device lowering on the shard, they compute every pair of positions
    that both lie in the shard; the PeerBlocks compute the rest."""
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
