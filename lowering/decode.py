"""Queries against a cache, key by key of their own sets (SPEC section 5): the decode path of the
SDPA lowering, in torch operations (differentiable, so the op's backward recomputes through it).

A causal query at position p of a sequence starting at key row s lies, in branch (w, r), in
segment j = p // w at in-segment position c = p % w, in offset class o (plans.class_of). Query
head h takes part in the branch only when h % r == o; its keys are then the sequence's tokens at
positions j*w + e for the members e of class o with e <= c: the rows s + j*w + e when no padding
lies between the sequence's tokens, in general the rows of those ranks among the batch row's real
tokens (sequences.key_ranks), so padding inside the sequence is never a key. So each query
reads at most w / r keys per branch, however long the cache is. Branches are merged by
log-sum-exp as in lowering/sdpa_lowering.py.

With an attn_mask of the queries' rows ([.., Nq, Nk]: a sliding window or ALiBi beside a cache)
a query's keys are the members of its set that exist (rows of its sequence: position >= 0) and
that the mask allows, the mask's values added to their scores: the query's row of section 2
with that mask, which does not make a query causal by itself (the mask does). Only
plain rows take a mask (no position_ids: arguments.problem), so keys are found by row.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .sequences import Cache, cached_query_positions, key_ranks, tables

NEG_INF = float("-inf")


def _keys(q, k, cache: Cache, positions: Tensor, ranks, w: int, r: int, hilbert: bool,
          mask=None):
    """(key_rows [B, Nq, L], allowed [B, Hq, Nq, L], bias [B, Hq, Nq, L] or None) of one branch:
    the key rows of each query's set (L = w // r), which of them it attends to (causal, or as
    the mask allows; only heads of its class) and a float mask's values at them."""
    b, hq, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    members, classes = tables(w, r, hilbert, q.device)
    p = positions.clamp(min=0)
    c = p % w
    cls = classes[0][c]  # [B, Nq]
    own = members[cls]  # [B, Nq, w // r]: in-segment positions of the query's class
    if ranks is None:  # no padding between a sequence's tokens: the keys are rows
        start = cache.query_rows - p + (p // w) * w  # key row of the query's segment start
        key_rows = (start.unsqueeze(-1) + own).clamp(0, nk - 1)
    else:
        # the segment start's rank among the row's real tokens: padding between a sequence's
        # tokens is skipped (SPEC section 5), so keys are found by rank, not at row - position
        rank, row_of_rank = ranks
        rows = cache.query_rows.clamp(0, nk - 1)
        start = rank.gather(1, rows) - p + (p // w) * w
        wanted = (start.unsqueeze(-1) + own).clamp(0, nk - 1)  # [B, Nq, L]: the keys' ranks
        key_rows = row_of_rank.gather(1, wanted.flatten(1)).view_as(wanted)
    if mask is None:
        allowed = own <= c.unsqueeze(-1)  # [B, Nq, L]
    else:  # the set's members that are rows of the sequence; the mask says which it sees
        inside = start.unsqueeze(-1) + own < nk
        allowed = inside & (cache.key_positions.gather(1, key_rows.flatten(1))
                            .view_as(key_rows) >= 0)
    allowed = allowed & (positions >= 0).unsqueeze(-1)
    heads = torch.arange(hq, device=q.device)
    takes_part = (heads.view(1, hq, 1) % r) == cls.unsqueeze(1)  # [B, Hq, Nq]
    allowed = allowed.unsqueeze(1) & takes_part.unsqueeze(-1)
    if mask is None:
        return key_rows, allowed, None
    index = key_rows.unsqueeze(1).expand(b, hq, nq, key_rows.shape[-1])
    at_keys = mask.expand(b, hq, nq, nk).gather(-1, index)  # [B, Hq, Nq, L]
    if at_keys.dtype == torch.bool:
        return key_rows, allowed & at_keys, None
    return key_rows, allowed & (at_keys != NEG_INF), at_keys


def _gather(x: Tensor, key_rows: Tensor) -> Tensor:
    """x [B, Hkv, Nk, D] at key_rows [B, Nq, L] -> [B, Nq, L, Hkv, D]."""
    batch = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)
    return x.transpose(1, 2)[batch, key_rows]


def _scores(q, kg, scale):
    """q [B, Hq, Nq, D], kg [B, Nq, L, Hkv, D] -> [B, Hq, Nq, L] in float32 or wider."""
    b, hq, nq, d = q.shape
    hkv = kg.shape[3]
    qg = q.view(b, hkv, hq // hkv, nq, d)
    wide = torch.promote_types(q.dtype, torch.float32)
    return torch.einsum("bkgnd,bnlkd->bkgnl", qg, kg).reshape(b, hq, nq, -1).to(wide) * scale


def _branch(q, k, v, cache: Cache, positions: Tensor, ranks, w: int, r: int, hilbert: bool,
            scale: float, mask=None) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv], lse [B, Hq, Nq]) of one branch in q's dtype / float32 or wider."""
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    key_rows, allowed, bias = _keys(q, k, cache, positions, ranks, w, r, hilbert, mask)
    scores = _scores(q, _gather(k, key_rows), scale)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    has_key = allowed.any(-1)
    # rows with no key keep finite scores (0) until their lse is set to -inf
    scores = scores.masked_fill(~allowed & has_key.unsqueeze(-1), NEG_INF)
    scores = scores.masked_fill(~has_key.unsqueeze(-1), 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(~allowed, 0.0).to(q.dtype)
    out = torch.einsum("bkgnl,bnlkd->bkgnd", probs.view(b, hkv, hq // hkv, nq, -1),
                       _gather(v, key_rows))
    return out.reshape(b, hq, nq, v.shape[-1]), lse.masked_fill(~has_key, NEG_INF)


def decode_forward(q: Tensor, k: Tensor, v: Tensor, key_positions: Tensor, query_rows: Tensor,
                   segment_lengths, dilation_rates, hilbert: bool,
                   scale: float, *, gapless: bool = False,
                   attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv] in q.dtype, lse [B, Hq, Nq]); rows with no key: out 0, lse -inf.
    key_positions [B, Nk]: each key row's position in its sequence (negative: not a key);
    query_rows [B, Nq]: the key row each query stands at (lowering/sequences.Cache).
    gapless: no padding lies between a sequence's tokens (Cache.gapless), so a key's row is its
    rank and the O(Nk) rank tables are not built. attn_mask: broadcast to [B, Hq, Nq, Nk],
    boolean (True: allowed) or added to the scores; it needs gapless (the module's docstring)."""
    cache = Cache(key_positions, query_rows)
    positions = cached_query_positions(cache)
    ranks = None if gapless else key_ranks(key_positions)
    wide = torch.promote_types(q.dtype, torch.float32)
    outs, lses = zip(*(_branch(q, k, v, cache, positions, ranks, w, r, hilbert, scale, attn_mask)
                       for w, r in zip(segment_lengths, dilation_rates)))
    lse_all = torch.stack(lses)  # [branches, B, Hq, Nq]
    top = lse_all.max(0).values
    base = top.masked_fill(top == NEG_INF, 0.0)
    weights = torch.exp(lse_all - base)  # 0 for branches a row takes no part in
    total = weights.sum(0)
    empty = total == 0
    out = sum(o.to(wide) * wt.unsqueeze(-1) for o, wt in zip(outs, weights))
    out = out / total.masked_fill(empty, 1.0).unsqueeze(-1)
    lse = torch.where(empty, NEG_INF, base + torch.log(total.masked_fill(empty, 1.0)))
    return out.to(q.dtype), lse


def decode_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    key_positions: Tensor, query_rows: Tensor, segment_lengths, dilation_rates,
                    hilbert: bool, scale: float, *, gapless: bool = False,
                    attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) given the final out and lse: the merged output is one softmax over every
    (branch, key) pair a query attends to, normalised by the final lse, so each branch's share
    is FlashAttention's backward with P = exp(S - lse) and Delta = rowsum(dO * O)."""
    cache = Cache(key_positions, query_rows)
    positions = cached_query_positions(cache)
    ranks = None if gapless else key_ranks(key_positions)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    wide = torch.promote_types(q.dtype, torch.float32)
    lse_safe = lse.to(wide).masked_fill(lse == NEG_INF, float("inf")).unsqueeze(-1)  # P = 0
    dout_w = dout.to(wide)
    delta = (dout_w * out.to(wide)).sum(-1, keepdim=True)  # [B, Hq, Nq, 1]
    dq = torch.zeros(b, hq, nq, d, dtype=wide, device=q.device)
    dk = torch.zeros(b, nk, hkv, d, dtype=wide, device=q.device)
    dv = torch.zeros(b, nk, hkv, v.shape[-1], dtype=wide, device=q.device)
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    for w, r in zip(segment_lengths, dilation_rates):
        key_rows, allowed, bias = _keys(q, k, cache, positions, ranks, w, r, hilbert, attn_mask)
        kg, vg = _gather(k, key_rows).to(wide), _gather(v, key_rows).to(wide)  # [B, Nq, L, Hkv, *]
        scores = _scores(q.to(wide), kg, scale)
        if bias is not None:
            scores = scores + bias.to(wide)
        probs = torch.exp(scores - lse_safe).masked_fill(~allowed, 0.0)
        probs = probs.view(b, hkv, group, nq, -1)
        dprobs = torch.einsum("bkgnd,bnlkd->bkgnl", dout_w.view(b, hkv, group, nq, -1), vg)
        dscores = probs * (dprobs - delta.view(b, hkv, group, nq, 1)) * scale
        dq += torch.einsum("bkgnl,bnlkd->bkgnd", dscores, kg).reshape(b, hq, nq, d)
        gk = torch.einsum("bkgnl,bkgnd->bnlkd", dscores, q.to(wide).view(b, hkv, group, nq, d))
        gv = torch.einsum("bkgnl,bkgnd->bnlkd", probs, dout_w.view(b, hkv, group, nq, -1))
        dk.index_put_((batch, key_rows), gk, accumulate=True)
        dv.index_put_((batch, key_rows), gv, accumulate=True)
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)
