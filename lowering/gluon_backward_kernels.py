"""The Hopper backward kernel, in Gluon: FlashAttention-3's backward schedule for one branch (w, r).

lowering/gluon_backward.py decides when it runs and launches it; everything else runs
lowering/triton_kernels.py's _bwd_dkdv_kernel and _bwd_dq_kernel. Written for Triton 3.6's Gluon
on sm_90, beside the forward (lowering/gluon_kernels.py), whose row addressing it shares.

A work item is 128 keys of one selected set (64 for each of two consumers), whose CTA walks the
set's query tiles (BLOCK_M = 64 rows) for every query head of its kv head that selects the set.
At D = 64 the kernel is persistent (one CTA an SM takes items in turn: _bwd_kernel says in which
order), at D = 128 each item has its CTA:

- a producer partition loads an item's keys and values once (and the keys again as two column
  halves [128, D/2], dQ's right-hand operand), then q and dout tiles into rings of STAGES slots
  guarded by `ready` / `empty` mbarriers: TMA boxes of the forward's 2-D views for strided sets
  (a box a tile) and for the Hilbert order's sets made of stride-r runs (a box a run, RUN),
  cp.async through the plan's positions for its other sets;
- two consumer warpgroups, per query tile, with P recomputed from the final lse (lse2 = lse *
  log2 e) and delta = rowsum(dout * out) (lowering/triton_kernels.py's _bwd_preprocess):
      S^T = K_c q^T,  dP^T = V_c dout^T           (asynchronous wgmma from shared memory)
      P^T = exp2(S^T * scale * log2 e - lse2),  dS^T = P^T (dP^T - delta)
      dV_c += P^T dout,  dK_c += dS^T q            (wgmma, P^T from registers)
  and each writes its dS^T into a shared [128, BLOCK_M] tile (dK's product reads it there at
  D = 128, from registers at D = 64: gluon_backward.DS_SHARED_HEAD_D); once both have (an mbarrier),
  consumer c computes dq[:, half c] = dS K[:, half c] over all 128 keys and adds it, times the
  scale, into a float32 dq: where the producer copies by TMA (strided sets, runs) the tile goes
  through shared memory and out by TMA reductions (DQ_BOX: a box of a tile or of a run; 7 to
  12% faster than the atomics at D = 128, as FlashAttention-3 adds its dQ), elsewhere by
  relaxed atomics of four columns a thread (TMA on Hopper cannot scatter rows).
  Five products per (key tile, query tile), as FlashAttention-3 and cuDNN do.

The end of a program adds its dK, dV rows into what the branches launched before left, as
lowering/triton_kernels.py's _add_rows does: float32 buffers DK, DV read only at rows an earlier
branch wrote (Seen), a LAST branch writing DKO, DVO in k's dtype. Key rows of different programs
never overlap within a launch (query heads of a kv head that share an offset h % r are one
program's loop), so dK and dV need no atomics; dq does, and is not bitwise repeatable.
Causal: a key tile's query tiles start at its diagonal; the mask is applied to every tile
(without a branch), though only the diagonal's two hold keys after their query. A user's
mask and dropout: P from the scores with the mask's entries (read while S^T and dP^T run), and
dropout's keep bits drawn as the forward drew them (lowering/gluon_kernels.py).
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma, warpgroup_mma_wait)

from .gluon_kernels import (CONSUMERS, _boxes, _gather_rows, _hashed, _item_index, _keep,
                            _key_positions, _mix32, _mma_layout, _tma_rows, _work)

KEYS = gl.constexpr(64)  # keys a consumer owns; a CTA owns CONSUMERS * KEYS


@builtin
def _tma_add(desc, coord, src, _semantic=None):
    """TMA's reduce-add of a shared tile into global memory at `coord` of desc's view
    (cp.reduce.async.bulk.tensor .add): Triton 3.6's Gluon builds the operation
    (create_async_tma_reduce) but exports no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord,
                                              src.handle)


@gluon.jit
def _tma_producer(q_desc, k_desc, kd_desc, v_desc, do_desc, Pos, q_smem, k_smem, kd_smem, v_smem,
                  do_smem, kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty, k_row, k_col,
                  v_row, v_col, q_row, q_col, q_step_row, q_step_col, do_row, do_col, do_step_row,
                  do_step_col, KCO, VCO, QCO, OCO, pos_set, key_first, t0, n_q, n_heads, it0,
                  item, R: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                  STAGES: gl.constexpr, RUN: gl.constexpr):
    """One warp, TMA (a box a tile for strided sets, a box a run for sets made of runs:
    lowering/gluon_kernels._tma_rows): the CTA's keys and values, then q and dout tiles
    t0 ... n_q - 1 of each of n_heads heads (the next head's rows and columns step by
    q_step_row, q_step_col) into their rings. The keys and values wait for the consumers to be
    done with the item before (kv_empty); the rings run on from it0 (tiles before this item)."""
    kv_bytes: gl.constexpr = _boxes(KEYS, RUN) * (k_desc.block_type.nbytes
                                                  + v_desc.block_type.nbytes)
    kd_bytes: gl.constexpr = _boxes(CONSUMERS * KEYS, RUN) * kd_desc.block_type.nbytes
    mbarrier.wait(kv_empty, (item & 1) ^ 1)
    mbarrier.expect(kv_bar, CONSUMERS * (kv_bytes + kd_bytes))
    for i in gl.static_range(CONSUMERS):
        _tma_rows(k_desc, k_smem.index(i), kv_bar, Pos, pos_set, key_first + i * KEYS, k_row,
                  k_col, KCO, R, KEYS, RUN)
        _tma_rows(v_desc, v_smem.index(i), kv_bar, Pos, pos_set, key_first + i * KEYS, v_row,
                  v_col, VCO, R, KEYS, RUN)
        _tma_rows(kd_desc, kd_smem.index(i), kv_bar, Pos, pos_set, key_first, k_row,
                  k_col + i * (HEAD_D // 2), KCO, R, CONSUMERS * KEYS, RUN)
    it = it0
    for hi in range(n_heads):
        for t in range(t0, n_q):
            slot = it % STAGES
            phase = ((it // STAGES) & 1) ^ 1  # the first round finds every slot free
            mbarrier.wait(q_empty.index(slot), phase)
            mbarrier.expect(q_ready.index(slot), _boxes(BLOCK_M, RUN) * q_desc.block_type.nbytes)
            _tma_rows(q_desc, q_smem.index(slot), q_ready.index(slot), Pos, pos_set, t * BLOCK_M,
                      q_row, q_col, QCO, R, BLOCK_M, RUN)
            mbarrier.wait(do_empty.index(slot), phase)
            mbarrier.expect(do_ready.index(slot),
                            _boxes(BLOCK_M, RUN) * do_desc.block_type.nbytes)
            _tma_rows(do_desc, do_smem.index(slot), do_ready.index(slot), Pos, pos_set,
                      t * BLOCK_M, do_row, do_col, OCO, R, BLOCK_M, RUN)
            it += 1
        q_row += q_step_row
        q_col += q_step_col
        do_row += do_step_row
        do_col += do_step_col


@gluon.jit
def _gather_producer(Q, K, V, DO, Pos, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar, kv_empty,
                     q_ready, q_empty, do_ready, do_empty, k_base, v_base, q_base, q_step, do_base,
                     do_step, k_sn, v_sn, q_sn, do_sn, pos_set, key_first, t0, n_q, n_heads, it0,
                     item,
                     BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                     PW: gl.constexpr):
    """PW warps, cp.async through the plan's positions: the same rings as _tma_producer; every
    thread arrives on a `ready` barrier once its own copies have landed."""
    mbarrier.wait(kv_empty, (item & 1) ^ 1)
    for i in gl.static_range(CONSUMERS):
        _gather_rows(k_smem.index(i), K + k_base, Pos, pos_set + key_first + i * KEYS, k_sn, KEYS,
                     HEAD_D, PW)
        _gather_rows(v_smem.index(i), V + v_base, Pos, pos_set + key_first + i * KEYS, v_sn, KEYS,
                     HEAD_D, PW)
        _gather_rows(kd_smem.index(i), K + k_base + i * (HEAD_D // 2), Pos, pos_set + key_first,
                     k_sn, CONSUMERS * KEYS, HEAD_D // 2, PW)
    async_copy.mbarrier_arrive(kv_bar, increment_count=False)
    it = it0
    for hi in range(n_heads):
        for t in range(t0, n_q):
            slot = it % STAGES
            phase = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(q_empty.index(slot), phase)
            _gather_rows(q_smem.index(slot), Q + q_base, Pos, pos_set + t * BLOCK_M, q_sn, BLOCK_M,
                         HEAD_D, PW)
            async_copy.mbarrier_arrive(q_ready.index(slot), increment_count=False)
            mbarrier.wait(do_empty.index(slot), phase)
            _gather_rows(do_smem.index(slot), DO + do_base, Pos, pos_set + t * BLOCK_M, do_sn,
                         BLOCK_M, HEAD_D, PW)
            async_copy.mbarrier_arrive(do_ready.index(slot), increment_count=False)
            it += 1
        q_base += q_step
        do_base += do_step


@gluon.jit
def _bwd_item(i, tiles, segments, thirds, HKV, GROUP, NUM_CLASSES, R, W, Cnt, stride_co,
              stride_cs, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, PARTIAL: gl.constexpr,
              ONE_HEAD: gl.constexpr, CHUNK: gl.constexpr, THIRD_FIRST: gl.constexpr):
    """(b, g, h, offset, segment, first key, members, first query tile, query tiles, heads) of
    work item i: keys key_first +
    [0, 128) of one set of kv head g, for the query heads h, h + R, ... of its group that share
    the set (n_heads of them). Under CAUSAL a key tile's query tiles start at its diagonal.
    PARTIAL: the set has Cnt[offset, segment] members; an item past them has no query tile
    (n_q = 0)."""
    key_tile, seg, pid = _work(i, tiles, segments, thirds, CAUSAL, CHUNK, THIRD_FIRST)
    cls = pid % NUM_CLASSES
    bg = pid // NUM_CLASSES
    b = bg // HKV
    g = bg % HKV
    h = g * GROUP + cls  # the first query head of the item; the others step by R
    off = h % R
    n_heads = 1 if ONE_HEAD else (GROUP - cls + R - 1) // R  # ONE_HEAD: GROUP <= R
    key_first = key_tile * (CONSUMERS * KEYS)
    if PARTIAL:
        count = gl.load(Cnt + off * stride_co + seg * stride_cs).to(gl.int32)
        n_q = ((count + BLOCK_M - 1) // BLOCK_M) * (key_first < count).to(gl.int32)
    else:
        count = W // R
        n_q = count // BLOCK_M
    t0 = 0
    if CAUSAL:  # query tiles from the key tile's diagonal on
        t0 = key_first // BLOCK_M
    return b, g, h, off, seg, key_first, count, t0, n_q, n_heads


@gluon.jit
def _load_partition(Qx, Kx, KDx, Vx, DOx, Pos, q_smem, k_smem, kd_smem, v_smem, do_smem, kv_bar,
                    kv_empty, q_ready, q_empty, do_ready, do_empty, Table, rounds, items, tiles,
                    segments, thirds, HKV, GROUP, NUM_CLASSES, W, stride_po, stride_ps, Cnt,
                    stride_co, stride_cs, QA, QB, QC, QD, KA, KB, KC, KD, VA, VB, VC, VD,
                    OA, OB, OC, OD, R: gl.constexpr, BLOCK_M: gl.constexpr,
                    HEAD_D: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr,
                    RUN: gl.constexpr, PW: gl.constexpr, CAUSAL: gl.constexpr,
                    PARTIAL: gl.constexpr, ONE_HEAD: gl.constexpr, CHUNK: gl.constexpr,
                    THIRD_FIRST: gl.constexpr, TABLE: gl.constexpr, PERSISTENT: gl.constexpr):
    """The producer partition: for each of the CTA's work items, the copy path of its set and
    where its rows start; the rings run on across items (it: q tiles copied so far)."""
    it = 0
    item = 0
    for j in range(rounds if PERSISTENT else 1):
        i = _item_index(Table, j, items, TABLE)
        b, g, h, off, seg, key_first, count, t0, n_q, n_heads = _bwd_item(
            gl.maximum(i, 0), tiles, segments, thirds, HKV, GROUP, NUM_CLASSES, R, W, Cnt,
            stride_co, stride_cs, BLOCK_M, CAUSAL, PARTIAL, ONE_HEAD, CHUNK, THIRD_FIRST)
        if (i >= 0) & (n_q > t0):
            if GATHER:
                pos_set = off * stride_po + seg * stride_ps
            else:
                pos_set = 0
            if GATHER and RUN == 0:
                _gather_producer(Qx, Kx, Vx, DOx, Pos, q_smem, k_smem, kd_smem, v_smem, do_smem,
                                 kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty,
                                 b.to(gl.int64) * KA + g.to(gl.int64) * KB,
                                 b.to(gl.int64) * VA + g.to(gl.int64) * VB,
                                 b.to(gl.int64) * QA + h.to(gl.int64) * QB, R * QB,
                                 b.to(gl.int64) * OA + h.to(gl.int64) * OB, R * OB,
                                 KC, VC, QC, OC, pos_set, key_first, t0, n_q, n_heads, it, item,
                                 BLOCK_M, HEAD_D, STAGES, PW)
            else:
                if GATHER:  # runs: each box's row and column follow from its first position
                    member = 0
                    o = 0
                else:  # member m of the set is row member + m, its offset's column
                    member = seg * (W // R)
                    o = off
                _tma_producer(Qx, Kx, KDx, Vx, DOx, Pos, q_smem, k_smem, kd_smem, v_smem, do_smem,
                              kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty,
                              b * KA + g * KB + member, o * KD + g * KC, b * VA + g * VB + member,
                              o * VD + g * VC, b * QA + h * QB + member, o * QD + h * QC, R * QB,
                              R * QC, b * OA + h * OB + member, o * OD + h * OC, R * OB, R * OC,
                              KD, VD, QD, OD, pos_set, key_first, t0, n_q, n_heads, it, item, R,
                              BLOCK_M, HEAD_D, STAGES, RUN)
            it += n_heads * (n_q - t0)
            item += 1


@gluon.jit
def _next_pair(hi, t, t0, n_q, n_heads):
    """The (head, query tile) pair after (hi, t) in a consumer's loop (tiles t0 ... n_q - 1 of
    heads 0 ... n_heads - 1), or (hi, t) itself after the last; without branches, which would
    end the asynchronous products in flight around them."""
    t_next = t + 1
    wrap = (t_next >= n_q).to(gl.int32)
    t_next = t_next - wrap * (n_q - t0)
    hi_next = hi + wrap
    past = (hi_next >= n_heads).to(gl.int32)
    return hi_next - past, t_next + past * (t - t_next)


@gluon.jit
def _add_rows(acc, Buf, Final, Seen, seen_idx, krow, cols, final_sn, valid,
              HEAD_D: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr,
              PARTIAL: gl.constexpr):
    """acc (float32 rows krow of a gradient, columns cols: in Buf at krow * HEAD_D, in Final at
    krow * final_sn) plus what the branches launched before left in Buf at the rows Seen marks,
    into Buf, or when LAST into Final in its dtype; PARTIAL: only rows where `valid` holds
    (members of a partial set past its count are no rows). Whole sets keep the unmasked code
    (the masks cost spilled registers at D = 128). Final's offsets are made only once Buf's
    are read: both held at once spilled registers at D = 128."""
    offs = gl.expand_dims(krow * HEAD_D, 1) + cols
    if PARTIAL:
        live = gl.expand_dims(valid, 1) & (offs >= 0)
        if not FIRST:
            seen = gl.expand_dims(gl.load(Seen + seen_idx, mask=valid, other=0) != 0, 1) & live
            acc += gl.load(Buf + offs, mask=seen, other=0.0)
        if LAST:
            gl.store(Final + (gl.expand_dims(krow * final_sn, 1) + cols),
                     acc.to(Final.dtype.element_ty), mask=live)
        else:
            gl.store(Buf + offs, acc, mask=live)
    else:
        if not FIRST:
            seen = gl.expand_dims(gl.load(Seen + seen_idx) != 0, 1) & (offs >= 0)
            acc += gl.load(Buf + offs, mask=seen, other=0.0)
        if LAST:
            gl.store(Final + (gl.expand_dims(krow * final_sn, 1) + cols),
                     acc.to(Final.dtype.element_ty))
        else:
            gl.store(Buf + offs, acc)


@gluon.jit
def _consume_item(q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, dq_smem, kv_bar, kv_empty,
                  q_ready, q_empty, do_ready, do_empty, ds_bar, DQx, DQ, DK, DV, DKO, DVO, Seen,
                  Lse2, Delta, Pos, qk_scale, sm_scale, q_head_row, q_head_step, kv_head_row,
                  dko_base, dko_sn, dvo_base, dvo_sn, seen_row, set_row, pos_set, key_first, t0,
                  n_q, n_heads, count, Mask, MH, MQ, MK, Seed, Rows, b, h, keep_threshold,
                  drop_scale, it0, item, R: gl.constexpr, CID: gl.constexpr, NW: gl.constexpr,
                  BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                  GATHER: gl.constexpr, CAUSAL: gl.constexpr, FIRST: gl.constexpr,
                  LAST: gl.constexpr, CP_ASYNC: gl.constexpr, PARTIAL: gl.constexpr,
                  MASK_KIND: gl.constexpr, DROPOUT: gl.constexpr, ROWS: gl.constexpr,
                  DS_SHARED: gl.constexpr, DQ_BOX: gl.constexpr):
    """Keys key_first + CID * KEYS + [0, KEYS) of a work item's set, over query tiles t0 ...
    n_q - 1 of n_heads heads; it0: query tiles the rings held before this item, item: items
    before it (kv_bar's phase; kv_empty frees the keys and values once their last product is
    done, before the epilogue). Flat rows (of a query head in Lse2, Delta, DQ; of the kv head
    in DK, DV): member m of the set is set_row + m * R past the head's first row, or
    Pos[pos_set + m] (GATHER). Offsets within a head are int32 (gluon_backward checks
    N * D < 2**31). CP_ASYNC:
    the rings were written by cp.async, which wgmma reads only after a proxy fence. PARTIAL:
    the set has `count` members; P is 0 for members past it, as queries and as keys, whose
    rows (the plan's padding positions) are neither read back nor written. DKO, DVO: key
    row n of the kv head starts at dko_base + n * dko_sn (dvo_base + n * dvo_sn).
    MASK_KIND (1 boolean, 2 additive): the user's mask, entry (p, p') of query head x at Mask +
    x * MH + p * MQ + p' * MK (Mask at the batch; p * MQ in int32, gluon_forward checks it
    fits). DROPOUT: keep bits hashed from (Seed, b, head, positions; Rows under ROWS), as the
    forward drew them: dV takes the kept P scaled by drop_scale, dP is kept and scaled alike,
    and dS = P (dP - delta). The query heads of the loop are h, h + R, ... DS_SHARED: dK's
    product reads dS^T from the shared tile written for dq's, not from registers. DQ_BOX > 0:
    dq's tile is stored to dq_smem[CID] and added by TMA reductions through DQx (the 2-D view of
    dq, boxes of DQ_BOX rows: a tile of a strided set, or each run of a set made of runs)."""
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_M)         # S^T, dP^T: [KEYS, BLOCK_M]
    acc_layout: gl.constexpr = _mma_layout(NW, HEAD_D)        # dK, dV: [KEYS, HEAD_D]
    dq_layout: gl.constexpr = _mma_layout(NW, HEAD_D // 2)    # a dq half: [BLOCK_M, HEAD_D / 2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    # lse2 and delta are loaded one value a thread and spread over the columns only when used:
    # held in the column layout across the products they spilled registers at D = 128.
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    # Without DQ_BOX, dq is added four columns a thread (red.global.add.v4.f32), half the atomic
    # instructions of wgmma's layout, whose threads hold column pairs: the atomics set the pace
    # of the backward (twice as many made it 27% slower at D = 64), and this layout made it 5
    # to 8% faster at D = 64 and 2 to 5% at D = 128 (H200, BENCHMARKS.md)
    red_l: gl.constexpr = gl.BlockedLayout([1, 4], [256 // HEAD_D, HEAD_D // 8], [NW, 1], [1, 0])
    dq_rows_l: gl.constexpr = gl.SliceLayout(1, red_l)
    k_tile = k_smem.index(CID)
    v_tile = v_smem.index(CID)
    kd_tile = kd_smem.index(CID)
    dk = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_D // 2], gl.float32, dq_layout)
    q_members = gl.arange(0, BLOCK_M, layout=vec_l)
    dq_members = gl.arange(0, BLOCK_M, layout=dq_rows_l)
    dq_cols = gl.expand_dims(CID * (HEAD_D // 2)
                             + gl.arange(0, HEAD_D // 2, layout=gl.SliceLayout(0, red_l)), 0)
    if not GATHER:  # a tile's rows past its first: the same for every tile
        q_offs = q_members * R
        dq_offs = gl.expand_dims(dq_members * (R * HEAD_D), 1) + dq_cols
    keys = key_first + CID * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    # a user's mask or dropout: the keys' positions (fixed), the queries' (a tile's) below
    USER: gl.constexpr = MASK_KIND != 0 or DROPOUT
    # at D = 64 nothing spills with the mask held, and the backward was 1.7% slower so (32K
    # causal, identity order: H100, BENCHMARKS.md)
    KEEP_IN_SIGN: gl.constexpr = DROPOUT and HEAD_D > 64
    if USER:
        kpos = _key_positions(Pos, pos_set, set_row, keys, R, GATHER)
        if MASK_KIND != 0:
            cols = gl.arange(0, BLOCK_M, layout=col_l)
        if MASK_KIND != 0:
            m_keys = gl.expand_dims(kpos.to(gl.int64) * MK, 1)
        if DROPOUT:
            khash = gl.expand_dims(_hashed(Rows, kpos, ROWS), 1)
            seed = gl.load(Seed).to(gl.uint32)
    # A tile's lse2 and delta come from L2 while the tile before runs its products: each
    # iteration loads those of the next (head, tile) pair, and with GATHER the positions of the
    # pair after it, on which they depend. Waiting for them at the top of each iteration
    # stalled the warps for longer than a tile's products take at D = 64 (backward 9% faster);
    # at D = 128 the registers they hold spilled while dq went out by atomics (2% slower), and
    # with dq's TMA reductions it is 1 to 4% faster (H200, BENCHMARKS.md).
    if GATHER:
        pos = gl.load(Pos + pos_set + t0 * BLOCK_M + q_members)
        lse = gl.load(Lse2 + q_head_row + pos)
        dl = gl.load(Delta + q_head_row + pos)
        _, t_n = _next_pair(0, t0, t0, n_q, n_heads)
        pos_n = gl.load(Pos + pos_set + t_n * BLOCK_M + q_members)
    else:
        lse = gl.load(Lse2 + q_head_row + set_row + t0 * (BLOCK_M * R) + q_offs)
        dl = gl.load(Delta + q_head_row + set_row + t0 * (BLOCK_M * R) + q_offs)
    mbarrier.wait(kv_bar, item & 1)
    it = it0
    for hi in range(n_heads):
        head_row = q_head_row + hi * q_head_step
        if MASK_KIND != 0:
            mask_head = Mask + (h + hi * R).to(gl.int64) * MH
        if DROPOUT:  # lowering/gluon_kernels._head_hash, of this head
            head_hash = _mix32(seed ^ _mix32(((b << 16) + h + hi * R).to(gl.uint32)))
        for t in range(t0, n_q):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            if not GATHER:
                tile_row = head_row + set_row + t * (BLOCK_M * R)
            hi_n, t_n = _next_pair(hi, t, t0, n_q, n_heads)  # the last pair's is itself
            next_row = q_head_row + hi_n * q_head_step
            if GATHER:
                lse_n = gl.load(Lse2 + next_row + pos_n)
                dl_n = gl.load(Delta + next_row + pos_n)
                _, t_nn = _next_pair(hi_n, t_n, t0, n_q, n_heads)
                pos_nn = gl.load(Pos + pos_set + t_nn * BLOCK_M + q_members)
            else:
                lse_n = gl.load(Lse2 + next_row + set_row + t_n * (BLOCK_M * R) + q_offs)
                dl_n = gl.load(Delta + next_row + set_row + t_n * (BLOCK_M * R) + q_offs)
            mbarrier.wait(q_ready.index(slot), phase)
            if CP_ASYNC:
                fence_async_shared()
            s_tok = warpgroup_mma(k_tile, q_smem.index(slot).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            if CP_ASYNC:
                fence_async_shared()
            dp_tok = warpgroup_mma(v_tile, do_smem.index(slot).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)
            if MASK_KIND != 0:  # loaded while the products run
                qpos = _key_positions(Pos, pos_set, set_row, t * BLOCK_M + cols, R, GATHER)
                m_val = gl.load(mask_head + m_keys + gl.expand_dims(qpos * MQ, 0))
            if DROPOUT:  # the queries' hashes one a thread, then spread over the columns
                qpos_v = _key_positions(Pos, pos_set, set_row, t * BLOCK_M + q_members, R,
                                        GATHER)
                qhash = gl.convert_layout(_mix32(head_hash ^ _hashed(Rows, qpos_v, ROWS)), col_l)
                keep = _keep(gl.expand_dims(qhash, 0), khash, keep_threshold)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            if MASK_KIND == 2:
                p = gl.exp2(s * qk_scale + m_val.to(gl.float32) * 1.4426950408889634
                            - gl.expand_dims(gl.convert_layout(lse, col_l), 0))
            else:
                p = gl.exp2(s * qk_scale - gl.expand_dims(gl.convert_layout(lse, col_l), 0))
                if MASK_KIND == 1:
                    p = gl.where(m_val != 0, p, 0.0)
            # CAUSAL: keys after their query get nothing. Only the diagonal's two tiles hold
            # such keys, but masking every tile, without a branch, left ptxas fewer registers
            # to spill at D = 128 (strided 100 against 148 bytes, gathered 212 against 340) and
            # the backward 1.7 to 2.2% faster at D = 128, 1% at D = 64 (H200, BENCHMARKS.md)
            # A tile's query index t * BLOCK_M + c is taken as a thread's part (c's bits 1, 2:
            # lane % 4 in wgmma's layout, one value a thread) plus a register's (constants):
            # compared so, the indices take no registers, where 16 a thread, hoisted out of the
            # loop, spilled (D = 128: runs 36 against 116 bytes, gathered 184 against 212); the
            # causal backward 2.3% faster at 16K, 1.8% at 64K (H200, BENCHMARKS.md)
            if CAUSAL or PARTIAL:
                members = gl.arange(0, BLOCK_M, layout=col_l)
                lane = members & 6
                regc = gl.expand_dims(members - lane, 0)
                if CAUSAL:
                    live = gl.expand_dims(keys - t * BLOCK_M, 1) - gl.expand_dims(lane, 0) <= regc
                    if PARTIAL:  # one select: keys past count come after every query
                        live = live & (regc < gl.expand_dims(count - t * BLOCK_M - lane, 0))
                else:
                    live = gl.expand_dims(keys < count, 1) \
                        & gl.expand_dims(t * BLOCK_M + members < count, 0)
                p = gl.where(live, p, 0.0)
            # KEEP_IN_SIGN: the keep bits ride in p's sign from here (an entry with p = 0 adds
            # nothing to dS or dV, kept or not), so that they hold no registers across dP's
            # wait and dS's store: held as a [KEYS, BLOCK_M] mask they spilled 360 bytes at
            # D = 128 (280 in the sign), and dropout's backward is 6% faster there (H100,
            # BENCHMARKS.md)
            if KEEP_IN_SIGN:
                p = gl.where(keep, p, -p)
            dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
            if KEEP_IN_SIGN:
                dp = gl.where(p > 0.0, dp * drop_scale, 0.0)
                p_ds = gl.abs(p)
            else:
                if DROPOUT:
                    dp = gl.where(keep, dp * drop_scale, 0.0)
                p_ds = p
            ds16 = (p_ds * (dp - gl.expand_dims(gl.convert_layout(dl, col_l), 0))).to(dtype)
            buf = it % 2
            ds_tile = ds_smem.index(buf).slice(CID * KEYS, KEYS)
            ds_tile.store(ds16)
            fence_async_shared()
            gl.thread_barrier()  # every thread's dS^T rows stored and fenced before the arrival
            mbarrier.arrive(ds_bar.index(buf), count=1)
            if KEEP_IN_SIGN:
                p = gl.where(p > 0.0, p * drop_scale, 0.0)
            elif DROPOUT:
                p = gl.where(keep, p * drop_scale, 0.0)
            p16 = gl.convert_layout(p.to(dtype), a_layout)
            if not DS_SHARED:
                ds16a = gl.convert_layout(ds16, a_layout)
            dv_tok = warpgroup_mma(p16, do_smem.index(slot), dv, is_async=True)
            dk_tok = warpgroup_mma(ds_tile if DS_SHARED else ds16a, q_smem.index(slot), dk,
                                   is_async=True)
            # whole gathered sets' dq rows, loaded while dK, dV and dq's products run: loaded
            # after dq's wait, the atomics waited for them, and the gathered launches were 1.5
            # to 4.5% slower (H100, BENCHMARKS.md). Partial sets load them there still: early,
            # their spills grew by 32 bytes for no measured gain.
            if GATHER and DQ_BOX == 0 and not PARTIAL:
                dq_pos = gl.load(Pos + pos_set + t * BLOCK_M + dq_members)
            mbarrier.wait(ds_bar.index(buf), (it // 2) & 1)
            dq_tok = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), kd_tile, dq_zero,
                                   use_acc=False, is_async=True)
            if DS_SHARED:
                dv, dk, p16_used = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok, p16))
            else:
                dv, dk, p16_used, ds_used = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok, p16,
                                                                        ds16a))
            mbarrier.arrive(q_empty.index(slot), count=1)
            mbarrier.arrive(do_empty.index(slot), count=1)
            dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
            if DQ_BOX > 0:  # staged in shared memory, added by TMA reductions
                tma.store_wait(0)  # the last tile's reductions have read the staging tile
                gl.thread_barrier()
                dq_tile = dq_smem.index(CID)
                dq_tile.store(dq * sm_scale)
                fence_async_shared()
                gl.thread_barrier()
                if GATHER:  # runs of DQ_BOX members, consecutive rows of the 2-D view
                    for c in gl.static_range(BLOCK_M // DQ_BOX):
                        p = gl.load(Pos + pos_set + t * BLOCK_M + c * DQ_BOX)
                        _tma_add(DQx, [(head_row // R + p // R).to(gl.int32),
                                       (p % R) * HEAD_D + CID * (HEAD_D // 2)],
                                 dq_tile.slice(c * DQ_BOX, DQ_BOX))
                else:  # member m of a tile is row tile_row / R + m of the 2-D view
                    _tma_add(DQx, [(tile_row // R).to(gl.int32),
                                   (set_row % R) * HEAD_D + CID * (HEAD_D // 2)], dq_tile)
            else:  # added by atomics
                dq = gl.convert_layout(dq, red_l)
                if GATHER:
                    if PARTIAL:
                        dq_pos = gl.load(Pos + pos_set + t * BLOCK_M + dq_members)
                    dq_ptrs = DQ + head_row * HEAD_D + (gl.expand_dims(dq_pos * HEAD_D, 1)
                                                        + dq_cols)
                else:
                    dq_ptrs = DQ + tile_row * HEAD_D + dq_offs
                if PARTIAL:
                    dq_live = (gl.expand_dims(t * BLOCK_M + dq_members < count, 1)
                               & (dq_cols >= 0))
                    gl.atomic_add(dq_ptrs, dq * sm_scale, mask=dq_live, sem="relaxed")
                else:
                    gl.atomic_add(dq_ptrs, dq * sm_scale, sem="relaxed")
            lse = lse_n
            dl = dl_n
            if GATHER:
                pos_n = pos_nn
            it += 1
    mbarrier.arrive(kv_empty, count=1)  # the next item's keys and values may load
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    members = key_first + CID * KEYS + gl.arange(0, KEYS, layout=rows_l)
    krow = _key_positions(Pos, pos_set, set_row, members, R, GATHER)
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout)), 0)
    base = kv_head_row * HEAD_D
    if PARTIAL:
        valid = members < count
    else:
        valid = 0
    _add_rows(dk * sm_scale, DK + base, DKO + dko_base, Seen, seen_row + krow, krow, cols,
              dko_sn, valid, HEAD_D, FIRST, LAST, PARTIAL)
    _add_rows(dv, DV + base, DVO + dvo_base, Seen, seen_row + krow, krow, cols, dvo_sn, valid,
              HEAD_D, FIRST, LAST, PARTIAL)


@gluon.jit
def _consumer(q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, dq_smem, kv_bar, kv_empty, q_ready,
              q_empty, do_ready, do_empty, ds_bar, DQx, DQ, DK, DV, DKO, DVO, Seen, Lse2, Delta,
              Pos, qk_scale, sm_scale, Table, rounds, items, tiles, segments, thirds, H, HKV, N,
              GROUP, NUM_CLASSES, W, stride_po, stride_ps, Cnt, stride_co, stride_cs, DKOB, DKOH,
              DKON, DVOB, DVOH, DVON, Mask, MB, MH, MQ, MK, Seed, Rows, keep_threshold, drop_scale,
              R: gl.constexpr, CID: gl.constexpr, NW: gl.constexpr, BLOCK_M: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr,
              CAUSAL: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr, CP_ASYNC: gl.constexpr,
              PARTIAL: gl.constexpr, MASK_KIND: gl.constexpr, DROPOUT: gl.constexpr,
              ROWS: gl.constexpr, ONE_HEAD: gl.constexpr, CHUNK: gl.constexpr, TABLE: gl.constexpr,
              PERSISTENT: gl.constexpr, DS_SHARED: gl.constexpr, DQ_BOX: gl.constexpr):
    """Consumer CID over the CTA's work items (_bwd_item), in the producer's order: where each
    item's rows lie, then _consume_item."""
    it = 0
    item = 0
    for j in range(rounds if PERSISTENT else 1):
        i = _item_index(Table, j, items, TABLE)
        b, g, h, off, seg, key_first, count, t0, n_q, n_heads = _bwd_item(
            gl.maximum(i, 0), tiles, segments, thirds, HKV, GROUP, NUM_CLASSES, R, W, Cnt,
            stride_co, stride_cs, BLOCK_M, CAUSAL, PARTIAL, ONE_HEAD, CHUNK, MASK_KIND != 0)
        if (i >= 0) & (n_q > t0):
            if GATHER:
                pos_set = off * stride_po + seg * stride_ps
            else:
                pos_set = 0
            _consume_item(q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, dq_smem, kv_bar,
                          kv_empty, q_ready, q_empty, do_ready, do_empty, ds_bar, DQx, DQ, DK, DV,
                          DKO, DVO, Seen, Lse2, Delta, Pos, qk_scale, sm_scale,
                          (b * H + h).to(gl.int64) * N, R * N, (b * HKV + g).to(gl.int64) * N,
                          b.to(gl.int64) * DKOB + g.to(gl.int64) * DKOH, DKON,
                          b.to(gl.int64) * DVOB + g.to(gl.int64) * DVOH, DVON, g * N,
                          seg * W + off, pos_set, key_first, t0, n_q, n_heads, count,
                          Mask + b.to(gl.int64) * MB, MH, MQ, MK, Seed, Rows, b, h,
                          keep_threshold, drop_scale, it, item, R, CID, NW, BLOCK_M, HEAD_D,
                          STAGES, GATHER, CAUSAL, FIRST, LAST, CP_ASYNC, PARTIAL, MASK_KIND,
                          DROPOUT, ROWS, DS_SHARED, DQ_BOX)
            it += n_heads * (n_q - t0)
            item += 1
    if DQ_BOX > 0:
        tma.store_wait(0)  # the staging tile stays until its last reduction has read it


@gluon.jit
def _bwd_kernel(Qx, Kx, KDx, Vx, DOx, DQx, DQ, DK, DV, DKO, DVO, Seen, Lse2, Delta, Pos, qk_scale,
                sm_scale, H, HKV, N, GROUP, NUM_CLASSES, W, stride_po, stride_ps, Cnt, stride_co,
                stride_cs,
                QA, QB, QC, QD, KA, KB, KC, KD, VA, VB, VC, VD, OA, OB, OC, OD,
                DKOB, DKOH, DKON, DVOB, DVOH, DVON,
                Mask, MB, MH, MQ, MK, Seed, Rows, keep_threshold, drop_scale,
                TILES, SEGMENTS, THIRDS, Table, ROUNDS,
                R: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                STAGES: gl.constexpr, GATHER: gl.constexpr, CAUSAL: gl.constexpr,
                FIRST: gl.constexpr, LAST: gl.constexpr, ONE_HEAD: gl.constexpr,
                RUN: gl.constexpr, PARTIAL: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                CHUNK: gl.constexpr, num_warps: gl.constexpr, MASK_KIND: gl.constexpr = 0,
                DROPOUT: gl.constexpr = False, ROWS: gl.constexpr = False,
                TABLE: gl.constexpr = False, PERSISTENT: gl.constexpr = True,
                DS_SHARED: gl.constexpr = False, DQ_BOX: gl.constexpr = 0):
    """Persistent, as the forward (lowering/gluon_kernels.py's _fwd_kernel): a 1-D grid of
    CTAs taking ROUNDS work items each (_item_index), item i being (key tile, j, (b, g, cls)) of
    `_work`'s order over the grid (set length / 128, segments, B * HKV * NUM_CLASSES): the key
    tile runs fastest; under CAUSAL the first key tiles (the longest: they meet every query tile
    after them) come first, the sets in chunks of CHUNK. The producer loads the next item's keys
    and values once the consumers' last products with the item before are done, while they add
    its dK, dV rows (the epilogue, whose loads and stores left the tensor cores idle when each
    item had its CTA). Not PERSISTENT: one item a CTA (a grid of them all), the loop compiled
    away.
    Item (tile, j, (b, g, cls)) owns keys tile * 128 + [0, 128) of set j of kv head g with
    offset o = (g * GROUP + cls) % R, for query heads g * GROUP + cls + i * R of the group.

    Strided sets (not GATHER): Qx, Kx, KDx, Vx, DOx are TMA descriptors of the forward's 2-D
    views (lowering/gluon_forward._view) and (A, B, C, D) of q, k, v, dout their (RB, RH, CH,
    CO): member m of set j of head x is row b*RB + x*RH + j*(w/r) + m, column o*CO + x*CH.
    GATHER: member m is at Pos[o, j, m]; the tensors (KDx is Kx) and (A, B, C) their batch, head
    and row strides, or, when RUN > 0 (members in stride-R runs of RUN), descriptors as above
    with boxes of RUN rows. Lse2, Delta, DQ are contiguous over [B, H, N], DK, DV over
    [B, HKV, N] (DKO, DVO, the gradients in k's and v's layouts: element (b, g, n, 0) of DKO at
    b * DKOB + g * DKOH + n * DKON, DVO's likewise), Seen over [HKV, N]. PARTIAL (GATHER,
    RUN == 0): set j of offset o has Cnt[o, j] members (a packed row's plan); items past it
    are skipped. MASK_KIND, DROPOUT, ROWS and their arguments: as the forward's
    (lowering/gluon_kernels.py's _fwd_kernel). DQx: with DQ_BOX > 0 a TMA descriptor of DQ's
    2-D view with boxes [DQ_BOX, D / 2], through which dq's tiles are added; else DQ itself."""
    items = TILES * SEGMENTS * THIRDS
    # the producer copies by cp.async (Qx a tensor; each of its threads arrives) or by TMA
    CP_ASYNC: gl.constexpr = GATHER and RUN == 0
    dtype: gl.constexpr = Qx.dtype.element_ty if CP_ASYNC else Qx.dtype
    arrivals: gl.constexpr = PRODUCER_WARPS * 32 if CP_ASYNC else 1
    if GATHER:
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_D], dtype)
        kd_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CONSUMERS * KEYS, HEAD_D // 2],
                                                                   dtype)
    else:
        q_sl: gl.constexpr = Qx.layout
        k_sl: gl.constexpr = Kx.layout
        kd_sl: gl.constexpr = KDx.layout
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CONSUMERS * KEYS, BLOCK_M], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, KEYS, HEAD_D], k_sl)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, KEYS, HEAD_D], k_sl)
    kd_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, CONSUMERS * KEYS, HEAD_D // 2], kd_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [2, CONSUMERS * KEYS, BLOCK_M], ds_sl)
    if DQ_BOX > 0:  # each consumer's dq tile, staged for its TMA reduction
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, BLOCK_M, HEAD_D // 2],
                                            DQx.layout)
    else:
        dq_smem = ds_smem
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=arrivals)
    mbarrier.init(kv_empty, count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=arrivals)
        mbarrier.init(do_ready.index(i), count=arrivals)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(do_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=CONSUMERS)
    fence_async_shared()

    # Triton 3.6: the argument tuples must be written inline (lowering/gluon_kernels.py)
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, dq_smem, kv_bar,
                     kv_empty, q_ready, q_empty, do_ready, do_empty, ds_bar, DQx, DQ, DK, DV, DKO,
                     DVO, Seen, Lse2, Delta, Pos, qk_scale, sm_scale, Table, ROUNDS, items, TILES,
                     SEGMENTS, THIRDS, H, HKV, N, GROUP, NUM_CLASSES, W, stride_po, stride_ps, Cnt,
                     stride_co, stride_cs, DKOB, DKOH, DKON, DVOB, DVOH, DVON, Mask, MB, MH, MQ,
                     MK, Seed, Rows, keep_threshold, drop_scale, R, 0, num_warps, BLOCK_M, HEAD_D,
                     STAGES, GATHER, CAUSAL, FIRST, LAST, CP_ASYNC, PARTIAL, MASK_KIND, DROPOUT,
                     ROWS, ONE_HEAD, CHUNK, TABLE, PERSISTENT, DS_SHARED, DQ_BOX)),
        (_consumer, (q_smem, k_smem, kd_smem, v_smem, do_smem, ds_smem, dq_smem, kv_bar,
                     kv_empty, q_ready, q_empty, do_ready, do_empty, ds_bar, DQx, DQ, DK, DV, DKO,
                     DVO, Seen, Lse2, Delta, Pos, qk_scale, sm_scale, Table, ROUNDS, items, TILES,
                     SEGMENTS, THIRDS, H, HKV, N, GROUP, NUM_CLASSES, W, stride_po, stride_ps, Cnt,
                     stride_co, stride_cs, DKOB, DKOH, DKON, DVOB, DVOH, DVON, Mask, MB, MH, MQ,
                     MK, Seed, Rows, keep_threshold, drop_scale, R, 1, num_warps, BLOCK_M, HEAD_D,
                     STAGES, GATHER, CAUSAL, FIRST, LAST, CP_ASYNC, PARTIAL, MASK_KIND, DROPOUT,
                     ROWS, ONE_HEAD, CHUNK, TABLE, PERSISTENT, DS_SHARED, DQ_BOX)),
        (_load_partition, (Qx, Kx, KDx, Vx, DOx, Pos, q_smem, k_smem, kd_smem, v_smem, do_smem,
                           kv_bar, kv_empty, q_ready, q_empty, do_ready, do_empty, Table, ROUNDS,
                           items, TILES, SEGMENTS, THIRDS, HKV, GROUP, NUM_CLASSES, W, stride_po,
                           stride_ps, Cnt, stride_co, stride_cs, QA, QB, QC, QD, KA, KB, KC, KD,
                           VA, VB, VC, VD, OA, OB, OC, OD, R, BLOCK_M, HEAD_D, STAGES, GATHER, RUN,
                           PRODUCER_WARPS, CAUSAL, PARTIAL, ONE_HEAD, CHUNK, MASK_KIND != 0,
                           TABLE, PERSISTENT)),
    ], [num_warps, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
