"""Dropout of attention probabilities, as a pure function of (seed, batch, head, query, key).

SPEC section 2 asks that dropout_p drops attention probabilities as SDPA does. We draw the keep
bit of entry (p, p') of query head h in batch b from a 32-bit integer hash rather than from a
generator's stream, so that every lowering (SDPA blocks, Triton, the ring) draws the same bits,
the backward recomputes them instead of storing them, and tests can reproduce them exactly.
A kept probability is scaled by 1 / (1 - dropout_p), as SDPA does.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer finaliser on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keep_threshold(dropout_p: float) -> int:
    """An entry is kept when the top 24 bits of its hash are >= this threshold."""
    return int(round(dropout_p * (1 << 24)))


def keep_mask(seed: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
              key: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Boolean keep mask, broadcast over the shapes of batch, head, query and key positions.

    seed is an int64 scalar tensor; the others are int64 tensors of broadcastable shapes.
    """
    x = _mix32((seed & _MASK32) ^ _mix32(((batch << 16) + head) & _MASK32))
    x = _mix32(x ^ (query & _MASK32))
    x = _mix32(x ^ (key & _MASK32))
    return (x >> 8) >= keep_threshold(dropout_p)


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed drawn from the device's default generator (torch.manual_seed makes it
    repeat). Drawn on the device itself: no host tensor and no copy per call, so a CUDA graph
    can capture it, and a replay draws a new one."""
    return torch.randint(0, 1 << 31, (), dtype=torch.int64, device=device)
