"""When the Hopper backward kernel (lowering/gluon_backward_kernels.py) runs a branch, and its launch.

lowering/triton_lowering.py's backward asks `unsupported(...)` for each branch: None means the
branch's dq, dk, dv come from here, a string says why the Triton kernels compute them instead
(logged once per reason, as the forward's choice is: lowering/gluon_forward.py). A branch runs
here on the same terms as the Hopper forward (compute capability 9.x, Triton 3.6, float16 or
bfloat16, head dims 64 and 128, a user's mask or dropout or neither (dropout at D = 64 too,
where the forward leaves it to the Triton kernel), w / r a multiple of 128 (whole sets, or
partial ones gathered: gluon_forward.partial_sets), q, k, v contiguous or
[B, N, H, D] transposed, N * D and Hkv * N under 2**31), and not when deterministic algorithms
are asked for: dq is added by float32 atomics in an order that varies.
"""
from __future__ import annotations

import torch

from . import gluon_forward
from .triton_plans import plan_tensors

LOG2E = 1.4426950408889634
CTA_KEYS = 128  # two consumers of 64 keys
PERSISTENT_HEAD_D = 64  # head dims up to this run the persistent backward
# from this head dim on, dK += dS^T q reads dS^T from the shared tile that dq's product reads,
# not from registers: at D = 128 the backward ran 3 to 4% faster (fewer registers held across
# the products, 28 against 116 bytes spilled in the strided configuration), at D = 64 3% slower
# (H200, BENCHMARKS.md)
DS_SHARED_HEAD_D = 128
_TILES = dict(BLOCK_M=64, STAGES=2)
# producer: one warp issuing TMA copies, or two issuing cp.async ones; with 40 registers for the
# cp.async producer (232 for consumers) the backward took 13.97 ms against 14.35 with the forward's
# 56/224 at N = 64K in the Hilbert order (H200; git show f7b4958:BENCHMARKS.md)
_TMA_PRODUCER = dict(PRODUCER_WARPS=1, PRODUCER_REGS=24, CONSUMER_REGS=240, num_warps=4)
_GATHER_PRODUCER = dict(PRODUCER_WARPS=2, PRODUCER_REGS=40, CONSUMER_REGS=232, num_warps=4)

_kernels = None


def _load():
    global _kernels
    if _kernels is None:
        from . import gluon_backward_kernels
        _kernels = gluon_backward_kernels
    return _kernels


def unsupported(q, k, v, plan, *, is_causal: bool, mask_kind: int, dropout: bool, scale: float,
                deterministic: bool, mask_strides=(0, 0, 0, 0)) -> str | None:
    """None when the Hopper kernel can run this branch's backward, else why not."""
    reason = gluon_forward._unsupported(q, k, v, plan, is_causal, mask_kind, dropout, scale,
                                        mask_strides)
    n = q.shape[2]
    if reason is None and deterministic:
        reason = "deterministic algorithms asked for (the Hopper kernel adds dq by atomics)"
    elif reason is None and max(q.shape[-1], k.shape[1]) * n >= 2**31:
        reason = "N * D or Hkv * N reaches 2**31 (the kernel's offsets within a head are int32)"
    return gluon_forward._note(reason, plan, "backward")


def launch(q, k, v, dout, dq, dk, dv, dk_final, dv_final, seen, lse2, delta, plan, positions, *,
           is_causal: bool, scale: float, first: bool, last: bool, mask=None, seed=None,
           dropout_rows=None, keep_threshold: int = 0, drop_scale: float = 1.0) -> None:
    """One branch's gradients, as lowering/triton_kernels.py's dK/dV and dq kernels would leave
    them: dq (float32 [B, Hq, N, D], contiguous) gets this branch's share added (by atomics or
    TMA reductions); dk, dv (float32 [B, Hkv, N, D]) or, when `last`, dk_final, dv_final (k's
    dtype, any layout with unit column stride) get the key rows of its sets, plus what earlier
    branches left in dk, dv where `seen` ([Hkv, N] uint8) is set. lse2 = lse * log2 e and
    delta = rowsum(dout * out), contiguous [B, Hq, N]. mask, seed, dropout_rows,
    keep_threshold, drop_scale: those of the forward (gluon_forward.launch)."""
    if dout_needs_copy(dout, plan):
        dout = dout.contiguous()
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    kernel, grid, args, kwargs = prepare(
        q, k, v, dout, plan, positions, is_causal=is_causal, scale=scale, first=first, last=last,
        refs=(q, k, v, dout, dq, dk, dv, dk_final, dv_final, seen, lse2, delta),
        final_strides=(*dk_final.stride()[:3], *dv_final.stride()[:3]),
        user=gluon_forward.user_arguments(lse2, mask, seed, dropout_rows, keep_threshold,
                                          drop_scale))
    kernel[grid](*[a.make(a.source) if isinstance(a, gluon_forward.Descriptor) else a
                   for a in args], **kwargs)


GENUINE_LAUNCH = launch  # lowering/triton_lowering.py calls `launch` itself when tests replace it


def dout_needs_copy(dout, plan) -> bool:
    """Whether dout must be made contiguous first: a layout the 2-D views cannot read, an
    unaligned start, or rows too far apart for the gather's int32 offsets."""
    n = dout.shape[2]
    partial = gluon_forward.partial_sets(plan)
    if partial:  # gathered row by row: rows of 16-byte multiples
        unreadable = dout.stride(-1) != 1 or dout.stride(2) * dout.element_size() % 16 != 0
    else:
        unreadable = gluon_forward._view(dout, plan.dilation_rate) is None
    return (unreadable or dout.data_ptr() % 16 != 0
            or ((partial or not plan.is_strided) and n * dout.stride(2) >= 2**31))


def prepare(q, k, v, dout, plan, positions, *, is_causal: bool, scale: float, first: bool,
            last: bool, refs, plan_refs=None, final_strides=None, user=None) -> tuple:
    """(kernel, grid, positional arguments, keyword arguments) of `launch` for a dout that needs
    no copy, where refs stand for (q, k, v, dout, dq, dk, dv, dk_final, dv_final, seen, lse2,
    delta) in the arguments and a TMA descriptor is a gluon_forward.Descriptor of its tensor's
    stand-in, and plan_refs for (positions, counts) (as gluon_forward.prepare). final_strides:
    the batch, head and row strides of dk_final, then of dv_final (None: contiguous). user: a
    mask's and dropout's arguments (gluon_forward.user_arguments; None: neither)."""
    kern = _load()
    q_ref, k_ref, v_ref, do_ref, *buffers = refs
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    w, r = plan.segment_length, plan.dilation_rate
    group = hq // hkv
    classes = min(r, group)
    work = (gluon_forward.set_tiles(plan, CTA_KEYS), plan.num_segments, b * hkv * classes)
    bm = _TILES["BLOCK_M"]
    run = gluon_forward.plan_run(plan)
    partial = gluon_forward.partial_sets(plan)
    counts = plan_tensors(plan, q.device)[1]
    if (plan.is_strided or run) and not partial:
        tensors, coords = [], []
        for x, ref, box in ((q, q_ref, [run or bm, d]), (k, k_ref, [run or 64, d]),
                            (k, k_ref, [run or CTA_KEYS, d // 2]), (v, v_ref, [run or 64, d]),
                            (dout, do_ref, [run or bm, d])):
            tensors.append(gluon_forward.Descriptor(ref, r, box))
            if box[1] == d:  # the second descriptor of k shares the first's coordinates
                coords += gluon_forward._view(x, r)[1:]
        regs = dict(GATHER=not plan.is_strided, RUN=run, **_TMA_PRODUCER)
    else:
        tensors = [q_ref, k_ref, k_ref, v_ref, do_ref]
        coords = [s for x in (q, k, v, dout) for s in (*x.stride()[:3], 0)]
        regs = dict(GATHER=True, RUN=0, **_GATHER_PRODUCER)
    # dq's tiles of sets the producer copies by TMA (strided, runs) are added by TMA reductions
    # from shared memory rather than by atomics from registers: the backward 5 to 12% faster at
    # D = 128, 2 to 9% at D = 64 causal in the identity order (H200, BENCHMARKS.md). DQ_BOX:
    # the rows of a reduction's box in dq's 2-D view (the forward's _view), or 0 for atomics.
    dq_box = ((run or bm) if (plan.is_strided or run) and not partial
              and b * hq * n // r < 2**31 else 0)
    tensors.append(gluon_forward.Descriptor(buffers[0], r, [dq_box, d // 2]) if dq_box
                   else buffers[0])
    pos_arg, cnt_arg = plan_refs or (positions, counts)
    args = [*tensors, *buffers, pos_arg, scale * LOG2E, scale, hq, hkv, n, group, classes, w,
            positions.stride(0), positions.stride(1), cnt_arg, counts.stride(0), counts.stride(1),
            *coords, *(final_strides or (hkv * n * d, n * d, d) * 2)]
    user_args, user_kinds = user or gluon_forward.user_arguments(buffers[-2], None, None, None,
                                                                 0, 1.0)
    # persistent at D = 64 as the forward (the causal order's items meet 2 * (tiles - rank)
    # query tiles each, the forward's shape of work, so the same schedule serves); at D = 128
    # one item a CTA, as the persistent loop's registers spilled more there and it ran 2 to 4%
    # slower (H200, BENCHMARKS.md)
    chunk = gluon_forward.chunk_sets(work, is_causal)
    persistent = d <= PERSISTENT_HEAD_D
    grid, table, rounds = gluon_forward.persistent_schedule(
        work, is_causal=is_causal, one_each=partial or not persistent, chunk=chunk,
        third_first=user_kinds["MASK_KIND"] != 0,
        ctas=gluon_forward.resident_ctas(q.device), device=q.device)
    args += [*user_args, *work, buffers[-2] if table is None else table, rounds]
    kwargs = dict(R=r, HEAD_D=d, CAUSAL=bool(is_causal), FIRST=first, LAST=last,
                  ONE_HEAD=group <= r, PARTIAL=partial, CHUNK=chunk, TABLE=table is not None,
                  PERSISTENT=persistent, DS_SHARED=d >= DS_SHARED_HEAD_D, DQ_BOX=dq_box,
                  **_TILES, **regs, **user_kinds)
    return kern._bwd_kernel, grid, args, kwargs
