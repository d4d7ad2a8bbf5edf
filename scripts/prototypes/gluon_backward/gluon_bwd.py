"""Prototype: FlashAttention-3-style attention BACKWARD for one dilated branch (w, r), in Gluon (Triton 3.6, sm_90a).

One CTA owns BLOCK_N = 128 keys of one set (identity order: every set strided) and walks every query tile of
the set (BLOCK_M = 64 rows):

- a producer warp loads the CTA's keys and values once by TMA (K and V as two [64, D] boxes, one per consumer;
  K once more as two [128, D/2] column halves for dQ), then Q and dO tiles into a ring of STAGES slots
  (`ready` / `empty` mbarriers, as lowering/gluon_kernels.py's forward);
- two consumer warpgroups own 64 keys each and, per query tile, compute
      S^T  = K_c Q^T                      (wgmma, SS)
      P^T  = exp2(S^T * scale*log2e - lse2[q])
      dP^T = V_c dO^T                     (wgmma, SS)
      dS^T = P^T (dP^T - delta[q])
      dV_c += P^T dO                      (wgmma, P^T from registers)
      dK_c += dS^T Q                      (wgmma, dS^T from registers)
  and write dS^T (bf16) into a shared [128 keys, BLOCK_M] tile (double-buffered); after an mbarrier that both
  consumers arrive on, consumer c computes dQ[:, c*D/2 : (c+1)*D/2] = dS K[:, half c] over all 128 keys
  (wgmma, A = the shared dS^T read transposed, B = K's column half c) and adds it, times `scale`, into a float32
  dQ buffer in global memory by relaxed atomics (Triton 3.6's Gluon has no TMA reduce-add; gl.atomic_add becomes
  atom.global.gpu.relaxed.add.v2.f32). = 5 matrix products per (key tile, query tile), as FA3 / cuDNN.
- at the end each consumer writes its dK (times scale) and dV rows in q's dtype.

Experimental switches (CONFIG / branch_backward overrides; compiled for sm_90a, NOT yet run on a GPU):
  PIPE=1: S^T and dP^T of the next query tile are issued before this tile's dQ adds (spills ~660 B at D=128);
  DQW=1: a fifth partition, one dQ-writer warp, takes each consumer's dQ half through shared memory and adds it
         with atom.global.v4.f32 (FA3's dQ-writer warp, with atomics instead of TMA reduce-add); +32 KB smem.
PIPE=0, DQW=0 (the default) is the kernel the GPU run measured.

Outputs: dq float32 (the atomic accumulator, scale applied) converted to q's dtype by the host, dk and dv in q's
dtype. Rows no set selects (other offsets when r > 1) are zero.
"""
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634
CONSUMERS = gl.constexpr(2)
KEYS = gl.constexpr(64)  # keys per consumer; BLOCK_N = CONSUMERS * KEYS = 128 per CTA

CONFIG = {128: dict(BLOCK_M=64, STAGES=2, PRODUCER_REGS=24, CONSUMER_REGS=240, num_warps=4, PIPE=0, DQW=0, WRITER_REGS=24, CHUNK=8),
          64: dict(BLOCK_M=64, STAGES=2, PRODUCER_REGS=24, CONSUMER_REGS=240, num_warps=4, PIPE=0, DQW=0, WRITER_REGS=24, CHUNK=8)}


@gluon.constexpr_function
def _mma_layout(num_warps, n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _producer(q_desc, k_desc, kd_desc, v_desc, do_desc, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar,
              q_ready, q_empty, do_ready, do_empty, q_row, k_row, col, n_q,
              BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr):
    """One warp. PIPE: one tile more than the set has (tile 0 again), which the pipelined consumers compute
    S^T and dP^T of and drop, so that their loop needs no condition."""
    mbarrier.expect(kv_bar, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                         + kd_desc.block_type.nbytes))
    for i in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [k_row + i * KEYS, col], kv_bar, k_smem.index(i))
        tma.async_copy_global_to_shared(v_desc, [k_row + i * KEYS, col], kv_bar, v_smem.index(i))
        tma.async_copy_global_to_shared(kd_desc, [k_row, col + i * (HEAD_D // 2)], kv_bar, kd_smem.index(i))
    for t in range(n_q + PIPE):
        slot = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1
        if PIPE:
            row = q_row + (t % n_q) * BLOCK_M
        else:
            row = q_row + t * BLOCK_M
        mbarrier.wait(q_empty.index(slot), phase)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(slot), q_smem.index(slot))
        mbarrier.wait(do_empty.index(slot), phase)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(slot), do_smem.index(slot))


@gluon.jit
def _dq_out(dq, ptrs, dq_smem, dq_full, dq_empty, t, CID: gl.constexpr, DQW: gl.constexpr):
    """This consumer's dQ half of query tile t (scaled): relaxed float32 atomics from its own registers (PTX
    atom.global.gpu.relaxed.add.v2.f32), or (DQW) handed to the dQ-writer warp through its shared slot."""
    if DQW:
        mbarrier.wait(dq_empty.index(CID), (t & 1) ^ 1)  # the first round finds the slot free
        dq_smem.index(CID).store(dq)
        gl.thread_barrier()  # all four warps' rows written before the partition arrives
        mbarrier.arrive(dq_full.index(CID), count=1)
    else:
        gl.atomic_add(ptrs, dq, sem="relaxed")


@gluon.jit
def _dq_writer(DQ, dq_smem, dq_full, dq_empty, row0, n_q, R: gl.constexpr, BLOCK_M: gl.constexpr,
               HEAD_D: gl.constexpr, CHUNK: gl.constexpr):
    """One warp: adds each consumer's dQ half [BLOCK_M, D/2] (float32, in shared memory) into DQ by relaxed
    vector atomics, CHUNK rows at a time, then frees the slot (FA3's dQ-writer warp, without TMA reduce)."""
    HALF: gl.constexpr = HEAD_D // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // HALF, HALF // 4], [1, 1], [1, 0])
    offs = (gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout)) * (R * HEAD_D), 1)
            + gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, layout)), 0))
    for t in range(n_q):
        base = DQ + (row0 + t * (BLOCK_M * R)) * HEAD_D
        for c in gl.static_range(2):
            mbarrier.wait(dq_full.index(c), t & 1)
            for i in gl.static_range(BLOCK_M // CHUNK):
                x = dq_smem.index(c).slice(i * CHUNK, CHUNK).load(layout)
                gl.atomic_add(base + (i * CHUNK * R * HEAD_D + c * HALF) + offs, x, sem="relaxed")
            mbarrier.arrive(dq_empty.index(c), count=1)


@gluon.jit
def _consumer(q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready, do_empty,
              ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q, dq_smem, dq_full,
              dq_empty, R: gl.constexpr, CID: gl.constexpr, NW: gl.constexpr, BLOCK_M: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr, DQW: gl.constexpr):
    """Keys key_first + CID * KEYS + [0, KEYS) of the set, over every query tile. row0: flat [B*H*N] row of
    the set's member 0 (int64); member m is row0 + m * R."""
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_M)          # S^T, dP^T: [KEYS, BLOCK_M]
    acc_layout: gl.constexpr = _mma_layout(NW, HEAD_D)         # dK, dV: [KEYS, HEAD_D]
    dq_layout: gl.constexpr = _mma_layout(NW, HEAD_D // 2)     # dQ half: [BLOCK_M, HEAD_D / 2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_tile = k_smem.index(CID)
    v_tile = v_smem.index(CID)
    kd_tile = kd_smem.index(CID)
    dk = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_D // 2], gl.float32, dq_layout)
    # lse2 and delta are prefetched one value a thread and spread over the columns only when used (through
    # shared memory, by convert_layout): 16 registers each held across the products would spill at D = 128.
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    q_off = gl.arange(0, BLOCK_M, layout=vec_l) * R
    dq_offs = (gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout)) * (R * HEAD_D), 1)
               + gl.expand_dims(CID * (HEAD_D // 2)
                                + gl.arange(0, HEAD_D // 2, layout=gl.SliceLayout(0, dq_layout)), 0))
    mbarrier.wait(kv_bar, 0)
    for t in range(n_q):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        qrow = row0 + t * (BLOCK_M * R)
        lse = gl.load(Lse2 + qrow + q_off)
        dl = gl.load(Delta + qrow + q_off)
        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = warpgroup_mma(k_tile, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(v_tile, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale - gl.expand_dims(gl.convert_layout(lse, col_l), 0))
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds16 = (p * (dp - gl.expand_dims(gl.convert_layout(dl, col_l), 0))).to(dtype)
        buf = t % 2
        ds_smem.index(buf).slice(CID * KEYS, KEYS).store(ds16)
        fence_async_shared()
        gl.thread_barrier()  # every thread's dS^T rows written and fenced before the partition arrives
        mbarrier.arrive(ds_bar.index(buf), count=1)
        p16 = gl.convert_layout(p.to(dtype), a_layout)
        ds16a = gl.convert_layout(ds16, a_layout)
        dv_tok = warpgroup_mma(p16, do_smem.index(slot), dv, is_async=True)
        dk_tok = warpgroup_mma(ds16a, q_smem.index(slot), dk, is_async=True)
        mbarrier.wait(ds_bar.index(buf), (t // 2) & 1)
        dq_tok = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), kd_tile, dq_zero, use_acc=False,
                               is_async=True)
        dv, dk, p16_used, ds_used = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok, p16, ds16a))
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
        _dq_out(dq * sm_scale, DQ + qrow * HEAD_D + dq_offs, dq_smem, dq_full, dq_empty, t, CID, DQW)
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    members = key_first + CID * KEYS + gl.arange(0, KEYS, layout=rows_l)
    rows = row0 + members.to(gl.int64) * R
    offs = gl.expand_dims(rows * HEAD_D, 1) + gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout)), 0)
    gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty))
    gl.store(DV + offs, dv.to(DV.dtype.element_ty))


@gluon.jit
def _consumer_pipe(q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready, do_empty,
              ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q, dq_smem, dq_full,
              dq_empty, R: gl.constexpr, CID: gl.constexpr, NW: gl.constexpr, BLOCK_M: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr, DQW: gl.constexpr):
    """Keys key_first + CID * KEYS + [0, KEYS) of the set, over every query tile. row0: flat [B*H*N] row of
    the set's member 0 (int64); member m is row0 + m * R."""
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_M)          # S^T, dP^T: [KEYS, BLOCK_M]
    acc_layout: gl.constexpr = _mma_layout(NW, HEAD_D)         # dK, dV: [KEYS, HEAD_D]
    dq_layout: gl.constexpr = _mma_layout(NW, HEAD_D // 2)     # dQ half: [BLOCK_M, HEAD_D / 2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_tile = k_smem.index(CID)
    v_tile = v_smem.index(CID)
    kd_tile = kd_smem.index(CID)
    dk = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_D // 2], gl.float32, dq_layout)
    # lse2 and delta are prefetched one value a thread and spread over the columns only when used (through
    # shared memory, by convert_layout): 16 registers each held across the products would spill at D = 128.
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    q_off = gl.arange(0, BLOCK_M, layout=vec_l) * R
    dq_offs = (gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout)) * (R * HEAD_D), 1)
               + gl.expand_dims(CID * (HEAD_D // 2)
                                + gl.arange(0, HEAD_D // 2, layout=gl.SliceLayout(0, dq_layout)), 0))
    mbarrier.wait(kv_bar, 0)
    mbarrier.wait(q_ready.index(0), 0)
    s_tok = warpgroup_mma(k_tile, q_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(0), 0)
    dp_tok = warpgroup_mma(v_tile, do_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    for t in range(n_q):  # S^T(t+1), dP^T(t+1) run while the atomics of dQ(t) are issued
        slot = t % STAGES
        nslot = (t + 1) % STAGES
        qrow = row0 + t * (BLOCK_M * R)
        lse = gl.load(Lse2 + qrow + q_off)
        dl = gl.load(Delta + qrow + q_off)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale - gl.expand_dims(gl.convert_layout(lse, col_l), 0))
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds16 = (p * (dp - gl.expand_dims(gl.convert_layout(dl, col_l), 0))).to(dtype)
        buf = t % 2
        ds_smem.index(buf).slice(CID * KEYS, KEYS).store(ds16)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_bar.index(buf), count=1)
        p16 = gl.convert_layout(p.to(dtype), a_layout)
        ds16a = gl.convert_layout(ds16, a_layout)
        dv_tok = warpgroup_mma(p16, do_smem.index(slot), dv, is_async=True)
        dk_tok = warpgroup_mma(ds16a, q_smem.index(slot), dk, is_async=True)
        mbarrier.wait(ds_bar.index(buf), (t // 2) & 1)
        dq_tok = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), kd_tile, dq_zero, use_acc=False,
                               is_async=True)
        mbarrier.wait(q_ready.index(nslot), ((t + 1) // STAGES) & 1)
        s_tok = warpgroup_mma(k_tile, q_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(do_ready.index(nslot), ((t + 1) // STAGES) & 1)
        dp_tok = warpgroup_mma(v_tile, do_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        dv, dk, dq, p16_used, ds_used = warpgroup_mma_wait(2, deps=(dv_tok, dk_tok, dq_tok, p16, ds16a))
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        _dq_out(dq * sm_scale, DQ + qrow * HEAD_D + dq_offs, dq_smem, dq_full, dq_empty, t, CID, DQW)
    s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))  # the extra tile's products, dropped
    mbarrier.arrive(q_empty.index(n_q % STAGES), count=1)
    mbarrier.arrive(do_empty.index(n_q % STAGES), count=1)
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    members = key_first + CID * KEYS + gl.arange(0, KEYS, layout=rows_l)
    rows = row0 + members.to(gl.int64) * R
    offs = gl.expand_dims(rows * HEAD_D, 1) + gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout)), 0)
    gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty))
    gl.store(DV + offs, dv.to(DV.dtype.element_ty))


@gluon.jit
def _bwd_kernel(q_desc, k_desc, kd_desc, v_desc, do_desc, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale,
                H, N, W, RB, RH,
                R: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PIPE: gl.constexpr,
                DQW: gl.constexpr, WRITER_REGS: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    """Grid (set length / 128, segments, B * H). Descriptors over the 2-D views [B*H*N/r, r*D] of contiguous
    [B, H, N, D] tensors: member m of set j of head h (offset o) is row b*RB + h*RH + j*(w/r) + m, columns
    o*D + [0, D). DQ float32 [B, H, N, D] (zeroed), DK, DV [B, H, N, D], Lse2 (lse * log2 e), Delta [B, H, N]."""
    key_tile = gl.program_id(0)
    seg = gl.program_id(1)
    bh = gl.program_id(2)
    b = bh // H
    h = bh % H
    off = h % R
    set_len = W // R
    n_q = set_len // BLOCK_M
    key_first = key_tile * (CONSUMERS * KEYS)
    member0 = b * RB + h * RH + seg * set_len
    col = off * HEAD_D
    row0 = bh.to(gl.int64) * N + seg * W + off
    dtype: gl.constexpr = q_desc.dtype
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CONSUMERS * KEYS, BLOCK_M], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, KEYS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, KEYS, HEAD_D], v_desc.layout)
    kd_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, CONSUMERS * KEYS, HEAD_D // 2], kd_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, CONSUMERS * KEYS, BLOCK_M], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    if DQW:
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, BLOCK_M, HEAD_D // 2],
                                            gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
    else:
        dq_smem = dq_full  # unused
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(do_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=CONSUMERS)
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    fence_async_shared()

    # Triton 3.6: argument tuples written inline (see lowering/gluon_kernels.py)
    if PIPE:
        if DQW:
            gl.warp_specialize([
                (_consumer_pipe, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 0, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_consumer_pipe, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 1, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_producer, (q_desc, k_desc, kd_desc, v_desc, do_desc, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar,
                             q_ready, q_empty, do_ready, do_empty, member0, member0 + key_first, col, n_q, BLOCK_M,
                             HEAD_D, STAGES, PIPE)),
                (_dq_writer, (DQ, dq_smem, dq_full, dq_empty, row0, n_q, R, BLOCK_M, HEAD_D, CHUNK)),
            ], [num_warps, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, WRITER_REGS])
        else:
            gl.warp_specialize([
                (_consumer_pipe, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 0, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_consumer_pipe, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 1, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_producer, (q_desc, k_desc, kd_desc, v_desc, do_desc, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar,
                             q_ready, q_empty, do_ready, do_empty, member0, member0 + key_first, col, n_q, BLOCK_M,
                             HEAD_D, STAGES, PIPE)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        if DQW:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 0, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_consumer, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 1, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_producer, (q_desc, k_desc, kd_desc, v_desc, do_desc, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar,
                             q_ready, q_empty, do_ready, do_empty, member0, member0 + key_first, col, n_q, BLOCK_M,
                             HEAD_D, STAGES, PIPE)),
                (_dq_writer, (DQ, dq_smem, dq_full, dq_empty, row0, n_q, R, BLOCK_M, HEAD_D, CHUNK)),
            ], [num_warps, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, WRITER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 0, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_consumer, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, kv_bar, q_ready, q_empty, do_ready,
                             do_empty, ds_bar, DQ, DK, DV, Lse2, Delta, qk_scale, sm_scale, row0, key_first, n_q,
                             dq_smem, dq_full, dq_empty, R, 1, num_warps, BLOCK_M, HEAD_D, STAGES, DQW)),
                (_producer, (q_desc, k_desc, kd_desc, v_desc, do_desc, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar,
                             q_ready, q_empty, do_ready, do_empty, member0, member0 + key_first, col, n_q, BLOCK_M,
                             HEAD_D, STAGES, PIPE)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- prep (Triton)


@triton.jit
def _prep_kernel(Out, dOut, Lse, Lse2, Delta, n_rows, HEAD_D: tl.constexpr, ROWS: tl.constexpr):
    """delta = rowsum(dout * out) in float32 and lse2 = lse * log2(e), ROWS rows a program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    offs = rows.to(tl.int64)[:, None] * HEAD_D + tl.arange(0, HEAD_D)[None, :]
    o = tl.load(Out + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(dOut + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(Delta + rows, tl.sum(o * do, axis=1), mask=ok)
    tl.store(Lse2 + rows, tl.load(Lse + rows, mask=ok, other=0.0) * 1.4426950408889634, mask=ok)


def prep(out, dout, lse):
    """(lse2, delta), float32 [B, H, N], by one Triton kernel."""
    B, H, N, D = dout.shape
    n = B * H * N
    lse2 = torch.empty(B, H, N, device=dout.device, dtype=torch.float32)
    delta = torch.empty_like(lse2)
    rows = 64
    _prep_kernel[(triton.cdiv(n, rows),)](out.contiguous(), dout, lse.float().contiguous(), lse2, delta, n,
                                          HEAD_D=D, ROWS=rows, num_warps=4)
    return lse2, delta


def torch_prep(out, dout, lse):
    """(lse2, delta) in torch (float32 copies of out and dout: ~1.2 ms at B=1, H=16, N=64K, D=128)."""
    return (lse.float() * LOG2E).contiguous(), (dout.float() * out.float()).sum(-1).contiguous()


# ----------------------------------------------------------------------------- host


def _gl_dtype(dt):
    return gl.bfloat16 if dt == torch.bfloat16 else gl.float16


def block_shapes(d, block_m):
    """(name -> TMA box) of the descriptors."""
    return dict(q=[block_m, d], k=[KEYS.value, d], kd=[CONSUMERS.value * KEYS.value, d // 2], v=[KEYS.value, d],
                do=[block_m, d])


def branch_backward(q, k, v, out, dout, lse, w, r, *, scale=None, dq_dtype=None, fused_prep=False, **over):
    """dq, dk, dv of one branch (w, r), identity order, non-causal, no mask. q, k, v, out, dout: contiguous
    [B, H, N, D] (same H for k, v); lse: float32 [B, H, N] (natural log, of the scaled scores) of this branch.
    Returns dq (q's dtype unless dq_dtype, accumulated in float32), dk, dv (q's dtype).
    fused_prep: delta and lse2 by the Triton kernel _prep_kernel (checked under TRITON_INTERPRET and compiled for
    sm_90a, not yet run on a GPU) instead of torch (what the GPU run measured). over: CONFIG overrides (PIPE, DQW:
    compiled, not yet run on a GPU)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, H, N, D = q.shape
    assert D in CONFIG and N % w == 0 and (w // r) % 128 == 0
    for x in (q, k, v, dout):
        assert x.is_contiguous() and x.shape == q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cfg = dict(CONFIG[D], **over)
    if fused_prep:
        lse2, delta = prep(out, dout, lse)
    else:
        lse2, delta = torch_prep(out, dout, lse)
    dq_acc = torch.zeros(B, H, N, D, device=q.device, dtype=torch.float32)
    alloc = torch.zeros if r > 1 else torch.empty
    dk = alloc(B, H, N, D, device=q.device, dtype=q.dtype)
    dv = alloc(B, H, N, D, device=q.device, dtype=q.dtype)
    gdt = _gl_dtype(q.dtype)
    boxes = block_shapes(D, cfg["BLOCK_M"])
    descs = []
    for name, x in (("q", q), ("k", k), ("kd", k), ("v", v), ("do", dout)):
        view = x.view(B * H * N // r, r * D)
        box = boxes[name]
        descs.append(TensorDescriptor(view, list(view.shape), list(view.stride()), box,
                                      gl.NVMMASharedLayout.get_default_for(box, gdt)))
    grid = ((w // r) // 128, N // w, B * H)
    _bwd_kernel[grid](*descs, dq_acc, dk, dv, lse2, delta, scale * LOG2E, scale, H, N, w, H * N // r, N // r,
                      R=r, HEAD_D=D, **cfg)
    dq = dq_acc if dq_dtype == torch.float32 else dq_acc.to(dq_dtype or q.dtype)
    return dq, dk, dv
