"""Checking the op's arguments (SPEC section 2) and choosing its lowering (SPEC section 3).

A broken rule is reported by a message naming the argument and the rule. The rules on tensors
live in one place, `problem`, which returns that message: the op and the ring raise it as
ValueError, the pass records it as the reason a site is not rewritten. The others raise it.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

LOWERINGS = ("auto", "triton", "sdpa")


def check_branches(segment_lengths: Sequence[int], dilation_rates: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validated (segment_lengths, dilation_rates) as tuples of ints."""
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(values, (int, str)) or not isinstance(values, Sequence):
            raise ValueError(f"{name} must be a sequence of ints, got {values!r}")
        if len(values) == 0:
            raise ValueError(f"{name} must not be empty")
        for x in values:
            if not _is_integer(x):
                raise ValueError(f"{name} must hold ints, got {x!r}")
            if operator.index(x) <= 0:
                raise ValueError(f"{name} must all be positive, got {tuple(values)}")
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(
            f"segment_lengths and dilation_rates must have equal lengths, got "
            f"{len(segment_lengths)} and {len(dilation_rates)}")
    for w, r in zip(segment_lengths, dilation_rates):
        if w % r:
            raise ValueError(
                f"each segment length must be a multiple of its dilation rate: segment_lengths "
                f"has {w}, dilation_rates has {r}")
    return (tuple(operator.index(w) for w in segment_lengths),
            tuple(operator.index(r) for r in dilation_rates))


try:
    import numpy
    _BOOLS: tuple[type, ...] = (bool, numpy.bool_)
except ImportError:  # pragma: no cover - numpy is optional for torch
    _BOOLS = (bool,)


def _is_bool(x) -> bool:
    return isinstance(x, _BOOLS)


def _is_integer(x) -> bool:
    """An integer of any kind (int, numpy's integers: numbers.Integral) but not a bool, which is
    one in Python: True as a segment length is a mistake, not 1."""
    return isinstance(x, numbers.Integral) and not _is_bool(x)


def check_flags(**flags) -> dict[str, bool]:
    """Each flag (hilbert, is_causal, enable_gqa) as a Python bool; anything but a bool (Python's
    or numpy's) is refused: bool('no') is True, so coercing would run is_causal='no' causal."""
    for name, value in flags.items():
        if not _is_bool(value):
            raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return {name: bool(value) for name, value in flags.items()}


def check_lowering(lowering: str) -> str:
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    return lowering


def check_same_dtype(q, k, v) -> None:
    """The custom op's own check (it runs after autocast, which casts the three to one dtype)."""
    reason = _dtype_problem(q.dtype, k.dtype, v.dtype)
    if reason:
        raise ValueError(reason)


def _dtype_problem(qd, kd, vd) -> str:
    if None in (qd, kd, vd) or qd == kd == vd:
        return ""
    return f"q, k and v must have the same dtype (as in SDPA), got q {qd}, k {kd}, v {vd}"


@dataclass(frozen=True)
class TensorSpec:
    """What the rules read of a tensor argument. The op builds one from a tensor (`of`); the pass
    builds one from the shapes it recorded for a site, where dtype and device may be unknown
    (None: the rules that read them are not checked)."""
    shape: tuple[int, ...]
    dtype: Optional[torch.dtype] = None
    device_type: Optional[str] = None
    requires_grad: bool = False

    @classmethod
    def of(cls, t: "torch.Tensor | TensorSpec") -> "TensorSpec":
        if isinstance(t, TensorSpec):
            return t
        return cls(tuple(t.shape), t.dtype, t.device.type, bool(t.requires_grad))

    def dim(self) -> int:
        return len(self.shape)


def problem(q, k, v, attn_mask=None, *, is_causal: bool = False, dropout_p: float = 0.0,
            enable_gqa: bool = False, scale=None, same_dtype: Optional[bool] = None,
            position_ids=None, cu_seqlens=None, seqused_k=None) -> str:
    """What is wrong with a call's tensors and numbers (SPEC section 2), "" when nothing: the one
    rule book that the op (which raises it), the ring (which agrees on it across ranks before any
    rank raises), the Triton lowering and the pass (which records it as the reason a site is not
    rewritten) all read. q, k, v and attn_mask are tensors or TensorSpecs.

    position_ids, cu_seqlens, seqused_k: the sequence structure of SPEC section 5 (README.md,
    "Packed sequences, padding and a KV cache"). q shorter than k is a cache continuation: the
    queries are the last tokens of the sequences whose keys k holds, which needs is_causal, or
    an attn_mask [.., Nq, Nk] of their rows (a sliding window, ALiBi: the queries' rows of
    section 2 with the mask, over the rows of k up to seqused_k).

    same_dtype: whether q, k and v must share a dtype. None (the op): unless autocast is on for
    q's device, since autocast casts them to one. The pass passes False: it does not know the
    autocast state the call runs under.
    """
    specs = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, (torch.Tensor, TensorSpec)):
            return f"{name} must be a tensor, got {type(t).__name__}"
        s = TensorSpec.of(t)
        if s.dim() != 4:
            return f"{name} must have 4 dimensions [B, H, N, D], got shape {s.shape}"
        if s.dtype is not None and not s.dtype.is_floating_point:
            return f"{name} must be a floating-point tensor, got {s.dtype}"
        specs.append(s)
    qs, ks, vs = specs
    if same_dtype is None:
        same_dtype = not (qs.device_type is not None and _autocast_enabled(qs.device_type))
    if same_dtype and _dtype_problem(qs.dtype, ks.dtype, vs.dtype):
        return _dtype_problem(qs.dtype, ks.dtype, vs.dtype)
    (b, hq, n, d), (bk, hkv, nk, dk), (bv, hv, nv, _) = qs.shape, ks.shape, vs.shape
    if n > nk or (n < nk and not is_causal and attn_mask is None):
        # "different lengths ... not self-attention": the pass reports cross-attention sites so
        return (f"q and k have different lengths (q has {n} positions, k has {nk}): not "
                f"self-attention over one sequence, where q and k must have the same length "
                f"(or q the last tokens of a cached sequence in k, which needs is_causal=True "
                f"or an attn_mask of their rows)")
    if nv != nk:
        return f"k and v must have the same length, got {nk} and {nv}"
    if not (b == bk == bv):
        return f"q, k and v must have the same batch size, got {b}, {bk}, {bv}"
    if d != dk:
        return f"q and k must have the same head dim, got {d} and {dk}"
    if hkv != hv:
        return f"k and v must have the same number of heads, got {hkv} and {hv}"
    if enable_gqa:
        if (hq % hkv if hkv else hq):
            return (f"the number of query heads must be a multiple of the key/value heads "
                    f"(enable_gqa): q has {hq} heads (Hq), k has {hkv} (Hkv); Hq % Hkv != 0")
    elif hq != hkv:
        return (f"q has {hq} heads and k has {hkv}: pass enable_gqa=True for grouped-query "
                f"attention (Hq % Hkv must then be 0)")
    if attn_mask is not None:
        if is_causal:
            return "attn_mask and is_causal cannot both be given (as in SDPA)"
        if not isinstance(attn_mask, (torch.Tensor, TensorSpec)):
            return f"attn_mask must be a tensor, got {type(attn_mask).__name__}"
        m = TensorSpec.of(attn_mask)
        if m.dtype is not None and m.dtype != torch.bool and not m.dtype.is_floating_point:
            return f"attn_mask must be boolean or floating point, got {m.dtype}"
        if m.dim() > 4:
            return f"attn_mask must have at most 4 dimensions, got {m.dim()}"
        # The mask must broadcast TO the scores' shape, not merely with it: a mask of batch 2
        # against q of batch 1 broadcasts with it (to batch 2) but cannot be expanded to it.
        target = (b, hq, n, nk)
        try:
            fits = tuple(torch.broadcast_shapes(m.shape, target)) == target
        except RuntimeError:
            fits = False
        if not fits:
            return (f"attn_mask of shape {m.shape} does not broadcast to [B, Hq, N, N] = {target}"
                    if n == nk else f"attn_mask of shape {m.shape} does not broadcast to "
                    f"[B, Hq, Nq, Nk] = {target} (the queries' rows of a cached sequence)")
        if m.requires_grad:
            return ("attn_mask must not require grad: it requires grad (a learned bias, such as "
                    "T5's relative position bias, in training), and the op does not compute the "
                    "mask's gradient")
    reason = _structure_problem(b, n, nk, attn_mask, is_causal, dropout_p, position_ids,
                                cu_seqlens, seqused_k)
    if reason:
        return reason
    if not (0.0 <= float(dropout_p) < 1.0):
        return f"dropout_p must be in [0, 1), got {dropout_p}"
    if scale is not None and not math.isfinite(float(scale)):
        return f"scale must be a finite number, got {scale}"
    return ""


def _structure_problem(b, n, nk, attn_mask, is_causal, dropout_p, position_ids, cu_seqlens,
                       seqused_k) -> str:
    given = [name for name, t in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens),
                                  ("seqused_k", seqused_k)) if t is not None]
    for name in given:
        t = {"position_ids": position_ids, "cu_seqlens": cu_seqlens, "seqused_k": seqused_k}[name]
        if not isinstance(t, (torch.Tensor, TensorSpec)):
            return f"{name} must be a tensor, got {type(t).__name__}"
        spec = TensorSpec.of(t)
        if spec.dtype is not None and (spec.dtype.is_floating_point or spec.dtype.is_complex
                                       or spec.dtype == torch.bool):
            return f"{name} must be an integer tensor, got {spec.dtype}"
        if spec.requires_grad:
            return f"{name} must not require grad"
    if position_ids is not None and cu_seqlens is not None:
        return "position_ids and cu_seqlens cannot both be given (each says where sequences start)"
    # a mask beside seqused_k is a cached sequence's rows of section 2 with that mask; documents
    # and padding by positions are a structure that replaces the mask
    placed = [name for name in given if name != "seqused_k"]
    if placed and attn_mask is not None:
        return (f"attn_mask cannot be combined with {' or '.join(placed)}: the sequence "
                f"structure replaces the mask (SPEC section 5)")
    if position_ids is not None:
        shape = TensorSpec.of(position_ids).shape
        if shape not in ((nk,), (1, nk), (b, nk)):
            return (f"position_ids must have shape [N], [1, N] or [B, N] over k's rows "
                    f"(B = {b}, N = {nk}), got {shape}")
    if cu_seqlens is not None:
        shape = TensorSpec.of(cu_seqlens).shape
        if len(shape) != 1 or shape[0] < 1:
            return f"cu_seqlens must be a 1-D tensor [S + 1] of cumulative lengths, got shape {shape}"
    if seqused_k is not None:
        shape = TensorSpec.of(seqused_k).shape
        if shape != (b,):
            return f"seqused_k must have shape [B] = [{b}], got {shape}"
        if not is_causal and attn_mask is None:
            return ("seqused_k (queries continuing a cached sequence) needs is_causal=True or an "
                    "attn_mask of the queries' rows")
    if (n < nk or seqused_k is not None) and float(dropout_p) > 0.0:
        return "dropout_p must be 0 for queries against a cache (q shorter than k, or seqused_k)"
    return ""


def _autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled for devices that have autocast; False for the others (meta
    tensors, which FSDP and model-initialisation tools pass around, raise in torch's own)."""
    return torch._C._is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def triton_capable(device: torch.device) -> bool:
    """Compute capability 8.0 or more (SPEC section 3)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_lowering(lowering: str, device: torch.device) -> str:
    """'triton' or 'sdpa' for tensors on `device` (SPEC section 3)."""
    check_lowering(lowering)
    if lowering != "auto":
        return lowering
    return "triton" if triton_capable(device) else "sdpa"
