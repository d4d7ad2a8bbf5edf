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

from . import decode, sdpa_lowering, sequences
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


def _forward(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p,
             seed, scale, lowering, position_ids, seqused_k):
    """(out, lse) in the compute dtype: plain rows, packed rows, or queries against a cache."""
    rows = _rows_of(q, k, position_ids, seqused_k)
    lower = _lowering_module(lowering)
    if rows is None:
        plans = branch_plans(q.shape[2], segment_lengths, dilation_rates, hilbert, q.device)
        return lower.forward(q, k, v, plans, is_causal=is_causal, attn_mask=attn_mask,
                             scale=scale, dropout_p=dropout_p, seed=seed)
    kind, what = rows
    if kind == "cache" and q.shape[2] <= sequences.DECODE_MAX_QUERIES:
        return _decode_module(lowering).decode_forward(
            q, k, v, what.key_positions, what.query_rows, segment_lengths, dilation_rates,
            hilbert, scale)
    b = q.shape[0]
    if kind == "cache":  # many queries: place them at their rows, run the sets of every row
        positions, cache = what.key_positions, what
        q = _at_rows(q, cache.query_rows, k.shape[2])
    else:
        positions, cache = what, None
    plans = sequences.plans_of(positions, segment_lengths, dilation_rates, hilbert)
    out, lse = lower.forward(sequences.flat_rows(q), sequences.flat_rows(k),
                             sequences.flat_rows(v), plans, is_causal=is_causal, attn_mask=None,
                             scale=scale, dropout_p=dropout_p, seed=seed)
    out, lse = sequences.batch_rows(out, b), sequences.batch_rows(lse, b)
    if cache is not None:
        out, lse = _from_rows(out, cache.query_rows), _from_rows(lse, cache.query_rows)
    return out, lse


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


def _op_forward(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int],
                dilation_rates: list[int], hilbert: bool, is_causal: bool,
                attn_mask: Optional[Tensor], dropout_p: float, seed: Optional[Tensor],
                scale: float, lowering: str, position_ids: Optional[Tensor] = None,
                seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Returns (out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] in float32 or wider).

    position_ids (int64 [B, Nk] or [1, Nk], negative: padding) and seqused_k (int64 [B]) are the
    sequence structure of SPEC section 5, already checked and normalised by the front."""
    check_same_dtype(q, k, v)
    if _empty(q, v):  # as SDPA: empty in, empty out (the lowerings index a set's last member)
        b, hq, n, _ = q.shape
        return (q.new_zeros(b, hq, n, v.shape[-1]),
                q.new_full((b, hq, n), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32)))
    dtype = _compute_dtype(q, lowering)
    out, lse = _forward(q.to(dtype), k.to(dtype), v.to(dtype), segment_lengths, dilation_rates,
                        hilbert, is_causal, attn_mask, dropout_p, seed, scale, lowering,
                        position_ids, seqused_k)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _op_fake(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p,
             seed, scale, lowering, position_ids=None, seqused_k=None):
    check_same_dtype(q, k, v)
    b, h, n, _ = q.shape
    out = q.new_empty(b, h, n, v.shape[-1])
    lse = q.new_empty(b, h, n, dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


def _op_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 segment_lengths: list[int], dilation_rates: list[int], hilbert: bool,
                 is_causal: bool, attn_mask: Optional[Tensor], dropout_p: float,
                 seed: Optional[Tensor], scale: float, lowering: str,
                 position_ids: Optional[Tensor] = None,
                 seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    if _empty(q, v):  # every gradient has a zero-size dimension, or no row reaches it
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    dtype = _compute_dtype(q, lowering)
    args = (dout.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out.to(dtype), lse,
            segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed,
            scale, lowering, position_ids, seqused_k)
    dq, dk, dv = _backward_in(*args)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


def _backward_in(dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal,
                 attn_mask, dropout_p, seed, scale, lowering, position_ids, seqused_k):
    rows = _rows_of(q, k, position_ids, seqused_k)
    lower = _lowering_module(lowering)
    if rows is None:
        plans = branch_plans(q.shape[2], segment_lengths, dilation_rates, hilbert, q.device)
        return lower.backward(dout, q, k, v, out, lse, plans, is_causal=is_causal,
                              attn_mask=attn_mask, scale=scale, dropout_p=dropout_p, seed=seed)
    kind, what = rows
    if kind == "cache" and q.shape[2] <= sequences.DECODE_MAX_QUERIES:
        # few queries (a decoding step) have no backward kernel: decode.py's torch operations
        return decode.decode_backward(dout, q, k, v, out, lse, what.key_positions,
                                      what.query_rows, segment_lengths, dilation_rates, hilbert,
                                      scale)
    b, nk = q.shape[0], k.shape[2]
    if kind == "cache":  # the gradients of the rows that hold no query are 0 (dout 0 there)
        positions, rows_q = what.key_positions, what.query_rows
        q, dout, out = (_at_rows(x, rows_q, nk) for x in (q, dout, out))
        lse = _at_rows(lse.unsqueeze(-1), rows_q, nk).squeeze(-1)
    else:
        positions, rows_q = what, None
    plans = sequences.plans_of(positions, segment_lengths, dilation_rates, hilbert)
    flat = sequences.flat_rows
    dq, dk, dv = lower.backward(flat(dout), flat(q), flat(k), flat(v), flat(out),
                                lse.transpose(0, 1).reshape(1, lse.shape[1], -1),
                                plans, is_causal=is_causal, attn_mask=None, scale=scale,
                                dropout_p=dropout_p, seed=seed)
    dq, dk, dv = (sequences.batch_rows(x, b) for x in (dq, dk, dv))
    if rows_q is not None:
        dq = _from_rows(dq, rows_q)
    return dq, dk, dv


def _op_backward_fake(dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert,
                      is_causal, attn_mask, dropout_p, seed, scale, lowering, position_ids=None,
                      seqused_k=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


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
        dq, dk, dv = backward_op(dout.contiguous(), q, k, v, out, lse, segment_lengths,
                                 dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed,
                                 scale, lowering, position_ids, seqused_k)
        return (dq, dk, dv) + (None,) * 11

    forward_op.register_autograd(backward, setup_context=setup_context)
    register_autocast(f"hilbert_fx::{name}")  # as SDPA under torch.autocast
    return forward_op, backward_op


dilated_attention_op, dilated_attention_backward_op = _register("dilated_attention", ())
# The same op for calls whose plans are built from position tensors (packed rows, and long chunks
# of queries against a cache): building them reads a count on the host, which a CUDA graph
# cannot capture, so Inductor runs graphs holding it without CUDA graphs (and says so) rather
# than failing in the capture.
_HOST_READ = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
dilated_attention_varlen_op, dilated_attention_varlen_backward_op = _register(
    "dilated_attention_varlen", _HOST_READ)


def reads_host(nq: int, nk: int, has_position_ids: bool, has_seqused_k: bool) -> bool:
    """Whether a call builds its plans from position tensors (dilated_attention_varlen)."""
    if nq < nk or has_seqused_k:
        return nq > sequences.DECODE_MAX_QUERIES
    return has_position_ids


def op_for(nq: int, nk: int, has_position_ids: bool, has_seqused_k: bool):
    """The custom op a call with these sizes and structure arguments runs (what the pass emits)."""
    if reads_host(nq, nk, has_position_ids, has_seqused_k):
        return torch.ops.hilbert_fx.dilated_attention_varlen.default
    return torch.ops.hilbert_fx.dilated_attention.default


# The checks of a call, by everything they read (shapes, dtypes, devices, flags and numbers with
# their types, autocast's state): a model calls the op with the same arguments layer after layer
# and step after step, and checking them costs more host time than launching the kernels.
_checked_calls: dict = {}


def _call_key(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k, segment_lengths,
              dilation_rates, hilbert, is_causal, enable_gqa, dropout_p, scale, lowering):
    """A hashable key of what the checks read, or None where a call is checked every time."""
    tensors = (q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k)
    if not all(t is None or type(t) is Tensor for t in tensors):
        return None
    if not (isinstance(segment_lengths, (list, tuple)) and isinstance(dilation_rates, (list, tuple))):
        return None
    try:
        return (tuple(None if t is None else (t.shape, t.dtype, t.device, t.requires_grad)
                      for t in tensors),
                tuple((type(x), x) for x in segment_lengths),
                tuple((type(x), x) for x in dilation_rates),
                tuple((type(x), x) for x in (hilbert, is_causal, enable_gqa, dropout_p, scale,
                                              lowering)),
                torch.is_autocast_enabled(q.device.type) if q.device.type in ("cpu", "cuda")
                else None)
    except TypeError:  # an unhashable argument: checked as it is
        return None


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
    row's sequence, continuing a cache: is_causal=True then."""
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
    key = _call_key(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k, segment_lengths,
                    dilation_rates, hilbert, is_causal, enable_gqa, dropout_p, scale, lowering)
    checked = _checked_calls.get(key) if key is not None else None
    if checked is None:
        checked = _check_call(q, k, v, attn_mask, position_ids, cu_seqlens, seqused_k,
                              segment_lengths, dilation_rates, hilbert, is_causal, enable_gqa,
                              dropout_p, scale, lowering)
        if key is not None:
            if len(_checked_calls) > 256:
                _checked_calls.clear()
            _checked_calls[key] = checked
    segment_lengths, dilation_rates, hilbert, is_causal, scale, resolved = checked
    seed = new_seed(q.device) if dropout_p > 0.0 else None
    b, nk = q.shape[0], k.shape[2]
    if cu_seqlens is not None:
        position_ids = sequences.positions_from_cu_seqlens(cu_seqlens.to(q.device), b, nk)
    if position_ids is not None:
        position_ids = position_ids.to(device=q.device, dtype=torch.int64).reshape(-1, nk)
    if seqused_k is not None:
        if seqused_k.device.type == "cpu" and bool(((seqused_k < 0) | (seqused_k > nk)).any()):
            # (on a GPU this check would wait for it: there a query outside k's rows gets 0)
            raise ValueError(f"seqused_k must lie in [0, Nk] = [0, {nk}], got {seqused_k.tolist()}")
        seqused_k = seqused_k.to(device=q.device, dtype=torch.int64)
    op = op_for(q.shape[2], nk, position_ids is not None, seqused_k is not None)
    out, _ = op(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
                float(dropout_p), seed, scale, resolved, position_ids, seqused_k)
    return out
