"""Every knob of the Triton and Hopper lowerings, read from the environment once, in one place.

`tuning()` returns the process's `Tuning`, read on first use and kept: the lowerings consult it
on every call without touching os.environ. `reload()` reads the environment again (a script
that changes a knob between runs). A test that monkeypatches the environment also sets
`_current` to None with the same monkeypatch: the next call reads the patched environment, and
the test's end puts back the knobs read before it.

The environment variables, all optional:

- HILBERT_FX_TRITON_FWD, HILBERT_FX_TRITON_DKDV, HILBERT_FX_TRITON_DQ =
  "BLOCK_M,BLOCK_N,num_warps,num_stages": the tiles of that Triton kernel instead of
  `tile_config`'s tables (BLOCK_M and BLOCK_N powers of two from 16 to 256: the plans' positions
  are padded for tiles up to 256, lowering/triton_plans.POSITION_PAD).
- HILBERT_FX_TRITON_FP32_PRECISION = ieee | tf32 | tf32x3: tl.dot's precision for float32
  inputs, instead of following torch.get_float32_matmul_precision().
- HILBERT_FX_TRITON_ATOMIC_DQ=1: the Triton backward folds dQ into its dK/dV kernel with float32
  atomics (not deterministic; off whenever deterministic algorithms are asked for).
- HILBERT_FX_DETERMINISTIC=1: ask for a bitwise repeatable backward, as
  torch.use_deterministic_algorithms(True) does (that torch state is read per call, as it can
  change at any time).
- HILBERT_FX_GLUON=0: the Hopper (Gluon) kernels off; HILBERT_FX_GLUON_RUNS=0: their TMA copies
  of stride-r runs off (lowering/gluon_forward.py).
- HILBERT_FX_FAST_LAUNCH=0: every launch goes through Triton's own launch path (binding and
  specialising its arguments, building the Hopper kernels' TMA descriptors) instead of reusing
  what the first call of a configuration bound (lowering/triton_launch.py); for
  comparing the two, and a way out should a Triton release change what that reuse relies on.
- HILBERT_FX_DRIVER_LAUNCH=0: those cached launches go through Triton's C launcher instead of
  calling the CUDA driver with a parameter block packed once (lowering/driver_launch.py).

The tile tables live here too, with why each entry is what it is.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


KINDS = ("fwd", "dkdv", "dq")  # the Triton kernels with tiles: forward, dK/dV, dQ
PRECISIONS = ("ieee", "tf32", "tf32x3")


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name)
    if value is None:
        return default
    return value not in ("", "0")


def _tiles(environ: Mapping[str, str], name: str) -> TileConfig | None:
    value = environ.get(name)
    if not value:
        return None
    try:
        bm, bn, warps, stages = (int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(
            f"{name} must be 'BLOCK_M,BLOCK_N,num_warps,num_stages', got {value!r}") from None
    if not all(x in (16, 32, 64, 128, 256) for x in (bm, bn)):
        raise ValueError(
            f"{name}: BLOCK_M and BLOCK_N must be powers of two from 16 to 256, got {value!r}")
    return TileConfig(bm, bn, warps, stages)


@dataclass(frozen=True)
class Tuning:
    """The knobs, as the environment set them (module docstring)."""
    fwd_tiles: TileConfig | None = None  # HILBERT_FX_TRITON_FWD
    dkdv_tiles: TileConfig | None = None  # HILBERT_FX_TRITON_DKDV
    dq_tiles: TileConfig | None = None  # HILBERT_FX_TRITON_DQ
    fp32_precision: str | None = None  # HILBERT_FX_TRITON_FP32_PRECISION
    atomic_dq: bool = False  # HILBERT_FX_TRITON_ATOMIC_DQ
    deterministic_env: bool = False  # HILBERT_FX_DETERMINISTIC
    gluon: bool = True  # HILBERT_FX_GLUON
    gluon_runs: bool = True  # HILBERT_FX_GLUON_RUNS
    fast_launch: bool = True  # HILBERT_FX_FAST_LAUNCH
    driver_launch: bool = True  # HILBERT_FX_DRIVER_LAUNCH

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Tuning":
        """Reads the knobs; raises ValueError naming the variable that holds a malformed value."""
        env = os.environ if environ is None else environ
        precision = env.get("HILBERT_FX_TRITON_FP32_PRECISION") or None
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(
                f"HILBERT_FX_TRITON_FP32_PRECISION must be ieee, tf32 or tf32x3, got {precision!r}")
        return cls(
            fwd_tiles=_tiles(env, "HILBERT_FX_TRITON_FWD"),
            dkdv_tiles=_tiles(env, "HILBERT_FX_TRITON_DKDV"),
            dq_tiles=_tiles(env, "HILBERT_FX_TRITON_DQ"),
            fp32_precision=precision,
            atomic_dq=_flag(env, "HILBERT_FX_TRITON_ATOMIC_DQ", False),
            deterministic_env=_flag(env, "HILBERT_FX_DETERMINISTIC", False),
            gluon=_flag(env, "HILBERT_FX_GLUON", True),
            gluon_runs=_flag(env, "HILBERT_FX_GLUON_RUNS", True),
            fast_launch=_flag(env, "HILBERT_FX_FAST_LAUNCH", True),
            driver_launch=_flag(env, "HILBERT_FX_DRIVER_LAUNCH", True))

    def deterministic(self) -> bool:
        """Whether the backward must be bitwise repeatable: HILBERT_FX_DETERMINISTIC or torch's
        deterministic algorithms (a torch state, read at each call)."""
        return self.deterministic_env or torch.are_deterministic_algorithms_enabled()

    def use_atomic_dq(self) -> bool:
        return self.atomic_dq and not self.deterministic()

    def tile_override(self, kind: str) -> TileConfig | None:
        return {"fwd": self.fwd_tiles, "dkdv": self.dkdv_tiles, "dq": self.dq_tiles}[kind]


_current: Tuning | None = None


def tuning() -> Tuning:
    """The process's knobs, read from the environment on first use."""
    global _current
    if _current is None:
        _current = Tuning.from_environ()
    return _current


def reload() -> Tuning:
    """Reads the environment again and returns the new knobs."""
    global _current
    _current = None
    return tuning()


# ----------------------------------------------------------------------------- tile tables


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim (<= 64, <= 128, <= 256), checked to compile
# for sm_90 without register spills and within its 227 KB of shared memory. A user mask is one
# more pipelined tile per step, so masked kernels keep fewer or smaller tiles in flight.
_FWD_HOPPER = {"16": ((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2)),
               "16mask": ((128, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2)),
               "32": ((64, 32, 4, 2), (64, 16, 4, 2), (16, 16, 4, 1))}
_FWD_AMPERE = {"16": ((128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2)),
               "16mask": ((128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
               "32": ((64, 32, 4, 2), (64, 16, 4, 2), (16, 16, 4, 1))}
# fwd "16", D <= 64: (128, 128, 4, 3) and (128, 64, 4, 3) were each 3% ahead in one of two H200
# runs at N = 64K (BENCHMARKS.md): within the noise between runs, so the default stays.
# dkdv "16", D <= 128: (64, 128, 8, 3), FlexAttention's sm90 tiles, once the kernel's edge loop
# was left unpipelined and a class of one head lost its head loop: 20.8 and 21.1 ms against
# 21.8 and 21.7 for (32, 64, 4, 3) on an H200 at N = 64K, forward+backward (BENCHMARKS.md).
_DKDV = {"16": ((32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 8, 1)),
         "16mask": ((32, 128, 4, 2), (64, 64, 8, 2), (32, 64, 8, 1)),
         "32": ((32, 64, 4, 2), (16, 32, 4, 1), (16, 16, 4, 1))}
# dq "16", D <= 128: (128, 64, 8, 3) took forward+backward from 23.3 to 21.8-22.3 ms on an H200
# at N = 64K (FlexAttention's sm90 dQ tiles; its dK/dV tiles (64, 128, 8, 3) were slower here).
_DQ = {"16": ((128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 8, 1)),
       "16mask": ((128, 32, 4, 2), (128, 64, 8, 2), (64, 32, 8, 1)),
       "32": ((64, 32, 4, 2), (32, 16, 4, 1), (16, 16, 4, 1))}
# small tiles under the interpreter: the tests cross tile edges with small shapes
_INTERPRETED = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}


def tile_config(kind: str, device, dtype, head_dim: int, interpreted: bool,
                masked: bool = False, knobs: Tuning | None = None) -> TileConfig:
    """Tiles of kernel `kind` ("fwd", "dkdv" or "dq"), unless HILBERT_FX_TRITON_<KIND> says
    (`knobs`, by default `tuning()`).

    fwd and dq need BLOCK_M a multiple of BLOCK_N, dkdv BLOCK_N a multiple of BLOCK_M (the causal
    diagonal is walked in whole tiles)."""
    if kind not in KINDS:
        raise ValueError(f"tile kinds are {KINDS}, got {kind!r}")
    override = (knobs or tuning()).tile_override(kind)
    if override is not None:
        return override
    if interpreted:
        return TileConfig(*_INTERPRETED[kind])
    if kind == "fwd":
        table = _FWD_HOPPER if _capability(torch.device(device))[0] >= 9 else _FWD_AMPERE
    else:
        table = _DKDV if kind == "dkdv" else _DQ
    variant = "32" if dtype == torch.float32 else ("16mask" if masked else "16")
    index = 0 if head_dim <= 64 else (1 if head_dim <= 128 else 2)
    return TileConfig(*table[variant][index])


def shrunk(cfg: TileConfig, keep_divisible_m: bool) -> TileConfig | None:
    """A smaller config to retry with after the GPU ran out of shared memory or registers:
    stages go first, then tiles halve, never below 16, the tile walked in whole steps (block_m
    for fwd and dq, else block_n) staying a multiple of the other; None when nothing is left."""
    if cfg.num_stages > 1:
        return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
    # `big` is the tile that must stay a multiple of `small`: block_m for fwd and dq, else block_n
    big, small = (cfg.block_m, cfg.block_n) if keep_divisible_m else (cfg.block_n, cfg.block_m)
    if big > small and big > 16:
        big //= 2
    elif small > 16:
        small //= 2
        big = max(big // 2, small)
    else:
        return None
    bm, bn = (big, small) if keep_divisible_m else (small, big)
    return TileConfig(bm, bn, cfg.num_warps, 2)


def fp32_precision(dtype: torch.dtype, interpreted: bool, upcast: bool,
                   knobs: Tuning | None = None) -> str:
    """tl.dot's input_precision. For float32 inputs: plain TF32 only where torch allows it for
    matmuls (torch.set_float32_matmul_precision("high" or "medium")); otherwise "tf32x3", three
    TF32 products that carry float32's accuracy on the tensor cores ("ieee" runs on the FMA
    units and spills registers at these tile sizes). HILBERT_FX_TRITON_FP32_PRECISION overrides.
    The interpreter (and its float32 copies of bfloat16 tiles) computes in IEEE float32."""
    if upcast or interpreted:
        return "ieee"
    if dtype != torch.float32:
        return "tf32"  # tl.dot's default, irrelevant for 16-bit inputs
    forced = (knobs or tuning()).fp32_precision
    if forced:
        return forced
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


# ----------------------------------------------------------------------------- per-plan caches


class PlanCache:
    """What a lowering derives from a plan, kept per plan object (and a key) while the plan
    lives: plans are frozen and mostly cached by their makers, so a derivation runs once per plan
    instead of once per call. Entries are keyed by id(plan) and dropped by a weak reference's
    callback when the plan is collected, so a later plan at the same address never sees them."""

    def __init__(self):
        self._entries: dict = {}

    def get(self, plan, key, make):
        """The value made by make() for (plan, key), made on the first request."""
        slot = (id(plan), key)
        hit = self._entries.get(slot)
        if hit is not None and hit[0]() is plan:
            return hit[1]
        value = make()
        entries = self._entries

        def drop(ref, slot=slot):
            if entries.get(slot, (None,))[0] is ref:
                del entries[slot]

        self._entries[slot] = (weakref.ref(plan, drop), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
