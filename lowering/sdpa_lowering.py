"""The SDPA lowering: gather each branch's selected sets into dense blocks, run the SDPA kernels
that return the log-sum-exp (lowering/block_attention.py), scatter back, merge by log-sum-exp
(weights relative to the largest branch lse, normalised by their sum: see `forward`).

Per branch the gathered blocks hold B * H * N / r rows of w / r keys each: memory grows as
N * w / r, never N^2, unless the user passed an N x N mask.

Segments before the last are always complete, so they run as one batch with no mask. The last
segment may be cut short by N; its selected sets then differ in size from head to head, and it
runs as a second batch padded to the largest set, with the padding masked out (causal attention
needs no mask for it: padding sits after every real position in the ascending order).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from . import block_attention
from .dropout import keep_mask
from .plans import BranchPlan

NEG_INF = float("-inf")
KEPT_ROWS = 1 << 20  # a block's flat indices are kept up to this many rows (`_rows`)


@dataclass
class Block:
    """One batch of selected sets: positions [H, S, L] (padded with N) and its validity.

    With query_rows (see `forward`), a block whose sets hold members that are no queries also
    has its query members: their indices in the set, ascending ([H, S, Lq]), their positions
    (padded with N) and validity; the block then computes those rows against every member."""
    positions: torch.Tensor
    valid: torch.Tensor
    padded: bool
    q_index: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None
    # [H, S, L]: each member's group (the first slot of its run, BranchPlan.groups); members
    # see only their own group's
    groups: torch.Tensor | None = None
    # flat row indices of the gathers and scatters (`_rows`), made once per layout
    rows: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def queries(self) -> torch.Tensor:
        return self.positions if self.q_positions is None else self.q_positions

    @property
    def queries_valid(self) -> torch.Tensor:
        return self.valid if self.q_valid is None else self.q_valid


# Blocks per (plan, heads), as long as the plan lives: deciding them reads counts on the host,
# which a CUDA graph cannot capture and which costs a synchronisation per call. The plans of
# plain rows are cached (plans.py) and so keep their blocks; those of packed rows are built per
# call (sequences.py) and take theirs with them.
_blocks: dict = {}


def blocks_of(plan: BranchPlan, num_heads: int, query_rows: int | None = None) -> list[Block]:
    key = (id(plan), num_heads, query_rows)
    hit = _blocks.get(key)
    if hit is None or hit[0]() is not plan:
        blocks = _make_blocks(plan, num_heads)
        if query_rows is not None:
            blocks = [x for x in (_with_queries(b, query_rows, plan.seq_len) for b in blocks)
                      if x is not None]
        hit = _blocks[key] = (weakref.ref(plan), blocks)
        weakref.finalize(plan, _blocks.pop, key, None)
    return hit[1]


def _with_queries(block: Block, query_rows: int, n: int) -> Block | None:
    """The block with its query members (rows < query_rows) apart; None when it has none.
    (The ring passes query_rows; it takes no rows of several sequences, so no groups here.)"""
    assert block.groups is None, "query_rows with grouped sets"
    is_query = block.valid & (block.positions < query_rows)
    if bool((is_query == block.valid).all()):
        return block
    counts = is_query.sum(-1)
    lq = int(counts.max())
    if lq == 0:
        return None
    # members that are queries first, each group in set order
    index = torch.sort((~is_query).to(torch.int8), dim=-1, stable=True).indices[..., :lq]
    valid = torch.arange(lq, device=index.device) < counts.unsqueeze(-1)
    positions = torch.where(valid, block.positions.gather(-1, index), n)  # padding: N
    return Block(block.positions, block.valid, block.padded, index, positions, valid)


def _make_blocks(plan: BranchPlan, num_heads: int) -> list[Block]:
    if plan.num_segments == 0:  # rows of padding only: no set, nothing to run
        return []
    positions = plan.for_heads(num_heads)
    heads = torch.arange(num_heads, device=positions.device) % plan.dilation_rate
    counts = plan.counts.index_select(0, heads)
    n = plan.seq_len
    if not plan.complete and positions.device.type != "cpu":
        # rows of several sequences on a GPU: one padded block, as built (reading the counts
        # to cut it would wait for the GPU)
        groups = None if plan.groups is None else plan.groups[0].index_select(0, heads)
        return [Block(positions, positions < n, True, groups=groups)]
    if not plan.complete:  # on the CPU: the sets that hold members (their plans leave room)
        used = (counts > 0).any(0).nonzero().view(-1)
        if used.numel() == 0:
            return []
        positions, counts = positions[:, used], counts[:, used]
        if plan.groups is not None:  # cut to the longest
            length = int(counts.max())
            positions = positions[..., :length]
            groups = plan.groups[0].index_select(0, heads)[:, used, :length]
            return [Block(positions, positions < n, True, groups=groups)]
    full = counts == plan.set_size
    if bool(full.all()):
        return [Block(positions, positions < n, False)]
    if not bool(full[:, :-1].all()):  # partial sets anywhere (packed rows): one padded block
        return [Block(positions, positions < n, True)]
    blocks = []
    if positions.shape[1] > 1:
        full = positions[:, :-1]
        blocks.append(Block(full, full < n, False))
    length = int(counts[:, -1].max())
    if length:  # no head has a member there (a ring's plan can say so): no block of length 0
        last = positions[:, -1:, :length]
        blocks.append(Block(last, last < n, True))
    return blocks


def _rows(block: Block, queries: bool, group: int, head_step: int, row_step: int,
          clamp: int | None) -> torch.Tensor:
    """Flat [H * S * L] indices of the block's queries (or members) in a tensor whose head
    h // group starts at h * head_step and whose row p at p * row_step; padding (position N)
    clamped to row `clamp` (a gather's) or kept (a scatter's spare row). Made once per block
    and layout (up to KEPT_ROWS): built at each call, they took about as long as the gathers
    themselves on the CPU (BENCHMARKS.md, "Host cost per call")."""
    key = (queries, group, head_step, row_step, clamp)
    hit = block.rows.get(key)
    if hit is None:
        positions = block.queries if queries else block.positions
        h = positions.shape[0]
        heads = torch.arange(h, device=positions.device) // group
        if clamp is not None:
            positions = positions.clamp(max=clamp)
        hit = (heads.view(h, 1, 1) * head_step + positions * row_step).reshape(-1)
        # kept for small blocks, where the host's time is what a call costs (a long sequence's
        # indices would hold several times its positions' memory), and not when made while a
        # CUDA graph is captured (their memory would be the graph's pool's)
        if hit.numel() <= KEPT_ROWS and (positions.device.type != "cuda"
                                         or not torch.cuda.is_current_stream_capturing()):
            block.rows[key] = hit
    return hit


def _gather(x: torch.Tensor, block: Block, queries: bool, group: int = 1) -> torch.Tensor:
    """x [B, Hx, N, D] -> [B, H * S, L, D]: rows positions[h] of head h // group, where
    positions are the block's queries or members. One index into a view of x whose rows start
    at every element (as_strided), so any strides do, without a copy."""
    b, hx, n, d = x.shape
    stride_b, stride_h, stride_n, stride_d = x.stride()
    h, s, length = (block.queries if queries else block.positions).shape
    rows = _rows(block, queries, group, stride_h, stride_n, n - 1)
    span = (hx - 1) * stride_h + (n - 1) * stride_n + 1
    starts = x.as_strided((b, span, d), (stride_b, 1, stride_d))
    return starts[:, rows].view(b, h * s, length, d)


def _gather_mask(attn_mask: torch.Tensor, batch: int, num_heads: int, n: int,
                 queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The user's mask (broadcastable to [B, H, N, N]) on each selected set's queries and
    members: [B, H, S, Lq, L]."""
    m = attn_mask.expand(batch, num_heads, n, n)
    h = torch.arange(num_heads, device=positions.device).view(num_heads, 1, 1, 1)
    return m[:, h, queries.clamp(max=n - 1).unsqueeze(-1), positions.clamp(max=n - 1).unsqueeze(-2)]


@dataclass
class BlockInputs:
    """Everything the kernels need for one block, built the same way forward and backward."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    keep: torch.Tensor | None
    has_key: torch.Tensor | None  # [B or 1, H*S, Lq] rows with at least one allowed key
    causal: bool  # for the kernels: a lower triangle over the set (else any causality is in bias)


def _block_inputs(q, k, v, block: Block, *, attn_mask, is_causal, dropout_p, seed,
                  dropout_rows=None) -> BlockInputs:
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    h, s, length = block.positions.shape
    queries = block.queries
    lq = queries.shape[-1]
    apart = block.q_index is not None  # query members apart: causality goes in the bias
    qg = _gather(q, block, True)
    kg = _gather(k, block, False, hq // hkv)
    vg = _gather(v, block, False, hq // hkv)

    allowed = None  # bool, broadcastable to [B, H, S, Lq, L]
    bias = None
    if attn_mask is not None:
        m = _gather_mask(attn_mask, b, hq, n, queries, block.positions)
        if m.dtype == torch.bool:
            allowed = m
        else:
            bias = m
    if block.padded and (apart or not is_causal):
        key_ok = block.valid.view(1, h, s, 1, length)
        allowed = key_ok if allowed is None else allowed & key_ok
    if block.groups is not None:  # members see their own group's (padding has group -1)
        same = block.groups.unsqueeze(-1) == block.groups.unsqueeze(-2)
        same = (same & block.valid.unsqueeze(-2)).view(1, h, s, length, length)
        allowed = same if allowed is None else allowed & same
    if apart and is_causal:  # member m sees members 0 .. m of its set
        seen = torch.arange(length, device=q.device) <= block.q_index.unsqueeze(-1)
        seen = seen.view(1, h, s, lq, length)
        allowed = seen if allowed is None else allowed & seen
    if allowed is not None:
        fill = torch.zeros((), dtype=q.dtype, device=q.device)
        pad = torch.full((), NEG_INF, dtype=q.dtype, device=q.device)
        extra = torch.where(allowed, fill, pad)
        bias = extra if bias is None else bias.to(q.dtype) + extra
    has_key = None
    if bias is not None:
        bias = bias.expand(bias.shape[0], h, s, lq, length).reshape(-1, h * s, lq, length)
        allowed_keys = bias != NEG_INF
        if is_causal and not apart:  # a row whose allowed keys all lie in its future has none
            allowed_keys = allowed_keys & torch.ones(
                length, length, dtype=torch.bool, device=q.device).tril()
        has_key = allowed_keys.any(-1)

    keep = None
    if dropout_p > 0.0:
        pos_q, pos_k = queries, block.positions
        if dropout_rows is not None:  # padding (row N) reads the last row's: its entries are 0
            last = dropout_rows.numel() - 1
            pos_q, pos_k = dropout_rows[pos_q.clamp(max=last)], dropout_rows[pos_k.clamp(max=last)]
        keep = keep_mask(seed, torch.arange(b, device=q.device).view(b, 1, 1, 1, 1),
                         torch.arange(h, device=q.device).view(1, h, 1, 1, 1),
                         pos_q.view(1, h, s, lq, 1),
                         pos_k.view(1, h, s, 1, length), dropout_p)
        keep = keep.reshape(b, h * s, lq, length)
    return BlockInputs(qg, kg, vg, bias, keep, has_key, is_causal and not apart)


def _scatter(buffer: torch.Tensor, block: Block, queries: bool, values: torch.Tensor,
             group: int = 1, accumulate: bool = False) -> None:
    """buffer [B, Hx, N + 1, ...] (contiguous) gets values [B, H * S, L, ...] at rows
    positions[h] of head h // group, where positions are the block's queries or members.

    Padding positions equal N and land in the spare last row, which callers drop."""
    b, hx, rows_per_head = buffer.shape[:3]
    rows = _rows(block, queries, group, rows_per_head, 1, None)
    flat = buffer.view(b, hx * rows_per_head, *buffer.shape[3:])
    torch.ops.aten.index_put_(flat, [None, rows],
                              values.reshape(b, rows.numel(), *values.shape[3:]), accumulate)


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """Branches are merged in float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def forward(q, k, v, plans: list[BranchPlan], *, is_causal: bool, attn_mask, scale: float,
            dropout_p: float = 0.0, seed=None, dropout_rows=None, query_rows=None):
    """Returns (out [B, Hq, N, Dv] in q.dtype, lse [B, Hq, N] in float32, float64 for float64).

    dropout_rows ([N] int64, optional): the position each row stands for in dropout's keep bits
    (lowering/dropout.py hashes positions); by default its row index. The ring passes the global
    positions of a shard's rows, or of the rows it gathered from peers.
    query_rows (int, optional): rows from this one on are keys and values only: they are no
    queries (out 0, lse -inf; in the backward no dq, and their dout is not read), and the work
    of their queries is not done. Causal attention stays the order within each set. The ring
    passes it for the rows it received from peers.

    The branches are merged as one softmax is computed: each branch's normalised output o_i
    weighs exp(lse_i - top) against top, the largest lse_i so far, and the sum is divided by
    the sum of the weights at the end. The differences lse_i - top are exact where it matters
    (close numbers), so the merge adds no error of the lse's size. (Normalising by the merged
    lse = logaddexp(...) instead divides by a number rounded at the lse's magnitude: at
    |lse| ~ 5e6 in float32, ulp 0.5, the weights sum to anything in e^(+-0.25).)"""
    b, hq, n, _ = q.shape
    wide = merge_dtype(q.dtype)
    if b * hq * n == 0 or not plans:
        return (torch.zeros(b, hq, n, v.shape[-1], dtype=q.dtype, device=q.device),
                torch.full((b, hq, n), NEG_INF, dtype=wide, device=q.device))
    acc = torch.zeros(b, hq, n + 1, v.shape[-1], dtype=wide, device=q.device)  # sum of o_i * w_i
    top = torch.full((b, hq, n + 1), NEG_INF, dtype=wide, device=q.device)
    for i, plan in enumerate(plans):
        # the first branch's rows go straight to acc and top: its weights are 1 where it has
        # an lse (exp(lse - lse)) and 0 where not, so its merge would leave them as they are
        first = i == 0
        out_b = acc if first else torch.zeros_like(acc)
        lse_b = top if first else torch.full_like(top, NEG_INF)
        for block in blocks_of(plan, hq, query_rows):
            x = _block_inputs(q, k, v, block, attn_mask=attn_mask, is_causal=is_causal,
                              dropout_p=dropout_p, seed=seed, dropout_rows=dropout_rows)
            o, lse = block_attention.forward(x.q, x.k, x.v, bias=x.bias, is_causal=x.causal,
                                             scale=scale, keep=x.keep, dropout_p=dropout_p)
            lse = lse.to(wide)
            if x.has_key is not None:
                lse = lse.masked_fill(~x.has_key, NEG_INF)
                o = o.masked_fill(~x.has_key.unsqueeze(-1), 0.0)
            _scatter(out_b, block, True, o.to(wide))
            _scatter(lse_b, block, True, lse)
        if first:
            total = torch.exp(top - top.masked_fill(top == NEG_INF, 0.0))  # sum of w_i
            continue
        new_top = torch.maximum(top, lse_b)
        base = new_top.masked_fill(new_top == NEG_INF, 0.0)  # rows with no key yet: weights 0
        w_old, w_new = torch.exp(top - base), torch.exp(lse_b - base)
        acc = acc * w_old.unsqueeze(-1) + out_b * w_new.unsqueeze(-1)
        total = total * w_old + w_new
        top = new_top
    empty = total == 0  # no key in any branch: out 0, lse -inf
    total = total.masked_fill(empty, 1.0)
    out = acc / total.unsqueeze(-1)
    lse = torch.where(empty, NEG_INF, top + torch.log(total))
    return out[:, :, :n].to(q.dtype), lse[:, :, :n].contiguous()


def backward(dout, q, k, v, out, lse, plans: list[BranchPlan], *, is_causal: bool, attn_mask,
             scale: float, dropout_p: float = 0.0, seed=None, dropout_rows=None,
             query_rows=None):
    """Returns (dq, dk, dv) given the op's output and its float32 lse (dropout_rows, query_rows:
    as in `forward`)."""
    b, hq, n, _ = q.shape
    if b * hq * n == 0 or not plans:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hkv = k.shape[1]
    group = hq // hkv
    # A row with no key anywhere has lse = -inf; +inf makes every probability of it 0.
    lse_pad = torch.nn.functional.pad(lse.masked_fill(lse == NEG_INF, float("inf")), (0, 1))
    wide = merge_dtype(q.dtype)
    dq = torch.zeros(b, hq, n + 1, q.shape[-1], dtype=wide, device=q.device)
    dk = torch.zeros(b, hkv, n + 1, k.shape[-1], dtype=wide, device=q.device)
    dv = torch.zeros(b, hkv, n + 1, v.shape[-1], dtype=wide, device=q.device)
    for plan in plans:
        for block in blocks_of(plan, hq, query_rows):
            x = _block_inputs(q, k, v, block, attn_mask=attn_mask, is_causal=is_causal,
                              dropout_p=dropout_p, seed=seed, dropout_rows=dropout_rows)
            h, s, lq = block.queries.shape
            dog = _gather(dout, block, True)
            og = _gather(out, block, True)
            lg = _gather(lse_pad.unsqueeze(-1), block, True).view(b, h * s, lq)
            if block.padded or block.q_valid is not None:
                # padded query rows read real rows through the clamp: silence them
                valid = block.queries_valid.reshape(1, h * s, lq)
                lg = lg.masked_fill(~valid, float("inf"))
                dog = dog.masked_fill(~valid.unsqueeze(-1), 0.0)
            gq, gk, gv = block_attention.backward(
                dog, x.q, x.k, x.v, og, lg, bias=x.bias, is_causal=x.causal, scale=scale,
                keep=x.keep, dropout_p=dropout_p)
            _scatter(dq, block, True, gq.to(wide), accumulate=True)
            _scatter(dk, block, False, gk.to(wide), group, accumulate=True)
            _scatter(dv, block, False, gv.to(wide), group, accumulate=True)
    return (dq[:, :, :n].to(q.dtype), dk[:, :, :n].to(k.dtype), dv[:, :, :n].to(v.dtype))
