"""Checking the op's arguments (SPEC section 2) and choosing its lowering (SPEC section 3).

Every rule broken raises ValueError naming the argument and the rule.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

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
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have the same dtype (as in SDPA), got q {q.dtype}, "
                         f"k {k.dtype}, v {v.dtype}")


def check_tensors(q, k, v, *, attn_mask, is_causal: bool, dropout_p: float, enable_gqa: bool,
                  scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, N, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not _autocast_enabled(q.device.type):  # autocast casts them to one dtype
        check_same_dtype(q, k, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"q and k must have the same length (self-attention): q has {q.shape[2]} positions, "
            f"k has {k.shape[2]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must have the same length, got {k.shape[2]} and {v.shape[2]}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    hq, hkv = q.shape[1], k.shape[1]
    if enable_gqa:
        if (hq % hkv if hkv else hq):
            raise ValueError(
                f"the number of query heads must be a multiple of the key/value heads (enable_gqa): "
                f"q has {hq} heads (Hq), k has {hkv} (Hkv); Hq % Hkv != 0")
    elif hq != hkv:
        raise ValueError(
            f"q has {hq} heads and k has {hkv}: pass enable_gqa=True for grouped-query attention "
            f"(Hq % Hkv must then be 0)")
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask and is_causal cannot both be given (as in SDPA)")
        if not isinstance(attn_mask, torch.Tensor):
            raise ValueError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be boolean or floating point, got {attn_mask.dtype}")
        if attn_mask.dim() > 4:
            raise ValueError(f"attn_mask must have at most 4 dimensions, got {attn_mask.dim()}")
        # The mask must broadcast TO the scores' shape, not merely with it: a mask of batch 2
        # against q of batch 1 broadcasts with it (to batch 2) but cannot be expanded to it.
        n = q.shape[2]
        target = (q.shape[0], hq, n, n)
        try:
            fits = tuple(torch.broadcast_shapes(attn_mask.shape, target)) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"[B, Hq, N, N] = {target}")
        if attn_mask.requires_grad:
            raise ValueError("attn_mask must not require grad: its gradient is not computed")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite number, got {scale}")


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
