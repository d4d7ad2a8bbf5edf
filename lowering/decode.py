"""Queries against a cache, key by key of their own sets (SPEC section 5): the decode path of the
SDPA lowering, in torch operations (differentiable, so the op's backward recomputes through it).

A causal query at position p of a sequence starting at key row s lies, in branch (w, r), in
segment j = p // w at in-segment position c = p % w, in offset class o (plans.class_of). Query
head h takes part in the branch only when h % r == o; its keys are then the rows s + j*w + e for
the members e of class o with e <= c. So each query reads at most w / r keys per branch, however
long the cache is. Branches are merged by log-sum-exp as in lowering/sdpa_lowering.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .sequences import Cache, cached_query_positions, tables

NEG_INF = float("-inf")


def _branch(q, k, v, cache: Cache, positions: Tensor, w: int, r: int, hilbert: bool,
            scale: float) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv], lse [B, Hq, Nq]) of one branch in q's dtype / float32 or wider."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    members, classes = tables(w, r, hilbert, q.device)
    p = positions.clamp(min=0)
    c = p % w
    cls = classes[0][c]  # [B, Nq]
    own = members[cls]  # [B, Nq, w // r]: in-segment positions of the query's class
    start = cache.query_rows - p + (p // w) * w  # key row of the query's segment start
    key_rows = (start.unsqueeze(-1) + own).clamp(0, nk - 1)
    allowed = (own <= c.unsqueeze(-1)) & (positions >= 0).unsqueeze(-1)  # [B, Nq, L]
    heads = torch.arange(hq, device=q.device)
    takes_part = (heads.view(1, hq, 1) % r) == cls.unsqueeze(1)  # [B, Hq, Nq]
    allowed = allowed.unsqueeze(1) & takes_part.unsqueeze(-1)  # [B, Hq, Nq, L]

    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    kg = k.transpose(1, 2)[batch, key_rows]  # [B, Nq, L, Hkv, D]
    vg = v.transpose(1, 2)[batch, key_rows]
    group = hq // hkv
    qg = q.view(b, hkv, group, nq, d)
    scores = torch.einsum("bkgnd,bnlkd->bkgnl", qg, kg).reshape(b, hq, nq, -1) * scale
    wide = torch.promote_types(q.dtype, torch.float32)
    has_key = allowed.any(-1)
    # rows with no key keep finite scores (0) so that no gradient of theirs is NaN; their lse
    # is set to -inf afterwards and their probabilities to 0
    scores = scores.to(wide).masked_fill(~allowed & has_key.unsqueeze(-1), NEG_INF)
    scores = scores.masked_fill(~has_key.unsqueeze(-1), 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(~allowed, 0.0).to(q.dtype)
    out = torch.einsum("bkgnl,bnlkd->bkgnd", probs.view(b, hkv, group, nq, -1), vg)
    return out.reshape(b, hq, nq, v.shape[-1]), lse.masked_fill(~has_key, NEG_INF)


def decode_forward(q: Tensor, k: Tensor, v: Tensor, key_positions: Tensor, query_rows: Tensor,
                   segment_lengths, dilation_rates, hilbert: bool,
                   scale: float) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv] in q.dtype, lse [B, Hq, Nq]); rows with no key: out 0, lse -inf.
    key_positions [B, Nk]: each key row's position in its sequence (negative: not a key);
    query_rows [B, Nq]: the key row each query stands at (lowering/sequences.Cache)."""
    cache = Cache(key_positions, query_rows)
    positions = cached_query_positions(cache)
    wide = torch.promote_types(q.dtype, torch.float32)
    outs, lses = zip(*(_branch(q, k, v, cache, positions, w, r, hilbert, scale)
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
