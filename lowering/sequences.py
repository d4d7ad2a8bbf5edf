"""Sequence structure (SPEC section 5): rows that hold several sequences, padding, or the last
tokens of a cached sequence. Every query gets what section 2 computes on its own sequence alone.

The structure reaches the op as per-token positions (`position_ids`: each key row's position in
its sequence, negative for padding; or FlashAttention's `cu_seqlens`, converted here) and, for
queries that continue a cached sequence, `seqused_k` (the key rows each batch row uses). The one
place where it meets the lowerings is `plan_of` below:

- Queries are the key rows (training, a prefill): the B rows are read as one row of B * N tokens
  and each branch's sets are built per sequence (`sequence_plans`), on the device and of a size
  fixed by B * N. The plans have the form of lowering/plans.py: a set may be partial in any
  segment, padding is in no set, and the short segments of many sequences share sets as
  groups that do not see each other (BranchPlan.groups), so that their number stays bounded.
- Queries against a cache: `Cache` names the key row each query stands at. Few queries take the
  decode path (lowering/decode.py: each query reads only the keys of its own sets); many (a
  chunked prefill) are placed at their rows and run as above.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .plans import BranchPlan, class_members, class_of

# A chunk of at most this many queries against a cache reads its keys per query (decode.py);
# a longer one runs the sets of its rows, whose cost is that of the whole cached sequence.
DECODE_MAX_QUERIES = 16


def positions_from_cu_seqlens(cu_seqlens: Tensor, batch: int, n: int) -> Tensor:
    """[B, N] int64 positions of FlashAttention's cumulative lengths over the B * N tokens read
    row after row; tokens from cu_seqlens[-1] on are padding (-1)."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(batch * n, device=cu.device)
    seq = torch.searchsorted(cu, t, right=True) - 1  # the sequence token t falls in
    inside = (seq >= 0) & (seq < cu.numel() - 1)
    start = cu.gather(0, seq.clamp(0, max(cu.numel() - 1, 0)))
    return torch.where(inside, t - start, -1).view(batch, n)


def _broken(positions: Tensor) -> Tensor:
    """[B, N] bool: the tokens whose position does not continue their sequence. A sequence
    counts 0, 1, 2, ... along one batch row, padding between its tokens skipped (a padding mask
    with holes: the real tokens of the row are one sequence), so a positive position must follow
    the batch row's last non-padding token before it, at position p - 1."""
    n = positions.shape[-1]
    rows = positions.reshape(positions.shape[:-1].numel(), n).to(torch.int64)
    if n == 0:
        return rows.bool()
    index = torch.arange(n, device=rows.device)
    last = torch.where(rows >= 0, index, -1).cummax(dim=-1).values
    before = torch.cat([last.new_full((last.shape[0], 1), -1), last[:, :-1]], dim=-1)
    prev = torch.where(before >= 0, rows.gather(-1, before.clamp(min=0)), -1)
    return (rows > 0) & (prev != rows - 1)


def sequence_plans(positions: Tensor, segment_lengths, dilation_rates,
                   hilbert: bool) -> list[BranchPlan]:
    """The plans of rows whose tokens have `positions` [B, N] (negative: padding), over the
    B * N = T tokens as one row (row b's token i is token b * N + i): two plans per branch, both
    of a size fixed by T, built on the tensors' device with no read on the host (no
    synchronisation; nothing that a CUDA graph cannot capture).

    Token t at position p lies in segment p // w of its sequence (the tokens since the last
    position 0 of its batch row, padding skipped); its in-segment position p % w decides its
    offset class and its place in the class (plans.class_of).

    - Segments get a set each, as plain rows do, the whole ones (all w positions present)
      first, then those cut short (a sequence's last), in order: 2 (T // w) + 1 sets, room for
      every whole segment and for T // w + 1 short ones; the sets past the real ones are empty
      (each still costs the kernels a program that ends at once, so the room is not larger).
    - Short segments past those (more sequences than that) hold fewer than w / r = m members
      per class. Per class, their members are laid one segment after the other in a stream;
      bin b takes the segments whose first member falls in stream slots [b m, (b + 1) m), so
      it spans fewer than 2 m slots, and its segments are groups of one set of 2 m slots that
      do not see each other (BranchPlan.groups). At most T // m + 1 bins, however many
      sequences the rows hold.

    A segment's members of a class are a prefix of the class's members (its positions are
    0 .. L - 1), so they take slots 0 .. count - 1 of their set or group, in ascending order.
    Positions on the CPU are checked (ValueError); on a GPU they are taken as given (a check
    would wait for the GPU), and whatever they say, no position outside the rows is read."""
    flat = positions.reshape(-1).to(torch.int64)
    if flat.device.type == "cpu":
        _check_positions(positions)
    total = flat.numel()
    device = flat.device
    tokens = torch.arange(total, device=device)
    valid = flat >= 0
    p = flat.clamp(min=0)
    # segment `total` is the spare, no segment (size[total] = 0 would copy the 0 from the host)
    real = torch.arange(total + 1, device=device) < total
    plans = []
    for branch, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        table = tables(w, r, hilbert, device)[1]
        in_segment = p % w
        cls, slot = table[:, in_segment]
        segment = torch.cumsum(valid & (in_segment == 0), 0) - 1
        inside = valid & (segment >= 0)
        segment = torch.where(inside, segment, total)  # segment `total`: a spare, dropped
        size = torch.zeros(total + 1, dtype=torch.int64, device=device)
        size.index_add_(0, segment, torch.ones_like(segment))
        whole, short = real & (size == w), real & (size > 0) & (size != w)
        s = 2 * (total // w) + 1
        index = torch.where(whole, torch.cumsum(whole, 0) - 1,
                            whole.sum() + torch.cumsum(short, 0) - 1)  # whole ones first
        index = torch.where(whole | short, index, s)[segment]
        in_set = inside & (index < s)
        at = (w, r, total, tokens, cls, slot, segment)
        parts = (_segment_sets(*at, hilbert, torch.where(in_set, index, s), s),
                 _binned_segments(*at, hilbert, inside & ~in_set))
        plans += [dataclasses.replace(plan, part_of=(branch, len(parts))) for plan in parts]
    return plans


def _segment_sets(w, r, total, tokens, cls, slot, segment, hilbert, index, s):
    """The plan of the segments that get a set each: token t's segment is set `index[t]` (s:
    none)."""
    m = w // r
    pos = torch.full((r, s + 1, m), total, dtype=torch.int64, device=tokens.device)
    pos.index_put_((cls, index, slot), tokens)
    cnt = _counted(r, s + 1, cls, index)
    pos, cnt = _within(pos[:, :s], cnt[:, :s], total)
    return BranchPlan(w, r, total, pos, cnt, strided=False, complete=False, hilbert=bool(hilbert))


def _binned_segments(w, r, total, tokens, cls, slot, segment, hilbert, binned):
    """The plan of the segments that get no set of their own, in bins (see sequence_plans)."""
    m, s = w // r, total // (w // r) + 1
    device = tokens.device
    seg = torch.where(binned, segment, total)
    # [r, segments]: members of each class
    count = _counted(r, total + 1, cls, seg)[:, :total].clamp_(max=m)
    base = torch.cumsum(count, 1) - count  # stream slot of each segment's first member
    bin_of = torch.where(count > 0, base // m, s)  # bin s: a spare, dropped
    first = torch.full((r, s + 1), total, dtype=torch.int64, device=device)
    first.scatter_reduce_(1, bin_of, base, "amin")
    start = base - first.gather(1, bin_of)  # each segment's first slot in its bin's set
    end = start + count
    cnt = torch.zeros(r, s + 1, dtype=torch.int64, device=device)
    cnt.scatter_reduce_(1, bin_of, end, "amax")
    seg = seg.clamp(max=total - 1)
    where = (cls, torch.where(binned, bin_of[cls, seg], s),
             (start[cls, seg] + slot).clamp(max=2 * m - 1))
    pos = torch.full((r, s + 1, 2 * m), total, dtype=torch.int64, device=device)
    pos.index_put_(where, tokens)
    groups = torch.full((2, r, s + 1, 2 * m), -1, dtype=torch.int64, device=device)
    groups[0].index_put_(where, start[cls, seg])
    groups[1].index_put_(where, end[cls, seg])
    pos, cnt = _within(pos[:, :s], cnt[:, :s], total)
    past = torch.arange(2 * m, device=device) >= cnt.unsqueeze(-1)
    groups = groups[:, :, :s].masked_fill(past, -1).contiguous()
    return BranchPlan(w, r, total, pos, cnt, strided=False, complete=False,
                      hilbert=bool(hilbert), groups=groups)


def _counted(rows: int, cols: int, row: Tensor, col: Tensor) -> Tensor:
    """[rows, cols] int64: how many tokens fall in each cell (row[t], col[t]). By index_add_
    (atomic adds): index_put_ with accumulate=True sorts the indices and adds duplicates one by
    one, and a cell here takes up to w tokens (on an H200 that took 11 of the 15 ms of a 64K
    row's plans on the GPU, scripts/sequences_bench.py)."""
    cnt = torch.zeros(rows * cols, dtype=torch.int64, device=row.device)
    cnt.index_add_(0, row * cols + col, torch.ones_like(col))
    return cnt.view(rows, cols)


def _within(pos: Tensor, cnt: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(pos, cnt) with every slot before a set's count a real row and every slot past it
    `total`: what the lowerings assume, whatever unchecked positions made of the sets."""
    cnt = cnt.clamp(max=pos.shape[-1]).contiguous()
    before = torch.arange(pos.shape[-1], device=pos.device) < cnt.unsqueeze(-1)
    return torch.where(before, pos.clamp(max=max(total - 1, 0)), total).contiguous(), cnt


def _capturing(x: Tensor) -> bool:
    """Whether a CUDA graph is being captured: what is cached per tensor is then not used, since
    a graph replays with new values in the same tensors (what was made before the capture would
    stay as it was)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_positions(positions: Tensor) -> None:
    if bool(_broken(positions).any()):
        raise ValueError(
            "position_ids (or cu_seqlens, read as positions) must count 0, 1, 2, ... along "
            "each sequence: a sequence starts at position 0 and does not cross a batch row; "
            "negative positions are padding, skipped where they fall between a sequence's "
            "tokens")


# Positions read from a cu_seqlens tensor, per cu_seqlens tensor (weakly, as long as it is not
# written to): a model's layers pass the same one, and then share its plans (plans_of).
_from_cu: dict = {}


def positions_of_cu_seqlens(cu_seqlens: Tensor, batch: int, n: int, device) -> Tensor:
    """positions_from_cu_seqlens on `device`, made once per cu_seqlens tensor. cu_seqlens on
    the CPU is checked here (ValueError naming it); on a GPU it is taken as FlashAttention
    takes it (a check would wait for the GPU)."""
    try:
        key = (id(cu_seqlens), cu_seqlens._version, batch, n, str(torch.device(device)))
    except RuntimeError:  # inference tensors count no versions: made again each call
        key = None
    if _capturing(cu_seqlens):  # made in the graph, so that each replay makes them anew
        return positions_from_cu_seqlens(cu_seqlens.to(device), batch, n)
    hit = _from_cu.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        return hit[1]
    if cu_seqlens.device.type == "cpu":
        _check_cu_seqlens(cu_seqlens, batch, n)
    positions = positions_from_cu_seqlens(cu_seqlens.to(device), batch, n)
    if key is not None:
        _from_cu[key] = (weakref.ref(cu_seqlens), positions)
        weakref.finalize(cu_seqlens, _from_cu.pop, key, None)
    return positions


def _check_cu_seqlens(cu_seqlens: Tensor, batch: int, n: int) -> None:
    """Raises ValueError unless cu_seqlens [S + 1] rises from 0 to at most B * N without a
    sequence crossing a batch row."""
    cu = cu_seqlens.to(torch.int64)
    if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or cu[-1] > batch * n:
        raise ValueError(f"cu_seqlens must rise from 0 to at most B * N = {batch * n} "
                         f"(cumulative lengths), got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    first, last = cu[:-1] // n, (cu[1:] - 1) // n
    if bool(((lengths > 0) & (first != last)).any()):
        raise ValueError(f"cu_seqlens: a sequence crosses a batch row of N = {n} tokens (each "
                         f"sequence lies within one row), got {cu.tolist()}")


# Plans per position tensor, as long as it lives and is not written to: the layers of a model
# all pass the same position_ids (one tensor, or views of it), so the plans are built once per
# batch rather than once per layer and pass.
_plans: dict = {}


def plans_of(positions: Tensor, segment_lengths, dilation_rates, hilbert: bool) -> list[BranchPlan]:
    """sequence_plans, cached for the tensor whose view `positions` is (weakly: a new batch's
    position_ids is a new tensor; an in-place change bumps its version)."""
    root = positions._base if positions._base is not None else positions
    if _capturing(positions):  # built in the graph, so that each replay builds them anew
        return sequence_plans(positions, segment_lengths, dilation_rates, hilbert)
    try:
        version = root._version
    except RuntimeError:  # inference tensors count no versions: nothing proves them unchanged
        return sequence_plans(positions, segment_lengths, dilation_rates, hilbert)
    key = (id(root), version, positions.storage_offset(), tuple(positions.shape),
           tuple(positions.stride()), tuple(segment_lengths), tuple(dilation_rates), bool(hilbert))
    hit = _plans.get(key)
    if hit is not None and hit[0]() is root:
        return hit[1]
    plans = sequence_plans(positions, segment_lengths, dilation_rates, hilbert)
    _plans[key] = (weakref.ref(root), plans)
    weakref.finalize(root, _plans.pop, key, None)
    return plans


def flat_rows(x: Tensor) -> Tensor:
    """[B, H, N, D] -> [1, H, B * N, D]: the batch rows one after the other (a view when B is 1)."""
    b, h, n, d = x.shape
    return x.transpose(0, 1).reshape(1, h, b * n, d)


def batch_rows(x: Tensor, batch: int) -> Tensor:
    """The inverse of flat_rows for [1, H, B * N, ...]."""
    h, t = x.shape[1], x.shape[2]
    return x.reshape(h, batch, t // batch, *x.shape[3:]).transpose(0, 1)


@dataclass(frozen=True)
class Cache:
    """Queries that continue cached sequences: key_positions [B, Nk] (negative: padding or rows
    past seqused_k), query_rows [B, Nq] (the key row each query stands at)."""
    key_positions: Tensor
    query_rows: Tensor
    # no padding between a sequence's tokens (no position_ids given: keys are rows 0, 1, ...):
    # the decode path then finds keys by row arithmetic, without O(Nk) rank tables
    gapless: bool = False


# An arange per device whose prefixes are a cache's key rows, so that a decoding step against a
# cache without position_ids or seqused_k (a transformers DynamicCache) makes no tensor: each
# would cost a kernel launch on the host's clock, layer after layer. The aranges made are all
# kept (a CUDA graph may read one that a longer one replaced).
_aranges: dict = {}
_ARANGE_MIN = 4096


def _arange(n: int, device) -> Tensor:
    """torch.arange(n, device=device) (int64), as a view of one kept per device; made anew and
    not kept while a CUDA graph is being captured (the graph, not this call, would write it)."""
    kept = _aranges.get(device)
    if kept is not None and kept[-1].shape[0] >= n:
        return kept[-1][:n]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.arange(n, device=device)
    longest = 0 if kept is None else kept[-1].shape[0]
    made = torch.arange(max(n, 2 * longest, _ARANGE_MIN), device=device)
    _aranges.setdefault(device, []).append(made)
    return made[:n]


def cache_of(nq: int, nk: int, batch: int, position_ids: Optional[Tensor],
             seqused_k: Optional[Tensor], device) -> Cache:
    """Queries are the last nq used key rows of each batch row (SPEC section 5, a cache)."""
    if position_ids is None and seqused_k is None and nq <= min(nk, DECODE_MAX_QUERIES):
        # a decoding step: views, no tensor made (a chunk's rows stay tensors of their own, as
        # plans_of keeps plans for as long as the rows' tensor lives)
        rows = _arange(nk, torch.device(device))
        return Cache(rows.expand(batch, nk), rows[nk - nq:].expand(batch, nq), gapless=True)
    rows = torch.arange(nk, device=device)
    if position_ids is None:
        key_positions = rows.expand(batch, nk)
    else:
        key_positions = position_ids.to(torch.int64).expand(batch, nk)
    if seqused_k is None:
        used = torch.full((batch,), nk, dtype=torch.int64, device=device)
    else:
        used = seqused_k.to(device=device, dtype=torch.int64)
        key_positions = torch.where(rows < used.view(batch, 1), key_positions, -1)
    query_rows = used.view(batch, 1) - nq + torch.arange(nq, device=device)
    return Cache(key_positions.contiguous(), query_rows, gapless=position_ids is None)


def cached_query_positions(cache: Cache) -> Tensor:
    """[B, Nq] positions of the queries (negative where the query stands on padding)."""
    rows = cache.query_rows
    nk = cache.key_positions.shape[1]
    inside = (rows >= 0) & (rows < nk)  # seqused_k past k's rows or below Nq: no such key row
    pos = cache.key_positions.gather(1, rows.clamp(0, nk - 1))
    return torch.where(inside, pos, -1)


def key_ranks(key_positions: Tensor, dtype=torch.int64) -> tuple[Tensor, Tensor]:
    """(rank [B, Nk], row_of_rank [B, Nk]) of a cache's key rows: rank[b, i] is the index of row
    i among the real (non-negative position) rows of batch row b, counted from 0 (a padding row
    gets the rank of the real row before it, or -1); row_of_rank[b, t] is the key row of the
    real token of rank t (0 past the last one). A sequence's tokens are consecutive in rank with
    padding between them skipped (SPEC section 5), so its token at position P, seen from a query
    at key row qr and position p, is row_of_rank[b, rank[b, qr] - p + P]. O(Nk), no host sync."""
    b, nk = key_positions.shape
    real = key_positions >= 0
    rank = real.to(dtype).cumsum(-1, dtype=dtype) - 1
    rows = torch.arange(nk, device=key_positions.device, dtype=dtype).expand(b, nk)
    spare = torch.full_like(rank, nk)  # padding writes into a spare column, dropped below
    row_of_rank = torch.zeros(b, nk + 1, dtype=dtype, device=key_positions.device)
    row_of_rank.scatter_(1, torch.where(real, rank, spare), rows)
    return rank, row_of_rank[:, :nk].contiguous()


@functools.lru_cache(maxsize=256)
def _tables(w: int, r: int, hilbert: bool, device: str) -> tuple[Tensor, Tensor]:
    return class_members(w, r, hilbert).to(device), class_of(w, r, hilbert).to(device)


def tables(w: int, r: int, hilbert: bool, device) -> tuple[Tensor, Tensor]:
    """(class_members [r, w // r], class_of [2, w]) of a branch on `device`, copied there once."""
    return _tables(int(w), int(r), bool(hilbert), str(torch.device(device)))
