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
its own set, once. A branch with r == 1 over a complete plan (every row in a set: no padding) selects every
position; it runs last and writes the final output in q's dtype directly, so that the float32
buffer is never read back by a separate pass. (Without such a branch a last elementwise pass
writes out, with 0 for rows no branch selects: padding rows of packed sequences, rows past
every set.)

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
the rows an earlier one wrote, `_seen_rows`), and a complete branch with r == 1 runs last and
writes dq, dk, dv in the inputs' dtype, so no pass converts float32 gradients afterwards (on an H200 at
N = 64K that took forward+backward from 22.3 to 21.8 ms, BENCHMARKS.md).
Setting HILBERT_FX_TRITON_ATOMIC_DQ=1 folds dQ into the dK/dV kernel with float32 atomics instead
(saves recomputing S and dP, not deterministic); HILBERT_FX_DETERMINISTIC=1 or
torch.use_deterministic_algorithms(True) turn that off again. Those knobs, and every other one,
are read once (lowering/tuning.py).

Plans may hold several sequences in one row (lowering/sequences.py): a set is then partial in
any segment or empty (count 0), and padding rows are in no set (plan.complete is False). The
kernels read each set's count and skip tiles past it, so they run such plans unchanged; only
the choice of which branch writes the final result in place depends on completeness.

On Hopper (compute capability 9.x, Triton 3.6) a branch runs instead on FlashAttention-3's
warp-specialised schedules written in Gluon (lowering/gluon_forward.py says when: no mask, no
dropout, whole sets of a complete plan, head dims 64 and 128, 16-bit types): the forward
(lowering/gluon_kernels.py) merges into the same (acc, lse); the backward
(lowering/gluon_backward_kernels.py) adds dq into a zeroed float32 buffer by atomics (not under
deterministic algorithms; the Triton dq kernel of a branch beside it then adds to that buffer
too) and dK/dV exactly as the Triton dK/dV kernel does. On an H200 at N = 64K (medians of 3
to 5 rounds): forward 3.75 ms in the identity order and 3.82 ms in the Hilbert order,
forward+backward 17.3 to 18.0 ms in either, against the floor's 3.50 to 3.53 and 13.97 to 14.36
(BENCHMARKS.md).

CPU tensors run the same kernels under the Triton interpreter (SPEC section 3). Triton decides
between interpreter and compiler when `triton` is first imported, so the process must start with
TRITON_INTERPRET=1 (the tests and CI do); a CPU tensor that reaches this lowering otherwise gets
a RuntimeError saying so. This module leaves the environment alone: setting the variable on
import would switch a process that also uses a GPU to the interpreter.

Tile sizes: lowering/tuning.py's `tile_config` (tables by GPU, dtype and head dim; overrides
HILBERT_FX_TRITON_FWD, _DKDV, _DQ), shrunk at launch if the GPU lacks the resources (`_launch`).
The kernels' positional parameters, shared by all three, are built by `Call.operands`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gluon_backward, gluon_forward
from .arguments import problem
from .dropout import keep_threshold
from .plans import BranchPlan
from .tuning import PlanCache, TileConfig, Tuning, fp32_precision, tile_config, tuning
from .tuning import shrunk as _shrunk

__all__ = ["forward", "backward", "interpreter_active", "tile_config", "TileConfig",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

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


_interpreted: bool | None = None


def interpreter_active() -> bool:
    """Whether this process's triton runs kernels in its interpreter (chosen at its import, so
    the answer is kept)."""
    global _interpreted
    if _interpreted is None:
        import triton  # noqa: F401
        import triton.language as tl
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # pragma: no cover - a triton without this class: its own switch
            import os
            _interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        else:
            _interpreted = isinstance(tl.zeros, InterpretedFunction) or isinstance(
                getattr(tl.standard, "zeros", None), InterpretedFunction)
    return _interpreted


def _check_device(q: torch.Tensor) -> bool:
    """Returns whether the kernels run interpreted; raises where they cannot run at all."""
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"lowering='triton' runs on CUDA or CPU tensors, got q on {q.device}")
    interpreted = interpreter_active()
    if q.device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "lowering='triton' on CPU tensors runs the Triton interpreter, which triton chooses "
            "when it is first imported: start the process with TRITON_INTERPRET=1 in the "
            "environment (this process's triton compiles for a GPU), or use lowering='sdpa'")
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


# ----------------------------------------------------------------------------- launches

# The tiles that ran, by kernel, first-choice tiles, device, dtype and compile-time arguments:
# a config the GPU had too few resources for is shrunk once, not at every call.
_working_configs: dict = {}


def _launch(kernel, grid_of, cfg: TileConfig, m_multiple_of_n: bool, call: "Call", args: list,
            constexprs: dict):
    """kernel[grid](*args, BLOCK_M, BLOCK_N, **constexprs), shrinking the tiles (tuning.shrunk)
    if the GPU has too few resources for them."""
    from triton.runtime.errors import OutOfResources
    key = (kernel.__name__, cfg, call.q.device, call.q.dtype, tuple(sorted(constexprs.items())))
    cfg = _working_configs.get(key, cfg)
    while True:
        try:
            kernel[grid_of(cfg)](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs)
            _working_configs[key] = cfg
            return
        except OutOfResources:
            smaller = _shrunk(cfg, m_multiple_of_n)
            if smaller is None:
                raise
            cfg = smaller


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _check_grid(*dims):
    if dims[1] > 65535 or dims[2] > 65535:
        raise ValueError(
            f"lowering='triton' launches grids (tiles, batch*heads, segments) = {dims}; the last "
            f"two must be at most 65535")


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


@dataclass(frozen=True)
class Branch:
    """One plan as the kernels read it: its positions (int32, padded: `_plan_tensors`) and counts
    on the call's device, and whether rows are reached by arithmetic instead (STRIDED)."""
    plan: BranchPlan
    pos: torch.Tensor
    cnt: torch.Tensor
    strided: bool

    def grid(self, tile: int, programs: int) -> tuple[int, int, int]:
        """(tiles of a set, programs per segment, segments), checked against CUDA's limits."""
        dims = (_cdiv(self.plan.set_size, tile), programs, self.plan.num_segments)
        _check_grid(*dims)
        return dims


@dataclass(frozen=True)
class Call:
    """What every kernel launch of one forward or backward call shares: the inputs, the mask, the
    dropout, the softmax's scale, the compile-time choices, and the knobs (lowering/tuning.py).

    `operands(branch)` is the run of positional arguments that lowering/triton_kernels.py's
    _fwd_kernel, _bwd_dkdv_kernel and _bwd_dq_kernel all take after their own buffers (that
    module's docstring lists it); `constexprs()` the compile-time arguments they share."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None  # the backward's dO; None in the forward, whose kernel takes none
    mask: torch.Tensor  # q when there is none (never read)
    mask_kind: int  # 0 none, 1 boolean, 2 additive float
    mask_strides: tuple
    seed: torch.Tensor  # q when there is no dropout (never read)
    dropout: bool
    threshold: int
    drop_scale: float
    scale: float
    is_causal: bool
    interpreted: bool
    upcast: bool  # the interpreter's bfloat16 tiles go through float32
    precision: str
    knobs: Tuning

    @property
    def b(self) -> int:
        return self.q.shape[0]

    @property
    def hq(self) -> int:
        return self.q.shape[1]

    @property
    def hkv(self) -> int:
        return self.k.shape[1]

    @property
    def n(self) -> int:
        return self.q.shape[2]

    @property
    def d(self) -> int:
        return self.q.shape[3]

    @property
    def dv(self) -> int:
        return self.v.shape[3]

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    def tiles(self, kind: str) -> TileConfig:
        return tile_config(kind, self.q.device, self.q.dtype, self.d, self.interpreted,
                           self.mask_kind != 0, knobs=self.knobs)

    def branch(self, plan: BranchPlan) -> Branch:
        pos, cnt, strided = _plan_tensors(plan, self.q.device)
        return Branch(plan, pos, cnt, strided)

    def operands(self, br: Branch) -> list:
        tensors = [self.q, self.k, self.v] + ([] if self.dout is None else [self.dout])
        strides = [s for t in tensors for s in t.stride()]
        return [*tensors, br.pos, br.cnt, self.mask, self.seed,
                *strides, *self.mask_strides, *br.pos.stride(), *br.cnt.stride(),
                self.hq, self.hkv, self.n, self.group, br.plan.segment_length,
                br.plan.dilation_rate, self.scale * LOG2E, self.scale, self.threshold,
                self.drop_scale]

    def constexprs(self, br: Branch, **own) -> dict:
        return dict(HEAD_DIM=self.d, HEAD_DIM_V=self.dv, BLOCK_D=_block_d(self.d),
                    BLOCK_DV=_block_d(self.dv), STRIDED=br.strided, CAUSAL=self.is_causal,
                    MASK_KIND=self.mask_kind, DROPOUT=self.dropout, UPCAST=self.upcast,
                    PRECISION=self.precision, **own)


def _call(q, k, v, attn_mask, dropout_p, seed, scale, is_causal, dout=None) -> Call:
    interpreted = _check_device(q)
    _check_inputs(q, k, v)
    b, hq, n, _ = q.shape
    knobs = tuning()
    mask, mask_kind, mstrides = _mask_args(attn_mask, b, hq, n, q)
    seed_t, dropout, threshold, drop_scale = _dropout_args(dropout_p, seed, q)
    upcast = interpreted and q.dtype == torch.bfloat16
    return Call(q, k, v, dout, mask, mask_kind, tuple(mstrides), seed_t, dropout, threshold,
                drop_scale, float(scale), bool(is_causal), interpreted, upcast,
                fp32_precision(q.dtype, interpreted, upcast, knobs), knobs)


# ----------------------------------------------------------------------------- plans


# The backward's epilogues address a head's gradient rows with int32 offsets (fewer spilled
# registers: forward+backward 0.1 to 1.7% faster on an H200 at N = 64K in two runs of three and
# two rounds, BENCHMARKS.md) unless N * BLOCK_D reaches this; tests lower it to run the int64 path.
INT32_OFFSET_LIMIT = 2**31

POSITION_PAD = 256  # the largest BLOCK_M / BLOCK_N: a tile past a set's last may be prefetched

# What the kernels read of each plan, per plan object and device (plans are frozen; most are
# cached by their makers, so this runs once per plan, not per call)
_plan_cache = PlanCache()


def _plan_tensors(plan: BranchPlan, device):
    """(positions, counts, strided) of a plan for the kernels on `device`, made once per plan.

    Strided plans (identity order) reach rows by arithmetic and pass their positions unused.
    Otherwise the positions go as int32, each set padded with 0 (a real row) from its count on,
    to a whole number of POSITION_PAD members plus one more POSITION_PAD: the kernels load a
    tile of positions, and the next tile's ahead of time, without a mask. On an H200 this took
    the Hilbert order's forward at N = 64K from 5.21 to 5.04 ms and from 5.25 to 5.08 ms, timed
    in one process against int64 positions and masked loads (BENCHMARKS.md)."""
    device = torch.device(device)

    def make():
        cnt = plan.counts.to(device)
        pos = plan.positions.to(device)
        if not plan.is_strided:
            r, s, m = pos.shape
            valid = torch.arange(m, device=device) < cnt.unsqueeze(-1)
            padded = torch.zeros(r, s, _cdiv(m, POSITION_PAD) * POSITION_PAD + POSITION_PAD,
                                 dtype=torch.int32, device=device)
            padded[:, :, :m] = torch.where(valid, pos, 0).to(torch.int32)
            pos = padded
        return pos, cnt, plan.is_strided

    return _plan_cache.get(plan, str(device), make)


def _complete(plan: BranchPlan) -> bool:
    """Whether every row is in some set of the plan (False where rows are padding)."""
    return bool(getattr(plan, "complete", True))


def _forward_order(plans):
    """(order, covers): branches with r > 1 first; a complete one with r == 1 (it selects every
    row, so it may write the final result in place) last, when there is one (covers)."""
    last = next((p for p in plans if p.dilation_rate == 1 and _complete(p)), None)
    if last is None:
        return list(plans), False
    rest = [p for p in plans if p is not last]
    return [p for p in rest if p.dilation_rate != 1] + [p for p in rest if p.dilation_rate == 1] \
        + [last], True


_seen_cache: dict = {}


def _selected_rows(plan: BranchPlan, num_heads: int) -> torch.Tensor:
    """[num_heads, N] bool: the positions query head h selects in this branch (offset h % r)."""
    r, n = plan.dilation_rate, plan.seq_len
    pos = plan.positions.reshape(r, -1, plan.set_size)
    valid = torch.arange(plan.set_size, device=pos.device) < plan.counts.unsqueeze(-1)
    pos = torch.where(valid, pos, n)  # past a set's count: column N, dropped below
    sel = torch.zeros(r, n + 1, dtype=torch.bool, device=pos.device)
    sel.scatter_(1, pos.reshape(r, -1), True)
    heads = torch.arange(num_heads, device=sel.device) % r
    return sel[:, :n].index_select(0, heads)


def _seen_rows(before, hq: int, hkv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows [Hq, N], key rows [Hkv, N]) uint8: 1 where a branch of `before` (launched
    earlier) wrote a gradient row, which a later branch adds to; its other rows are not
    initialised. Made once per sequence of plans and head counts (the entry holds the plans, so
    their ids stay theirs while it lives)."""
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
    """Whether the backward must be bitwise repeatable (lowering/tuning.py)."""
    return tuning().deterministic()


# ----------------------------------------------------------------------------- forward


def forward(q, k, v, plans: list[BranchPlan], *, is_causal: bool, attn_mask, scale: float,
            dropout_p: float = 0.0, seed=None):
    """Returns (out [B, Hq, N, Dv] in q.dtype, lse [B, Hq, N] float32, -inf for rows with no key)."""
    call = _call(q, k, v, attn_mask, dropout_p, seed, scale, is_causal)
    b, hq, n, dv = call.b, call.hq, call.n, call.dv
    lse = torch.full((b, hq, n), NEG_INF, dtype=torch.float32, device=q.device)
    if b * hq * n == 0 or not plans:
        return torch.zeros(b, hq, n, dv, dtype=q.dtype, device=q.device), lse
    order, covers = _forward_order(plans)
    out = torch.empty(b, hq, n, dv, dtype=q.dtype, device=q.device)
    single = covers and len(order) == 1
    acc = out if single else torch.empty(b, hq, n, dv, dtype=torch.float32, device=q.device)
    kern = _kernels()
    cfg = call.tiles("fwd")
    for i, plan in enumerate(order):
        first, last = i == 0, covers and i == len(order) - 1
        br = call.branch(plan)
        if gluon_forward.unsupported(q, k, v, plan, is_causal=is_causal, mask_kind=call.mask_kind,
                                     dropout=call.dropout, scale=scale) is None:
            gluon_forward.launch(q, k, v, out, acc, lse, plan, br.pos, is_causal=is_causal,
                                 scale=scale, first=first, last=last)
            continue
        _launch(kern._fwd_kernel, lambda cfg, br=br: br.grid(cfg.block_m, b * hq), cfg, True,
                call, [out, acc, lse, *call.operands(br)],
                call.constexprs(br, FIRST=first, LAST=last, NONNEG_SCALE=scale >= 0))
    if not covers:  # rows no branch selects: out 0 (acc holds nothing there), lse -inf
        out = torch.where((lse > NEG_INF).unsqueeze(-1), acc, 0.0).to(q.dtype)
    return out, lse


# ----------------------------------------------------------------------------- backward


def backward(dout, q, k, v, out, lse, plans: list[BranchPlan], *, is_causal: bool, attn_mask,
             scale: float, dropout_p: float = 0.0, seed=None):
    """Returns (dq, dk, dv) in the inputs' dtypes, given the op's final out and lse."""
    call = _call(q, k, v, attn_mask, dropout_p, seed, scale, is_causal, dout=dout)
    b, hq, hkv, n, d, dv = call.b, call.hq, call.hkv, call.n, call.d, call.dv
    if b * hq * n == 0 or not plans:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kern = _kernels()

    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    pre_m = 16 if call.interpreted else 64
    kern._bwd_preprocess[(_cdiv(n, pre_m), b * hq)](
        out, dout, lse, delta, lse2, *out.stride(), *dout.stride(), hq, n,
        HEAD_DIM_V=dv, BLOCK_DV=_block_d(dv), BLOCK_M=pre_m)

    # The order of the forward: a complete branch with r == 1, if any, runs last and writes dq,
    # dk, dv in the inputs' dtype (it has every row); the ones before add up in float32 buffers
    # that are never zeroed (each launch reads only rows an earlier one wrote: _seen_rows).
    order, covers = _forward_order(plans)
    det = call.knobs.deterministic()
    atomic = call.knobs.atomic_dq and not det
    hopper = [gluon_backward.unsupported(q, k, v, plan, is_causal=is_causal,
                                         mask_kind=call.mask_kind, dropout=call.dropout,
                                         scale=scale, deterministic=det) is None
              for plan in order]
    # dq in a zeroed float32 buffer that the Hopper kernel (and the Triton dK/dV kernel when
    # `atomic`) adds to by atomics, and the Triton dq kernel reads wherever it writes
    dq_zeroed = atomic or any(hopper)
    alone = covers and len(order) == 1  # FIRST and LAST: no float32 buffer at all

    def new(h, dim, dtype=torch.float32, used=True):
        return torch.empty((b, h, n, dim) if used else (0,), dtype=dtype, device=q.device)

    # the gradients in the inputs' dtype, written by the last branch when it covers every row
    # (dq's not when dq is summed in the zeroed buffer), and the float32 sums of the branches
    # before it
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
    wide = n * max(_block_d(d), _block_d(dv)) >= INT32_OFFSET_LIMIT
    kv_cfg, q_cfg = call.tiles("dkdv"), call.tiles("dq")
    group = call.group
    for i, plan in enumerate(order):
        br = call.branch(plan)
        first, last = i == 0, covers and i == len(order) - 1
        seen_q, seen_kv = _seen_rows(order[:i], hq, hkv, q.device) if i else (nothing, nothing)
        if hopper[i]:
            gluon_backward.launch(q, k, v, dout, dq, dk, dvb, grads[1], grads[2], seen_kv, lse2,
                                  delta, plan, br.pos, is_causal=is_causal, scale=scale,
                                  first=first, last=last)
            continue
        classes = min(plan.dilation_rate, group)
        _launch(kern._bwd_dkdv_kernel,
                lambda cfg, br=br, classes=classes: br.grid(cfg.block_n, b * hkv * classes),
                kv_cfg, False, call,
                [dk, dvb, dq, grads[1], grads[2], seen_kv, lse2, delta, *call.operands(br),
                 classes],
                call.constexprs(br, FIRST=first, LAST=last, ONE_HEAD=group <= plan.dilation_rate,
                                ATOMIC_DQ=atomic, WIDE=wide))
        if atomic:
            continue
        _launch(kern._bwd_dq_kernel, lambda cfg, br=br: br.grid(cfg.block_m, b * hq), q_cfg,
                True, call,
                [dq, grads[0], every_q if dq_zeroed else seen_q, lse2, delta, *call.operands(br)],
                call.constexprs(br, FIRST=first and not dq_zeroed, LAST=last and not dq_zeroed,
                                WIDE=wide))
    if not dq_zeroed and covers:
        return tuple(grads)
    if covers:
        return dq.to(q.dtype), grads[1], grads[2]
    # no branch has every row: rows none wrote are 0
    seen_q, seen_kv = _seen_rows(order, hq, hkv, q.device)
    dq = dq if dq_zeroed else torch.where(seen_q[:, :, None] != 0, dq, 0.0)
    return (dq.to(q.dtype), torch.where(seen_kv[:, :, None] != 0, dk, 0.0).to(k.dtype),
            torch.where(seen_kv[:, :, None] != 0, dvb, 0.0).to(v.dtype))
