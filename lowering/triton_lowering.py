"""The Triton lowering: fused FlashAttention-2 kernels over the selected sets, straight from q, k, v.

lowering/op.py calls `forward` and `backward` here when lowering == "triton". The kernels
(lowering/triton_kernels.py) read the rows of each selected set where they lie: by arithmetic
(j*w + o + m*r, through strides) when the branch's order is the identity, through the plan's
positions (Hilbert order) otherwise. Nothing is gathered, scattered or expanded: no copy of
q, k, v, no repeat of k, v for grouped-query attention, no materialised mask.

Forward. One launch per branch, one program per (query tile of a selected set, batch * head,
segment), FlashAttention-2 over the set (causal: a lower triangle over the ascending set, tiles
above the diagonal skipped). At its end a program merges its rows into the running result of the
branches launched before it, by log-sum-exp in float32: (acc [B, H, N, Dv] float32, lse).
Branches run one after the other, so no two programs ever write the same rows at once, and the
merge costs no extra pass over the output: each program reads and writes only the float32 rows of
its own set, once. A branch with r == 1 selects every position; it runs last and writes the final
output in q's dtype directly, so that the float32 buffer is never read back by a separate pass.
(Without such a branch a last elementwise pass writes out, with 0 for rows no branch selects.)

Why per-branch launches rather than one program looping over all branches of a query tile: a
tile of one branch's set is not a tile of another's (dilation interleaves them), so a program
that looped over branches would either compute a fraction of each tile or need a per-row
gather of partial results. With the branches (2048,1), (4096,2), (8192,4), (16384,8) at
N = 64K, D = 128, every set has 2048 members, so each branch is 2048-long dense attention; the
merge traffic is one float32 row read and written per selected (row, branch) except the last,
under 10% of the bytes of q, k, v read by the attention itself and overlapped with it.

Backward (FlashAttention-2, recomputing P = exp(S - lse) with the final lse and
Delta = rowsum(dO * O) with the final O, which makes each branch's share exact term by term):
per branch, a dK/dV kernel with one program per (key tile, batch * kv head * offset class,
segment) -- the query heads of a kv head that share the offset h % r share the key set, so the
program loops over them and over their query tiles with K, V held in registers -- and a dQ kernel
with one program per query tile. Each adds into float32 buffers rows that no other program of the
launch touches, so the default path uses no atomics and is deterministic (bitwise repeatable).
Branches run in the forward's order: the float32 buffers are never zeroed (a launch reads only
the rows an earlier one wrote, `_seen_rows`), and a branch with r == 1 runs last and writes dq,
dk, dv in the inputs' dtype, so no pass converts float32 gradients afterwards (on an H200 at
N = 64K that took forward+backward from 22.3 to 21.8 ms, BENCHMARKS.md).
Setting HILBERT_FX_TRITON_ATOMIC_DQ=1 folds dQ into the dK/dV kernel with float32 atomics instead
(saves recomputing S and dP, not deterministic); HILBERT_FX_DETERMINISTIC=1 or
torch.use_deterministic_algorithms(True) turn that off again.

On Hopper (compute capability 9.x, Triton 3.6) a branch runs instead on FlashAttention-3's
warp-specialised schedules written in Gluon (lowering/gluon_forward.py says when: no mask, no
dropout, whole sets, head dims 64 and 128, 16-bit types): the forward (lowering/gluon_kernels.py)
merges into the same (acc, lse); the backward (lowering/gluon_backward_kernels.py) adds dq into
a zeroed float32 buffer by atomics (not under deterministic algorithms; the Triton dq kernel of
a branch beside it then adds to that buffer too) and dK/dV exactly as the Triton dK/dV kernel
does. On an H200 at N = 64K (medians of 3 to 5 rounds): forward 3.75 ms in the
identity order and 3.82 ms in the Hilbert order, forward+backward 17.3 to 18.0 ms in either,
against the floor's 3.50 to 3.53 and 13.97 to 14.36 (BENCHMARKS.md).

CPU tensors run the same kernels under the Triton interpreter (SPEC section 3). Triton decides
between interpreter and compiler when `triton` is first imported; importing this module without
a CUDA device sets TRITON_INTERPRET=1 first when triton is not imported yet.

Tile sizes: `tile_config`; override with HILBERT_FX_TRITON_FWD,
HILBERT_FX_TRITON_DKDV, HILBERT_FX_TRITON_DQ = "BLOCK_M,BLOCK_N,num_warps,num_stages".
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from . import gluon_backward, gluon_forward
from .arguments import problem
from .dropout import keep_threshold
from .plans import BranchPlan

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ \
        and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # Triton reads it when it is first imported

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------- triton, lazily

_kernels_module = None


def _kernels():
    """lowering/triton_kernels.py, imported on first use."""
    global _kernels_module
    if _kernels_module is None:
        try:
            from . import triton_kernels
        except ImportError as e:
            raise RuntimeError(f"lowering='triton' needs the triton package: {e}") from e
        _kernels_module = triton_kernels
    return _kernels_module


def interpreter_active() -> bool:
    """Whether this process's triton runs kernels in its interpreter (chosen at its import)."""
    import triton
    import triton.language as tl
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return isinstance(tl.zeros, InterpretedFunction) or isinstance(
        getattr(tl.standard, "zeros", None), InterpretedFunction)


def _check_device(q: torch.Tensor) -> bool:
    """Returns whether the kernels run interpreted; raises where they cannot run at all."""
    interpreted = interpreter_active()
    if q.device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "lowering='triton' on CPU tensors runs the Triton interpreter, which triton chooses "
            "when it is first imported: set TRITON_INTERPRET=1 in the environment (triton was "
            "already imported in compiled mode in this process)")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"lowering='triton' runs on CUDA or CPU tensors, got q on {q.device}")
    return interpreted


def _check_inputs(q, k, v):
    """The op's rule book (shapes, one dtype, Hq % Hkv == 0; the op checked the mask), then what
    the kernels alone require."""
    reason = problem(q, k, v, None, enable_gqa=True, same_dtype=True)
    if reason:
        raise ValueError(reason)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"lowering='triton' supports float16, bfloat16 and float32; q has dtype {q.dtype} "
            f"(use lowering='sdpa')")
    for name, d in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if d > MAX_HEAD_DIM:
            raise ValueError(
                f"lowering='triton' supports head dims up to {MAX_HEAD_DIM}; {name} has {d} "
                f"(use lowering='sdpa')")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")


# ----------------------------------------------------------------------------- tile configs


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _env_config(name: str) -> TileConfig | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        bm, bn, warps, stages = (int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"{name} must be 'BLOCK_M,BLOCK_N,num_warps,num_stages', got {value!r}") from None
    if not all(x in (16, 32, 64, 128, 256) for x in (bm, bn)):
        raise ValueError(f"{name}: BLOCK_M and BLOCK_N must be powers of two from 16 to 256, got {value!r}")
    return TileConfig(bm, bn, warps, stages)


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
_INTERPRETED = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}


def tile_config(kind: str, device, dtype, head_dim: int, interpreted: bool,
                masked: bool = False) -> TileConfig:
    """Tiles of kernel `kind` ("fwd", "dkdv" or "dq"), unless HILBERT_FX_TRITON_<KIND> says.

    fwd and dq need BLOCK_M a multiple of BLOCK_N, dkdv BLOCK_N a multiple of BLOCK_M (the causal
    diagonal is walked in whole tiles)."""
    env = _env_config(f"HILBERT_FX_TRITON_{kind.upper()}")
    if env is not None:
        return env
    if interpreted:  # small tiles: the tests cross tile edges with small shapes
        return TileConfig(*_INTERPRETED[kind])
    if kind == "fwd":
        table = _FWD_HOPPER if _capability(device)[0] >= 9 else _FWD_AMPERE
    else:
        table = _DKDV if kind == "dkdv" else _DQ
    variant = "32" if dtype == torch.float32 else ("16mask" if masked else "16")
    index = 0 if head_dim <= 64 else (1 if head_dim <= 128 else 2)
    return TileConfig(*table[variant][index])


def _shrunk(cfg: TileConfig, keep_divisible_m: bool) -> TileConfig | None:
    """A smaller config to retry with after the GPU ran out of shared memory or registers."""
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


_working_configs: dict = {}


def _launch(kernel, grid_of, cfg: TileConfig, m_multiple_of_n: bool, *args, **kwargs):
    """kernel[grid](*args, BLOCK_M, BLOCK_N, ...), shrinking the tiles if the GPU has too few
    resources for them (remembered per device, dtypes and compile-time arguments)."""
    from triton.runtime.errors import OutOfResources
    key = (kernel.__name__, cfg, args[0].device, args[0].dtype, tuple(sorted(kwargs.items())))
    cfg = _working_configs.get(key, cfg)
    while True:
        try:
            kernel[grid_of(cfg)](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kwargs)
            _working_configs[key] = cfg
            return
        except OutOfResources:
            smaller = _shrunk(cfg, m_multiple_of_n)
            if smaller is None:
                raise
            cfg = smaller


# ----------------------------------------------------------------------------- arguments


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _mask_args(attn_mask, b: int, h: int, n: int, like: torch.Tensor):
    """(tensor, kind, strides): the mask broadcast to [B, H, N, N] by strides (0 on broadcast
    dims, nothing materialised); kind 0 none, 1 boolean, 2 additive float."""
    if attn_mask is None:
        return like, 0, (0, 0, 0, 0)
    if attn_mask.device != like.device:
        raise ValueError(f"attn_mask must be on q's device {like.device}, got {attn_mask.device}")
    m = attn_mask.expand(b, h, n, n)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), 1, m.stride()
    return m, 2, m.stride()


def _dropout_args(dropout_p: float, seed, like: torch.Tensor):
    if dropout_p <= 0.0:
        return like, False, 0, 1.0
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed (an int64 0-dim tensor)")
    if seed.device != like.device:
        seed = seed.to(like.device)
    return seed.reshape(()), True, keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _precision(dtype: torch.dtype, interpreted: bool, upcast: bool) -> str:
    """tl.dot's input_precision for float32 inputs: plain TF32 only where torch allows it for
    matmuls (torch.set_float32_matmul_precision("high" or "medium")); otherwise "tf32x3", three
    TF32 products that carry float32's accuracy on the tensor cores ("ieee" runs on the FMA
    units and spills registers at these tile sizes). HILBERT_FX_TRITON_FP32_PRECISION overrides.
    Irrelevant for 16-bit inputs."""
    if upcast or interpreted:
        return "ieee"
    if dtype != torch.float32:
        return "tf32"  # tl.dot's default
    forced = os.environ.get("HILBERT_FX_TRITON_FP32_PRECISION")
    if forced:
        if forced not in ("ieee", "tf32", "tf32x3"):
            raise ValueError(f"HILBERT_FX_TRITON_FP32_PRECISION must be ieee, tf32 or tf32x3, got {forced!r}")
        return forced
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


# The backward's epilogues address a head's gradient rows with int32 offsets (fewer spilled
# registers: forward+backward 0.1 to 1.7% faster on an H200 at N = 64K in two runs of three and
# two rounds, BENCHMARKS.md) unless N * BLOCK_D reaches this; tests lower it to run the int64 path.
INT32_OFFSET_LIMIT = 2**31

POSITION_PAD = 256  # the largest BLOCK_M / BLOCK_N: a tile past a set's last may be prefetched


def _plan_tensors(plan: BranchPlan, device):
    """(positions, counts, strided) of a plan for the kernels on `device`, made once per plan.

    Strided plans (identity order) reach rows by arithmetic and pass their positions unused.
    Otherwise the positions go as int32, each set padded with 0 (a real row) from its count on,
    to a whole number of POSITION_PAD members plus one more POSITION_PAD: the kernels load a
    tile of positions, and the next tile's ahead of time, without a mask. On an H200 this took
    the Hilbert order's forward at N = 64K from 5.21 to 5.04 ms and from 5.25 to 5.08 ms, timed
    in one process against int64 positions and masked loads (BENCHMARKS.md)."""
    cached = getattr(plan, "_triton_tensors", None)
    if cached is None or cached[0].device != device:
        cnt = plan.counts.to(device)
        pos = plan.positions.to(device)
        if not plan.is_strided:
            r, s, m = pos.shape
            valid = torch.arange(m, device=device) < cnt.unsqueeze(-1)
            padded = torch.zeros(r, s, _cdiv(m, POSITION_PAD) * POSITION_PAD + POSITION_PAD,
                                 dtype=torch.int32, device=device)
            padded[:, :, :m] = torch.where(valid, pos, 0).to(torch.int32)
            pos = padded
        cached = (pos, cnt, plan.is_strided)
        object.__setattr__(plan, "_triton_tensors", cached)  # plans are frozen and cached
    return cached


def _check_grid(*dims):
    if dims[1] > 65535 or dims[2] > 65535:
        raise ValueError(
            f"lowering='triton' launches grids (tiles, batch*heads, segments) = {dims}; the last "
            f"two must be at most 65535")


def _common(q, k, v, attn_mask, dropout_p, seed):
    interpreted = _check_device(q)
    _check_inputs(q, k, v)
    b, hq, n, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    mask, mask_kind, mstrides = _mask_args(attn_mask, b, hq, n, q)
    seed_t, dropout, threshold, drop_scale = _dropout_args(dropout_p, seed, q)
    upcast = interpreted and q.dtype == torch.bfloat16
    return dict(
        interpreted=interpreted, b=b, hq=hq, hkv=hkv, n=n, d=d, dv=dv, group=hq // hkv,
        mask=mask, mask_kind=mask_kind, mstrides=mstrides, seed=seed_t, dropout=dropout,
        threshold=threshold, drop_scale=drop_scale, upcast=upcast,
        precision=_precision(q.dtype, interpreted, upcast),
        block_d=_block_d(d), block_dv=_block_d(dv))


def _forward_order(plans):
    """Branches with r > 1 first; one with r == 1 (it selects every row) last."""
    full = [p for p in plans if p.dilation_rate == 1]
    rest = [p for p in plans if p.dilation_rate != 1]
    return rest + full[1:] + full[:1], bool(full)


_seen_cache: dict = {}


def _selected_rows(plan: BranchPlan, num_heads: int) -> torch.Tensor:
    """[num_heads, N] bool: the positions query head h selects in this branch (offset h % r)."""
    r, n = plan.dilation_rate, plan.seq_len
    sel = torch.zeros(r, n + 1, dtype=torch.bool, device=plan.positions.device)
    sel.scatter_(1, plan.positions.reshape(r, -1), True)  # padding is position N: column N
    heads = torch.arange(num_heads, device=sel.device) % r
    return sel[:, :n].index_select(0, heads)


def _seen_rows(before, hq: int, hkv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows [Hq, N], key rows [Hkv, N]) uint8: 1 where a branch of `before` (launched
    earlier) wrote a gradient row, which a later branch adds to; its other rows are not
    initialised. Made once per sequence of plans and head counts."""
    key = (tuple(id(p) for p in before), hq, hkv, str(device))
    hit = _seen_cache.get(key)
    if hit is None:
        rows = torch.zeros(hq, before[0].seq_len, dtype=torch.bool, device=device)
        for plan in before:
            rows |= _selected_rows(plan, hq).to(device)
        kv_rows = rows.view(hkv, hq // hkv, -1).any(1)
        if len(_seen_cache) > 64:
            _seen_cache.clear()
        hit = _seen_cache[key] = (tuple(before), rows.to(torch.uint8), kv_rows.to(torch.uint8))
    return hit[1], hit[2]


def deterministic() -> bool:
    return os.environ.get("HILBERT_FX_DETERMINISTIC", "0") not in ("", "0") or \
        torch.are_deterministic_algorithms_enabled()


def _use_atomic_dq() -> bool:
    return os.environ.get("HILBERT_FX_TRITON_ATOMIC_DQ", "0") not in ("", "0") and not deterministic()


# ----------------------------------------------------------------------------- forward


def forward(q, k, v, plans: list[BranchPlan], *, is_causal: bool, attn_mask, scale: float,
            dropout_p: float = 0.0, seed=None):
    """Returns (out [B, Hq, N, Dv] in q.dtype, lse [B, Hq, N] float32, -inf for rows with no key)."""
    c = _common(q, k, v, attn_mask, dropout_p, seed)
    b, hq, n, dv = c["b"], c["hq"], c["n"], c["dv"]
    lse = torch.full((b, hq, n), NEG_INF, dtype=torch.float32, device=q.device)
    if b * hq * n == 0 or not plans:
        return torch.zeros(b, hq, n, dv, dtype=q.dtype, device=q.device), lse
    order, covers = _forward_order(plans)
    out = torch.empty(b, hq, n, dv, dtype=q.dtype, device=q.device)
    single = covers and len(order) == 1
    acc = out if single else torch.empty(b, hq, n, dv, dtype=torch.float32, device=q.device)
    kern = _kernels()
    cfg = tile_config("fwd", q.device, q.dtype, c["d"], c["interpreted"], c["mask_kind"] != 0)
    for i, plan in enumerate(order):
        last = covers and i == len(order) - 1
        pos, cnt, strided = _plan_tensors(plan, q.device)
        if gluon_forward.unsupported(q, k, v, plan, is_causal=is_causal, mask_kind=c["mask_kind"],
                                     dropout=c["dropout"], scale=scale) is None:
            gluon_forward.launch(q, k, v, out, acc, lse, plan, pos, is_causal=is_causal,
                                 scale=scale, first=i == 0, last=last)
            continue

        def grid(cfg, plan=plan):
            dims = (_cdiv(plan.set_size, cfg.block_m), b * hq, plan.num_segments)
            _check_grid(*dims)
            return dims

        _launch(kern._fwd_kernel, grid, cfg, True,
                q, k, v, out, acc, lse, pos, cnt, c["mask"], c["seed"],
                *q.stride(), *k.stride(), *v.stride(), *c["mstrides"],
                *pos.stride(), *cnt.stride(), hq, n, c["group"], plan.segment_length,
                plan.dilation_rate, scale * LOG2E, c["threshold"], c["drop_scale"],
                HEAD_DIM=c["d"], HEAD_DIM_V=dv, BLOCK_D=c["block_d"], BLOCK_DV=c["block_dv"],
                STRIDED=strided, CAUSAL=bool(is_causal), MASK_KIND=c["mask_kind"],
                DROPOUT=c["dropout"], FIRST=i == 0, LAST=last, UPCAST=c["upcast"],
                PRECISION=c["precision"], NONNEG_SCALE=scale >= 0)
    if not covers:  # rows no branch selects: out 0 (acc holds nothing there), lse -inf
        out = torch.where((lse > NEG_INF).unsqueeze(-1), acc, 0.0).to(q.dtype)
    return out, lse


# ----------------------------------------------------------------------------- backward


def backward(dout, q, k, v, out, lse, plans: list[BranchPlan], *, is_causal: bool, attn_mask,
             scale: float, dropout_p: float = 0.0, seed=None):
    """Returns (dq, dk, dv) in the inputs' dtypes, given the op's final out and lse."""
    c = _common(q, k, v, attn_mask, dropout_p, seed)
    b, hq, hkv, n, d, dv = c["b"], c["hq"], c["hkv"], c["n"], c["d"], c["dv"]
    if b * hq * n == 0 or not plans:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kern = _kernels()
    interpreted = c["interpreted"]

    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    pre_m = 16 if interpreted else 64
    kern._bwd_preprocess[(_cdiv(n, pre_m), b * hq)](
        out, dout, lse, delta, lse2, *out.stride(), *dout.stride(), hq, n,
        HEAD_DIM_V=dv, BLOCK_DV=c["block_dv"], BLOCK_M=pre_m)

    # The order of the forward: a branch with r == 1, if any, runs last and writes dq, dk, dv in
    # the inputs' dtype (it has every row); the ones before add up in float32 buffers that are
    # never zeroed (each launch reads only rows an earlier one wrote: _seen_rows).
    order, covers = _forward_order(plans)
    atomic = _use_atomic_dq()
    hopper = [gluon_backward.unsupported(q, k, v, plan, is_causal=is_causal,
                                         mask_kind=c["mask_kind"], dropout=c["dropout"],
                                         scale=scale, deterministic=deterministic()) is None
              for plan in order]
    # dq in a zeroed float32 buffer that the Hopper kernel (and the Triton dK/dV kernel when
    # `atomic`) adds to by atomics, and the Triton dq kernel reads wherever it writes
    dq_zeroed = atomic or any(hopper)
    alone = covers and len(order) == 1  # FIRST and LAST: no float32 buffer at all

    def new(h, dim, dtype=torch.float32, used=True):
        return torch.empty((b, h, n, dim) if used else (0,), dtype=dtype, device=q.device)

    # the gradients in the inputs' dtype, written by the r == 1 branch (dq's not when dq is
    # summed in the zeroed buffer), and the float32 sums of the branches before it
    grads = [new(hq, d, q.dtype, covers and not dq_zeroed), new(hkv, d, q.dtype, covers),
             new(hkv, dv, q.dtype, covers)]
    dk, dvb = grads[1:] if alone else (new(hkv, d), new(hkv, dv))
    if dq_zeroed:
        dq = torch.zeros(b, hq, n, d, dtype=torch.float32, device=q.device)
    else:
        dq = grads[0] if alone else new(hq, d)
    nothing = torch.empty(0, dtype=torch.uint8, device=q.device)  # Seen of a FIRST launch
    # the Seen of a Triton dq kernel adding to the zeroed dq: every row (made only if one runs)
    every_q = torch.ones(hq, n, dtype=torch.uint8, device=q.device) \
        if dq_zeroed and not atomic and not all(hopper) else nothing
    common = dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=c["block_d"], BLOCK_DV=c["block_dv"],
                  CAUSAL=bool(is_causal), MASK_KIND=c["mask_kind"], DROPOUT=c["dropout"],
                  UPCAST=c["upcast"], PRECISION=c["precision"],
                  WIDE=n * max(c["block_d"], c["block_dv"]) >= INT32_OFFSET_LIMIT)
    kv_cfg = tile_config("dkdv", q.device, q.dtype, d, interpreted, c["mask_kind"] != 0)
    q_cfg = tile_config("dq", q.device, q.dtype, d, interpreted, c["mask_kind"] != 0)
    group = c["group"]
    for i, plan in enumerate(order):
        pos, cnt, strided = _plan_tensors(plan, q.device)
        first, last = i == 0, covers and i == len(order) - 1
        seen_q, seen_kv = _seen_rows(order[:i], hq, hkv, q.device) if i else (nothing, nothing)
        if hopper[i]:
            gluon_backward.launch(q, k, v, dout, dq, dk, dvb, grads[1], grads[2], seen_kv, lse2,
                                  delta, plan, pos, is_causal=is_causal, scale=scale, first=first,
                                  last=last)
            continue
        classes = min(plan.dilation_rate, group)
        scalars = (plan.segment_length, plan.dilation_rate, scale * LOG2E, scale, c["threshold"],
                   c["drop_scale"])

        def kv_grid(cfg, plan=plan, classes=classes):
            dims = (_cdiv(plan.set_size, cfg.block_n), b * hkv * classes, plan.num_segments)
            _check_grid(*dims)
            return dims

        _launch(kern._bwd_dkdv_kernel, kv_grid, kv_cfg, False,
                q, k, v, dout, dk, dvb, dq, grads[1], grads[2], seen_kv, lse2, delta, pos, cnt,
                c["mask"], c["seed"],
                *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *c["mstrides"],
                *pos.stride(), *cnt.stride(), hq, hkv, n, group, classes, *scalars,
                STRIDED=strided, FIRST=first, LAST=last, ONE_HEAD=group <= plan.dilation_rate,
                ATOMIC_DQ=atomic, **common)
        if atomic:
            continue

        def q_grid(cfg, plan=plan):
            dims = (_cdiv(plan.set_size, cfg.block_m), b * hq, plan.num_segments)
            _check_grid(*dims)
            return dims

        _launch(kern._bwd_dq_kernel, q_grid, q_cfg, True,
                q, k, v, dout, dq, grads[0], every_q if dq_zeroed else seen_q, lse2, delta, pos,
                cnt, c["mask"], c["seed"],
                *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *c["mstrides"],
                *pos.stride(), *cnt.stride(), hq, n, group, *scalars,
                STRIDED=strided, FIRST=first and not dq_zeroed, LAST=last and not dq_zeroed,
                **common)
    if not dq_zeroed and covers:
        return tuple(grads)
    if covers:
        return dq.to(q.dtype), grads[1], grads[2]
    # no branch has every row: rows none wrote are 0
    seen_q, seen_kv = _seen_rows(order, hq, hkv, q.device)
    dq = dq if dq_zeroed else torch.where(seen_q[:, :, None] != 0, dq, 0.0)
    return (dq.to(q.dtype), torch.where(seen_kv[:, :, None] != 0, dk, 0.0).to(k.dtype),
            torch.where(seen_kv[:, :, None] != 0, dvb, 0.0).to(v.dtype))
