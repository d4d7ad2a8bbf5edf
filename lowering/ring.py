"""Dilated attention over a 1-D device mesh (SPEC section 4): torch.ops.hilbert_fx.ring_dilated_attention.

Each of the P ranks of the mesh's process group holds a contiguous shard [B, H, n, D] of q, k and
v (rank i: global positions [i*n, (i+1)*n)) and gets back its shard of what the single-device op
computes on the whole sequence, forward and backward.

The ring is a composition of four parts, each in a file of its own:
- agreement (lowering/ring_agree.py): every call starts with one small exchange through the
  process group's store, so that a rank that rejects its arguments, or shards and
  configurations that differ across ranks, make every rank raise instead of hanging;
- plan (lowering/ring_plan.py): which rows travel, and the branch plans of the two calls below;
- transport (lowering/ring_transport.py): the key/value rows and the gradients, point to point;
- the computation here: two calls of one lowering's `forward` (or `backward`), the interface
  every lowering implements (lowering/op.py calls it on one device):

      forward(q, k, v, plans, *, is_causal, attn_mask, scale, dropout_p, seed) -> (out, lse)
      backward(dout, q, k, v, out, lse, plans, *, same keywords) -> (dq, dk, dv)

  over BranchPlans whose sets may be partial or empty and may leave rows out
  (plan.complete False: such rows get out 0, lse -inf, gradients 0).

Forward: the key/value rows are posted first; then the *local* call runs on the shard itself
(every set none of whose members comes from a peer, `RingPlan.local_plans`) while they travel;
then, once they arrived, the *cross* call runs on an extended row (the local rows of the other
sets, followed by the rows received: `RingPlan.cross_plans`), each such set whole, in global
order. Its results on the local rows are merged into the local call's by log-sum-exp in float32
(float64 for float64 inputs), on those rows only. The received rows are no queries: a lowering
that takes `query_rows` (the SDPA lowering) skips them, another computes them too and their
results are dropped (ring_plan.py says what that costs).

Backward (FlashAttention-2 style, with the final out and lse, so that each call's gradients are
its exact share and add up): the rows travel again while the local call's backward runs; the
cross call's backward gives the local rows' share and the received rows' key/value gradients,
which go back to their owners (in float32), which add them to their own. On the SDPA lowering
(many small kernels) the local call is cut in two runs of about equal work, the second computed
while the gradients travel back.

Dropout: the keep bits are a hash of global positions (lowering/dropout.py), and rank 0's seed is
used everywhere. A lowering whose forward and backward take `dropout_rows` (the global position
of each row of the call) runs dropout in the ring; the SDPA lowering does. Until the Triton
lowering does, lowering="triton" with dropout runs both calls on the SDPA lowering, as do dtypes
and head dims the Triton lowering does not take (float64, D > 256).

attn_mask is not supported with a mesh (ValueError naming attn_mask), nor are op.py's sequence
arguments (position_ids, seqused_k; op.dilated_attention refuses them with mesh=). The lowering
is carried so that the rewritten graph shows it, as for the single-device op.
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from torch import Tensor

from . import block_attention, ring_agree, ring_transport, sdpa_lowering
from .arguments import check_branches, check_flags, check_lowering, problem, resolve_lowering
from .autocast import register_autocast
from .dropout import new_seed
from .op import _compute_dtype, _op_backward_fake, _op_fake
from .ring_agree import group_name_of
from .ring_plan import RingPlan, plan_bytes, ring_plan
from .ring_transport import comm_stats, reset_comm_stats

NEG_INF = float("-inf")

__all__ = ["ring_dilated_attention", "dilated_attention_on_mesh", "ring_dilated_attention_op",
           "comm_stats", "reset_comm_stats", "plan_bytes", "group_name_of"]


# ---------------------------------------------------------------------------------------------
# Which lowering the two calls run on.

_TAKES: dict = {}


def _takes(module, keyword: str) -> bool:
    """Whether a lowering's forward and backward take an optional keyword of the interface
    (read once per pair of functions: signatures cost more than a small kernel's launch)."""
    key = (module.forward, module.backward, keyword)
    if key not in _TAKES:
        _TAKES[key] = all(keyword in inspect.signature(f).parameters for f in key[:2])
    return _TAKES[key]


def _lowering(q: Tensor, lowering: str, dropout_p: float):
    """(module, name): the Triton lowering where it was asked for and takes the call (see the
    module docstring), else the SDPA lowering."""
    if lowering == "triton":
        from . import triton_lowering
        if (q.dtype in triton_lowering.SUPPORTED_DTYPES
                and q.shape[-1] <= triton_lowering.MAX_HEAD_DIM
                and (dropout_p == 0.0 or _takes(triton_lowering, "dropout_rows"))):
            return triton_lowering, "triton"
    return sdpa_lowering, "sdpa"


def _rows(dropout_p: float, positions: Tensor) -> dict:
    """The keyword that makes a call's dropout hash global positions (only a call with dropout
    passes it: a lowering without dropout need not take it)."""
    return {"dropout_rows": positions} if dropout_p > 0.0 else {}


def _cross(lower, plan: RingPlan, dropout_p: float) -> dict:
    """The cross call's optional keywords: global positions for dropout, and query_rows (the
    received rows are no queries) where the lowering takes it; one that does not computes those
    rows' queries too, and their results are dropped."""
    kw = _rows(dropout_p, plan.ext_positions)
    if _takes(lower, "query_rows"):
        kw["query_rows"] = plan.cross_rows.numel()
    return kw


# ---------------------------------------------------------------------------------------------
# The extended row of the cross call.

def _queries(plan: RingPlan, x: Tensor, fill: float = 0.0) -> Tensor:
    """[B, H, T, ...]: x's rows cross_rows, then `fill` for the received rows (not queries)."""
    t = plan.cross_rows.numel()
    ext = x.new_full((*x.shape[:2], plan.ext_len, *x.shape[3:]), fill)
    ext[:, :, :t] = x[:, :, plan.cross_rows]
    return ext


def _keys(plan: RingPlan, x: Tensor, received: Optional[Tensor]) -> Tensor:
    """[B, Hkv, T, D]: x's rows cross_rows, then each received row at its (kv head, extended
    row); an extended row that no kv head's message brought stays 0 for that head (no query
    head of it reads the row)."""
    ext = _queries(plan, x)
    if received is not None:
        ext[:, plan.recv_heads, plan.recv_ext] = received
    return ext




def _merge_rows(out: Tensor, lse: Tensor, rows: Tensor, o: Tensor, lse_o: Tensor) -> None:
    """Merges (o, lse_o) [B, H, T_loc, ...] into out, lse at rows `rows`, by log-sum-exp in lse's
    dtype (block_attention.merge). Rows with lse -inf have no key: their out is taken as 0 (a
    lowering may leave anything there)."""
    wide = lse.dtype
    l1 = lse[:, :, rows]
    o1 = out[:, :, rows].to(wide).masked_fill((l1 == NEG_INF).unsqueeze(-1), 0.0)
    lse_o = lse_o.to(wide)
    o2 = o.to(wide).masked_fill((lse_o == NEG_INF).unsqueeze(-1), 0.0)
    merged, lse[:, :, rows] = block_attention.merge(o1, l1, o2, lse_o)
    out[:, :, rows] = merged.to(out.dtype)


def _accumulate(x: Tensor, index, delta: Tensor, wide: torch.dtype) -> None:
    x[index] = (x[index].to(wide) + delta.to(wide)).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Forward and backward on one rank.

def _forward(q, k, v, plan: RingPlan, group, lower, *, is_causal, scale, dropout_p, seed):
    b, dk, dv = q.shape[0], k.shape[-1], v.shape[-1]
    common = dict(is_causal=is_causal, attn_mask=None, scale=scale, dropout_p=dropout_p,
                  seed=seed)
    posted = ring_transport.post_rows(plan, group, k, v, "forward", ring_transport.FORWARD)
    out, lse = lower.forward(q, k, v, list(plan.local_plans), **common,
                             **_rows(dropout_p, plan.local_positions))
    kbuf, vbuf = ring_transport.received_rows(plan, posted, b, dk, dv)
    if plan.cross_plans:
        t = plan.cross_rows.numel()
        ox, lx = lower.forward(_queries(plan, q), _keys(plan, k, kbuf), _keys(plan, v, vbuf),
                               list(plan.cross_plans), **common, **_cross(lower, plan, dropout_p))
        _merge_rows(out, lse, plan.cross_rows, ox[:, :, :t], lx[:, :, :t])
    return out, lse


def _backward(dout, q, k, v, out, lse, plan: RingPlan, group, lower, *, is_causal, scale,
              dropout_p, seed, split: bool):
    b, dk_dim, dv_dim = q.shape[0], k.shape[-1], v.shape[-1]
    wide = torch.promote_types(q.dtype, torch.float32)
    common = dict(is_causal=is_causal, attn_mask=None, scale=scale, dropout_p=dropout_p,
                  seed=seed)
    local = _rows(dropout_p, plan.local_positions)
    posted = ring_transport.post_rows(plan, group, k, v, "backward", ring_transport.BACKWARD)
    first, second = plan.local_halves if split and plan.talks else (plan.local_plans, ())
    dq, dk, dv = lower.backward(dout, q, k, v, out, lse, list(first), **common, **local)

    kbuf, vbuf = ring_transport.received_rows(plan, posted, b, dk_dim, dv_dim)
    gk = gv = cross = None
    if plan.cross_plans:
        # received rows are no queries: dout 0 (and lse -inf) gives them no share of anything
        cross = lower.backward(
            _queries(plan, dout), _queries(plan, q), _keys(plan, k, kbuf), _keys(plan, v, vbuf),
            _queries(plan, out), _queries(plan, lse, NEG_INF), list(plan.cross_plans), **common,
            **_cross(lower, plan, dropout_p))
        if plan.recv_total:  # a row that arrived twice carries its total once
            first_arrival = plan.recv_first.view(1, -1, 1)
            gk, gv = (torch.where(first_arrival, g[:, plan.recv_heads, plan.recv_ext].to(wide), 0.0)
                      for g in cross[1:])
    works, recvs, payloads = ring_transport.post_gradients(
        plan, group, gk, gv, batch=b, dk=dk_dim, dv=dv_dim, dtype=wide, device=q.device)

    if second:  # while the gradients travel
        more = lower.backward(dout, q, k, v, out, lse, list(second), **common, **local)
        dq, dk, dv = (x.to(wide) + y.to(wide) for x, y in zip((dq, dk, dv), more))
    if cross is not None:
        t = plan.cross_rows.numel()
        rows = (slice(None), slice(None), plan.cross_rows)
        for x, g in zip((dq, dk, dv), cross):
            _accumulate(x, rows, g[:, :, :t], wide)
    back = ring_transport.received_gradients(plan, works, recvs, batch=b, dk=dk_dim, dv=dv_dim)
    del payloads  # kept alive until received_gradients waited for every send of the batch
    if back is not None:
        rows = (slice(None), plan.grad_heads, plan.grad_rows)
        _accumulate(dk, rows, back[0], wide)
        _accumulate(dv, rows, back[1], wide)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _prepare(phase, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
             dropout_p, seed, scale, lowering, group_name):
    """Agreement, then (group, plan, lowering module and name, seed, q, k, v in its dtype)."""
    group = ring_agree.resolve(group_name)
    seed = ring_agree.start(phase, group, q, k, v, segment_lengths, dilation_rates, hilbert,
                            is_causal, attn_mask, dropout_p, seed, scale, lowering)
    ring_transport.count_call(phase)
    ring_transport.connect(group, q.device)
    lower, name = _lowering(q, lowering, dropout_p)
    plan = ring_plan(q.shape[2], torch.distributed.get_world_size(group),
                     torch.distributed.get_rank(group), segment_lengths, dilation_rates, hilbert,
                     is_causal, q.shape[1], k.shape[1], q.device)
    return group, plan, lower, name, seed, _compute_dtype(q, name)


# ---------------------------------------------------------------------------------------------
# The custom ops: the single-device op's fake implementations (lowering/op.py), and an autograd
# formula that passes every argument after q, k, v on to the backward op.

@torch.library.custom_op("hilbert_fx::ring_dilated_attention", mutates_args=())
def ring_dilated_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int],
                              dilation_rates: list[int], hilbert: bool, is_causal: bool,
                              attn_mask: Optional[Tensor], dropout_p: float,
                              seed: Optional[Tensor], scale: float, lowering: str,
                              group_name: str) -> tuple[Tensor, Tensor]:
    """Local shards in, local shards out: (out [B, Hq, n, Dv], lse [B, Hq, n] float32+)."""
    group, plan, lower, _, seed, dtype = _prepare(
        "forward", q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
        dropout_p, seed, scale, lowering, group_name)
    out, lse = _forward(q.to(dtype), k.to(dtype), v.to(dtype), plan, group, lower,
                        is_causal=is_causal, scale=scale, dropout_p=dropout_p, seed=seed)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@ring_dilated_attention_op.register_fake
def _(*args):
    return _op_fake(*args[:-1])  # the single-device op's, group_name aside


@torch.library.custom_op("hilbert_fx::ring_dilated_attention_backward", mutates_args=())
def ring_dilated_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                       lse: Tensor, segment_lengths: list[int],
                                       dilation_rates: list[int], hilbert: bool, is_causal: bool,
                                       attn_mask: Optional[Tensor], dropout_p: float,
                                       seed: Optional[Tensor], scale: float, lowering: str,
                                       group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    group, plan, lower, name, seed, dtype = _prepare(
        "backward", q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
        dropout_p, seed, scale, lowering, group_name)
    dq, dk, dv = _backward(*(x.to(dtype) for x in (dout, q, k, v, out)), lse, plan, group, lower,
                           is_causal=is_causal, scale=scale, dropout_p=dropout_p, seed=seed,
                           split=name == "sdpa")
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@ring_dilated_attention_backward_op.register_fake
def _(*args):
    return _op_backward_fake(*args[:-1])


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and every tensor argument; the others ride on ctx."""
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(x if isinstance(x, Tensor) else None for x in rest))
    ctx.rest = [None if isinstance(x, Tensor) else x for x in rest]
    ctx.mark_non_differentiable(lse)


def _backward_formula(ctx, dout, _dlse):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    rest = [t if t is not None else x for t, x in zip(tensors, ctx.rest)]
    dq, dk, dv = ring_dilated_attention_backward_op(dout.contiguous(), q, k, v, out, lse, *rest)
    return (dq, dk, dv) + (None,) * len(rest)


ring_dilated_attention_op.register_autograd(_backward_formula, setup_context=_setup_context)
register_autocast("hilbert_fx::ring_dilated_attention")  # as SDPA under torch.autocast


# ---------------------------------------------------------------------------------------------
# Python fronts.

def ring_dilated_attention(q: Tensor, k: Tensor, v: Tensor, segment_lengths, dilation_rates, *,
                           hilbert: bool = False, is_causal: bool = False,
                           attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                           seed: Optional[Tensor] = None, scale: Optional[float] = None,
                           lowering: str = "sdpa", mesh) -> Tensor:
    """The op on this rank's shards, arguments already checked (as lowering/op.py calls it)."""
    name = group_name_of(mesh)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if lowering == "auto":
        lowering = resolve_lowering(lowering, q.device)
    if dropout_p > 0.0 and seed is None:
        seed = new_seed(q.device)
    out, _ = torch.ops.hilbert_fx.ring_dilated_attention(
        q, k, v, list(segment_lengths), list(dilation_rates), bool(hilbert), bool(is_causal),
        attn_mask, float(dropout_p), seed, scale, lowering, name)
    return out


def dilated_attention_on_mesh(q: Tensor, k: Tensor, v: Tensor, segment_lengths, dilation_rates, *,
                              hilbert: bool = False, is_causal: bool = False,
                              attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                              scale: Optional[float] = None, enable_gqa: bool = False,
                              lowering: str = "auto", mesh) -> Tensor:
    """hilbert_fx.dilated_attention(..., mesh=mesh) with its arguments checked such that a rank
    that rejects its own arguments makes every rank raise (instead of leaving the others waiting
    for it in the first collective)."""
    name = group_name_of(mesh)
    try:
        hilbert, is_causal, enable_gqa = check_flags(hilbert=hilbert, is_causal=is_causal,
                                                     enable_gqa=enable_gqa).values()
        segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
        check_lowering(lowering)
        reason = problem(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                         enable_gqa=enable_gqa, scale=scale)
        if reason:
            raise ValueError(reason)
    except ValueError as e:
        ring_agree.agree(ring_agree.resolve(name), 0, "invalid", 0, str(e))
        raise  # not reached: agree raises on every rank
    return ring_dilated_attention(q, k, v, segment_lengths, dilation_rates, hilbert=hilbert,
                                  is_causal=is_causal, attn_mask=attn_mask, dropout_p=dropout_p,
                                  scale=scale, lowering=resolve_lowering(lowering, q.device),
                                  mesh=mesh)
