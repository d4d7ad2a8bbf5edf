"""When the Hopper forward kernel (lowering/gluon_kernels.py) runs a branch, and its launch.

The Hopper backward (lowering/gluon_backward.py) runs on the same terms, so its eligibility,
logging and addressing (the 2-D views, runs of stride r) are shared from here.

lowering/triton_lowering.py's forward asks `unsupported(...)` for each branch: None means the
branch runs here, a string says why it runs on lowering/triton_kernels.py instead (logged once
per reason on the "hilbert_fx.lowering" logger, which TORCH_LOGS="hilbert_fx" shows). Both
kernels merge their branches the same way (float32 Acc and Lse), so one call may mix them.

It runs on compute capability 9.x with Triton 3.6 (Gluon's API changes between releases: other
versions run the Triton kernels, with the reason logged), for float16 and bfloat16, head dims 64
and 128 (v's the same), causal or not, a user's mask (boolean or additive, any strides whose
offsets within a head fit int32) or not, dropout or not (not at D = 64: DROPOUT_AT_64), a
scale >= 0 (> 0 when causal),
w / r a multiple of 128, and q, k, v each contiguous or a [B, N, H, D] tensor transposed. Whole
sets (N % w == 0, no padding row: plan.complete) reached by strides (the identity order, or
r == 1 in any order) are read by TMA, and so are the Hilbert order's sets made of runs of stride
r (`plan_run`: its r = 2 sets); its others by cp.async through the plan's positions. Partial
sets (`partial_sets`: packed documents, padding, N % w != 0 in either order) are gathered by
cp.async too, each set's count read by the kernel (a ring shard's sets among them).
HILBERT_FX_GLUON=0 turns the Hopper kernels off, HILBERT_FX_GLUON_RUNS=0 the TMA copies of runs
(both read once: lowering/tuning.py).

The kernels are persistent (one CTA an SM taking work items in turn; the backward at D = 64
only): `persistent_schedule` gives a launch its grid and, for causal launches, whose items
differ in work, the order made once on the host in which each CTA takes them.

Whether a plan qualifies is decided from its fields, without reading its counts on the host (a
synchronisation with the GPU). A qualifying plan's runs (`plan_run`) come from its order's table
on the host (plans.class_members) when the plan names its order, as the plans of one row and of
packed rows do; another has its positions read, once per plan object.
"""
from __future__ import annotations

import logging

import torch

from . import plans
from .triton_plans import plan_tensors
from .tuning import PlanCache, tuning

log = logging.getLogger("hilbert_fx.lowering")

LOG2E = 1.4426950408889634
CTA_ROWS = 128  # two consumers of BLOCK_M = 64 query rows
BLOCK_N = 128
_TILES = {64: dict(BLOCK_M=64, BLOCK_N=BLOCK_N, STAGES=3), 128: dict(BLOCK_M=64, BLOCK_N=BLOCK_N, STAGES=2)}
# warps and registers of the partitions: two consumers of one warpgroup each, and a producer of one
# warp issuing TMA copies, or of four warps issuing cp.async ones. The cp.async producer reads a
# tile's positions once, before its wait; then four warps at 40 registers took 4% (D = 128) and
# 6 to 7% (D = 64) fewer cycles than two at 56 (the r = 4 and 8 Hilbert branches at N = 64K, ncu
# on an H200, git show f7b4958:BENCHMARKS.md)
_TMA_PRODUCER = dict(PRODUCER_WARPS=1, PRODUCER_REGS=24, CONSUMER_REGS=240, num_warps=4)
# causal launches run in chunks of up to this many sets, the longest tiles first (gluon_kernels'
# _work; 1: grid order). In a list-scheduling model of 132 SMs, grid order left the last
# wave 3% (256 sets a launch) to 26% (32 sets) over the balanced time, chunks of 16 sets 1 to 3%.
CHUNK_SETS = 16


def chunk_sets(grid, is_causal: bool) -> int:
    """The chunk of `_work` for a launch over `grid` (tiles, segments, third): the largest
    power of two up to CHUNK_SETS that divides the number of sets (a constant divisor in the
    kernel); 1 where the tiles are alike (not causal), which reads nothing of it."""
    if not is_causal:
        return 1
    sets, chunk = grid[1] * grid[2], 1
    while chunk * 2 <= CHUNK_SETS and sets % (chunk * 2) == 0:
        chunk *= 2
    return chunk
_GATHER_PRODUCER = dict(PRODUCER_WARPS=4, PRODUCER_REGS=40, CONSUMER_REGS=232, num_warps=4)
# under a boolean mask at D = 64 a consumer also holds the tile's key positions and mask entries
# while S is in flight: at 232 registers it spilled 104 bytes, at 240 (two producer warps) none,
# and its forward took 0.966 of the time (16K, Hilbert order, H100; BENCHMARKS.md). At D = 128
# (112 bytes against 28) the two producer warps made it 1.2% slower.
_MASKED_GATHER_PRODUCER = dict(PRODUCER_WARPS=2, PRODUCER_REGS=40, CONSUMER_REGS=240,
                               num_warps=4)

_kernels = None
_import_error: str | None = None


TESTED_TRITON = ("3.6.",)  # Gluon's API changes between releases (3.9 renamed the TMA copies)


def _load():
    """lowering/gluon_kernels.py, imported on first use; None (and the reason kept) if it cannot be."""
    global _kernels, _import_error
    if _kernels is None and _import_error is None:
        import triton
        if not triton.__version__.startswith(TESTED_TRITON):
            _import_error = (f"Triton {triton.__version__}: the Hopper kernel is written for the Gluon "
                             f"of Triton {', '.join(v + 'x' for v in TESTED_TRITON)}")
            return None
        try:
            from . import gluon_kernels
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
            _kernels = gluon_kernels
        except Exception as e:  # noqa: BLE001 - any Triton without this Gluon API
            _import_error = f"Triton's Gluon lacks the Hopper API this kernel uses ({type(e).__name__}: {e})"
    return _kernels


def _view(x: torch.Tensor, r: int):
    """(2-D view [rows, r * row_length], RB, RH, CH, CO) of x [B, Hx, N, D], or None: member m of
    set j of head hx, offset o, is row b*RB + hx*RH + j*(w/r) + m, columns o*CO + hx*CH + [0, D)."""
    b, hx, n, d = x.shape
    if x.is_contiguous():
        return x.view(b * hx * n // r, r * d), hx * n // r, n // r, 0, d
    if x.transpose(1, 2).is_contiguous():  # [B, N, H, D] seen as [B, H, N, D]
        return x.transpose(1, 2).reshape(b * n // r, r * hx * d), n // r, 0, d, hx * d
    return None


def _descriptor(x: torch.Tensor, r: int, box: list[int]):
    """(TMA descriptor of x's 2-D view with boxes `box`, (RB, RH, CH, CO) of the view: _view)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    view, *row_col = _view(x, r)
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                torch.float32: gl.float32}[x.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl_dtype)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), box, layout), row_col


class Descriptor:
    """A launch argument standing for the TMA descriptor of a call's tensor (`source`, a stand-in
    that the launcher replaces by the tensor) seen as the 2-D view of `_view` with boxes `box`.

    `make(x)` builds the descriptor as `launch` always did (layout, validation, the view).
    `rebase(x)` is the same descriptor for another tensor of the same shape, strides, dtype and
    16-byte alignment, made without that work: the fields of the first descriptor made, with
    only the base changed. The base is x itself rather than its view: the view starts at x's
    first element, and a launch reads of the base only its data pointer (Triton 3.6's
    make_tensordesc_arg). lowering/triton_launch.py uses `rebase` only for launches that skip
    Triton's argument binding, whose configuration (hence shape, strides, box) is the first
    launch's; the first descriptor's base is not kept (it would keep that call's tensor alive).

    `expanded(x)`: what Triton's launcher passes the kernel for the descriptor of x (the encoded
    CUtensorMap, shape and strides: `expand`, set by the lowering from Triton's own function),
    kept by data pointer, the only input that changes between launches of one configuration:
    the caching allocator hands the same addresses back step after step, and a tensor map made
    for an address stays valid for any tensor of this geometry there."""
    __slots__ = ("source", "r", "box", "_fields", "expand", "_expanded")

    MAPS = 256  # addresses kept per descriptor (a model's layers each bring theirs)

    def __init__(self, source, r: int, box: list[int]):
        self.source, self.r, self.box = source, r, box
        self._fields = self.expand = None
        self._expanded: dict = {}

    def make(self, x: torch.Tensor):
        desc, _ = _descriptor(x, self.r, self.box)
        if self._fields is None:
            self._fields = dict(vars(desc), base=None)
        return desc

    def rebase(self, x: torch.Tensor):
        desc = object.__new__(_descriptor_class())
        desc.__dict__.update(self._fields)
        desc.base = x
        return desc

    def expanded(self, x: torch.Tensor) -> list:
        ptr = x.data_ptr()
        hit = self._expanded.get(ptr)
        if hit is None:
            if len(self._expanded) >= self.MAPS:
                self._expanded.clear()
            hit = self._expanded[ptr] = self.expand(self.rebase(x))
        return hit


def _descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor


def partial_sets(plan) -> bool:
    """Whether the plan's sets may hold fewer than w / r members (packed rows, padding, N % w
    != 0): the kernels then read each set's count and gather its members by cp.async."""
    return not plans.whole_sets(plan)


def set_tiles(plan, rows: int) -> int:
    """Programs along a set for tiles of `rows` members: w / r / rows for whole sets; for partial
    ones, enough for the plan's slots (a ring's folded cross plan has sets of 2048 slots in a
    segment of w = 131072, r = 1: w / r would launch 64 times the programs, all but 1/64 ending
    at once)."""
    slots = plan.set_size if partial_sets(plan) else plan.segment_length // plan.dilation_rate
    return -(-slots // rows)


RUN_LENGTHS = (64, 32, 16, 8)  # boxes of at least 8 rows keep the 128-byte swizzle's alignment


# the run length of each plan the Hopper kernels launched: found by reading its positions on the
# host, which waits for the GPU, so once per plan object
_runs = PlanCache()


def plan_run(plan) -> int:
    """The longest RUN_LENGTHS entry L such that every L consecutive members of every set
    (from member 0 on) are a stride-r run of positions p, p + r, ..., p + (L-1) r, which TMA
    copies as one box of the 2-D view; 0 for none, for strided plans, or when
    HILBERT_FX_GLUON_RUNS=0. Found once per plan (`_runs`).
    Hilbert's r = 2 sets are a checkerboard of its grid, so each grid row's members are such a
    run: at N = 64K, L = 32 for w = 4096 (a 64-wide grid); r = 4 and 8 have none."""
    if plan.is_strided or not tuning().gluon_runs or partial_sets(plan):
        return 0
    return _runs.get(plan, None, lambda: _longest_run(plan))


def _longest_run(plan) -> int:
    r, m = plan.dilation_rate, plan.set_size
    if plan.hilbert is not None and plans.whole_sets(plan):
        # every set is a segment's first row plus its class's in-segment positions: the runs
        # are the table's, found on the host without reading positions from the GPU (a packed
        # batch's plans are new each batch, and each read would wait for the GPU)
        pos = plans.class_members(plan.segment_length, r, plan.hilbert)
    else:
        pos = plan.positions
    for length in RUN_LENGTHS:
        if m % length == 0:
            chunks = pos.reshape(r, -1, m // length, length)
            steps = torch.arange(length, device=pos.device) * r
            if bool((chunks - chunks[..., :1] == steps).all()):
                return length
    return 0


_logged: set = set()


def _note(reason: str | None, plan, what: str = "forward") -> str | None:
    """Logs, once per pass, reason and branch, which kernel runs `what` (forward or backward)."""
    key = (what, reason, plan.segment_length, plan.dilation_rate)
    if key not in _logged and len(_logged) < 256:
        _logged.add(key)
        if log.parent is not None and log.parent.name == "hilbert_fx":
            # torch._logging's set-up can leave its handler on the registered log twice (as
            # hilbert_fx/logs.py notes), which printed every line twice
            del log.parent.handlers[1:]
        where = f"branch ({plan.segment_length}, {plan.dilation_rate})"
        if reason is None:
            log.info("%s %s: Hopper kernel (Gluon)", where, what)
        else:
            log.info("%s %s: Triton kernel, not the Hopper one: %s", where, what, reason)
    return reason


def kernel_choices() -> list[str]:
    """What this process's forwards and backwards ran, one line per branch, pass and reason
    (for benchmark tables)."""
    return sorted(f"({w}, {r}) {what}: " + ("Hopper kernel (Gluon)" if reason is None
                                             else f"Triton kernel ({reason})")
                  for what, reason, w, r in _logged)


def unsupported(q, k, v, plan, *, is_causal: bool, mask_kind: int, dropout: bool,
                scale: float, mask_strides=(0, 0, 0, 0)) -> str | None:
    """None when the Hopper kernel can run this branch, else why not (mask_strides: those of
    the mask broadcast to [B, H, N, N])."""
    reason = _unsupported(q, k, v, plan, is_causal, mask_kind, dropout, scale, mask_strides)
    if reason is None and dropout and q.shape[-1] == 64:
        reason = DROPOUT_AT_64
    return _note(reason, plan)


# With dropout the forward's keep bits (an integer hash an entry) outweigh its products at
# D = 64, and there the Triton forward ran at the floor's speed where the Hopper one did not
# (H200, 16 heads, p = 0.1: 1.47 against 1.89 ms at 16K in the Hilbert order, 1.75 against
# 2.33 ms at 32K causal; at D = 128 the Hopper one is faster, 1.97 against 2.20 and 2.53
# against 2.68 ms; BENCHMARKS.md). The backward runs the Hopper kernel at either.
DROPOUT_AT_64 = "dropout at head dim 64 (the Triton forward hashes the keep bits faster there)"


_capabilities: dict = {}


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, asked once per device (it does not change)."""
    hit = _capabilities.get(device)
    if hit is None:
        hit = _capabilities[device] = torch.cuda.get_device_capability(device)
    return hit


def _unsupported(q, k, v, plan, is_causal, mask_kind, dropout, scale,
                 mask_strides=(0, 0, 0, 0)) -> str | None:
    if not tuning().gluon:
        return "HILBERT_FX_GLUON=0"
    if q.device.type != "cuda" or _capability(q.device)[0] != 9:
        return "not a compute capability 9.x GPU"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}"
    d = q.shape[-1]
    if d not in _TILES or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dims {d}/{v.shape[-1]} (runs 64 and 128, v's equal to q's)"
    if mask_kind and (q.shape[2] - 1) * max(abs(x) for x in mask_strides[2:]) >= 2**31:
        return "the mask's offsets within a head reach 2**31 (int32 in the kernels)"
    if scale < 0 or (is_causal and scale == 0):
        return "negative scale (or zero, causal)"
    reason = _sets_unsupported(q, k, v, plan)
    if reason is None and _load() is None:
        return _import_error
    return reason


def _sets_unsupported(q, k, v, plan) -> str | None:
    """Why the kernels cannot read this plan's sets from q, k, v as laid out, or None."""
    n, w, r = plan.seq_len, plan.segment_length, plan.dilation_rate
    if getattr(plan, "groups", None) is not None:
        return "several sequences' short segments in one set (groups: the Triton kernels mask them)"
    if (w // r) % CTA_ROWS:
        return f"w / r not a multiple of {CTA_ROWS}"
    partial = partial_sets(plan)
    if set_tiles(plan, CTA_ROWS) * plan.num_segments * q.shape[0] * q.shape[1] >= 2**31:
        return "2**31 work items or more (tiles * segments * batch * heads: int32 in the kernels)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.data_ptr() % 16 or (x.stride(-1) != 1 if partial else _view(x, r) is None):
            return f"{name}'s layout (neither contiguous nor [B, N, H, D] transposed, or unaligned)"
        if partial and x.stride(2) * x.element_size() % 16:
            return f"{name}'s rows are not 16-byte aligned (cp.async copies 16 bytes)"
        if (partial or not plan.is_strided) and n * x.stride(2) >= 2**31:
            return f"{name}'s rows lie 2**31 elements apart or more (int32 offsets of the gather)"
    return None


def launch(q, k, v, out, acc, lse, plan, positions, *, is_causal: bool, scale: float, first: bool,
           last: bool, mask=None, seed=None, dropout_rows=None, keep_threshold: int = 0,
           drop_scale: float = 1.0) -> None:
    """One branch into (out, acc, lse) as lowering/triton_kernels.py's _fwd_kernel would; out
    [B, H, N, D] with unit column stride, acc contiguous [B, H, N, D], lse contiguous [B, H, N].
    Strided sets are read by TMA, others through `positions` (int32 [r, segments, >= w / r],
    lowering/triton_plans.plan_tensors). mask: boolean (as uint8) or float, [B, H, N, N] by
    strides; seed (int64, 0-dim): dropout, with keep_threshold and drop_scale
    (lowering/dropout.py), hashing dropout_rows[p] for row p if given."""
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    user = user_arguments(lse, mask, seed, dropout_rows, keep_threshold, drop_scale)
    kernel, grid, args, kwargs = prepare(q, k, v, plan, positions, is_causal=is_causal,
                                         scale=scale, first=first, last=last,
                                         refs=(q, k, v, out, acc, lse),
                                         out_strides=out.stride()[:3], user=user)
    kernel[grid](*[a.make(a.source) if isinstance(a, Descriptor) else a for a in args], **kwargs)


def user_arguments(unused, mask, seed, dropout_rows, keep_threshold: int, drop_scale: float,
                   refs=None) -> tuple:
    """((mask, MB, MH, MQ, MK, seed, rows, keep_threshold, drop_scale), constexprs) of a call
    with a user's mask (boolean as uint8, or float) and / or dropout, as the Hopper kernels
    take them; refs stand for (mask, seed, dropout_rows) in the arguments (a lowering's slots),
    else the tensors. `unused` (a tensor or slot of the launch's own) stands for what is not
    given, never read."""
    mask_ref, seed_ref, rows_ref = refs or (mask, seed, dropout_rows)
    kind = 0 if mask is None else (1 if mask.dtype == torch.uint8 else 2)
    strides = (0, 0, 0, 0) if mask is None else mask.stride()
    args = (mask_ref if kind else unused, *strides, seed_ref if seed is not None else unused,
            rows_ref if dropout_rows is not None else unused, keep_threshold, drop_scale)
    return args, dict(MASK_KIND=kind, DROPOUT=seed is not None, ROWS=dropout_rows is not None)


GENUINE_LAUNCH = launch  # lowering/triton_lowering.py calls `launch` itself when tests replace it


def prepare(q, k, v, plan, positions, *, is_causal: bool, scale: float, first: bool, last: bool,
            refs, plan_refs=None, out_strides=None, user=None) -> tuple:
    """(kernel, grid, positional arguments, keyword arguments) of `launch`, where refs stand for
    (q, k, v, out, acc, lse) in the arguments (the tensors themselves, or a lowering's stand-ins
    for a call's tensors) and a TMA descriptor is a `Descriptor` of its tensor's stand-in. q, k,
    v give shapes, strides and dtype only; so do positions and the plan's counts where plan_refs
    (positions, counts) stand for them in the arguments (a program's slots of a per-call plan).
    out_strides: out's batch, head and row strides (None: contiguous). user: a mask's and
    dropout's arguments (`user_arguments`; None: neither)."""
    kern = _load()
    q_ref, k_ref, v_ref, out, acc, lse = refs
    b, hq, n, d = q.shape
    w, r = plan.segment_length, plan.dilation_rate
    tiles = _TILES[d]
    run = plan_run(plan)
    partial = partial_sets(plan)
    work = (set_tiles(plan, CTA_ROWS), plan.num_segments, b * hq)  # _work's grid of items
    counts = plan_tensors(plan, q.device)[1]
    user_args, user_kinds = user or user_arguments(lse, None, None, None, 0, 1.0)
    if (plan.is_strided or run) and not partial:
        tensors, coords = [], []
        for x, ref, rows in ((q, q_ref, tiles["BLOCK_M"]), (k, k_ref, tiles["BLOCK_N"]),
                             (v, v_ref, tiles["BLOCK_N"])):
            tensors.append(Descriptor(ref, r, [run or rows, d]))
            coords += _view(x, r)[1:]
        regs = dict(GATHER=not plan.is_strided, RUN=run, **_TMA_PRODUCER)
    else:
        tensors = [q_ref, k_ref, v_ref]
        coords = [s for x in (q, k, v) for s in (*x.stride()[:3], 0)]
        producer = (_MASKED_GATHER_PRODUCER if user_kinds["MASK_KIND"] == 1 and d == 64
                    else _GATHER_PRODUCER)
        regs = dict(GATHER=True, RUN=0, **producer)
    pos_arg, cnt_arg = plan_refs or (positions, counts)
    out_strides = out_strides or (hq * n * v.shape[-1], n * v.shape[-1], v.shape[-1])
    args = [*tensors, out, acc, lse, pos_arg, scale * LOG2E, hq, n, hq // k.shape[1], r, w,
            positions.stride(0), positions.stride(1), cnt_arg, counts.stride(0), counts.stride(1),
            *coords, *out_strides]
    chunk = chunk_sets(work, is_causal)
    grid, table, rounds = persistent_schedule(
        work, is_causal=is_causal, one_each=partial, chunk=chunk,
        third_first=user_kinds["MASK_KIND"] != 0, ctas=resident_ctas(q.device), device=q.device)
    args += [*user_args, *work, lse if table is None else table, rounds]
    kwargs = dict(FIRST=first, LAST=last, CAUSAL=bool(is_causal), HEAD_D=d, PARTIAL=partial,
                  CHUNK=chunk, TABLE=table is not None, **tiles, **regs, **user_kinds)
    return kern._fwd_kernel, grid, args, kwargs


# per-item overhead of the causal schedule's cost model, in key tiles (start and end of an item)
ITEM_OVERHEAD_TILES = 1.5
_schedules = {}  # (work, chunk, order, ctas, device) -> schedule; at most _SCHEDULES entries
_SCHEDULES = 256


def persistent_schedule(work, *, is_causal: bool, one_each: bool, chunk: int, third_first: bool,
                        ctas: int, device) -> tuple:
    """(grid, table, rounds) of a persistent Hopper kernel (the forward; the backward at D = 64)
    over `work` = (tiles, segments, thirds) items in `_work`'s order, on `ctas` CTAs (one an SM):
    - items alike in work (not causal, whole sets): CTA p takes items p, p + ctas, ...;
    - causal: items differ (rank k of a set meets tiles - k key tiles, or twice as many query
      tiles in the backward), and that static share left SMs idle at the end (D = 128, 16K:
      0.79 against 0.66 ms one CTA an item); the table hands them out as the hardware would,
      each to the CTA that frees first, by the cost model tiles - rank + ITEM_OVERHEAD_TILES
      (list scheduling in the items' order, which keeps the chunks' sets together in L2;
      third_first: a masked launch's order). Made once per (work, chunk, order, ctas).
    - one_each (partial sets, whose items' work depends on counts the host does not read; the
      backward at D = 128): each item has its CTA (grid = items, rounds 1), and the hardware
      hands them out as SMs free up."""
    tiles, segments, thirds = work
    items = tiles * segments * thirds
    if one_each or items <= ctas:
        return (items, ), None, 1
    key = (work, chunk, third_first, ctas, device)
    if not is_causal or (key not in _schedules and device.type == "cuda"
                         and torch.cuda.is_current_stream_capturing()):
        # under a CUDA graph's capture (a program first built there) the table cannot be copied
        # to the GPU: the items go round-robin, which balances them less well, nothing more
        return (ctas, ), None, -(-items // ctas)
    if key not in _schedules:
        if len(_schedules) >= _SCHEDULES:  # programs keep the tables they launch with
            _schedules.clear()
        lists = _list_schedule(items, tiles, thirds, chunk, third_first, ctas)
        rounds = max(len(x) for x in lists)
        table = torch.full((rounds, ctas), -1, dtype=torch.int32)
        for cta, x in enumerate(lists):
            table[:len(x), cta] = torch.tensor(x, dtype=torch.int32)
        _schedules[key] = ((ctas, ), table.to(device), rounds)
    return _schedules[key]


def _list_schedule(items: int, tiles: int, thirds: int, chunk: int, third_first: bool,
                   ctas: int) -> list:
    """Each CTA's items when items 0 ... items - 1, in order, each go to the CTA that frees
    first (the lowest-numbered of those freeing at once), item i keeping its CTA busy for
    tiles - rank(i) + ITEM_OVERHEAD_TILES. The CTAs freeing at one time take the next items
    together: every item ends at least 1 + ITEM_OVERHEAD_TILES after it starts, so none of them
    frees again at that time. About 0.09 s for a branch of 131,072 items (a million tokens,
    16 heads), half the time of a heap operation an item (table included)."""
    import heapq
    period = thirds * tiles if third_first else chunk * tiles  # ranks repeat with this period
    # _work's order; rank 0 is each set's longest item
    cost = [tiles - ((i // thirds) % tiles if third_first else i // chunk) + ITEM_OVERHEAD_TILES
            for i in range(period)]
    lists = [[] for _ in range(ctas)]
    freeing = {0.0: list(range(ctas))}  # time -> the CTAs that free then
    times = [0.0]
    i = 0
    while i < items:
        at = heapq.heappop(times)
        for cta in sorted(freeing.pop(at))[:items - i]:
            lists[cta].append(i)
            end = at + cost[i % period]
            if end in freeing:
                freeing[end].append(cta)
            else:
                freeing[end] = [cta]
                heapq.heappush(times, end)
            i += 1
    return lists


# CTAs of the persistent kernels: one per SM (their registers allow no second), read once a device
_resident = {}


def resident_ctas(device: torch.device) -> int:
    """The persistent kernels' grid: the device's SM count (132 on an H100 SXM, which a CPU
    tensor, only ever launched by tests' stand-ins, is taken for)."""
    key = (device.type, device.index)
    if key not in _resident:
        _resident[key] = (torch.cuda.get_device_properties(device).multi_processor_count
                          if device.type == "cuda" else 132)
    return _resident[key]
