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
the rows an earlier one wrote, triton_plans.seen_rows), and a complete branch with r == 1 runs
last and writes dq, dk, dv in the inputs' dtype, so no pass converts float32 gradients
afterwards (on an H200 at N = 64K that took forward+backward from 22.3 to 21.8 ms,
BENCHMARKS.md).
Setting HILBERT_FX_TRITON_ATOMIC_DQ=1 folds dQ into the dK/dV kernel with float32 atomics instead
(saves recomputing S and dP, not deterministic); HILBERT_FX_DETERMINISTIC=1 or
torch.use_deterministic_algorithms(True) turn that off again. Those knobs, and every other one,
are read once (lowering/tuning.py).

Plans may hold several sequences in one row (lowering/sequences.py): a set is then partial in
any segment or empty (count 0), and padding rows are in no set (plan.complete is False). The
kernels read each set's count and skip tiles past it, so they run such plans unchanged; only
the choice of which branch writes the final result in place depends on completeness. Sets that
hold several short segments as groups (plan.groups) run the kernels' GROUPED variant, which
masks each row to its group.

On Hopper (compute capability 9.x, Triton 3.6) a branch runs instead on FlashAttention-3's
warp-specialised schedules written in Gluon (lowering/gluon_forward.py says when: head dims 64
and 128, 16-bit types, sets of multiples of 128 members, masks and dropout too): the forward
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
HILBERT_FX_TRITON_FWD, _DKDV, _DQ), shrunk at the first launch if the GPU lacks the resources
(lowering/triton_launch.py). The kernels' positional parameters, shared by all three, are built
by `Call.operands`.

Programs. The host must not set the pace (lowering/triton_launch.py says why), so a call's work
is planned once per configuration: `forward` and `backward` look up a program (`_Forward`,
`_Backward`) by a key of everything that shapes the launches (`_key`: shapes, strides, dtypes,
devices and alignment of the inputs, the plans by identity, mask and dropout layouts, the scale,
the knobs), built on the first call with the checks, the plans' tensors, the Hopper kernels'
eligibility, the tiles, grids and every static argument. A program's steps are
lowering/triton_launch.py's `Launch`es, which name the call's tensors by `Slot` and replay
later launches through Triton's launcher directly. The plans of rows that hold sequences
(lowering/sequences.py) come new with every batch: a program names them by their sizes instead,
and takes their tensors by slot as it takes q, k, v (`_PlanInputs`), so batches of one size
share it. The backward's preprocessing also zeroes the
dq buffer that atomics add to, instead of a separate fill.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from . import gluon_backward, gluon_forward
from .arguments import problem
from .dropout import keep_threshold
from .plans import BranchPlan
from .triton_launch import (ACC, DELTA, DK, DK_FINAL, DOUT, DOUT_G, DQ, DQ_FINAL, DROPOUT_ROWS,
                            DV, DV_FINAL, K, LSE, LSE2, LSE_IN, MASK, NUM_SLOTS, OUT, OUT_IN, Q,
                            SEED, V, Emulated, Launch, Slot, launch_stream)
from .triton_plans import POSITION_PAD  # noqa: F401 - tests/test_op_exact.py imports it here
from .triton_plans import forward_order as _forward_order
from .triton_plans import plan_tensors as _plan_tensors
from .triton_plans import seen_rows as _seen_rows
from .tuning import TileConfig, Tuning, fp32_precision, tile_config, tuning
from .tuning import shrunk as _shrunk  # noqa: F401 - tests/test_op_exact.py imports it from here

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


# ----------------------------------------------------------------------------- a call's arguments


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


def _dropout_args(dropout_p: float, seed, dropout_rows, like: torch.Tensor):
    """(seed, dropout, keep threshold, scale of kept entries, rows, ROWS): `like` stands for the
    tensors a call without dropout, or without dropout_rows, does not pass."""
    if dropout_p <= 0.0:
        return like, False, 0, 1.0, like, False
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed (an int64 0-dim tensor)")
    if seed.device != like.device:
        seed = seed.to(like.device)
    args = seed.reshape(()), True, keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p)
    if dropout_rows is None:
        return (*args, like, False)
    n = like.shape[2]
    if not isinstance(dropout_rows, torch.Tensor):
        got = type(dropout_rows).__name__
    elif dropout_rows.dtype not in (torch.int32, torch.int64) or dropout_rows.shape != (n,):
        got = f"{dropout_rows.dtype} of shape {tuple(dropout_rows.shape)}"
    else:
        return (*args, _on_device(dropout_rows, like.device), True)
    raise ValueError(f"dropout_rows must be an int32 or int64 tensor of shape ({n},), one "
                     f"position per row of q; got {got}")


def _on_device(rows: torch.Tensor, device) -> torch.Tensor:
    """dropout_rows as the kernels read it: on q's device, contiguous (one stride of 1)."""
    return (rows if rows.device == device else rows.to(device)).contiguous()


def _per_call(plan) -> bool:
    """Whether a program takes this plan's tensors from each call rather than keeping them: the
    plans of rows that hold sequences (lowering/sequences.py, `part_of`) come new with every
    batch, of sizes fixed by the rows, so one program serves every batch of a shape; plain rows'
    plans live long (their makers cache them) and are the program's constants."""
    return getattr(plan, "part_of", None) is not None


class _PlanInputs:
    """What a program reads of its per-call plans (`_per_call`), by Slot past the call's own
    (NUM_SLOTS on): each plan's tensors (triton_plans.plan_tensors), the plan itself (for steps
    that call a replacement of the Hopper kernels), and the rows earlier branches wrote
    (triton_plans.seen_rows), filled from the call's plans by `fill`."""

    def __init__(self, plans):
        self.at = {id(p): i for i, p in enumerate(plans)}  # a plan's place in the call's list
        self.count = NUM_SLOTS
        self.tensors, self.plans, self.seen = [], [], []

    def _slot(self, name: str) -> Slot:
        self.count += 1
        return Slot(self.count - 1, name)

    def branch(self, plan) -> tuple:
        """(pos, cnt, groups or None, plan) slots of a per-call plan."""
        i = self.at[id(plan)]
        slots = (self._slot(f"pos{i}"), self._slot(f"cnt{i}"),
                 None if plan.groups is None else self._slot(f"groups{i}"))
        self.tensors.append((i, slots))
        plan_slot = self._slot(f"plan{i}")
        self.plans.append((i, plan_slot))
        return (*slots, plan_slot)

    def seen_rows(self, before, hq: int, hkv: int) -> tuple:
        """(query rows, key rows) slots of triton_plans.seen_rows(before)."""
        slots = (self._slot("seen_q"), self._slot("seen_kv"))
        self.seen.append((tuple(self.at[id(p)] for p in before), hq, hkv, slots))
        return slots

    def fill(self, bufs: list, plans, device) -> None:
        for i, (pos, cnt, groups) in self.tensors:
            t = _plan_tensors(plans[i], device)
            bufs[pos.index], bufs[cnt.index] = t[0], t[1]
            if groups is not None:
                bufs[groups.index] = t[3]
        for i, slot in self.plans:
            bufs[slot.index] = plans[i]
        for before, hq, hkv, (sq, skv) in self.seen:
            bufs[sq.index], bufs[skv.index] = _seen_rows([plans[i] for i in before], hq, hkv,
                                                         device)


@dataclass(frozen=True)
class Branch:
    """One plan as the kernels read it: its positions (int32, padded: triton_plans.plan_tensors)
    and counts on the call's device (or, for a per-call plan, the Slots they fill), whether rows
    are reached by arithmetic instead (STRIDED), and the plan's sizes and the strides of its
    tensors (a program keeps these, not the plan, which its cache holds weakly)."""
    pos: object
    cnt: object
    strided: bool
    segment_length: int
    dilation_rate: int
    set_size: int
    num_segments: int
    pos_strides: tuple
    cnt_strides: tuple
    groups: object = None  # int32 [2, r, S, as pos] (GROUPED), its Slot, or None
    groups_stride: int = 0
    plan_slot: Slot | None = None  # a per-call plan's (for a replacement of the Hopper kernels)

    def grid(self, tile: int, programs: int) -> tuple[int, int, int]:
        """(tiles of a set, programs per segment, segments), checked against CUDA's limits."""
        dims = (_cdiv(self.set_size, tile), programs, self.num_segments)
        _check_grid(*dims)
        return dims


@dataclass(frozen=True)
class Call:
    """What every kernel launch of one forward or backward configuration shares: the inputs of
    the call that built it (for their shapes and strides), the mask, the dropout, the softmax's
    scale, the compile-time choices, and the knobs (lowering/tuning.py).

    `operands(branch)` is the run of positional arguments that lowering/triton_kernels.py's
    _fwd_kernel, _bwd_dkdv_kernel and _bwd_dq_kernel all take after their own buffers (that
    module's docstring lists it), a call's tensors in it as `Slot`s; `constexprs()` the
    compile-time arguments they share."""
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
    dropout_rows: torch.Tensor  # q when dropout hashes the rows themselves (never read)
    hashes_rows: bool  # ROWS: dropout hashes dropout_rows[row], the position a row stands for
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

    def branch(self, plan: BranchPlan, inputs: _PlanInputs | None = None) -> Branch:
        """The Branch of `plan`; a per-call plan's tensors become slots of `inputs`."""
        pos, cnt, strided, groups = _plan_tensors(plan, self.q.device)
        sizes = (plan.segment_length, plan.dilation_rate, plan.set_size, plan.num_segments,
                 pos.stride(), cnt.stride())
        groups_stride = 0 if groups is None else groups.stride(0)
        if _per_call(plan) and inputs is not None:
            pos_slot, cnt_slot, groups_slot, plan_slot = inputs.branch(plan)
            return Branch(pos_slot, cnt_slot, strided, *sizes, groups_slot, groups_stride,
                          plan_slot)
        return Branch(pos, cnt, strided, *sizes, groups, groups_stride)

    def operands(self, br: Branch) -> list:
        tensors = [self.q, self.k, self.v] + ([] if self.dout is None else [self.dout])
        strides = [s for t in tensors for s in t.stride()]
        slots = [Q, K, V] + ([] if self.dout is None else [DOUT])
        grp = br.pos if br.groups is None else br.groups  # pos: never read
        return [*slots, br.pos, br.cnt, grp, MASK if self.mask_kind else Q,
                SEED if self.dropout else Q, DROPOUT_ROWS if self.hashes_rows else Q,
                *strides, *self.mask_strides, *br.pos_strides, *br.cnt_strides,
                br.groups_stride,
                self.hq, self.hkv, self.n, self.group, br.segment_length,
                br.dilation_rate, self.scale * LOG2E, self.scale, self.threshold,
                self.drop_scale]

    def constexprs(self, br: Branch, programs: int, **own) -> dict:
        """`programs`: the second grid dimension of the launch (for the causal order's chunk,
        lowering/triton_kernels.py's _scheduled)."""
        chunk = gluon_forward.chunk_sets((0, programs, br.num_segments), self.is_causal)
        return dict(HEAD_DIM=self.d, HEAD_DIM_V=self.dv, BLOCK_D=_block_d(self.d),
                    BLOCK_DV=_block_d(self.dv), STRIDED=br.strided, CAUSAL=self.is_causal,
                    GROUPED=br.groups is not None,
                    MASK_KIND=self.mask_kind, DROPOUT=self.dropout, ROWS=self.hashes_rows,
                    UPCAST=self.upcast, PRECISION=self.precision, CHUNK=chunk, **own)

    def launch(self, kernel, args: list, constexprs: dict, cfg: TileConfig, grid_of,
               m_multiple_of_n: bool) -> Launch:
        """A Triton kernel's launch with tiles `cfg` (or those that ran before, shrunk)."""
        key = (kernel.__name__, cfg, self.q.device, self.q.dtype,
               tuple(sorted(constexprs.items())))
        return Launch(kernel, args, constexprs, grid_of=grid_of, cfg=cfg,
                       m_multiple_of_n=m_multiple_of_n, cfg_key=key)


def _call(q, k, v, attn_mask, dropout_p, seed, dropout_rows, scale, is_causal,
          dout=None) -> Call:
    interpreted = _check_device(q)
    _check_inputs(q, k, v)
    b, hq, n, _ = q.shape
    knobs = tuning()
    mask, mask_kind, mstrides = _mask_args(attn_mask, b, hq, n, q)
    dropout_args = _dropout_args(dropout_p, seed, dropout_rows, q)
    upcast = interpreted and q.dtype == torch.bfloat16
    return Call(q, k, v, dout, mask, mask_kind, tuple(mstrides), *dropout_args, float(scale),
                bool(is_causal), interpreted, upcast,
                fp32_precision(q.dtype, interpreted, upcast, knobs), knobs)


# ----------------------------------------------------------------------------- programs


class _Programs:
    """The programs built so far, by key (`_key`), the oldest dropped past `limit`. A key names
    its plans by id; an entry holds them weakly and goes when one of them does (so that a later
    plan at the same address never finds it, and a program keeps no plan alive)."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._entries: dict = {}

    def get(self, key):
        hit = self._entries.get(key)
        if hit is None:
            return None
        refs, program = hit
        if any(ref() is None for ref in refs):
            return None
        return program

    def put(self, key, plans, program) -> None:
        entries = self._entries

        def drop(ref, key=key):
            hit = entries.get(key)
            if hit is not None and any(r is ref for r in hit[0]):
                del entries[key]

        entries.pop(key, None)
        while len(entries) >= self.limit:
            del entries[next(iter(entries))]
        entries[key] = (tuple(weakref.ref(p, drop) for p in plans), program)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


_programs = _Programs()


# ----------------------------------------------------------------------------- forward


def _key(kind: str, q, k, v, plans, is_causal, attn_mask, scale, dropout_p, seed, dropout_rows,
         knobs, *more) -> tuple | None:
    """A program's key: what its launches depend on besides the data pointers (`Launch`), i.e.
    the inputs' shapes, strides, dtypes, devices and 16-byte alignment, the plans (by id: an
    entry goes when one of its plans does, `_Programs`; per-call plans by their sizes,
    `_plan_key`), the mask's layout, the dropout's (its
    seed's and dropout_rows'), the scale, the knobs (by id: tuning() returns one object until
    reloaded, and the program keeps it), the float32 matmul precision where it matters, the
    interpreter, and the Hopper path's entry points (tests replace them). None for arguments
    that are not tensors (`_call` says what is wrong)."""
    try:
        mask = None if attn_mask is None else _tensor_key(attn_mask)
        drop = None if not dropout_p > 0.0 else (
            float(dropout_p),
            None if seed is None else (seed.device, seed.dtype, seed.shape, seed.data_ptr() % 16),
            None if dropout_rows is None else _tensor_key(dropout_rows))
        precision = torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None
        return (kind, _tensor_key(q), _tensor_key(k), _tensor_key(v),
                tuple(map(_plan_key, plans)),
                bool(is_causal), float(scale), mask, drop, id(knobs), precision,
                interpreter_active(), gluon_forward.unsupported, gluon_forward._unsupported,
                gluon_forward.launch, *more)
    except (AttributeError, TypeError):
        return None


def _plan_key(plan):
    """A plan in a program's key: its id, or for a per-call plan (`_per_call`) what a program
    built for it reads of it besides its tensors (sizes, completeness, order, groups, part)."""
    if not _per_call(plan):
        return id(plan)
    return (plan.segment_length, plan.dilation_rate, plan.seq_len, plan.positions.shape,
            plan.positions.device, plan.strided, plan.complete, plan.hilbert,
            None if plan.groups is None else plan.groups.shape, plan.part_of)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _program(key, plans, build):
    """The program of `key`, built by build() on its first call. Programs built while a CUDA
    graph is being captured are not kept: the constant tensors they make (the plans' tensors on
    the device, rows seen) would be filled by the graph, not now."""
    program = _programs.get(key) if key is not None else None
    if program is None:
        program = build()
        if key is not None and not (program.device.type == "cuda"
                                    and torch.cuda.is_current_stream_capturing()):
            _programs.put(key, [p for p in plans if not _per_call(p)], program)
    return program


def _call_tensors(bufs: list, b: int, hq: int, n: int, device, attn_mask, dropout_p, seed,
                  dropout_rows) -> None:
    """A call's mask (broadcast as `_mask_args` does), dropout seed and dropout_rows into their
    slots."""
    if attn_mask is not None:
        m = attn_mask.expand(b, hq, n, n)
        bufs[MASK.index] = m.view(torch.uint8) if m.dtype == torch.bool else m
    if dropout_p > 0.0:
        bufs[SEED.index] = (seed if seed.device == device else seed.to(device)).reshape(())
        if dropout_rows is not None:
            bufs[DROPOUT_ROWS.index] = _on_device(dropout_rows, device)


def _gluon_step(module, call: Call, plan: BranchPlan, br: Branch, refs: tuple, dout=None, **kw):
    """The Hopper kernel's launch of one branch (gluon_forward or gluon_backward; `dout`: the dO
    whose layout the backward's launch reads, a contiguous copy's where dO must be copied), or,
    where a test replaced the module's `launch`, a step that calls the replacement."""
    kw.update(is_causal=call.is_causal, scale=call.scale)
    # the forward's out strides, the backward's dk, dv strides: `launch` reads them off tensors
    layouts = {name: kw.pop(name) for name in ("out_strides", "final_strides") if name in kw}
    if module.launch is not module.GENUINE_LAUNCH:
        user = {}  # the call's mask and dropout, as `launch` takes them (slots filled per call)
        if call.mask_kind:
            user["mask"] = MASK
        if call.dropout:
            user.update(seed=SEED, keep_threshold=call.threshold, drop_scale=call.drop_scale)
        if call.hashes_rows:
            user["dropout_rows"] = DROPOUT_ROWS
        return Emulated(module, "launch", [*refs, br.plan_slot or plan, br.pos], {**kw, **user})
    positions = _plan_tensors(plan, call.q.device)[0]  # for its strides (br.pos may be a Slot)
    plan_refs = (br.pos, br.cnt)
    # a launch's own float32 buffer (lse, lse2) stands for the mask, seed, rows it is not given
    user = gluon_forward.user_arguments(
        refs[5] if module is gluon_forward else refs[10],
        call.mask if call.mask_kind else None, call.seed if call.dropout else None,
        call.dropout_rows if call.hashes_rows else None, call.threshold, call.drop_scale,
        refs=(MASK, SEED, DROPOUT_ROWS))
    if module is gluon_forward:
        kernel, grid, args, kwargs = module.prepare(call.q, call.k, call.v, plan, positions,
                                                    refs=refs, plan_refs=plan_refs, user=user,
                                                    **layouts, **kw)
    else:
        kernel, grid, args, kwargs = module.prepare(call.q, call.k, call.v, dout, plan,
                                                    positions, refs=refs, plan_refs=plan_refs,
                                                    user=user, **layouts, **kw)
    return Launch(kernel, args, kwargs, grid)


class _Forward:
    """`forward` for one configuration (`_key`): its launches, made once."""

    def __init__(self, call: Call, plans):
        b, hq, n, dv = call.b, call.hq, call.n, call.dv
        self.knobs = call.knobs  # keeps id(knobs) in the key this program's own
        self.dtype, self.device = call.q.dtype, call.q.device
        self.rows, self.out_shape = (b, hq, n), (b, hq, n, dv)
        # out is [B, N, H, Dv] in memory, as FlashAttention's: a model's output projection
        # reads it as [B, N, H * Dv] without a copy (which cost 0.7 ms of a 32K Llama step)
        out_strides = (n * hq * dv, dv, hq * dv)
        self.empty = b * hq * n == 0 or not plans
        self.steps = []
        self.inputs, self.num_slots = None, NUM_SLOTS
        if self.empty:
            return
        order, final, self.zeroed = _forward_order(plans)
        self.covers = final > 0
        self.single = final == len(order) == 1
        kern = _kernels()
        cfg = call.tiles("fwd")
        inputs = _PlanInputs(plans)
        for i, plan in enumerate(order):
            first, last = i == 0, i >= len(order) - final
            br = call.branch(plan, inputs)
            if gluon_forward.unsupported(call.q, call.k, call.v, plan, is_causal=call.is_causal,
                                         mask_kind=call.mask_kind, dropout=call.dropout,
                                         scale=call.scale,
                                         mask_strides=call.mask_strides) is None:
                self.steps.append(_gluon_step(gluon_forward, call, plan, br,
                                              (Q, K, V, OUT, ACC, LSE), first=first, last=last,
                                              out_strides=out_strides))
                continue
            self.steps.append(call.launch(
                kern._fwd_kernel, [OUT, ACC, LSE, *out_strides, *call.operands(br)],
                call.constexprs(br, b * hq, FIRST=first, LAST=last,
                                NONNEG_SCALE=call.scale >= 0), cfg,
                lambda cfg, br=br: br.grid(cfg.block_m, b * hq), True))
        self.inputs = inputs if inputs.count > NUM_SLOTS else None
        self.num_slots = inputs.count

    def __call__(self, q, k, v, plans, attn_mask, dropout_p, seed, dropout_rows):
        device = self.device
        lse = torch.full(self.rows, NEG_INF, dtype=torch.float32, device=device)
        if self.empty:
            return torch.zeros(self.out_shape, dtype=self.dtype, device=device), lse
        bufs = [None] * self.num_slots
        if self.inputs is not None:
            self.inputs.fill(bufs, plans, device)
        bufs[Q.index], bufs[K.index], bufs[V.index] = q, k, v
        if attn_mask is not None or dropout_p > 0.0:
            _call_tensors(bufs, *self.rows, device, attn_mask, dropout_p, seed, dropout_rows)
        # zeroed: the padding rows, which no branch writes
        b, hq, n, dv = self.out_shape
        out = (torch.zeros if self.zeroed else torch.empty)((b, n, hq, dv), dtype=self.dtype,
                                                             device=device).transpose(1, 2)
        acc = out if self.single else torch.empty(self.out_shape, dtype=torch.float32,
                                                  device=device)
        bufs[OUT.index], bufs[ACC.index], bufs[LSE.index] = out, acc, lse
        stream = launch_stream(device, self.knobs)
        for step in self.steps:
            step(bufs, stream)
        if not self.covers:  # rows no branch selects: out 0 (acc holds nothing there), lse -inf
            out = torch.where((lse > NEG_INF).unsqueeze(-1), acc, 0.0).to(self.dtype)
        return out, lse


def forward(q, k, v, plans: list[BranchPlan], *, is_causal: bool, attn_mask, scale: float,
            dropout_p: float = 0.0, seed=None, dropout_rows=None):
    """Returns (out [B, Hq, N, Dv] in q.dtype, lse [B, Hq, N] float32, -inf for rows with no key).

    dropout_rows ([N] int32 or int64, optional): the position each row stands for in dropout's
    keep bits (lowering/dropout.py hashes positions); by default its row index. The ring passes
    the global positions of a shard's rows, or of the rows it gathered from peers."""
    knobs = tuning()
    key = _key("fwd", q, k, v, plans, is_causal, attn_mask, scale, dropout_p, seed, dropout_rows,
               knobs)
    program = _program(key, plans, lambda: _Forward(
        _call(q, k, v, attn_mask, dropout_p, seed, dropout_rows, scale, is_causal), plans))
    return program(q, k, v, plans, attn_mask, dropout_p, seed, dropout_rows)


# ----------------------------------------------------------------------------- backward


# The backward's epilogues address a head's gradient rows with int32 offsets (fewer spilled
# registers: forward+backward 0.1 to 1.7% faster on an H200 at N = 64K in two runs of three and
# two rounds, BENCHMARKS.md) unless N * BLOCK_D reaches this; tests lower it to run the int64 path.
INT32_OFFSET_LIMIT = 2**31


def deterministic() -> bool:
    """Whether the backward must be bitwise repeatable (lowering/tuning.py)."""
    return tuning().deterministic()


class _Backward:
    """`backward` for one configuration (`_key`, with dO's, out's and lse's layouts, the
    deterministic choice and the int32 offset limit): its buffers and launches, made once.

    The order of the forward: a complete branch with r == 1, if any, runs last and writes dq,
    dk, dv in the inputs' dtype (it has every row); the ones before add up in float32 buffers
    that are never zeroed (each launch reads only rows an earlier one wrote:
    triton_plans.seen_rows). Where dq is summed by atomics (the Hopper kernel's, or the Triton
    dK/dV kernel's when `atomic`) its float32 buffer is zeroed by the preprocessing launch,
    which reads every row anyway."""

    def __init__(self, call: Call, plans, out: torch.Tensor):
        q, k, v = call.q, call.k, call.v
        b, hq, hkv, n, d, dv = call.b, call.hq, call.hkv, call.n, call.d, call.dv
        self.knobs = call.knobs
        self.dtypes, self.device = (q.dtype, k.dtype, v.dtype), q.device
        self.shapes = (q.shape, k.shape, v.shape)
        self.empty = b * hq * n == 0 or not plans
        self.rows = (b, hq, n)
        self.steps = []
        self.inputs, self.num_slots = None, NUM_SLOTS
        if self.empty:
            return
        kern = _kernels()
        det = call.knobs.deterministic()
        atomic = call.knobs.atomic_dq and not det
        order, final, self.zeroed = _forward_order(plans)
        covers = final > 0
        hopper = [gluon_backward.unsupported(q, k, v, plan, is_causal=call.is_causal,
                                             mask_kind=call.mask_kind, dropout=call.dropout,
                                             scale=call.scale, deterministic=det,
                                             mask_strides=call.mask_strides) is None
                  for plan in order]
        # dq in a zeroed float32 buffer that the Hopper kernel (and the Triton dK/dV kernel when
        # `atomic`) adds to by atomics, and the Triton dq kernel reads wherever it writes
        dq_zeroed = atomic or any(hopper)
        alone = covers and len(order) == 1  # FIRST and LAST: no float32 buffer at all
        self.covers, self.dq_zeroed, self.alone = covers, dq_zeroed, alone
        # dk, dv in the layouts of k and v (as torch.empty_like), so that a model's k and v
        # projections take them without a copy, where the last branch runs the Hopper kernel,
        # which writes any layout; the Triton kernels write them contiguous
        self.like_inputs = covers and hopper[-1]
        # the gradients in the inputs' dtype, written by the last branch when it covers every
        # row (dq's not when dq is summed in the zeroed buffer; dk's and dv's made like k, v
        # instead when like_inputs), and the float32 sums of the branches before it; those not
        # written are empty tensors made once
        contiguous_kv = covers and not self.like_inputs
        # dq summed in float32 where every row is covered: cast into q's layout by a launch
        # of its own after the branches (`_cast_dq`), as dk, dv are written in theirs
        self.cast_dq = covers and dq_zeroed
        self.final = [((b, hq, n, d), q.dtype, covers and not dq_zeroed),
                      ((b, hkv, n, d), q.dtype, contiguous_kv),
                      ((b, hkv, n, dv), q.dtype, contiguous_kv)]
        if self.like_inputs:  # the strides torch.empty_like gives, and the kernel is given
            kv_strides = [torch.empty_like(x, device="meta").stride()[:3] for x in (k, v)]
        self.unused = torch.empty(0, dtype=q.dtype, device=q.device)
        # the float32 buffers no caller sees (delta, lse * log2 e, the sums of dk, dv, dq), as
        # views of one allocation: in a training step's backward each allocation costs the
        # autograd thread about 10 us of host time (BENCHMARKS.md, "Host cost per call")
        float32 = [(DELTA, self.rows), (LSE2, self.rows)]
        if not alone:
            float32 += [(DK, (b, hkv, n, d)), (DV, (b, hkv, n, dv))]
        if dq_zeroed or not alone:  # zeroed by the preprocessing launch if dq_zeroed
            float32.append((DQ, (b, hq, n, d)))
        self.views, start = [], 0
        for slot, shape in float32:
            size = math.prod(shape)
            self.views.append((slot.index, start, start + size, shape))
            start += -(-size // 64) * 64  # 256-byte starts: aligned as an allocation's
        self.workspace = start
        nothing = torch.empty(0, dtype=torch.uint8, device=q.device)  # Seen of a FIRST launch
        # the Seen of a Triton dq kernel adding to the zeroed dq: every row (made only if one
        # runs)
        every_q = torch.ones(hq, n, dtype=torch.uint8, device=q.device) \
            if dq_zeroed and not atomic and not all(hopper) else nothing
        wide = n * max(_block_d(d), _block_d(dv)) >= INT32_OFFSET_LIMIT
        pre_m = 16 if call.interpreted else 64  # rows a program of the preprocessing, dq's cast
        self.steps.append(Launch(
            kern._bwd_preprocess,
            [OUT_IN, DOUT, LSE_IN, DELTA, LSE2, DQ, *out.stride(), *call.dout.stride(), hq, n],
            dict(HEAD_DIM_V=dv, BLOCK_DV=_block_d(dv), BLOCK_M=pre_m, HEAD_DIM=d,
                 BLOCK_D=_block_d(d), ZERO_DQ=dq_zeroed),
            (_cdiv(n, pre_m), b * hq)))
        kv_cfg, q_cfg = call.tiles("dkdv"), call.tiles("dq")
        group = call.group
        self.dout_copy = False
        inputs = _PlanInputs(plans)

        def seen_rows(before):  # constants, or slots where a plan comes with each call
            if any(map(_per_call, before)):
                return inputs.seen_rows(before, hq, hkv)
            return _seen_rows(before, hq, hkv, q.device)

        for i, plan in enumerate(order):
            br = call.branch(plan, inputs)
            first, last = i == 0, i >= len(order) - final
            seen_q, seen_kv = seen_rows(order[:i]) if i else (nothing, nothing)
            if hopper[i]:
                copy = gluon_backward.dout_needs_copy(call.dout, plan)
                self.dout_copy |= copy
                final_strides = (*kv_strides[0], *kv_strides[1]) \
                    if last and self.like_inputs else None
                self.steps.append(_gluon_step(
                    gluon_backward, call, plan, br,
                    (Q, K, V, DOUT_G if copy else DOUT, DQ, DK, DV, DK_FINAL, DV_FINAL, seen_kv,
                     LSE2, DELTA), dout=call.dout.contiguous() if copy else call.dout,
                    first=first, last=last, final_strides=final_strides))
                continue
            classes = min(plan.dilation_rate, group)
            self.steps.append(call.launch(
                kern._bwd_dkdv_kernel,
                [DK, DV, DQ, DK_FINAL, DV_FINAL, seen_kv, LSE2, DELTA, *call.operands(br),
                 classes],
                call.constexprs(br, b * hkv * classes, FIRST=first, LAST=last,
                                ONE_HEAD=group <= plan.dilation_rate, ATOMIC_DQ=atomic,
                                WIDE=wide),
                kv_cfg, lambda cfg, br=br, classes=classes: br.grid(cfg.block_n,
                                                                    b * hkv * classes), False))
            if atomic:
                continue
            self.steps.append(call.launch(
                kern._bwd_dq_kernel,
                [DQ, DQ_FINAL, every_q if dq_zeroed else seen_q, LSE2, DELTA,
                 *call.operands(br)],
                call.constexprs(br, b * hq, FIRST=first and not dq_zeroed,
                                LAST=last and not dq_zeroed, WIDE=wide),
                q_cfg, lambda cfg, br=br: br.grid(cfg.block_m, b * hq), True))
        if self.cast_dq:
            q_like = torch.empty_like(q, device="meta").stride()
            self.steps.append(Launch(
                kern._cast_dq, [DQ, DQ_FINAL, *q_like, hq, n],
                dict(HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=pre_m), (_cdiv(n, pre_m), b * hq)))
        self.written = None
        if not covers:  # no branch has every row: rows none wrote are 0
            self.written = seen_rows(order)
        self.inputs = inputs if inputs.count > NUM_SLOTS else None
        self.num_slots = inputs.count

    def __call__(self, dout, q, k, v, out, lse, plans, attn_mask, dropout_p, seed,
                 dropout_rows):
        if self.empty:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        device = self.device
        bufs = [None] * self.num_slots
        if self.inputs is not None:
            self.inputs.fill(bufs, plans, device)
        bufs[Q.index], bufs[K.index], bufs[V.index], bufs[DOUT.index] = q, k, v, dout
        bufs[OUT_IN.index] = out
        bufs[LSE_IN.index] = lse.to(torch.float32).contiguous()
        if self.dout_copy:
            bufs[DOUT_G.index] = dout.contiguous()
        if attn_mask is not None or dropout_p > 0.0:
            _call_tensors(bufs, *self.rows, device, attn_mask, dropout_p, seed, dropout_rows)
        workspace = torch.empty(self.workspace, dtype=torch.float32, device=device)
        for index, start, stop, shape in self.views:
            bufs[index] = workspace[start:stop].view(shape)
        make = torch.zeros if self.zeroed else torch.empty  # zeroed: the padding rows
        grads = [make(shape, dtype=dtype, device=device) if used else self.unused
                 for shape, dtype, used in self.final]
        if self.like_inputs:
            like = torch.zeros_like if self.zeroed else torch.empty_like
            grads[1:] = like(k, dtype=self.dtypes[0]), like(v, dtype=self.dtypes[0])
        if self.cast_dq:  # every row of it written by `_cast_dq`
            grads[0] = torch.empty_like(q, dtype=self.dtypes[0])
        bufs[DQ_FINAL.index], bufs[DK_FINAL.index], bufs[DV_FINAL.index] = grads
        if self.alone:  # one branch, FIRST and LAST: the gradients written in place
            bufs[DK.index], bufs[DV.index] = grads[1:]
            if not self.dq_zeroed:
                bufs[DQ.index] = grads[0]
        dk, dvb, dq = bufs[DK.index], bufs[DV.index], bufs[DQ.index]
        stream = launch_stream(device, self.knobs)
        for step in self.steps:
            step(bufs, stream)
        if self.covers:
            return tuple(grads)
        keep_q, keep_kv = (bufs[w.index] if type(w) is Slot else w for w in self.written)
        keep_q, keep_kv = keep_q[:, :, None] != 0, keep_kv[:, :, None] != 0
        dq = dq if self.dq_zeroed else torch.where(keep_q, dq, 0.0)
        return (dq.to(self.dtypes[0]), torch.where(keep_kv, dk, 0.0).to(self.dtypes[1]),
                torch.where(keep_kv, dvb, 0.0).to(self.dtypes[2]))


def backward(dout, q, k, v, out, lse, plans: list[BranchPlan], *, is_causal: bool, attn_mask,
             scale: float, dropout_p: float = 0.0, seed=None, dropout_rows=None):
    """Returns (dq, dk, dv) in the inputs' dtypes, given the op's final out and lse
    (dropout_rows: as in `forward`)."""
    knobs = tuning()
    try:
        more = (_tensor_key(dout), _tensor_key(out), _tensor_key(lse), knobs.deterministic(),
                INT32_OFFSET_LIMIT, gluon_backward.unsupported, gluon_backward.launch)
    except (AttributeError, TypeError):
        more = None
    key = None if more is None else _key("bwd", q, k, v, plans, is_causal, attn_mask, scale,
                                         dropout_p, seed, dropout_rows, knobs, *more)

    program = _program(key, plans, lambda: _Backward(
        _call(q, k, v, attn_mask, dropout_p, seed, dropout_rows, scale, is_causal, dout=dout),
        plans, out))
    return program(dout, q, k, v, out, lse, plans, attn_mask, dropout_p, seed, dropout_rows)
