"""The op: torch.ops.hilbert_fx.dilated_attention, a torch.library custom op with a fake
implementation and a registered autograd formula, and `dilated_attention`, its public front.

The custom op takes everything already checked and resolved (scale a float, lowering either
"sdpa" or "triton"), so that a rewritten FX graph shows the lowering it will run.

Two ways into the same forward and backward (`_run_forward`, `_run_backward`):
- the custom ops, for everything that traces (torch.compile, export, make_fx, fake and functional
  tensors, torch.func): they are what a graph shows, with their fake implementations, autograd
  formula and autocast kernel;
- `_EagerAttention`, a torch.autograd.Function, for the front called eagerly on plain tensors:
  the custom op's dispatch, its autograd wrapper and its argument handling cost a few hundred
  microseconds of host time per forward and backward, more than the Triton lowering's own
  launches, and eager use traces nothing. It keeps what the custom op does there: autocast's
  casts (lowering/autocast.py), no zero gradient made for an unused output, a refused double
  backward.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor
from torch._C import _functions as autograd_functions

from . import decode, graph_pools, sdpa_lowering, sequences
from .arguments import (check_branches, check_flags, check_lowering, check_same_dtype, problem,
                        resolve_lowering)
from .autocast import autocast_dtype, autocast_off, cast_args, register_autocast
from .dropout import new_seed
from .plans import branch_plans


_lowerings = {"sdpa": sdpa_lowering}  # the Triton lowering joins on first use (it imports triton)


def _lowering_module(lowering: str):
    module = _lowerings.get(lowering)
    if module is not None:  # (an import statement per call costs a microsecond)
        return module
    if lowering == "triton":
        from . import triton_lowering
        _lowerings["triton"] = triton_lowering
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


def _decode_module(lowering: str):
    """The Triton decode kernel where the Triton lowering runs, else decode.py's torch ops."""
    if lowering == "triton":
        try:
            from . import triton_decode
            return triton_decode
        except ImportError:  # the kernel is optional: decode.py computes the same
            pass
    return decode


def _rows_of(q: Tensor, k: Tensor, position_ids, seqused_k):
    """How the queries meet the sequences (SPEC section 5): None for plain rows (section 2),
    ("packed", positions [B, N]) when the queries are the key rows of `position_ids`'
    sequences, or ("cache", Cache) for queries that continue cached sequences."""
    b, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    if seqused_k is None and nq == nk:
        return None if position_ids is None else ("packed", position_ids.expand(b, nk))
    return ("cache", sequences.cache_of(nq, nk, b, position_ids, seqused_k, q.device))


def _layout(q: Tensor, k: Tensor, segment_lengths, dilation_rates, hilbert, position_ids,
            seqused_k, masked: bool = False):
    """What the forward and the backward of a call both read of its rows: (kind, plans, cache)
    with kind "plain", "packed", "decode" (few queries against a cache, no plans) or "chunk"
    (many queries against a cache, placed at their rows). Built once per call on the eager
    path, which hands it from the forward to the backward."""
    rows = _rows_of(q, k, position_ids, seqused_k)
    if rows is None:
        return "plain", _plain_plans(q.shape[2], segment_lengths, dilation_rates, hilbert,
                                     q.device), None
    kind, what = rows
    if kind == "cache" and q.shape[2] <= sequences.DECODE_MAX_QUERIES:
        return "decode", None, what
    if kind == "cache" and masked:  # queries placed at their rows, the mask over the row
        return "chunk", _plain_plans(k.shape[2], segment_lengths, dilation_rates, hilbert,
                                     q.device), what
    if kind == "cache":
        return "chunk", sequences.plans_of(what.key_positions, segment_lengths, dilation_rates,
                                           hilbert), what
    return "packed", sequences.plans_of(what, segment_lengths, dilation_rates, hilbert), None


# The plans of plain rows by (N, flag, device, branches): one lookup per call, where plans.py
# looks up each branch on its own.
_plain: dict = {}


def _plain_plans(n: int, segment_lengths, dilation_rates, hilbert: bool, device):
    key = (n, hilbert, device, len(segment_lengths), *segment_lengths, *dilation_rates)
    plans = _plain.get(key)
    if plans is None:
        if len(_plain) > 256:
            _plain.clear()
        plans = _plain[key] = branch_plans(n, segment_lengths, dilation_rates, hilbert, device)
    return plans


def _forward(q, k, v, layout, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
             dropout_p, seed, scale, lowering):
    """(out, lse) in the compute dtype: plain rows, packed rows, or queries against a cache."""
    kind, plans, cache = layout
    lower = _lowering_module(lowering)
    if kind == "plain":
        return lower.forward(q, k, v, plans, is_causal=is_causal, attn_mask=attn_mask,
                             scale=scale, dropout_p=dropout_p, seed=seed)
    if kind == "decode" and attn_mask is not None:  # the Triton decode kernel takes no mask
        return decode.decode_forward(
            q, k, v, cache.key_positions, cache.query_rows, segment_lengths, dilation_rates,
            hilbert, scale, gapless=cache.gapless, attn_mask=attn_mask)
    if kind == "decode":
        return _decode_module(lowering).decode_forward(
            q, k, v, cache.key_positions, cache.query_rows, segment_lengths, dilation_rates,
            hilbert, scale, gapless=cache.gapless)
    if kind == "chunk" and attn_mask is not None:
        rows = cache.query_rows
        out, lse = lower.forward(_at_rows(q, rows, k.shape[2]), k, v, plans, is_causal=False,
                                 attn_mask=_placed_mask(attn_mask, cache, q.shape[1]),
                                 scale=scale, dropout_p=dropout_p, seed=seed)
        return _from_rows(out, rows), _from_rows(lse, rows)
    b = q.shape[0]
    if kind == "chunk":  # many queries: place them at their rows, run the sets of every row
        q = _at_rows(q, cache.query_rows, k.shape[2])
    out, lse = lower.forward(sequences.flat_rows(q), sequences.flat_rows(k),
                             sequences.flat_rows(v), plans, is_causal=is_causal, attn_mask=None,
                             scale=scale, dropout_p=dropout_p, seed=seed)
    out, lse = sequences.batch_rows(out, b), sequences.batch_rows(lse, b)
    if cache is not None:
        out, lse = _from_rows(out, cache.query_rows), _from_rows(lse, cache.query_rows)
    return out, lse


def _placed_mask(mask: Tensor, cache, hq: int) -> Tensor:
    """A mask [.., Nq, Nk] of queries at cache.query_rows laid over the rows of a [B, H, Nk, Nk]
    mask (H: the mask's heads, 1 or Hq) for the queries placed at their rows (`_at_rows`):
    every key forbidden to the rows that hold no query, and to every row the keys that are no
    rows of the sequence (past seqused_k). O(Nk^2): only a chunk of many queries against a
    cache with a mask kept (a static cache's prompt under a sliding window or ALiBi) builds it."""
    b, nq = cache.query_rows.shape
    nk = cache.key_positions.shape[1]
    heads = mask.shape[-3] if mask.dim() >= 3 else 1
    m = mask.expand(b, heads, nq, nk)
    forbidden = False if m.dtype == torch.bool else float("-inf")
    rows = cache.query_rows
    inside = (rows >= 0) & (rows < nk)
    index = torch.where(inside, rows, nk).view(b, 1, nq, 1).expand(b, heads, nq, nk)
    full = m.new_full((b, heads, nk + 1, nk), forbidden).scatter(2, index, m)[:, :, :nk]
    return full.masked_fill((cache.key_positions < 0).view(b, 1, 1, nk), forbidden)


def _at_rows(q: Tensor, rows: Tensor, n: int) -> Tensor:
    """[B, H, Nq, D] placed at key rows `rows` [B, Nq] of a zero [B, H, n, D]; a query outside
    [0, n) (seqused_k below Nq) goes to a spare row that is dropped, never onto a real one."""
    b, h, nq, d = q.shape
    full = q.new_zeros(b, h, n + 1, d)
    inside = (rows >= 0) & (rows < n)
    index = torch.where(inside, rows, n).view(b, 1, nq, 1).expand(b, h, nq, d)
    return full.scatter(2, index, q)[:, :, :n]


def _from_rows(x: Tensor, rows: Tensor) -> Tensor:
    """Rows `rows` [B, Nq] of x [B, H, N, ...]; 0 for a row outside [0, N) (lse: -inf)."""
    b, h, n = x.shape[:3]
    nq = rows.shape[1]
    shape = (b, 1, nq, *([1] * (x.dim() - 3)))
    inside = ((rows >= 0) & (rows < n)).view(shape)
    index = rows.clamp(0, n - 1).view(shape)
    picked = x.gather(2, index.expand(b, h, nq, *x.shape[3:]))
    empty = float("-inf") if x.dim() == 3 else 0.0
    return picked.masked_fill(~inside, empty)


def _bnhd(x: Tensor) -> Tensor:
    """x [B, H, N, D] laid out as [B, N, H, D] in memory: the op's output, as FlashAttention's
    (the Triton lowering writes it so; the others' results are copied)."""
    if x.transpose(1, 2).is_contiguous():
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _like(grad: Tensor, x: Tensor) -> Tensor:
    """The gradient of x in x's dtype and laid out as torch.empty_like(x) lays it out (x's own
    strides when x is dense), as the backward's fake says; a copy only where the lowering wrote
    another layout."""
    if grad.dtype == x.dtype and grad.stride() == x.stride():
        return grad
    like = torch.empty_like(x)
    if grad.dtype == x.dtype and grad.stride() == like.stride():
        return grad
    return like.copy_(grad)


def _dense(x: Tensor) -> Tensor:
    """x [B, H, N, D] as it is when contiguous, or contiguous as [B, N, H, D] (the layout in
    which a model's output projection hands back the gradient of the op's output: a copy of it
    cost 0.8 ms of a 32K Llama step), else a contiguous copy. The lowerings read either layout
    through its strides."""
    if x.is_contiguous() or x.transpose(1, 2).is_contiguous():
        return x
    return x.contiguous()


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _run_forward(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
                 dropout_p, seed, scale, lowering, position_ids, seqused_k):
    """(out in q's dtype, lse, layout): what both ways into the op compute; layout is None for
    an empty output."""
    check_same_dtype(q, k, v)
    if _empty(q, v):  # as SDPA: empty in, empty out (the lowerings index a set's last member)
        b, hq, n, _ = q.shape
        return (q.new_zeros(b, n, hq, v.shape[-1]).transpose(1, 2),
                q.new_full((b, hq, n), float("-inf"),
                           dtype=torch.promote_types(q.dtype, torch.float32)), None)
    dtype = _compute_dtype(q, lowering)
    layout = _layout(q, k, segment_lengths, dilation_rates, hilbert, position_ids, seqused_k,
                     attn_mask is not None)
    out, lse = _forward(_as(q, dtype), _as(k, dtype), _as(v, dtype), layout, segment_lengths,
                        dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed, scale,
                        lowering)
    return _bnhd(_as(out, q.dtype)), lse.contiguous(), layout


def _run_backward(dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal,
                  attn_mask, dropout_p, seed, scale, lowering, position_ids, seqused_k,
                  layout=None):
    """(dq, dk, dv) in the inputs' dtypes; layout: the forward's, else built again."""
    if _empty(q, v):  # every gradient has a zero-size dimension, or no row reaches it
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if layout is None:
        layout = _layout(q, k, segment_lengths, dilation_rates, hilbert, position_ids, seqused_k,
                         attn_mask is not None)
    dtype = _compute_dtype(q, lowering)
    dq, dk, dv = _backward_in(_as(dout, dtype), _as(q, dtype), _as(k, dtype), _as(v, dtype),
                              _as(out, dtype), lse, layout, segment_lengths, dilation_rates,
                              hilbert, is_causal, attn_mask, dropout_p, seed, scale, lowering)
    return _like(dq, q), _like(dk, k), _like(dv, v)


def _backward_in(dout, q, k, v, out, lse, layout, segment_lengths, dilation_rates, hilbert,
                 is_causal, attn_mask, dropout_p, seed, scale, lowering):
    kind, plans, cache = layout
    lower = _lowering_module(lowering)
    if kind == "plain":
        return lower.backward(dout, q, k, v, out, lse, plans, is_causal=is_causal,
                              attn_mask=attn_mask, scale=scale, dropout_p=dropout_p, seed=seed)
    if kind == "decode":
        # few queries (a decoding step) have no backward kernel: decode.py's torch operations
        return decode.decode_backward(dout, q, k, v, out, lse, cache.key_positions,
                                      cache.query_rows, segment_lengths, dilation_rates, hilbert,
                                      scale, gapless=cache.gapless, attn_mask=attn_mask)
    b, nk = q.shape[0], k.shape[2]
    if kind == "chunk" and attn_mask is not None:
        rows_q = cache.query_rows
        placed = [_at_rows(x, rows_q, nk) for x in (dout, q, out)]
        lse = _at_rows(lse.unsqueeze(-1), rows_q, nk).squeeze(-1)
        dq, dk, dv = lower.backward(placed[0], placed[1], k, v, placed[2], lse, plans,
                                    is_causal=False,
                                    attn_mask=_placed_mask(attn_mask, cache, q.shape[1]),
                                    scale=scale, dropout_p=dropout_p, seed=seed)
        return _from_rows(dq, rows_q), dk, dv
    if kind == "chunk":  # the gradients of the rows that hold no query are 0 (dout 0 there)
        rows_q = cache.query_rows
        q, dout, out = (_at_rows(x, rows_q, nk) for x in (q, dout, out))
        lse = _at_rows(lse.unsqueeze(-1), rows_q, nk).squeeze(-1)
    flat = sequences.flat_rows
    dq, dk, dv = lower.backward(flat(dout), flat(q), flat(k), flat(v), flat(out),
                                lse.transpose(0, 1).reshape(1, lse.shape[1], -1),
                                plans, is_causal=is_causal, attn_mask=None, scale=scale,
                                dropout_p=dropout_p, seed=seed)
    dq, dk, dv = (sequences.batch_rows(x, b) for x in (dq, dk, dv))
    if kind == "chunk":
        dq = _from_rows(dq, cache.query_rows)
    return dq, dk, dv


def _op_forward(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int],
                dilation_rates: list[int], hilbert: bool, is_causal: bool,
                attn_mask: Optional[Tensor], dropout_p: float, seed: Optional[Tensor],
                scale: float, lowering: str, position_ids: Optional[Tensor] = None,
                seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Returns (out [B, Hq, Nq, Dv] in q's dtype, [B, Nq, Hq, Dv] in memory; lse [B, Hq, Nq] in
    float32 or wider).

    position_ids (int64 [B, Nk] or [1, Nk], negative: padding) and seqused_k (int64 [B]) are the
    sequence structure of SPEC section 5, already checked and normalised by the front."""
    args = (q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p,
            seed, scale, lowering, position_ids, seqused_k)
    if graph_pools.warming_up(q.device):  # what the call keeps stays out of the graph's pool
        out, lse, _ = graph_pools.outside_the_pool(_run_forward, q.device, *args)
    else:
        out, lse, _ = _run_forward(*args)
    return out, lse


def _op_fake(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p,
             seed, scale, lowering, position_ids=None, seqused_k=None):
    check_same_dtype(q, k, v)
    b, h, n, _ = q.shape
    out = q.new_empty(b, n, h, v.shape[-1]).transpose(1, 2)  # as _run_forward's: _bnhd
    lse = q.new_empty(b, h, n, dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


def _op_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 segment_lengths: list[int], dilation_rates: list[int], hilbert: bool,
                 is_causal: bool, attn_mask: Optional[Tensor], dropout_p: float,
                 seed: Optional[Tensor], scale: float, lowering: str,
                 position_ids: Optional[Tensor] = None,
                 seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    args = (dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal,
            attn_mask, dropout_p, seed, scale, lowering, position_ids, seqused_k)
    if graph_pools.warming_up(q.device):  # as in _op_forward
        return graph_pools.outside_the_pool(_run_backward, q.device, *args)
    return _run_backward(*args)


def _op_backward_fake(dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert,
                      is_causal, attn_mask, dropout_p, seed, scale, lowering, position_ids=None,
                      seqused_k=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # as _like


def _register(name: str, tags: tuple):
    """The op `hilbert_fx::<name>` and its backward op, with a fake implementation, the autograd
    formula and autocast as SDPA's."""
    forward_op = torch.library.custom_op(f"hilbert_fx::{name}", mutates_args=(),
                                         tags=tags)(_op_forward)
    forward_op.register_fake(_op_fake)
    backward_op = torch.library.custom_op(f"hilbert_fx::{name}_backward", mutates_args=(),
                                          tags=tags)(_op_backward)
    backward_op.register_fake(_op_backward_fake)

    def setup_context(ctx, inputs, output):
        q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, \
            seed, scale, lowering, position_ids, seqused_k = inputs
        ctx.save_for_backward(q, k, v, *output, attn_mask, seed, position_ids, seqused_k)
        ctx.config = (segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale,
                      lowering)
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zero gradient made for lse on every backward

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, attn_mask, seed, position_ids, seqused_k = ctx.saved_tensors
        if dout is None:  # out was not used: no gradient reaches q, k, v
            return (None,) * 14
        segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale, lowering = \
            ctx.config
        dq, dk, dv = backward_op(_dense(dout), q, k, v, out, lse, segment_lengths,
                                 dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed,
                                 scale, lowering, position_ids, seqused_k)
        return (dq, dk, dv) + (None,) * 11

    forward_op.register_autograd(backward, setup_context=setup_context)
    register_autocast(f"hilbert_fx::{name}")  # as SDPA under torch.autocast
    return forward_op, backward_op


class _EagerAttention(torch.autograd.Function):
    """The op called eagerly on plain tensors (see the module's docstring): the custom op's
    forward and backward without its dispatch. `args` is the custom op's arguments after q, k,
    v; none of them takes a gradient (the front refuses a mask or structure that requires one).
    """

    @staticmethod
    def forward(ctx, q, k, v, args):
        out, lse, layout = _run_forward(q, k, v, *args)
        segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed, scale, \
            lowering, _, _ = args
        # every tensor the backward reads goes through save_for_backward, as the custom op's
        # do, so that checkpointing and saved-tensor hooks see them; the structure arguments
        # are read in the layout, which the backward takes from here
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, seed)
        ctx.config = (segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale,
                      lowering)
        ctx.layout = layout
        ctx.set_materialize_grads(False)  # no zero gradient made where out is not used
        return out

    @staticmethod
    def backward(ctx, dout):
        if not torch.is_grad_enabled():
            return _EagerAttention.grads(ctx, dout)
        # create_graph=True: gradients that take part in the graph but refuse a second
        # backward, as those of the custom op's backward op (which has no autograd formula) do
        with torch.no_grad():
            grads = _EagerAttention.grads(ctx, dout)
        return _refusing_second_backward(grads)

    @staticmethod
    def grads(ctx, dout):
        if dout is None:
            return None, None, None, None
        q, k, v, out, lse, attn_mask, seed = ctx.saved_tensors
        segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale, lowering = \
            ctx.config
        dq, dk, dv = _run_backward(_dense(dout), q, k, v, out, lse, segment_lengths,
                                   dilation_rates, hilbert, is_causal, attn_mask, dropout_p,
                                   seed, scale, lowering, None, None, ctx.layout)
        return dq, dk, dv, None


# _EagerAttention.apply less its torch.func handling (unwrapping dead functorch wrappers), which
# has nothing to do where _eager holds: no transform is active and the tensors are plain.
_apply_eager_attention = super(torch.autograd.Function, _EagerAttention).apply

_NO_DOUBLE_BACKWARD = (b"hilbert_fx.dilated_attention has no double backward: its gradients "
                       b"come from kernels that have no derivative")


def _refusing_second_backward(grads: tuple) -> tuple:
    """The gradients, each behind a node that raises if a backward reaches it."""
    present = [g.detach().requires_grad_() for g in grads if g is not None]
    if not present:
        return grads
    refusing = autograd_functions.DelayedError(_NO_DOUBLE_BACKWARD, len(present))(*present)
    refusing = iter(refusing if len(present) > 1 else (refusing,))
    return tuple(None if g is None else next(refusing) for g in grads)


# One op for every call: the plans of packed rows, padding and caches are built on the device
# from the position tensors (lowering/sequences.py), with nothing read on the host, so a CUDA
# graph may capture any call.
dilated_attention_op, dilated_attention_backward_op = _register("dilated_attention", ())


# The checks of a call, by everything they read (shapes, dtypes, devices, flags and numbers with
# their types, autocast's state): a model calls the op with the same arguments layer after layer
# and step after step, and checking them costs more host time than launching the kernels.
_checked_calls: dict = {}


def _call_key(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k, segment_lengths,
              dilation_rates, hilbert, is_causal, enable_gqa, dropout_p, scale, lowering):
    """A key of what the checks read, or None where a call is checked every time. Values go
    with their types: True == 1 and np.int64(4) == 4, but the checks tell them apart."""
    if not (isinstance(segment_lengths, (list, tuple)) and isinstance(dilation_rates, (list, tuple))):
        return None
    flags = (hilbert, is_causal, enable_gqa, dropout_p, scale, lowering)
    key = [tuple(segment_lengths), tuple(map(type, segment_lengths)), tuple(dilation_rates),
           tuple(map(type, dilation_rates)), flags, tuple(map(type, flags))]
    for t in (q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k):
        if t is None:
            key.append(None)
        elif type(t) is Tensor:
            key += (t.shape, t.dtype, t.device, t.requires_grad)
        else:
            return None
    device_type = q.device.type
    key.append(torch.is_autocast_enabled(device_type) if device_type in ("cpu", "cuda") else None)
    return tuple(key)


def _checked_args(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k, segment_lengths,
                  dilation_rates, hilbert, is_causal, enable_gqa, dropout_p, scale, lowering):
    """_check_call's result, from the calls already checked where the key matches."""
    args = (q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k, segment_lengths,
            dilation_rates, hilbert, is_causal, enable_gqa, dropout_p, scale, lowering)
    key = _call_key(*args)
    if key is not None:
        try:
            checked = _checked_calls.get(key)
        except TypeError:  # an unhashable argument (an array as scale): checked as it is
            return _check_call(*args)
        if checked is not None:
            return checked
    checked = _check_call(*args)
    if key is not None:
        if len(_checked_calls) > 256:
            _checked_calls.clear()
        _checked_calls[key] = checked
    return checked


def _check_call(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k, segment_lengths,
                dilation_rates, hilbert, is_causal, enable_gqa, dropout_p, scale, lowering):
    """The front's checks (ValueError naming the argument); returns the resolved arguments."""
    hilbert, is_causal, enable_gqa = check_flags(hilbert=hilbert, is_causal=is_causal,
                                                 enable_gqa=enable_gqa).values()
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    check_lowering(lowering)
    reason = problem(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                     enable_gqa=enable_gqa, scale=scale, position_ids=position_ids,
                     cu_seqlens=cu_seqlens, seqused_k=seqused_k)
    if reason:
        raise ValueError(reason)
    scale = 1.0 / math.sqrt(max(q.shape[-1], 1)) if scale is None else float(scale)
    return (list(segment_lengths), list(dilation_rates), hilbert, is_causal, scale,
            resolve_lowering(lowering, q.device))


_PLAIN = (Tensor, torch.nn.Parameter)  # types with no __torch_function__ of their own
_custom_op_only = False  # set by custom_op_path()


@contextlib.contextmanager
def custom_op_path():
    """Eager calls in this block go through the custom op, as traced ones do (for tests and
    benchmarks that compare the two paths)."""
    global _custom_op_only
    before, _custom_op_only = _custom_op_only, True
    try:
        yield
    finally:
        _custom_op_only = before


def _eager(*tensors) -> bool:
    """Whether a call runs on the eager path: plain tensors (no fake, functional, meta or other
    subclass of Tensor), with nothing tracing or transforming it (torch.compile, a dispatch
    mode such as make_fx's, FakeTensorMode's or export's, a torch function mode, torch.func,
    torch.jit.trace). Everything else calls the custom op, which all of these understand."""
    if torch.compiler.is_compiling() or _custom_op_only:
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return not (tensors[0].is_meta or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._are_functorch_transforms_active()
                or torch._C._get_tracing_state() is not None)


def _eager_call(q: Tensor, k: Tensor, v: Tensor, args: tuple) -> Tensor:
    """The op's output on the eager path, autocast's casts made as the custom op's autocast
    kernel makes them (lowering/autocast.py)."""
    device_type = q.device.type
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return _eager_apply(q, k, v, args)
    q, k, v, *args = cast_args((q, k, v, *args), device_type, dtype)
    with autocast_off(device_type):
        return _eager_apply(q, k, v, tuple(args))


def _eager_apply(q: Tensor, k: Tensor, v: Tensor, args: tuple) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _apply_eager_attention(q, k, v, args)
    return _run_forward(q, k, v, *args)[0]  # nothing to differentiate: no autograd node


def dilated_attention(q: Tensor, k: Tensor, v: Tensor, segment_lengths, dilation_rates, *,
                      hilbert: bool = False, is_causal: bool = False,
                      attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                      scale: Optional[float] = None, enable_gqa: bool = False,
                      lowering: str = "auto", mesh=None, position_ids: Optional[Tensor] = None,
                      cu_seqlens: Optional[Tensor] = None,
                      seqused_k: Optional[Tensor] = None) -> Tensor:
    """LongNet dilated attention as SPEC section 2 defines it; arguments as in SDPA.

    Sequence structure (SPEC section 5; each query gets the op on its own sequence alone):
    position_ids [Nk] or [B, Nk]: each key row's position in its sequence, negative for padding
    (sequences count 0, 1, 2, ... on consecutive rows: packed documents restart at 0);
    cu_seqlens [S + 1]: FlashAttention's cumulative lengths over the B * Nk rows read one after
    the other, the rows past its last entry padding; seqused_k [B]: row b's keys are k's rows
    [0, seqused_k[b]). q shorter than k (or seqused_k given) holds the last tokens of each
    row's sequence, continuing a cache: is_causal=True then. Called eagerly with cu_seqlens,
    the plans are sized by its length and built without reading anything from the GPU (so the
    call can be captured in a CUDA graph); cu_seqlens on the CPU is checked, on a GPU it is
    taken as FlashAttention takes it."""
    if mesh is not None:  # checked there so that every rank of the mesh raises, none hangs
        from .ring import dilated_attention_on_mesh
        for name, t in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens),
                        ("seqused_k", seqused_k)):
            if t is not None:  # every rank passes the same arguments: every rank raises
                raise ValueError(f"{name} is not supported with mesh= (the ring runs one "
                                 f"sequence per batch row, sharded over the mesh)")
        return dilated_attention_on_mesh(q, k, v, segment_lengths, dilation_rates, hilbert=hilbert,
                                         is_causal=is_causal, attn_mask=attn_mask,
                                         dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                                         lowering=lowering, mesh=mesh)
    checked = _checked_args(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k,
                            segment_lengths, dilation_rates, hilbert, is_causal, enable_gqa,
                            dropout_p, scale, lowering)
    segment_lengths, dilation_rates, hilbert, is_causal, scale, resolved = checked
    seed = new_seed(q.device) if dropout_p > 0.0 else None
    b, nk = q.shape[0], k.shape[2]
    if cu_seqlens is not None and _eager(q, k, v, attn_mask, cu_seqlens):
        # made (and on the CPU checked) once per cu_seqlens tensor: a model's layers share them
        position_ids = sequences.positions_of_cu_seqlens(cu_seqlens, b, nk, q.device)
    elif cu_seqlens is not None:
        position_ids = sequences.positions_from_cu_seqlens(cu_seqlens.to(q.device), b, nk)
    if position_ids is not None:
        position_ids = position_ids.to(device=q.device, dtype=torch.int64).reshape(-1, nk)
    if seqused_k is not None:
        if seqused_k.device.type == "cpu" and bool(((seqused_k < 0) | (seqused_k > nk)).any()):
            # (on a GPU this check would wait for it: there a query outside k's rows gets 0)
            raise ValueError(f"seqused_k must lie in [0, Nk] = [0, {nk}], got {seqused_k.tolist()}")
        seqused_k = seqused_k.to(device=q.device, dtype=torch.int64)
    args = (segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, float(dropout_p),
            seed, scale, resolved, position_ids, seqused_k)
    if _eager(q, k, v, attn_mask, position_ids, seqused_k):
        return _eager_call(q, k, v, args)
    out, _ = dilated_attention_op(q, k, v, *args)
    return out
