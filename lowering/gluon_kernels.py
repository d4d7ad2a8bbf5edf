"""The Hopper forward kernel, in Gluon: FlashAttention-3's schedule for one branch (w, r) per launch.

lowering/gluon_forward.py decides when it runs and launches it; everything else runs
lowering/triton_kernels.py. Written for Triton 3.6's Gluon (triton.experimental.gluon) on sm_90.

A CTA works through items of 128 query rows of one selected set (two tiles of 64, one per
consumer), persistent: one CTA an SM, taking items in turn (_fwd_kernel says in which order):

- a producer partition copies an item's q rows (once the consumers are done with the item
  before's), then the key and value tiles of its set into rings of STAGES shared-memory slots,
  each slot guarded by a `ready` and an `empty` mbarrier, the rings running on across items;
- two consumer partitions of one warpgroup each run the online softmax over the set for their
  64 rows: S = q k^T and O += P v by asynchronous wgmma (P from registers), with the product
  S(t) = q k(t)^T and O += P(t-1) v(t-1) in flight together while the softmax of tile t waits
  only for S(t) (FlashAttention-3's overlap inside a warpgroup); the two consumers overlap each
  other's softmax with their products.

The producer reaches the rows where they lie, with no copy of q, k, v:
- strided sets (identity order, or any order when r == 1): one warp, TMA boxes. A [B, H, N, D]
  tensor of either layout the op sees (contiguous, or [B, N, H, D] transposed) read as 2-D
  [rows, r * row_length] makes the set's members one column block of consecutive rows
  (gluon_forward._view). Row and column of member m of set j of head `hx` (offset o = h % r):
  row = b * RB + hx * RH + j * (w / r) + m, column = o * CO + hx * CH.
- the Hilbert order's sets made of runs (GATHER, RUN > 0: its r = 2 sets, a checkerboard of the
  curve's grid, are a stride-2 run per grid row): one warp, a TMA box of the same 2-D view a run.
- the Hilbert order's other sets (GATHER): four warps, cp.async of 16 bytes a thread from the rows
  the plan's positions name (Hopper's TMA cannot gather rows). Every producer thread arrives on
  the slot's `ready` barrier when its own copies have landed (cp.async.mbarrier.arrive.noinc),
  and the consumers fence the async proxy before wgmma reads what cp.async wrote.

The end of a program merges its rows into the result of the branches launched before, exactly
as lowering/triton_kernels.py's _fwd_kernel does: by log-sum-exp in float32 through
(Acc [B, H, N, D] float32, Lse [B, H, N]) unless FIRST; a LAST branch writes Out in q's dtype.
The scale is not negative; the structural masks are the causal diagonal, on one key tile per
program, and, for the partial sets of packed rows (PARTIAL: sets of Cnt members, reached
through the plan's positions), the members past a set's count on its last key tile. A user's
mask (MASK_KIND: boolean or additive, read per tile at the members' positions while the
product runs) and dropout (DROPOUT: lowering/dropout.py's hash of each entry's positions, as
the Triton kernels draw it) take the softmax's other path, whose scores are scaled first and
whose rows may have no key at all (_softmax_step_any; such a row's lse is -inf, its output 0).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma, warpgroup_mma_wait)

CONSUMERS = gl.constexpr(2)  # consumer partitions of one warpgroup each; a CTA covers CONSUMERS * BLOCK_M rows


@gluon.constexpr_function
def _mma_layout(num_warps, n):
    """wgmma's accumulator layout for a [*, n] tile over num_warps warps (16 rows a warp)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.constexpr_function
def _copy_layout(num_warps, d):
    """cp.async's layout for [rows, d] tiles: 16 bytes (8 elements) a thread along d."""
    across = d // 8
    return gl.BlockedLayout([1, 8], [32 // across, across], [num_warps, 1], [1, 0])


@gluon.jit
def _gather_rows(dst, base, Pos, first, stride_n, ROWS: gl.constexpr, HEAD_D: gl.constexpr,
                 PW: gl.constexpr):
    """cp.async of rows Pos[first + i] (i < ROWS) of one head, 64 at a time, into dst [ROWS, D]."""
    layout: gl.constexpr = _copy_layout(PW, HEAD_D)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(ROWS // 64):
        pos = gl.load(Pos + first + c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout)))
        offs = gl.expand_dims(pos * stride_n, 1) + gl.expand_dims(cols, 0)
        async_copy.async_copy_global_to_shared(dst.slice(c * 64, 64), base + offs)


@gluon.jit
def _gather_producer(Q, K, V, Pos, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                     v_ready, v_empty, q_base, k_base, v_base, q_sn, k_sn, v_sn, pos_set, q_first,
                     n_tiles, c0, item, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, STAGES: gl.constexpr, PW: gl.constexpr):
    """PW warps, for sets reached through the plan's positions: the same rings as _tma_producer,
    filled by cp.async (Hopper's TMA cannot gather rows); every thread of the partition
    arrives on the slot's `ready` barrier once its own copies have landed."""
    mbarrier.wait(q_empty, (item & 1) ^ 1)
    for i in gl.static_range(CONSUMERS):
        _gather_rows(q_smem.index(i), Q + q_base, Pos, pos_set + q_first + i * BLOCK_M, q_sn,
                     BLOCK_M, HEAD_D, PW)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    layout: gl.constexpr = _copy_layout(PW, HEAD_D)
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout)), 0)
    # (pos_set is added in the loop: a tensor of pos_set + members held across it spilled)
    members = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    for t in range(n_tiles):
        # a key tile's positions serve its value tile too, and they are read before the slot
        # frees (the wait hides their latency): 6 to 8% fewer cycles than reading them after
        # each wait (ncu, r = 4 and 8 at N = 64K)
        slot = (c0 + t) % STAGES
        phase = (((c0 + t) // STAGES) & 1) ^ 1
        pos = gl.expand_dims(gl.load(Pos + pos_set + t * BLOCK_N + members), 1)
        mbarrier.wait(k_empty.index(slot), phase)
        async_copy.async_copy_global_to_shared(k_smem.index(slot),
                                               K + k_base + (pos * k_sn + cols))
        async_copy.mbarrier_arrive(k_ready.index(slot), increment_count=False)
        mbarrier.wait(v_empty.index(slot), phase)
        async_copy.async_copy_global_to_shared(v_smem.index(slot),
                                               V + v_base + (pos * v_sn + cols))
        async_copy.mbarrier_arrive(v_ready.index(slot), increment_count=False)


@gluon.constexpr_function
def _boxes(rows, run):
    """TMA boxes a tile of `rows` set members takes: one, or one per run of `run` members."""
    return rows // run if run else 1


@gluon.jit
def _run_starts(Pos, first, ROWS: gl.constexpr, RUN: gl.constexpr):
    """Pos[first + c * RUN], c < ROWS / RUN: the first positions of the runs of members first ...
    first + ROWS - 1, every one in every thread's registers (read once, before a wait)."""
    layout: gl.constexpr = gl.BlockedLayout([ROWS // RUN], [32], [1], [0])
    return gl.load(Pos + first + gl.arange(0, ROWS // RUN, layout=layout) * RUN)


@gluon.jit
def _tma_rows(desc, dst, bar, Pos, pos_set, member, row0, col0, CO, R, ROWS: gl.constexpr,
              RUN: gl.constexpr, starts=0, STARTS: gl.constexpr = False):
    """TMA copies of set members member ... member + ROWS - 1 into dst [ROWS, D] (the caller
    expects their bytes on bar). RUN == 0, strided sets: one box at row row0 + member of the 2-D
    view, column col0. RUN > 0: every RUN consecutive members are a stride-R run of positions
    p, p + R, ... (p = Pos[pos_set + member + c * RUN], or starts[c] when STARTS: _run_starts),
    which are consecutive rows of the 2-D view: one box each, at row row0 + p // R, column
    col0 + (p % R) * CO."""
    if RUN == 0:
        tma.async_copy_global_to_shared(desc, [row0 + member, col0], bar, dst)
    else:
        for c in gl.static_range(ROWS // RUN):
            if STARTS:  # a register of each thread: the select folds away
                p = gl.sum(gl.where(gl.arange(0, ROWS // RUN, layout=starts.type.layout) == c,
                                    starts, 0), axis=0)
            else:
                p = gl.load(Pos + pos_set + member + c * RUN)
            tma.async_copy_global_to_shared(desc, [row0 + p // R, col0 + (p % R) * CO], bar,
                                            dst.slice(c * RUN, RUN))


@gluon.jit
def _tma_producer(q_desc, k_desc, v_desc, Pos, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                  k_empty, v_ready, v_empty, q_row, q_col, k_row, k_col, v_row, v_col, QCO, KCO,
                  VCO, R, pos_set, q_first, n_tiles, c0, item, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RUN: gl.constexpr):
    """One warp: the q rows of both consumers (once they are done with the item before), then
    key and value tiles into their rings, by TMA: a box a tile for strided sets, a box a run
    for sets made of runs (_tma_rows, their first positions read once a tile, before the
    waits)."""
    mbarrier.wait(q_empty, (item & 1) ^ 1)
    mbarrier.expect(q_bar, CONSUMERS * _boxes(BLOCK_M, RUN) * q_desc.block_type.nbytes)
    for i in gl.static_range(CONSUMERS):
        _tma_rows(q_desc, q_smem.index(i), q_bar, Pos, pos_set, q_first + i * BLOCK_M, q_row,
                  q_col, QCO, R, BLOCK_M, RUN)
    for t in range(n_tiles):
        slot = (c0 + t) % STAGES
        phase = (((c0 + t) // STAGES) & 1) ^ 1  # the first round finds every slot free
        if RUN > 0:
            starts = _run_starts(Pos, pos_set + t * BLOCK_N, BLOCK_N, RUN)
        else:
            starts = 0
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), _boxes(BLOCK_N, RUN) * k_desc.block_type.nbytes)
        _tma_rows(k_desc, k_smem.index(slot), k_ready.index(slot), Pos, pos_set, t * BLOCK_N,
                  k_row, k_col, KCO, R, BLOCK_N, RUN, starts, RUN > 0)
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), _boxes(BLOCK_N, RUN) * v_desc.block_type.nbytes)
        _tma_rows(v_desc, v_smem.index(slot), v_ready.index(slot), Pos, pos_set, t * BLOCK_N,
                  v_row, v_col, VCO, R, BLOCK_N, RUN, starts, RUN > 0)


@gluon.jit
def _item_index(Table, j, items, TABLE: gl.constexpr):
    """The CTA's j-th work item, or -1 for none: Table[j, program] (a schedule made on the host,
    lowering/gluon_forward.item_table), else program + j * programs."""
    if TABLE:
        i = gl.load(Table + j * gl.num_programs(0) + gl.program_id(0))
    else:
        i = gl.program_id(0) + j * gl.num_programs(0)
        if i >= items:
            i = -1
    return i


@gluon.jit
def _fwd_item(i, tiles, segments, thirds, H, R, W, Cnt, stride_co, stride_cs,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              PARTIAL: gl.constexpr, CHUNK: gl.constexpr, THIRD_FIRST: gl.constexpr):
    """(b, h, offset, segment, first member, members, key tiles) of work item i: CONSUMERS *
    BLOCK_M query members of one set of query head h. Under CAUSAL the ranks run last tile to
    first (the longest first), and each stops at the key tile of its last query. PARTIAL: set
    (offset, segment) has Cnt[offset, segment] members; an item past them has no key tile."""
    tile, seg, bh = _work(i, tiles, segments, thirds, CAUSAL, CHUNK, THIRD_FIRST)
    if CAUSAL:  # rank 0 is the last query tile, the longest
        tile = tiles - 1 - tile
    b = bh // H
    h = bh % H
    off = h % R
    q_first = tile * (CONSUMERS * BLOCK_M)
    if PARTIAL:
        count = gl.load(Cnt + off * stride_co + seg * stride_cs).to(gl.int32)
        n_tiles = ((count + BLOCK_N - 1) // BLOCK_N) * (q_first < count).to(gl.int32)
    else:
        count = W // R
        n_tiles = count // BLOCK_N
    if CAUSAL:  # key tiles up to the one holding the item's last query
        n_tiles = gl.minimum(n_tiles, (q_first + CONSUMERS * BLOCK_M + BLOCK_N - 1) // BLOCK_N)
    return b, h, off, seg, q_first, count, n_tiles


@gluon.jit
def _load_partition(Qx, Kx, Vx, Pos, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                    v_ready, v_empty, Table, rounds, items, tiles, segments, thirds, H, GROUP, R,
                    W, stride_po, stride_ps, Cnt, stride_co, stride_cs, QA, QB, QC, QD, KA, KB,
                    KC, KD, VA, VB, VC, VD, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_D: gl.constexpr, STAGES: gl.constexpr, GATHER: gl.constexpr,
                    RUN: gl.constexpr, PW: gl.constexpr, CAUSAL: gl.constexpr,
                    PARTIAL: gl.constexpr, CHUNK: gl.constexpr, THIRD_FIRST: gl.constexpr,
                    TABLE: gl.constexpr):
    """The producer partition: for each of the CTA's work items, the copy path of its set and
    where its rows start. The rings run on across items (c: key tiles copied so far), so the
    next item's q and first key tiles load while the consumers finish the one before."""
    c = 0
    item = 0
    for j in range(rounds):
        i = _item_index(Table, j, items, TABLE)
        b, h, off, seg, q_first, count, n_tiles = _fwd_item(
            gl.maximum(i, 0), tiles, segments, thirds, H, R, W, Cnt, stride_co, stride_cs,
            BLOCK_M, BLOCK_N, CAUSAL, PARTIAL, CHUNK, THIRD_FIRST)
        if (i >= 0) & (n_tiles > 0):
            hk = h // GROUP
            if GATHER and RUN == 0:
                _gather_producer(Qx, Kx, Vx, Pos, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                                 k_empty, v_ready, v_empty,
                                 b.to(gl.int64) * QA + h.to(gl.int64) * QB,
                                 b.to(gl.int64) * KA + hk.to(gl.int64) * KB,
                                 b.to(gl.int64) * VA + hk.to(gl.int64) * VB, QC, KC, VC,
                                 off * stride_po + seg * stride_ps, q_first, n_tiles, c, item,
                                 BLOCK_M, BLOCK_N, HEAD_D, STAGES, PW)
            else:
                if GATHER:  # runs: each box's row and column follow from its first position
                    member = 0
                    o = 0
                    pos_set = off * stride_po + seg * stride_ps
                else:  # member m of the set is row member + m, its offset's column
                    member = seg * (W // R)
                    o = off
                    pos_set = 0
                _tma_producer(Qx, Kx, Vx, Pos, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                              k_empty, v_ready, v_empty, b * QA + h * QB + member, o * QD + h * QC,
                              b * KA + hk * KB + member, o * KD + hk * KC,
                              b * VA + hk * VB + member, o * VD + hk * VC, QD, KD, VD, R,
                              pos_set, q_first, n_tiles, c, item, BLOCK_M, BLOCK_N, STAGES, RUN)
            c += n_tiles
            item += 1


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax in base 2 over raw products s (every one finite, qk_scale >= 0)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _on_diagonal(s, key_first, query_first, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 layout: gl.constexpr):
    """Causal: scores of keys after their query (by member index in the ascending set) to -inf."""
    keys = key_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    queries = query_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    return gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(queries, 1), s, float("-inf"))


@gluon.jit
def _past_count(s, key_first, count, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Partial sets: scores of the members past the set's count (no keys) to -inf."""
    keys = key_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    return gl.where(gl.expand_dims(keys < count, 0), s, float("-inf"))


@gluon.jit
def _softmax_step_any(s, m_i, l_i):
    """Online softmax in base 2 over scores s already scaled, any of them -inf (a user's mask),
    whole rows even: such a row keeps m = -inf and l = 0 (exp2 against 0, not -inf - -inf)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _mix32(x):
    """The 'lowbias32' integer finaliser on uint32 (lowering/dropout.py's _mix32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@gluon.jit
def _head_hash(Seed, b, h):
    """The part of dropout's keep hash fixed by (seed, batch, head): lowering/dropout.keep_mask."""
    seed = gl.load(Seed).to(gl.uint32)
    return _mix32(seed ^ _mix32(((b << 16) + h).to(gl.uint32)))


@gluon.jit
def _hashed(Rows, pos, ROWS: gl.constexpr):
    """The positions dropout hashes for rows `pos`: Rows[pos] (dropout_rows, a ring shard's
    global positions) under ROWS, else the rows themselves, as uint32."""
    if ROWS:
        hashed = gl.load(Rows + pos).to(gl.uint32)
    else:
        hashed = pos.to(gl.uint32)
    return hashed


@gluon.jit
def _keep(qhash, khash, threshold):
    """Dropout's keep bits of entries (query, key): the query's hash and the key's hashed
    position, shaped to broadcast (lowering/dropout.keep_mask)."""
    return (_mix32(qhash ^ khash) >> 8) >= threshold.to(gl.uint32)  # unsigned: no widening


@gluon.jit
def _user_tile(Pos, pos_set, set_first, members, R, m_rows, MK, GATHER: gl.constexpr,
               MASK_KIND: gl.constexpr):
    """(positions of the key tile's members, the tile's mask entries at m_rows, the rows'
    addresses, plus each key's column; 0 without a mask). Called while the tile's products
    run: read after their wait, the entries' round trip to L2 stalled every tile."""
    kpos = _key_positions(Pos, pos_set, set_first, members, R, GATHER)
    m_val = 0
    if MASK_KIND != 0:
        m_val = gl.load(m_rows + gl.expand_dims(kpos * MK, 0))
    return kpos, m_val


@gluon.jit
def _user_scores(s, qk_scale, m_val, MASK_KIND: gl.constexpr):
    """Raw products s scaled to base 2, then the user's mask entries m_val (in s's layout), if
    any: boolean (MASK_KIND 1, nonzero = allowed) or additive float (2, in natural-log
    units)."""
    s = s * qk_scale
    if MASK_KIND == 1:
        s = gl.where(m_val != 0, s, float("-inf"))
    elif MASK_KIND == 2:
        s = s + m_val.to(gl.float32) * 1.4426950408889634
    return s


@gluon.jit
def _user_softmax(s, m_i, l_i, qhash, kpos, Rows, keep_threshold, DROPOUT: gl.constexpr,
                  ROWS: gl.constexpr):
    """The softmax step of scaled scores (_softmax_step_any); under DROPOUT the entries whose
    keep bits say so leave p (l counts every probability, the product with v kept ones)."""
    p, alpha, m_i, l_i = _softmax_step_any(s, m_i, l_i)
    if DROPOUT:
        p = gl.where(_keep(qhash, gl.expand_dims(_hashed(Rows, kpos, ROWS), 0), keep_threshold),
                     p, 0.0)
    return p, alpha, m_i, l_i


@gluon.jit
def _key_positions(Pos, pos_set, set_first, members, R, GATHER: gl.constexpr):
    """Positions of set members `members`: Pos[pos_set + m] (GATHER) or set_first + m * R."""
    if GATHER:
        pos = gl.load(Pos + pos_set + members)
    else:
        pos = set_first + members * R
    return pos


@gluon.jit
def _merge_rows(acc, m_i, l_i, old, Out, Acc, Lse, rows, out_rows, valid, drop_scale,
                HEAD_D: gl.constexpr, NW: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr,
                PARTIAL: gl.constexpr, EMPTY: gl.constexpr, DROPOUT: gl.constexpr):
    """This branch's rows (o = acc / l, lse) merged into the branches' before: `rows` (int64, of
    the flat [B * H * N] row index of Acc and Lse), `out_rows` (int64, where each row starts in
    Out); PARTIAL: those where `valid` holds (members of a partial set past its count are no
    rows). EMPTY: a user's mask may leave a row no key (l = 0): its o is 0 and its lse -inf, as
    no branch had selected it. DROPOUT: o scaled by drop_scale (acc summed kept entries only).
    Loads and stores stay in wgmma's layout (each thread's pairs of columns fill whole 32-byte
    sectors)."""
    layout: gl.constexpr = _mma_layout(NW, HEAD_D)
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    l_r = gl.convert_layout(l_i, rows_l)
    if EMPTY:
        none = l_r == 0.0
        l_r = gl.where(none, 1.0, l_r)
        lse = gl.where(none, float("-inf"),
                       (gl.convert_layout(m_i, rows_l) + gl.log2(l_r)) * 0.6931471805599453)
    else:
        lse = (gl.convert_layout(m_i, rows_l) + gl.log2(l_r)) * 0.6931471805599453
    if DROPOUT:
        o = acc * gl.expand_dims(drop_scale / l_r, 1)
    else:
        o = acc * gl.expand_dims(1.0 / l_r, 1)
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=cols_l), 0)
    offs = gl.expand_dims(rows * HEAD_D, 1) + cols
    if PARTIAL:
        live = gl.expand_dims(valid, 1) & (offs >= 0)
    else:
        live = offs >= 0
    if not FIRST:  # old: Lse at rows, -inf where no branch before selected the row
        top = gl.maximum(old, lse)  # finite: lse is (unless EMPTY)
        if EMPTY:
            top = gl.where(top == float("-inf"), 0.0, top)
        w_old = gl.exp(old - top)
        w_new = gl.exp(lse - top)
        total = w_old + w_new
        if EMPTY:  # neither this branch nor one before has a key of the row
            none = total == 0.0
            total = gl.where(none, 1.0, total)
        seen = gl.expand_dims(old > float("-inf"), 1) & live
        prev = gl.load(Acc + offs, mask=seen, other=0.0)
        o = prev * gl.expand_dims(w_old / total, 1) + o * gl.expand_dims(w_new / total, 1)
        if EMPTY:
            lse = gl.where(none, float("-inf"), top + gl.log(total))
        else:
            lse = top + gl.log(total)
    if LAST:
        out_offs = gl.expand_dims(out_rows, 1) + cols
    if PARTIAL:
        if LAST:
            gl.store(Out + out_offs, o.to(Out.dtype.element_ty), mask=live)
        else:
            gl.store(Acc + offs, o, mask=live)
        gl.store(Lse + rows, lse, mask=valid)
    else:
        if LAST:
            gl.store(Out + out_offs, o.to(Out.dtype.element_ty))
        else:
            gl.store(Acc + offs, o)
        gl.store(Lse + rows, lse)


@gluon.jit
def _consume_item(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, Out,
                  Acc, Lse, Pos, qk_scale, first_row, out_first, ON, R, pos_q, q_first, n_tiles,
                  count, Mask, MQ, MK, Rows, head_hash, keep_threshold, drop_scale, set_first,
                  c0, item, CID: gl.constexpr, NW: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                  FIRST: gl.constexpr, LAST: gl.constexpr, GATHER: gl.constexpr,
                  CAUSAL: gl.constexpr, CP_ASYNC: gl.constexpr, PARTIAL: gl.constexpr,
                  MASK_KIND: gl.constexpr, DROPOUT: gl.constexpr, ROWS: gl.constexpr):
    """Rows CID * BLOCK_M ... of a work item's query tile (members q_first + ...), over the key
    tiles [0, n_tiles) of the set; under CAUSAL the last of them holds the diagonal. c0: key
    tiles the rings held before this item; item: items before it (the phase of q_bar and
    q_empty, which this consumer frees once its last product with q is done). GATHER: rows are
    found through Pos. CP_ASYNC: the rings were written by cp.async (the generic proxy), which
    wgmma reads only after a proxy fence. PARTIAL: the set has `count` members (a packed row's
    set); members past it are neither keys (masked on the last tile; under CAUSAL the diagonal
    already excludes them for every member's query) nor rows to write.
    MASK_KIND (1 boolean, 2 additive): the user's mask, entry (p, p') at Mask + p * MQ + p' * MK
    (Mask at the program's batch and head; p' * MK in int32, gluon_forward checks it fits).
    DROPOUT: the entries whose keep bits (head_hash, Rows: _hashed) say so leave the product
    with v, not the softmax's sum, and o is scaled by drop_scale. Either way the scores are
    scaled before the softmax (the mask is added in base 2, rows may have no key). Member m of
    a strided set is position set_first + m * R."""
    query_first = q_first + CID * BLOCK_M
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(NW, HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_tile = q_smem.index(CID)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    rows_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    members = CID * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_l)
    if PARTIAL:
        valid = (q_first + members) < count
    else:
        valid = 0
    # the output rows' positions, and the lse the branches before left there (their kernels are
    # done), read while the first tiles load rather than in the epilogue's chain of dependent
    # loads: 4% fewer cycles on the r = 2 runs, 1 to 1.5% elsewhere (ncu, BENCHMARKS.md)
    if GATHER:
        q_pos = gl.load(Pos + pos_q + members)
    if not FIRST:
        if PARTIAL:
            old_lse = gl.load(Lse + first_row + q_pos.to(gl.int64), mask=valid,
                              other=float("-inf"))
        elif GATHER:
            old_lse = gl.load(Lse + first_row + q_pos.to(gl.int64))
        else:
            old_lse = gl.load(Lse + first_row + members.to(gl.int64) * R)
    else:
        old_lse = 0
    # a user's mask or dropout: the positions of the rows (of s's layout) and of each key tile
    USER: gl.constexpr = MASK_KIND != 0 or DROPOUT
    if USER:
        s_rows = query_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if GATHER:
            s_qpos = gl.load(Pos + (pos_q - q_first) + s_rows)
        else:
            s_qpos = set_first + s_rows * R
        m_rows = 0
        if MASK_KIND != 0:
            m_rows = gl.expand_dims(Mask + s_qpos.to(gl.int64) * MQ, 1)
        qhash = 0
        if DROPOUT:
            qhash = gl.expand_dims(_mix32(head_hash ^ _hashed(Rows, s_qpos, ROWS)), 1)
    mbarrier.wait(q_bar, item & 1)

    first = c0 % STAGES
    mbarrier.wait(k_ready.index(first), (c0 // STAGES) & 1)
    if CP_ASYNC:
        fence_async_shared()
    s_tok = warpgroup_mma(q_tile, k_smem.index(first).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    if USER:  # the tile's key positions and mask entries, read while its product runs
        kpos, m_val = _user_tile(Pos, pos_q - q_first, set_first, s_cols, R, m_rows, MK,
                                 GATHER, MASK_KIND)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(first), count=1)
    if USER:
        s = _user_scores(s, qk_scale, m_val, MASK_KIND)
    if CAUSAL:
        if n_tiles == 1:
            s = _on_diagonal(s, 0, query_first, BLOCK_M, BLOCK_N, s_layout)
    elif PARTIAL:
        if n_tiles == 1:
            s = _past_count(s, 0, count, BLOCK_N, s_layout)
    if USER:
        p, alpha, m_i, l_i = _user_softmax(s, m_i, l_i, qhash, kpos, Rows, keep_threshold,
                                           DROPOUT, ROWS)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    p16 = gl.convert_layout(p.to(dtype), p_layout)
    for t in range(1, n_tiles):  # S(t) and P(t-1) v(t-1) in flight; then the softmax of t
        slot = (c0 + t) % STAGES
        prev = (c0 + t - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), ((c0 + t) // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((c0 + t - 1) // STAGES) & 1)
        if CP_ASYNC:
            fence_async_shared()
        s_tok = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        acc_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
        if USER:
            kpos, m_val = _user_tile(Pos, pos_q - q_first, set_first, t * BLOCK_N + s_cols, R,
                                     m_rows, MK, GATHER, MASK_KIND)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        if USER:
            s = _user_scores(s, qk_scale, m_val, MASK_KIND)
        if CAUSAL:
            if t == n_tiles - 1:
                s = _on_diagonal(s, t * BLOCK_N, query_first, BLOCK_M, BLOCK_N, s_layout)
        elif PARTIAL:
            if t == n_tiles - 1:
                s = _past_count(s, t * BLOCK_N, count, BLOCK_N, s_layout)
        if USER:
            p, alpha, m_i, l_i = _user_softmax(s, m_i, l_i, qhash, kpos, Rows, keep_threshold,
                                               DROPOUT, ROWS)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        acc, p16_used = warpgroup_mma_wait(0, deps=(acc_tok, p16))  # p16 stays live until read
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.arrive(q_empty, count=1)  # q's last product is done: the next item's q may load
    last = (c0 + n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((c0 + n_tiles - 1) // STAGES) & 1)
    if CP_ASYNC:
        fence_async_shared()
    acc_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
    acc, p16_used = warpgroup_mma_wait(0, deps=(acc_tok, p16))
    mbarrier.arrive(v_empty.index(last), count=1)
    if GATHER:
        rows = first_row + q_pos.to(gl.int64)
        out_rows = out_first + q_pos.to(gl.int64) * ON
    else:
        rows = first_row + members.to(gl.int64) * R
        out_rows = out_first + members.to(gl.int64) * (R * ON)
    _merge_rows(acc, m_i, l_i, old_lse, Out, Acc, Lse, rows, out_rows, valid, drop_scale, HEAD_D,
                NW, FIRST, LAST, PARTIAL, MASK_KIND != 0, DROPOUT)


@gluon.jit
def _work(linear, tiles, segments, thirds, CAUSAL: gl.constexpr, CHUNK: gl.constexpr,
          THIRD_FIRST: gl.constexpr = False):
    """(rank, segment, third) of work item `linear` of a grid (tiles, segments, thirds) read in
    this order: grid order (the rank fastest), or, under causal masks, whose tiles differ in
    work (the longest tile of a set has 16 times the shortest's at sets of 2048), chunks of
    CHUNK sets (CHUNK divides segments * thirds: lowering/gluon_forward.chunk_sets); within a
    chunk, the items of rank 0 (each set's longest tile, the caller's choice which) come first,
    then rank 1, ..., so the last wave holds the shortest tiles rather than some of the longest
    (longest-first scheduling, as FlashAttention-3's causal scheduler). A chunk's sets run
    together and share their rows in L2, as a set's tiles do in grid order.
    THIRD_FIRST (a user's mask, which heads and batches may share): the third dimension runs
    fastest, then the rank, then the segment, so that the programs reading one set's entries
    of the mask (every head's; with r > 1 every offset's, interleaved in the same rows) run
    together and meet them in L2, rather than once per head from memory."""
    if THIRD_FIRST:
        third = linear % thirds
        rank = (linear // thirds) % tiles
        seg = linear // (thirds * tiles)
    elif CAUSAL:
        chunk = linear // (CHUNK * tiles)
        within = linear - chunk * (CHUNK * tiles)
        set_index = chunk * CHUNK + within % CHUNK
        rank = within // CHUNK
        seg = set_index % segments
        third = set_index // segments
    else:
        rank = linear % tiles
        seg = (linear // tiles) % segments
        third = linear // (tiles * segments)
    return rank, seg, third


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, Out,
              Acc, Lse, Pos, qk_scale, Table, rounds, items, tiles, segments, thirds, H, N, R, W,
              stride_po, stride_ps, Cnt, stride_co, stride_cs, OB, OH, ON, Mask, MB, MH, MQ, MK,
              Seed, Rows, keep_threshold, drop_scale, CID: gl.constexpr, NW: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr,
              GATHER: gl.constexpr, CAUSAL: gl.constexpr, CP_ASYNC: gl.constexpr,
              PARTIAL: gl.constexpr, MASK_KIND: gl.constexpr, DROPOUT: gl.constexpr,
              ROWS: gl.constexpr, CHUNK: gl.constexpr, TABLE: gl.constexpr):
    """Consumer CID over the CTA's work items (_fwd_item), in the producer's order: where each
    item's rows lie, then _consume_item."""
    c = 0
    item = 0
    for j in range(rounds):
        i = _item_index(Table, j, items, TABLE)
        b, h, off, seg, q_first, count, n_tiles = _fwd_item(
            gl.maximum(i, 0), tiles, segments, thirds, H, R, W, Cnt, stride_co, stride_cs,
            BLOCK_M, BLOCK_N, CAUSAL, PARTIAL, CHUNK, MASK_KIND != 0)
        if (i >= 0) & (n_tiles > 0):
            bh = b * H + h
            if GATHER:
                first_row = bh.to(gl.int64) * N  # Acc, Lse: [B, H, N]
                out_first = b.to(gl.int64) * OB + h.to(gl.int64) * OH
                pos_set = off * stride_po + seg * stride_ps
            else:
                first_row = bh.to(gl.int64) * N + seg * W + off + q_first * R
                out_first = (b.to(gl.int64) * OB + h.to(gl.int64) * OH
                             + (seg * W + off + q_first * R).to(gl.int64) * ON)
                pos_set = 0
            if DROPOUT:
                head_hash = _head_hash(Seed, b, h)
            else:
                head_hash = 0
            _consume_item(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                          v_empty, Out, Acc, Lse, Pos, qk_scale, first_row, out_first, ON, R,
                          pos_set + q_first, q_first, n_tiles, count,
                          Mask + b.to(gl.int64) * MB + h.to(gl.int64) * MH, MQ, MK, Rows,
                          head_hash, keep_threshold, drop_scale, seg * W + off, c, item, CID, NW,
                          BLOCK_M, BLOCK_N, HEAD_D, STAGES, FIRST, LAST, GATHER, CAUSAL, CP_ASYNC,
                          PARTIAL, MASK_KIND, DROPOUT, ROWS)
            c += n_tiles
            item += 1


@gluon.jit
def _fwd_kernel(Qx, Kx, Vx, Out, Acc, Lse, Pos, qk_scale,
                H, N, GROUP, R: gl.constexpr, W, stride_po, stride_ps, Cnt, stride_co, stride_cs,
                QA, QB, QC, QD, KA, KB, KC, KD, VA, VB, VC, VD, OB, OH, ON,
                Mask, MB, MH, MQ, MK, Seed, Rows, keep_threshold, drop_scale,
                TILES, SEGMENTS, THIRDS, Table, ROUNDS,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                STAGES: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr,
                GATHER: gl.constexpr, CAUSAL: gl.constexpr, RUN: gl.constexpr,
                PARTIAL: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                CHUNK: gl.constexpr, num_warps: gl.constexpr, MASK_KIND: gl.constexpr = 0,
                DROPOUT: gl.constexpr = False, ROWS: gl.constexpr = False,
                TABLE: gl.constexpr = False):
    """Persistent: a 1-D grid of CTAs, each taking ROUNDS work items in turn (_item_index: its
    column of Table under TABLE, a schedule made on the host; else program, program + programs,
    ... < TILES * SEGMENTS * THIRDS), item i being (query tile, segment, b * H + h) of `_work`'s
    order over the grid (set length / (2 * BLOCK_M), segments, B * H): the query tile runs
    fastest, so the items of one set run together and share its keys and values in L2; under
    CAUSAL the query tiles run last to first (the longest first), the sets in chunks of CHUNK,
    and each tile stops at its diagonal key tile (_fwd_item). A CTA's producer copies the next
    item's q and first key tiles while its consumers finish the item before (its last products
    and the merge's loads and stores): launched one CTA an item, each CTA paid that start and
    end with the tensor cores idle. A grid of one CTA an item (ROUNDS = 1) is the plain launch.

    Strided sets (not GATHER): Qx, Kx, Vx are TMA descriptors of the 2-D views and (A, B, C, D)
    of each are (RB, RH, CH, CO) above. GATHER: member m of set j of offset o is at Pos[o, j, m];
    Qx, Kx, Vx are the tensors and (A, B, C) their batch, head and row strides, or, when RUN > 0
    (the members come in stride-R runs of RUN), descriptors as above with boxes of RUN rows.
    PARTIAL (GATHER, RUN == 0): set j of offset o has Cnt[o, j] members (a packed row's plan);
    items past it are skipped, the others stop at its last key tile. Out's element (b, h, n, 0)
    is at b * OB + h * OH + n * ON (the op's output is [B, N, H, D] in memory, as
    FlashAttention's, so that a model's output projection reads it without a copy).

    MASK_KIND (1 boolean, 2 additive float): the user's mask broadcast to [B, H, N, N] by
    strides (MB, MH, MQ, MK); DROPOUT: keep bits hashed from (Seed, b, h, positions, Rows under
    ROWS), kept entries scaled by drop_scale (lowering/triton_kernels.py's conventions)."""
    items = TILES * SEGMENTS * THIRDS
    # the producer copies by cp.async (Qx a tensor; each of its threads arrives) or by TMA
    CP_ASYNC: gl.constexpr = GATHER and RUN == 0
    dtype: gl.constexpr = Qx.dtype.element_ty if CP_ASYNC else Qx.dtype
    arrivals: gl.constexpr = PRODUCER_WARPS * 32 if CP_ASYNC else 1
    if GATHER:
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    else:
        q_sl: gl.constexpr = Qx.layout
        kv_sl: gl.constexpr = Kx.layout

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_D], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_sl)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=arrivals)
    mbarrier.init(q_empty, count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=arrivals)
        mbarrier.init(v_ready.index(i), count=arrivals)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()

    # Triton 3.6: the argument tuples must be written inline (a tuple held in a variable turns
    # its constexprs into tensors).
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                     Out, Acc, Lse, Pos, qk_scale, Table, ROUNDS, items, TILES, SEGMENTS, THIRDS,
                     H, N, R, W,
                     stride_po, stride_ps, Cnt, stride_co, stride_cs, OB, OH, ON, Mask, MB, MH,
                     MQ, MK, Seed, Rows, keep_threshold, drop_scale, 0, num_warps, BLOCK_M,
                     BLOCK_N, HEAD_D, STAGES, FIRST, LAST, GATHER, CAUSAL, CP_ASYNC, PARTIAL,
                     MASK_KIND, DROPOUT, ROWS, CHUNK, TABLE)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                     Out, Acc, Lse, Pos, qk_scale, Table, ROUNDS, items, TILES, SEGMENTS, THIRDS,
                     H, N, R, W,
                     stride_po, stride_ps, Cnt, stride_co, stride_cs, OB, OH, ON, Mask, MB, MH,
                     MQ, MK, Seed, Rows, keep_threshold, drop_scale, 1, num_warps, BLOCK_M,
                     BLOCK_N, HEAD_D, STAGES, FIRST, LAST, GATHER, CAUSAL, CP_ASYNC, PARTIAL,
                     MASK_KIND, DROPOUT, ROWS, CHUNK, TABLE)),
        (_load_partition, (Qx, Kx, Vx, Pos, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                           k_empty, v_ready, v_empty, Table, ROUNDS, items, TILES, SEGMENTS,
                           THIRDS, H, GROUP, R, W, stride_po, stride_ps, Cnt, stride_co,
                           stride_cs, QA, QB, QC, QD, KA, KB, KC, KD, VA, VB, VC, VD, BLOCK_M,
                           BLOCK_N, HEAD_D, STAGES, GATHER, RUN, PRODUCER_WARPS, CAUSAL, PARTIAL,
                           CHUNK, MASK_KIND != 0, TABLE)),
    ], [num_warps, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
