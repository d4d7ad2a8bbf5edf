"""The op: torch.ops.hilbert_fx.dilated_attention, a torch.library custom op with a fake
implementation and a registered autograd formula, and `dilated_attention`, its public front.

The custom op takes everything already checked and resolved (scale a float, lowering either
"sdpa" or "triton"), so that a rewritten FX graph shows the lowering it will run.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import sdpa_lowering
from .arguments import (check_branches, check_flags, check_lowering, check_same_dtype, problem,
                        resolve_lowering)
from .autocast import register_autocast
from .dropout import new_seed
from .plans import branch_plans


def _lowering_module(lowering: str):
    if lowering == "sdpa":
        return sdpa_lowering
    if lowering == "triton":
        from . import triton_lowering
        return triton_lowering
    raise ValueError(f"lowering must be 'sdpa' or 'triton' once resolved, got {lowering!r}")


def _compute_dtype(q: Tensor, lowering: str) -> torch.dtype:
    """The SDPA lowering works in float32 where the device has no fast half type (SPEC 3)."""
    if lowering == "sdpa" and q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cpu":
        return torch.float32
    return q.dtype


def _empty(q: Tensor, v: Tensor) -> bool:
    """Whether the output [B, Hq, N, Dv] has no element (B, Hq, N or Dv is 0). SDPA returns it
    empty; the lowerings would index the last member of sets that do not exist. No output
    element depends on q, k or v then: every gradient is 0 (or empty)."""
    b, hq, n, _ = q.shape
    return b * hq * n * v.shape[-1] == 0


@torch.library.custom_op("hilbert_fx::dilated_attention", mutates_args=())
def dilated_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int],
                         dilation_rates: list[int], hilbert: bool, is_causal: bool,
                         attn_mask: Optional[Tensor], dropout_p: float, seed: Optional[Tensor],
                         scale: float, lowering: str) -> tuple[Tensor, Tensor]:
    """Returns (out [B, Hq, N, Dv] in q's dtype, lse [B, Hq, N] in float32 or wider)."""
    check_same_dtype(q, k, v)
    if _empty(q, v):  # as SDPA: empty in, empty out (the lowerings index a set's last member)
        b, hq, n, _ = q.shape
        return (q.new_zeros(b, hq, n, v.shape[-1]),
                q.new_full((b, hq, n), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32)))
    plans = branch_plans(q.shape[2], segment_lengths, dilation_rates, hilbert, q.device)
    dtype = _compute_dtype(q, lowering)
    out, lse = _lowering_module(lowering).forward(
        q.to(dtype), k.to(dtype), v.to(dtype), plans, is_causal=is_causal, attn_mask=attn_mask,
        scale=scale, dropout_p=dropout_p, seed=seed)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@dilated_attention_op.register_fake
def _(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed,
      scale, lowering):
    check_same_dtype(q, k, v)
    b, h, n, _ = q.shape
    out = q.new_empty(b, h, n, v.shape[-1])
    lse = q.new_empty(b, h, n, dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


@torch.library.custom_op("hilbert_fx::dilated_attention_backward", mutates_args=())
def dilated_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                  lse: Tensor, segment_lengths: list[int],
                                  dilation_rates: list[int], hilbert: bool, is_causal: bool,
                                  attn_mask: Optional[Tensor], dropout_p: float,
                                  seed: Optional[Tensor], scale: float,
                                  lowering: str) -> tuple[Tensor, Tensor, Tensor]:
    if _empty(q, v):  # every gradient has a zero-size dimension, or no row reaches it
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    plans = branch_plans(q.shape[2], segment_lengths, dilation_rates, hilbert, q.device)
    dtype = _compute_dtype(q, lowering)
    dq, dk, dv = _lowering_module(lowering).backward(
        dout.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out.to(dtype), lse, plans,
        is_causal=is_causal, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p, seed=seed)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@dilated_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
      dropout_p, seed, scale, lowering):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed, \
        scale, lowering = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, seed)
    ctx.config = (segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale, lowering)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, seed = ctx.saved_tensors
    segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale, lowering = ctx.config
    dq, dk, dv = dilated_attention_backward_op(
        dout.contiguous(), q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal,
        attn_mask, dropout_p, seed, scale, lowering)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


dilated_attention_op.register_autograd(_backward, setup_context=_setup_context)
register_autocast("hilbert_fx::dilated_attention")  # as SDPA under torch.autocast


def dilated_attention(q: Tensor, k: Tensor, v: Tensor, segment_lengths, dilation_rates, *,
                      hilbert: bool = False, is_causal: bool = False,
                      attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                      scale: Optional[float] = None, enable_gqa: bool = False,
                      lowering: str = "auto", mesh=None) -> Tensor:
    """LongNet dilated attention as SPEC section 2 defines it; arguments as in SDPA."""
    if mesh is not None:  # checked there so that every rank of the mesh raises, none hangs
        from .ring import dilated_attention_on_mesh
        return dilated_attention_on_mesh(q, k, v, segment_lengths, dilation_rates, hilbert=hilbert,
                                         is_causal=is_causal, attn_mask=attn_mask,
                                         dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                                         lowering=lowering, mesh=mesh)
    hilbert, is_causal, enable_gqa = check_flags(hilbert=hilbert, is_causal=is_causal,
                                                 enable_gqa=enable_gqa).values()
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    check_lowering(lowering)
    reason = problem(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                     enable_gqa=enable_gqa, scale=scale)
    if reason:
        raise ValueError(reason)
    scale = 1.0 / math.sqrt(max(q.shape[-1], 1)) if scale is None else float(scale)
    resolved = resolve_lowering(lowering, q.device)
    seed = new_seed(q.device) if dropout_p > 0.0 else None
    out, _ = torch.ops.hilbert_fx.dilated_attention(
        q, k, v, list(segment_lengths), list(dilation_rates), hilbert, is_causal,
        attn_mask, float(dropout_p), seed, scale, resolved)
    return out
