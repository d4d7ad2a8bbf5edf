"""The @triton.jit kernels of the Triton lowering; lowering/triton_lowering.py launches them.

FlashAttention-2 kernels that read q, k, v where they lie (no gathered copies), one branch
(w, r) of dilated attention per launch. Notation:

- A *set* is what query head h selects in segment j of a branch: the positions of offset
  o = h % r, ascending. Member m of the set lies at position j*w + o + m*r when STRIDED (the
  identity order: rows are reached through strides), else at Pos[o, j, m] (the Hilbert plan).
  The set has Cnt[o, j] members; members past that (tile padding) read position 0, a real row,
  so that loads never need a row mask, and their scores are set to -inf where it matters.
  Pos is int32 and padded with 0 (lowering/triton_plans.py's plan_tensors), so a tile of
  positions is one unmasked load.
- Scores are kept in base 2: s = log2(e) * (scale * q.k + float mask), so exp2 is the exponential.
- A tile is EDGE when it may hold padded members or cross the causal diagonal; only EDGE tiles
  pay for the structural masks. Causal attention over an ascending set is a lower triangle
  over member indices, so tiles above the diagonal are never visited.
- Dropout keeps entry (b, h, p, p') when lowbias32 hashes of (seed, b, h, p, p') say so:
  exactly lowering/dropout.py's keep_mask, in uint32 arithmetic. Under ROWS the hash takes
  Rows[p], Rows[p'] instead of the rows p, p' (the global positions that a ring's rows stand
  for, `dropout_rows`); otherwise Rows is never read.
- A set may hold fewer members than the plan's set size in any segment, or none (Cnt 0: every
  program of it returns at once), and some rows may be in no set (padding of packed sequences):
  the kernels never assume a set is whole or that a branch covers every row; the launcher
  decides who writes rows no set holds (lowering/triton_lowering.py).
- GROUPED sets hold several short segments as groups (lowering/plans.py's BranchPlan.groups):
  member m sees the members Grp[0, o, j, m] <= m' < Grp[1, o, j, m] only (Grp: int32, laid out
  as Pos, the second plane stride_pg further). A tile then visits the members its rows' groups
  span, every tile masked.

Positional parameters. The three branch kernels take their own buffers first, then one shared
run of operands, built by lowering/triton_lowering.py's Call.operands, then their own scalars
(only _bwd_dkdv_kernel's NUM_CLASSES) and the compile-time arguments by name:

    Q, K, V, [DO,] Pos, Cnt, Grp, Mask, Seed, Rows,
    strides (batch, head, row, column) of Q, K, V, [DO,] and of Mask broadcast to [B, H, N, N],
    strides of Pos [r, S, >= w / r] (offset, segment, member) and of Cnt [r, S], stride_pg,
    H (query heads), HKV (key/value heads), N (rows), GROUP = H // HKV,
    SEG (segment length w), R (dilation rate), qk_scale = scale * log2(e), scale,
    keep_threshold, drop_scale (dropout: keep when hash >> 8 >= threshold, scale kept ones),

with DO and its strides only in the backward's kernels. A kernel may leave some unused (the
forward reads neither HKV nor scale): one run for all keeps the launches from drifting apart.
"""
import triton
import triton.language as tl


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _mix32(x):
    """The 'lowbias32' integer finaliser on uint32 (lowering/dropout.py's _mix32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _query_hash(Seed, b, h, pos_q):
    """The part of keep_mask's hash fixed by (seed, batch, head, query position)."""
    seed = tl.load(Seed).to(tl.uint32)
    x = _mix32(seed ^ _mix32(((b << 16) + h).to(tl.uint32)))
    return _mix32(x ^ pos_q.to(tl.uint32))


@triton.jit
def _dropout_positions(Rows, pos, ROWS: tl.constexpr):
    """The positions dropout hashes for rows `pos` (always real rows: no load mask): Rows[pos]
    under ROWS, else the rows themselves."""
    if ROWS:
        hashed = tl.load(Rows + pos)
    else:
        hashed = pos
    return hashed


@triton.jit
def _keep(qhash, pos_k, threshold):
    """Keep bits of entries (query, key): qhash and pos_k already shaped to broadcast."""
    x = _mix32(qhash ^ pos_k.to(tl.uint32))
    return (x >> 8) >= threshold


@triton.jit
def _set_positions(Pos, set_base, stride_pm, first, R, idx, count, STRIDED: tl.constexpr):
    """Positions (int32) of members idx of a set; members at or past `count` read position 0.
    Pos is padded with 0 past each set's count and one tile beyond its last: no load mask."""
    if STRIDED:
        pos = tl.where(idx < count, first + idx * R, 0)
    else:
        pos = tl.load(Pos + set_base + idx * stride_pm)
    return pos


@triton.jit
def _load_rows(base, pos, stride_n, stride_d, row_ok, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `pos` of one head of q, k, v or dO: a [len(pos), BLOCK_D] tile, zero past DIM."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + pos.to(tl.int64)[:, None] * stride_n + offs_d[None, :] * stride_d
    if MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < DIM), other=0.0)
    elif DIM == BLOCK_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[None, :] < DIM, other=0.0)
    if UPCAST:  # the interpreter multiplies bfloat16 as raw integers in tl.dot: go through float32
        x = x.to(tl.float32)
    return x


@triton.jit
def _scheduled(CAUSAL: tl.constexpr, CHUNK: tl.constexpr):
    """(rank, program, segment) of a program of the grid (tiles, programs, segments): its
    program ids, or, under causal masks, the grid read as chunks of CHUNK sets (CHUNK divides
    programs * segments), the programs of rank 0 of a chunk's sets first: the caller makes rank
    0 its sets' longest tile, so that a launch's last wave holds its shortest
    (lowering/gluon_kernels.py's `_work`, the same order over that kernel's work items, says
    why)."""
    if CAUSAL:
        tiles = tl.num_programs(0)
        programs = tl.num_programs(1)
        linear = tl.program_id(0) + tiles * (tl.program_id(1) + programs * tl.program_id(2))
        chunk = linear // (CHUNK * tiles)
        within = linear - chunk * (CHUNK * tiles)
        set_index = chunk * CHUNK + within % CHUNK
        rank = within // CHUNK
        program = set_index % programs
        seg = set_index // programs
    else:
        rank = tl.program_id(0)
        program = tl.program_id(1)
        seg = tl.program_id(2)
    return rank, program, seg


@triton.jit
def _query_tile(Pos, Cnt, stride_po, stride_ps, stride_pm, stride_co, stride_cs, H, SEG, R,
                BLOCK_M: tl.constexpr, STRIDED: tl.constexpr, CAUSAL: tl.constexpr,
                CHUNK: tl.constexpr):
    """The query tile of a program over (query tile, batch * head, segment): which set, its
    member count, and the positions of the tile's rows. Under CAUSAL the longest rows go first
    (`_scheduled`). The caller returns at once when start_m >= count (a tile past the set's
    end)."""
    pid_m, bh, seg = _scheduled(CAUSAL, CHUNK)
    if CAUSAL:  # rank 0 is the last query tile, the longest
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = bh // H
    h = bh % H
    off = h % R
    count = tl.load(Cnt + off * stride_co + seg * stride_cs).to(tl.int32)
    start_m = pid_m * BLOCK_M
    first = seg * SEG + off
    set_base = off * stride_po + seg * stride_ps
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    pos_m = _set_positions(Pos, set_base, stride_pm, first, R, offs_m, count, STRIDED)
    return bh, b, h, count, start_m, first, set_base, offs_m, row_ok, pos_m


@triton.jit
def _group_bounds(Grp, set_base, stride_pm, stride_pg, idx, ok, count):
    """(group starts, group ends) of members idx, and the run [lo, hi) of members that the
    groups of the `ok` ones span."""
    gs = tl.load(Grp + set_base + idx * stride_pm)
    ge = tl.load(Grp + stride_pg + set_base + idx * stride_pm)
    lo = tl.min(tl.where(ok, gs, count), 0)
    hi = tl.max(tl.where(ok, ge, 0), 0)
    return gs, ge, lo, hi


@triton.jit
def _masked_scores(s, M_base, pos_q, pos_k, stride_mq, stride_mk, MASK_KIND: tl.constexpr):
    """Applies the user's mask to base-2 scores s[q, k] (pos_q, pos_k shaped to broadcast):
    MASK_KIND 1 is boolean (nonzero = allowed), 2 is additive float."""
    if MASK_KIND == 1:
        allowed = tl.load(M_base + pos_q.to(tl.int64) * stride_mq + pos_k.to(tl.int64) * stride_mk)
        s = tl.where(allowed != 0, s, float("-inf"))
    elif MASK_KIND == 2:
        bias = tl.load(M_base + pos_q.to(tl.int64) * stride_mq + pos_k.to(tl.int64) * stride_mk)
        s = s + bias.to(tl.float32) * 1.4426950408889634
    return s


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, pos_m, offs_m, gs_m, ge_m, qhash, lo, hi,
               K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
               Pos, set_base, stride_pm, first, R, count, M_base, stride_mq, stride_mk,
               qk_scale, keep_threshold, Rows,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr,
               CAUSAL: tl.constexpr, STRIDED: tl.constexpr, MASK_KIND: tl.constexpr,
               DROPOUT: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr,
               PRECISION: tl.constexpr, NONNEG_SCALE: tl.constexpr, GROUPED: tl.constexpr):
    """Online softmax of one query tile over the key members [lo, hi) of its set (GROUPED:
    each row over its group's, gs_m <= member < ge_m)."""
    pos_next = _set_positions(Pos, set_base, stride_pm, first, R, lo + tl.arange(0, BLOCK_N),
                              count, STRIDED)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pos_n = pos_next  # positions one tile ahead: the rows' loads need not wait for the plan
        pos_next = _set_positions(Pos, set_base, stride_pm, first, R, offs_n + BLOCK_N, count,
                                  STRIDED)
        key_ok = offs_n < count
        k = _load_rows(K_base, pos_n, stride_kn, stride_kd, key_ok, HEAD_DIM, BLOCK_D, EDGE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if EDGE or MASK_KIND != 0 or not NONNEG_SCALE:  # scores may be -inf, whole rows even
            s = _masked_scores(qk * qk_scale, M_base, pos_m[:, None], pos_n[None, :], stride_mq,
                               stride_mk, MASK_KIND)
            if EDGE:
                ok = key_ok[None, :]
                if CAUSAL:
                    ok = ok & (offs_n[None, :] <= offs_m[:, None])
                if GROUPED:
                    ok = ok & (offs_n[None, :] >= gs_m[:, None]) & (offs_n[None, :] < ge_m[:, None])
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0
            p = tl.math.exp2(s - m_use[:, None])
        else:  # every score finite, scale >= 0: the maximum of the raw products, one FMA a score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:  # the denominator counts every probability, the numerator only kept ones
            keep = _keep(qhash[:, None], _dropout_positions(Rows, pos_n, ROWS)[None, :],
                         keep_threshold)
            p = tl.where(keep, p, 0.0)
        v = _load_rows(V_base, pos_n, stride_vn, stride_vd, key_ok, HEAD_DIM_V, BLOCK_DV, EDGE,
                       UPCAST)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Out, Acc, Lse, stride_ob, stride_oh, stride_on,
                Q, K, V, Pos, Cnt, Grp, Mask, Seed, Rows,
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_mb, stride_mh, stride_mq, stride_mk,
                stride_po, stride_ps, stride_pm, stride_co, stride_cs, stride_pg,
                H, HKV, N, GROUP, SEG, R, qk_scale, scale, keep_threshold, drop_scale,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                STRIDED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                DROPOUT: tl.constexpr, ROWS: tl.constexpr, FIRST: tl.constexpr,
                LAST: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                NONNEG_SCALE: tl.constexpr, GROUPED: tl.constexpr, CHUNK: tl.constexpr):
    """One branch, one program per (query tile, batch * head, segment).

    Computes the branch's attention for the tile's query rows and merges it by log-sum-exp
    into the running result of the branches launched before: (Acc float32, Lse), read unless
    FIRST. A LAST branch selects every position (r == 1, no padding) and writes the final Out in
    q's dtype, through its strides (the op's output is [B, N, H, D] in memory).
    Within one launch every (batch, head, position) belongs to one program: no races.
    """
    bh, b, h, count, start_m, first, set_base, offs_m, row_ok, pos_m = _query_tile(
        Pos, Cnt, stride_po, stride_ps, stride_pm, stride_co, stride_cs, H, SEG, R,
        BLOCK_M, STRIDED, CAUSAL, CHUNK)
    if start_m >= count:
        return

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    g64 = (h // GROUP).to(tl.int64)
    q = _load_rows(Q + b64 * stride_qb + h64 * stride_qh, pos_m, stride_qn, stride_qd, row_ok,
                   HEAD_DIM, BLOCK_D, False, UPCAST)
    K_base = K + b64 * stride_kb + g64 * stride_kh
    V_base = V + b64 * stride_vb + g64 * stride_vh
    M_base = Mask + b64 * stride_mb + h64 * stride_mh
    if DROPOUT:
        qhash = _query_hash(Seed, b, h, _dropout_positions(Rows, pos_m, ROWS))
    else:
        qhash = pos_m.to(tl.uint32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if GROUPED:  # the members the rows' groups span, every tile masked
        gs_m, ge_m, lo, hi = _group_bounds(Grp, set_base, stride_pm, stride_pg, offs_m, row_ok,
                                           count)
        if CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M, count)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, pos_m, offs_m, gs_m, ge_m, qhash, lo, hi, K_base, V_base,
            stride_kn, stride_kd, stride_vn, stride_vd, Pos, set_base, stride_pm, first, R,
            count, M_base, stride_mq, stride_mk, qk_scale, keep_threshold, Rows,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, CAUSAL, STRIDED, MASK_KIND,
            DROPOUT, ROWS, UPCAST, PRECISION, NONNEG_SCALE, True)
    else:
        if CAUSAL:  # key tiles left of the query tile in full, then the diagonal ones masked
            lo = start_m
            hi = tl.minimum(start_m + BLOCK_M, count)
        else:  # full key tiles, then the set's last, partial one
            lo = count // BLOCK_N * BLOCK_N
            hi = count
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, pos_m, offs_m, offs_m, offs_m, qhash, 0, lo, K_base, V_base,
            stride_kn, stride_kd, stride_vn, stride_vd, Pos, set_base, stride_pm, first, R,
            count, M_base, stride_mq, stride_mk, qk_scale, keep_threshold, Rows,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, CAUSAL, STRIDED, MASK_KIND,
            DROPOUT, ROWS, UPCAST, PRECISION, NONNEG_SCALE, False)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, pos_m, offs_m, offs_m, offs_m, qhash, lo, hi, K_base, V_base,
            stride_kn, stride_kd, stride_vn, stride_vd, Pos, set_base, stride_pm, first, R,
            count, M_base, stride_mq, stride_mk, qk_scale, keep_threshold, Rows,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, CAUSAL, STRIDED, MASK_KIND,
            DROPOUT, ROWS, UPCAST, PRECISION, NONNEG_SCALE, False)

    # This branch's result: o (normalised) and its log-sum-exp, -inf for rows with no key.
    empty = l_i == 0.0
    l_use = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_use)) * 0.6931471805599453)
    o = acc * (drop_scale / l_use)[:, None]

    offs_dv = tl.arange(0, BLOCK_DV)
    rows = bh.to(tl.int64) * N + pos_m  # Acc: contiguous [B, H, N, HEAD_DIM_V]; Lse: [B, H, N]
    ptr_off = rows[:, None] * HEAD_DIM_V + offs_dv[None, :]
    out_ok = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    if not FIRST:  # merge with the branches before, by log-sum-exp in float32
        old = tl.load(Lse + rows, mask=row_ok, other=float("-inf"))
        top = tl.maximum(old, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp(old - top)
        w_new = tl.exp(lse - top)
        total = w_old + w_new
        none = total == 0.0  # neither has a key
        total = tl.where(none, 1.0, total)
        lse = tl.where(none, float("-inf"), top + tl.log(total))
        prev = tl.load(Acc + ptr_off, mask=out_ok & (old > float("-inf"))[:, None], other=0.0)
        o = prev * (w_old / total)[:, None] + o * (w_new / total)[:, None]
    if LAST:
        out_off = (b64 * stride_ob + h64 * stride_oh + pos_m.to(tl.int64) * stride_on)[:, None] \
            + offs_dv[None, :]
        tl.store(Out + out_off, o.to(Out.dtype.element_ty), mask=out_ok)
    else:
        tl.store(Acc + ptr_off, o, mask=out_ok)
    tl.store(Lse + rows, lse, mask=row_ok)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _bwd_preprocess(Out, DO, Lse, Delta, Lse2, DQ,
                    stride_ob, stride_oh, stride_on, stride_od,
                    stride_db, stride_dh, stride_dn, stride_dd,
                    H, N, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_DQ: tl.constexpr):
    """Delta = rowsum(dO * O) with the final O, and the lse in base 2 with +inf for rows that have
    no key (so that every probability of theirs is exp2(s - inf) = 0). ZERO_DQ: also zeroes the
    program's rows of DQ (float32, contiguous [B, H, N, HEAD_DIM]), which the dq atomics add to:
    one launch fewer than a separate fill."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N
    ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_on
                + offs_d[None, :] * stride_od, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m.to(tl.int64)[:, None] * stride_dn
                 + offs_d[None, :] * stride_dd, mask=ok, other=0.0).to(tl.float32)
    rows = bh.to(tl.int64) * N + offs_m
    tl.store(Delta + rows, tl.sum(o * do, 1), mask=row_ok)
    lse = tl.load(Lse + rows, mask=row_ok, other=0.0)
    tl.store(Lse2 + rows, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634),
             mask=row_ok)
    if ZERO_DQ:
        offs_dq = tl.arange(0, BLOCK_D)
        tl.store(DQ + rows[:, None] * HEAD_DIM + offs_dq[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=row_ok[:, None] & (offs_dq[None, :] < HEAD_DIM))


@triton.jit
def _cast_dq(DQ, DQO, stride_ob, stride_oh, stride_on, stride_od, H, N,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """DQO (q's dtype and layout) = DQ (float32, contiguous [B, H, N, HEAD_DIM]), the sum the
    atomics or TMA reductions left: a tile of rows a program, read whole and written through
    DQO's strides. torch's copy_ between these layouts took 94 us at B = 1, H = 16, N = 32K,
    D = 64 (its strided elementwise path), cuDNN's own dq conversion 56 us (H200)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m < N)[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = bh.to(tl.int64) * N + offs_m
    dq = tl.load(DQ + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=ok)
    tl.store(DQO + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_on
             + offs_d[None, :] * stride_od, dq.to(DQO.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_dkdv_tiles(dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, lo, hi,
                    Q_base, DO_base, DQ_base, stride_qn, stride_qd, stride_don, stride_dod,
                    Lse2_base, Delta_base, Pos, set_base, stride_pm, first, R, count,
                    M_base, stride_mq, stride_mk, Seed, Rows, b, h,
                    qk_scale, scale, keep_threshold, drop_scale,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, EDGE: tl.constexpr,
                    CAUSAL: tl.constexpr, STRIDED: tl.constexpr, MASK_KIND: tl.constexpr,
                    DROPOUT: tl.constexpr, ROWS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr, GROUPED: tl.constexpr):
    """dK, dV of one key tile from the query members [lo, hi) of one head (transposed tiles;
    drop_n: the positions dropout hashes for the key rows, _dropout_positions; GROUPED: each
    key from its group's queries, gs_n <= member < ge_n).
    EDGE ranges (a causal diagonal, a set's last partial tile) are not software-pipelined: the
    pipelined copy of the loop held registers the main loop's tiles needed (fewer spills)."""
    pos_next = _set_positions(Pos, set_base, stride_pm, first, R, lo + tl.arange(0, BLOCK_M),
                              count, STRIDED)
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=1 if EDGE else None):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        pos_m = pos_next  # one tile ahead, as in _fwd_tiles
        pos_next = _set_positions(Pos, set_base, stride_pm, first, R, offs_m + BLOCK_M, count,
                                  STRIDED)
        q_ok = offs_m < count
        q = _load_rows(Q_base, pos_m, stride_qn, stride_qd, q_ok, HEAD_DIM, BLOCK_D, EDGE, UPCAST)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [keys, queries]
        s_t = _masked_scores(s_t, M_base, pos_m[None, :], pos_n[:, None], stride_mq, stride_mk,
                             MASK_KIND)
        if EDGE:
            ok = q_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_m[None, :] >= offs_n[:, None])
            if GROUPED:
                ok = ok & (offs_m[None, :] >= gs_n[:, None]) & (offs_m[None, :] < ge_n[:, None])
            s_t = tl.where(ok, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - tl.load(Lse2_base + pos_m)[None, :])
        do = _load_rows(DO_base, pos_m, stride_don, stride_dod, q_ok, HEAD_DIM_V, BLOCK_DV, EDGE,
                        UPCAST)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            qhash = _query_hash(Seed, b, h, _dropout_positions(Rows, pos_m, ROWS))
            keep_t = _keep(qhash[None, :], drop_n[:, None], keep_threshold)
            pd_t = tl.where(keep_t, p_t * drop_scale, 0.0)
            dp_t = tl.where(keep_t, dp_t * drop_scale, 0.0)
        else:
            pd_t = p_t
        dv = tl.dot(pd_t.to(do.dtype), do, dv, input_precision=PRECISION)
        ds_t = p_t * (dp_t - tl.load(Delta_base + pos_m)[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
        if ATOMIC_DQ:
            ds_t = tl.where(key_ok[:, None], ds_t, 0.0)
            dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=PRECISION) * scale
            offs_d = tl.arange(0, BLOCK_D)
            tl.atomic_add(DQ_base + pos_m.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], dq,
                          mask=q_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    return dk, dv


@triton.jit
def _bwd_dkdv_head(dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, lo_g, hi_g,
                   start_n, count, h, b,
                   Q, DO, DQ, Lse2, Delta, Mask, Seed, Rows,
                   stride_qb, stride_qh, stride_qn, stride_qd,
                   stride_dob, stride_doh, stride_don, stride_dod, stride_mb, stride_mh,
                   stride_mq, stride_mk, H, N, Pos, set_base, stride_pm, first, R,
                   qk_scale, scale, keep_threshold, drop_scale,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, STRIDED: tl.constexpr, MASK_KIND: tl.constexpr,
                   DROPOUT: tl.constexpr, ROWS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, GROUPED: tl.constexpr):
    """Adds to dK, dV of one key tile what query head h's members of the set give (GROUPED:
    the queries [lo_g, hi_g) that the key rows' groups span)."""
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    bh64 = (b * H + h).to(tl.int64)
    Q_base = Q + b64 * stride_qb + h64 * stride_qh
    DO_base = DO + b64 * stride_dob + h64 * stride_doh
    DQ_base = DQ + bh64 * N * HEAD_DIM
    Lse2_base = Lse2 + bh64 * N
    Delta_base = Delta + bh64 * N
    M_base = Mask + b64 * stride_mb + h64 * stride_mh
    if GROUPED:
        if CAUSAL:
            lo_g = start_n
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, lo_g, hi_g,
            Q_base, DO_base, DQ_base, stride_qn, stride_qd, stride_don, stride_dod,
            Lse2_base, Delta_base, Pos, set_base, stride_pm, first, R, count,
            M_base, stride_mq, stride_mk, Seed, Rows, b, h, qk_scale, scale, keep_threshold,
            drop_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, CAUSAL,
            STRIDED, MASK_KIND, DROPOUT, ROWS, ATOMIC_DQ, UPCAST, PRECISION, True)
        return dk, dv
    if CAUSAL:  # queries from the key tile's diagonal on: the diagonal tiles masked
        lo = start_n + BLOCK_N
        dk, dv = _bwd_dkdv_tiles(
            dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, start_n,
            tl.minimum(lo, count),
            Q_base, DO_base, DQ_base, stride_qn, stride_qd, stride_don, stride_dod,
            Lse2_base, Delta_base, Pos, set_base, stride_pm, first, R, count,
            M_base, stride_mq, stride_mk, Seed, Rows, b, h, qk_scale, scale, keep_threshold,
            drop_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, CAUSAL,
            STRIDED, MASK_KIND, DROPOUT, ROWS, ATOMIC_DQ, UPCAST, PRECISION, False)
    else:
        lo = 0
    full = count // BLOCK_M * BLOCK_M
    dk, dv = _bwd_dkdv_tiles(
        dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, lo, full,
        Q_base, DO_base, DQ_base, stride_qn, stride_qd, stride_don, stride_dod,
        Lse2_base, Delta_base, Pos, set_base, stride_pm, first, R, count,
        M_base, stride_mq, stride_mk, Seed, Rows, b, h, qk_scale, scale, keep_threshold,
        drop_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, False, CAUSAL,
        STRIDED, MASK_KIND, DROPOUT, ROWS, ATOMIC_DQ, UPCAST, PRECISION, False)
    dk, dv = _bwd_dkdv_tiles(
        dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, tl.maximum(full, lo), count,
        Q_base, DO_base, DQ_base, stride_qn, stride_qd, stride_don, stride_dod,
        Lse2_base, Delta_base, Pos, set_base, stride_pm, first, R, count,
        M_base, stride_mq, stride_mk, Seed, Rows, b, h, qk_scale, scale, keep_threshold,
        drop_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, CAUSAL,
        STRIDED, MASK_KIND, DROPOUT, ROWS, ATOMIC_DQ, UPCAST, PRECISION, False)
    return dk, dv


@triton.jit
def _add_rows(acc, Buf, Final, Seen, seen_base, head_row, pos, row_ok, DIM: tl.constexpr,
              BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, WIDE: tl.constexpr):
    """The epilogue of a backward program: acc (float32 rows `pos` of one head of a [.., N, DIM]
    gradient whose first row is head_row) plus what the branches launched before left in Buf
    (float32), stored to Buf, or when LAST to Final in its own dtype. Buf is never zeroed:
    unless FIRST, a program reads it only at rows an earlier branch wrote, Seen[seen_base + pos]
    != 0. Offsets within the head are int32 unless WIDE (N * BLOCK >= 2**31): int64 pointers to
    every element spilled registers here."""
    offs = tl.arange(0, BLOCK)
    Buf = Buf + head_row * DIM
    Final = Final + head_row * DIM
    if WIDE:
        off = pos.to(tl.int64)[:, None] * DIM + offs[None, :]
    else:
        off = pos[:, None] * DIM + offs[None, :]
    ok = row_ok[:, None] & (offs[None, :] < DIM)
    if not FIRST:
        seen = tl.load(Seen + seen_base + pos, mask=row_ok, other=0)
        acc += tl.load(Buf + off, mask=ok & (seen != 0)[:, None], other=0.0)
    if LAST:
        tl.store(Final + off, acc.to(Final.dtype.element_ty), mask=ok)
    else:
        tl.store(Buf + off, acc, mask=ok)


@triton.jit
def _bwd_dkdv_kernel(DK, DV, DQ, DKO, DVO, Seen, Lse2, Delta,
                     Q, K, V, DO, Pos, Cnt, Grp, Mask, Seed, Rows,
                     stride_qb, stride_qh, stride_qn, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_dob, stride_doh, stride_don, stride_dod,
                     stride_mb, stride_mh, stride_mq, stride_mk,
                     stride_po, stride_ps, stride_pm, stride_co, stride_cs, stride_pg,
                     H, HKV, N, GROUP, SEG, R, qk_scale, scale, keep_threshold, drop_scale,
                     NUM_CLASSES,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     STRIDED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                     DROPOUT: tl.constexpr, ROWS: tl.constexpr, FIRST: tl.constexpr,
                     LAST: tl.constexpr, ONE_HEAD: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                     GROUPED: tl.constexpr, CHUNK: tl.constexpr):
    """One branch, one program per (key tile, batch * kv head * offset class, segment).

    The query heads of kv head g = h // GROUP fall into classes by their offset h % R; a program
    takes one class, loops over its heads (ONE_HEAD: GROUP <= R, so a class is one head) and
    their query tiles, and adds dK, dV of its key rows into DK, DV (float32; a LAST branch
    writes DKO, DVO in k's dtype instead, see _add_rows). Key rows of different programs never
    overlap within a launch: no atomics, a deterministic sum. Under CAUSAL the first key tiles
    (the longest: they meet every query tile after them) go first (`_scheduled`).
    """
    pid_n, pid, seg = _scheduled(CAUSAL, CHUNK)
    cls = pid % NUM_CLASSES
    bg = pid // NUM_CLASSES
    b = bg // HKV
    g = bg % HKV
    h_first = g * GROUP + cls
    off = h_first % R
    count = tl.load(Cnt + off * stride_co + seg * stride_cs).to(tl.int32)
    start_n = pid_n * BLOCK_N
    if start_n >= count:
        return
    first = seg * SEG + off
    set_base = off * stride_po + seg * stride_ps
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < count
    pos_n = _set_positions(Pos, set_base, stride_pm, first, R, offs_n, count, STRIDED)
    b64 = b.to(tl.int64)
    g64 = g.to(tl.int64)
    k = _load_rows(K + b64 * stride_kb + g64 * stride_kh, pos_n, stride_kn, stride_kd, key_ok,
                   HEAD_DIM, BLOCK_D, False, UPCAST)
    v = _load_rows(V + b64 * stride_vb + g64 * stride_vh, pos_n, stride_vn, stride_vd, key_ok,
                   HEAD_DIM_V, BLOCK_DV, False, UPCAST)
    drop_n = _dropout_positions(Rows, pos_n, ROWS)  # read only under DROPOUT
    if GROUPED:
        gs_n, ge_n, lo_g, hi_g = _group_bounds(Grp, set_base, stride_pm, stride_pg, offs_n,
                                               key_ok, count)
    else:
        gs_n, ge_n, lo_g, hi_g = offs_n, offs_n, 0, count
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # ONE_HEAD: a constant trip count of 1, which the compiler folds away (the loop's state
    # held registers the tiles needed)
    for i in range(0, 1 if ONE_HEAD else (GROUP - cls + R - 1) // R):
        dk, dv = _bwd_dkdv_head(
            dk, dv, k, v, pos_n, drop_n, offs_n, key_ok, gs_n, ge_n, lo_g, hi_g, start_n, count,
            h_first + i * R, b,
            Q, DO, DQ, Lse2, Delta, Mask, Seed, Rows, stride_qb, stride_qh, stride_qn,
            stride_qd, stride_dob, stride_doh, stride_don, stride_dod, stride_mb, stride_mh,
            stride_mq, stride_mk, H, N, Pos, set_base, stride_pm, first, R, qk_scale, scale,
            keep_threshold, drop_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
            BLOCK_N, CAUSAL, STRIDED, MASK_KIND, DROPOUT, ROWS, ATOMIC_DQ, UPCAST, PRECISION,
            GROUPED)
    head_row = bg.to(tl.int64) * N  # DK, DV, DKO, DVO: contiguous [B, HKV, N, *]
    _add_rows(dk * scale, DK, DKO, Seen, g64 * N, head_row, pos_n, key_ok, HEAD_DIM, BLOCK_D,
              FIRST, LAST, WIDE)
    _add_rows(dv, DV, DVO, Seen, g64 * N, head_row, pos_n, key_ok, HEAD_DIM_V, BLOCK_DV, FIRST,
              LAST, WIDE)


@triton.jit
def _bwd_dq_tiles(dq, q, do, lse2, delta, pos_m, offs_m, gs_m, ge_m, qhash, lo, hi,
                  K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
                  Pos, set_base, stride_pm, first, R, count, M_base, stride_mq, stride_mk,
                  qk_scale, keep_threshold, drop_scale, Rows,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr,
                  CAUSAL: tl.constexpr, STRIDED: tl.constexpr, MASK_KIND: tl.constexpr,
                  DROPOUT: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr, GROUPED: tl.constexpr):
    """dQ of one query tile from the key members [lo, hi) of its set (GROUPED: as _fwd_tiles)."""
    pos_next = _set_positions(Pos, set_base, stride_pm, first, R, lo + tl.arange(0, BLOCK_N),
                              count, STRIDED)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pos_n = pos_next  # one tile ahead, as in _fwd_tiles
        pos_next = _set_positions(Pos, set_base, stride_pm, first, R, offs_n + BLOCK_N, count,
                                  STRIDED)
        key_ok = offs_n < count
        k = _load_rows(K_base, pos_n, stride_kn, stride_kd, key_ok, HEAD_DIM, BLOCK_D, EDGE, UPCAST)
        v = _load_rows(V_base, pos_n, stride_vn, stride_vd, key_ok, HEAD_DIM_V, BLOCK_DV, EDGE,
                       UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = _masked_scores(s, M_base, pos_m[:, None], pos_n[None, :], stride_mq, stride_mk,
                           MASK_KIND)
        if EDGE:
            ok = key_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            if GROUPED:
                ok = ok & (offs_n[None, :] >= gs_m[:, None]) & (offs_n[None, :] < ge_m[:, None])
            s = tl.where(ok, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            keep = _keep(qhash[:, None], _dropout_positions(Rows, pos_n, ROWS)[None, :],
                         keep_threshold)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(DQ, DQO, Seen, Lse2, Delta,
                   Q, K, V, DO, Pos, Cnt, Grp, Mask, Seed, Rows,
                   stride_qb, stride_qh, stride_qn, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_don, stride_dod,
                   stride_mb, stride_mh, stride_mq, stride_mk,
                   stride_po, stride_ps, stride_pm, stride_co, stride_cs, stride_pg,
                   H, HKV, N, GROUP, SEG, R, qk_scale, scale, keep_threshold, drop_scale,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   STRIDED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                   DROPOUT: tl.constexpr, ROWS: tl.constexpr, FIRST: tl.constexpr,
                   LAST: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   WIDE: tl.constexpr, GROUPED: tl.constexpr, CHUNK: tl.constexpr):
    """One branch, one program per (query tile, batch * head, segment): adds dQ of its rows into
    DQ (float32; a LAST branch writes DQO in q's dtype instead, see _add_rows)."""
    bh, b, h, count, start_m, first, set_base, offs_m, row_ok, pos_m = _query_tile(
        Pos, Cnt, stride_po, stride_ps, stride_pm, stride_co, stride_cs, H, SEG, R,
        BLOCK_M, STRIDED, CAUSAL, CHUNK)
    if start_m >= count:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    g64 = (h // GROUP).to(tl.int64)
    q = _load_rows(Q + b64 * stride_qb + h64 * stride_qh, pos_m, stride_qn, stride_qd, row_ok,
                   HEAD_DIM, BLOCK_D, False, UPCAST)
    do = _load_rows(DO + b64 * stride_dob + h64 * stride_doh, pos_m, stride_don, stride_dod,
                    row_ok, HEAD_DIM_V, BLOCK_DV, False, UPCAST)
    rows = bh.to(tl.int64) * N + pos_m
    lse2 = tl.load(Lse2 + rows)
    delta = tl.load(Delta + rows)
    K_base = K + b64 * stride_kb + g64 * stride_kh
    V_base = V + b64 * stride_vb + g64 * stride_vh
    M_base = Mask + b64 * stride_mb + h64 * stride_mh
    if DROPOUT:
        qhash = _query_hash(Seed, b, h, _dropout_positions(Rows, pos_m, ROWS))
    else:
        qhash = pos_m.to(tl.uint32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if GROUPED:  # as in _fwd_kernel
        gs_m, ge_m, lo, hi = _group_bounds(Grp, set_base, stride_pm, stride_pg, offs_m, row_ok,
                                           count)
        if CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M, count)
        dq = _bwd_dq_tiles(dq, q, do, lse2, delta, pos_m, offs_m, gs_m, ge_m, qhash, lo, hi,
                           K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
                           Pos, set_base, stride_pm, first, R, count, M_base, stride_mq,
                           stride_mk, qk_scale, keep_threshold, drop_scale, Rows,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, CAUSAL,
                           STRIDED, MASK_KIND, DROPOUT, ROWS, UPCAST, PRECISION, True)
    else:
        if CAUSAL:
            lo = start_m
            hi = tl.minimum(start_m + BLOCK_M, count)
        else:
            lo = count // BLOCK_N * BLOCK_N
            hi = count
        dq = _bwd_dq_tiles(dq, q, do, lse2, delta, pos_m, offs_m, offs_m, offs_m, qhash, 0, lo,
                           K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
                           Pos, set_base, stride_pm, first, R, count, M_base, stride_mq,
                           stride_mk, qk_scale, keep_threshold, drop_scale, Rows,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, CAUSAL,
                           STRIDED, MASK_KIND, DROPOUT, ROWS, UPCAST, PRECISION, False)
        dq = _bwd_dq_tiles(dq, q, do, lse2, delta, pos_m, offs_m, offs_m, offs_m, qhash, lo, hi,
                           K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
                           Pos, set_base, stride_pm, first, R, count, M_base, stride_mq,
                           stride_mk, qk_scale, keep_threshold, drop_scale, Rows,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, CAUSAL,
                           STRIDED, MASK_KIND, DROPOUT, ROWS, UPCAST, PRECISION, False)
    # DQ, DQO: contiguous [B, H, N, D]
    _add_rows(dq * scale, DQ, DQO, Seen, h64 * N, bh.to(tl.int64) * N, pos_m, row_ok, HEAD_DIM,
              BLOCK_D, FIRST, LAST, WIDE)
