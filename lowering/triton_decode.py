"""A fused Triton decode kernel: queries that continue a cached causal sequence (SPEC section 5).

FlashDecoding over dilated attention. A query at key row `row`, position p in its sequence,
lies in branch (w, r) in segment j = p // w at in-segment position c = p % w, in offset class
o = rank(c) % r (rank: the inverse of the order pi_w, the identity or the Hilbert order). Query
head h takes part in the branch only when h % r == o; its keys are then the sequence's tokens at
positions j*w + e for the members e of class o with e <= c. Padding may lie between a
sequence's tokens (SPEC section 5), so a key is found by its rank among the batch row's real
tokens: row_of_rank[R - p + j*w + e], R the query row's rank (sequences.key_ranks, built per
call in O(Nk) on the device where position_ids were given; without them, or without such
padding, it is the row row - p + j*w + e, read with no table). The members of a class are kept in ascending order, so the causal keys are a prefix of them:
the first slot_of[c] + 1 (slot_of[c] is c's own index among its class's members). A query thus
reads at most w / r key rows per branch, however long the cache is.

Two launches, whatever the number of branches:
- `_decode_split_kernel`: one program per (batch * kv head * query, split). The splits are
  chunks of SPLIT_N consecutive members of one branch's class; every branch has its own splits
  and a small table (`meta`) says which branch and which members a split covers. A program
  serves all query heads of its kv head at once (grouped-query attention reads each key row
  once per group): the heads that do not take part in the branch are masked out. It writes its
  partial result, normalised, and its log-sum-exp (float32; -inf and 0 where it has no key).
- `_decode_combine_kernel`: one program per (batch * head * query) merges the partials of all
  splits of all branches by log-sum-exp. That one merge is SPEC section 2's mixture: a softmax
  over the union of the branches' key sets, each branch's keys counted once.

No host synchronisation: every launch parameter comes from shapes and from tables built once
per configuration (make one call before capturing a CUDA graph, so the tables exist). Forward
only: decoding has no backward, and nothing here records one.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import plans
from .sequences import key_ranks
from .triton_launch import Launch, Slot, Value, int_class, launch_stream
from .triton_lowering import LOG2E, MAX_HEAD_DIM, NEG_INF, SUPPORTED_DTYPES, interpreter_active
from .tuning import fp32_precision, tuning

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

META_COLS = 8  # w, r, members offset, set size, table offset, first member of the split, -, -


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _decode_split_kernel(Q, K, V, KPos, QRows, Rank, RowOfRank, Members, ClassOf, SlotOf, Meta,
                         OPart, LPart,
                         stride_qb, stride_qh, stride_qn, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_pb, stride_pn, stride_rb, stride_rn, stride_tb,
                         HQ, HKV, NQ, NK, GROUP, NUM_SPLITS, SPLIT_N, qk_scale,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr, HOLES: tl.constexpr):
    """One split of one branch for the query heads of one kv head at one query.

    OPart [B, HQ, NQ, NUM_SPLITS, HEAD_DIM_V] float32 gets the split's normalised output,
    LPart [B, HQ, NQ, NUM_SPLITS] its natural log-sum-exp (-inf, with output 0, without keys).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    i = (pid % NQ).to(tl.int64)
    bg = pid // NQ
    b = bg // HKV
    g = bg % HKV
    b64 = b.to(tl.int64)

    meta = Meta + split * 8  # META_COLS
    w = tl.load(meta)
    r = tl.load(meta + 1)
    mem_off = tl.load(meta + 2)
    set_size = tl.load(meta + 3)
    tab_off = tl.load(meta + 4)
    m0 = tl.load(meta + 5)

    # The query: its key row, its position; invalid rows (negative, past the keys, padding)
    # read row 0 and get no key.
    row = tl.load(QRows + b64 * stride_rb + i * stride_rn)
    row_ok = (row >= 0) & (row < NK)
    row = tl.where(row_ok, row, 0)
    pos = tl.load(KPos + b64 * stride_pb + row * stride_pn)
    valid = row_ok & (pos >= 0)
    pos = tl.where(valid, pos, 0)
    # rank (among the batch row's real tokens) of in-segment position 0 of the query's segment:
    # the keys are found by rank, so padding between a sequence's tokens is never read
    # (without HOLES no padding lies between a sequence's tokens: ranks are rows)
    rank_base = RowOfRank + b64 * stride_tb
    if HOLES:
        seg_rank = tl.load(Rank + b64 * stride_tb + row) - pos + (pos // w) * w
    else:
        seg_rank = row - pos + (pos // w) * w
    c = pos % w
    cls = tl.load(ClassOf + tab_off + c)
    count = tl.load(SlotOf + tab_off + c) + 1  # members e <= c: a prefix of the ascending class
    offs_h = tl.arange(0, BLOCK_H)
    heads = g * GROUP + offs_h
    in_group = offs_h < GROUP
    head_ok = in_group & (heads % r == cls)
    # no key when the query is invalid or none of the group's heads takes part in the branch
    # (with r > GROUP that is most programs: they must not read the keys)
    any_head = tl.max(head_ok.to(tl.int32), 0) > 0
    hi = tl.where(valid & any_head, tl.minimum(count, m0 + SPLIT_N), m0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b64 * stride_qb + heads.to(tl.int64)[:, None] * stride_qh + i * stride_qn
                + offs_d[None, :] * stride_qd,
                mask=head_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:  # the interpreter multiplies bfloat16 as raw integers in tl.dot: go through float32
        q = q.to(tl.float32)
    K_base = K + b64 * stride_kb + g.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + g.to(tl.int64) * stride_vh
    set_base = Members + mem_off + cls * set_size

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(m0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        e = tl.load(set_base + offs_n, mask=key_ok, other=0)
        krank = seg_rank + e
        key_ok = key_ok & (krank >= 0) & (krank < NK)  # ranks outside the cache: never read
        if HOLES:
            krow = tl.load(rank_base + krank, mask=key_ok, other=0).to(tl.int64)
        else:
            krow = krank.to(tl.int64)
        k = tl.load(K_base + krow[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        v = tl.load(V_base + krow[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(head_ok[:, None] & key_ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_use = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_use)) * 0.6931471805599453)
    o = acc / l_use[:, None]
    part = ((b64 * HQ + heads.to(tl.int64)) * NQ + i) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(OPart + part[:, None] * HEAD_DIM_V + offs_dv[None, :], o,
             mask=in_group[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LPart + part, lse, mask=in_group)


@triton.jit
def _decode_combine_kernel(OPart, LPart, Out, Lse, NUM_SPLITS,
                           HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    """Merges the NUM_SPLITS partials of one (batch, head, query) by log-sum-exp: Out (q's
    dtype, contiguous [B, HQ, NQ, HEAD_DIM_V]) and Lse (float32); no key at all: 0 and -inf."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        lse_s = tl.load(LPart + row * NUM_SPLITS + s0 + offs_s, mask=s0 + offs_s < NUM_SPLITS,
                        other=float("-inf"))
        top = tl.maximum(top, lse_s)
    top_all = tl.max(top, 0)
    base = tl.where(top_all == float("-inf"), 0.0, top_all)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        ok = s0 + offs_s < NUM_SPLITS
        lse_s = tl.load(LPart + row * NUM_SPLITS + s0 + offs_s, mask=ok, other=float("-inf"))
        wt = tl.exp(lse_s - base)  # 0 for splits without a key
        o = tl.load(OPart + (row * NUM_SPLITS + s0 + offs_s)[:, None] * HEAD_DIM_V
                    + offs_dv[None, :], mask=ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                    other=0.0)
        total += wt
        acc += tl.sum(o * wt[:, None], 0)
    total_all = tl.sum(total, 0)
    none = total_all == 0.0
    denom = tl.where(none, 1.0, total_all)
    tl.store(Out + row * HEAD_DIM_V + offs_dv, (acc / denom).to(Out.dtype.element_ty),
             mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + row, tl.where(none, float("-inf"), base + tl.log(denom)))


# ----------------------------------------------------------------------------- tables


@functools.lru_cache(maxsize=256)
def _host_tables(w: int, r: int, hilbert: bool) -> tuple[Tensor, Tensor, Tensor]:
    """plans.class_members and plans.class_of (the sets' definition, in one place) as int32."""
    members = plans.class_members(w, r, hilbert)
    cls, slot = plans.class_of(w, r, hilbert)
    return members.to(torch.int32), cls.to(torch.int32), slot.to(torch.int32)


@functools.lru_cache(maxsize=256)
def _device_tables(w: int, r: int, hilbert: bool, device: str) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.to(device) for t in _host_tables(w, r, hilbert))


def branch_tables(w: int, r: int, hilbert: bool, device) -> tuple[Tensor, Tensor, Tensor]:
    """(members int32 [r, w // r], class_of int32 [w], slot_of int32 [w]) of branch (w, r) on
    `device`, made once: members[o] are the in-segment positions of offset class o, ascending;
    class_of[c] is c's class and slot_of[c] its index there (members[class_of[c], slot_of[c]]
    == c)."""
    w, r = int(w), int(r)
    if w <= 0 or r <= 0 or w % r:
        raise ValueError(f"segment length {w} must be a positive multiple of dilation rate {r}")
    return _device_tables(w, r, bool(hilbert), str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _launch_tables(segment_lengths: tuple, dilation_rates: tuple, hilbert: bool, split_n: int,
                   device: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(members, class_of, slot_of, meta) over all branches, concatenated; meta int32
    [splits, META_COLS] holds per split: w, r, members offset, set size, class_of / slot_of
    offset, first member."""
    members, class_of, slot_of, meta = [], [], [], []
    mem_off = tab_off = 0
    for w, r in zip(segment_lengths, dilation_rates):
        mem, cls, slot = _host_tables(w, r, hilbert)
        members.append(mem.reshape(-1))
        class_of.append(cls)
        slot_of.append(slot)
        size = w // r
        for m0 in range(0, size, split_n):
            meta.append([w, r, mem_off, size, tab_off, m0] + [0] * (META_COLS - 6))
        mem_off += mem.numel()
        tab_off += w
    # int32 offsets: the tables of every branch together stay far below 2**31 entries
    meta_t = torch.tensor(meta, dtype=torch.int32)
    return (torch.cat(members).to(device), torch.cat(class_of).to(device),
            torch.cat(slot_of).to(device), meta_t.to(device))


# ----------------------------------------------------------------------------- launcher


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _split_size(total_keys: int, largest_set: int, programs: int, block_n: int,
                device: torch.device, interpreted: bool) -> int:
    """Keys per split: enough splits that programs * splits fills the GPU about twice over, at
    most 64 splits per branch, whole BLOCK_N tiles."""
    if interpreted:
        return 2 * block_n  # small splits: the tests cross split edges with small sets
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, -(-2 * sms // max(1, programs)))  # splits over all branches
    split = -(-total_keys // want)
    split = max(split, -(-largest_set // 64), block_n)
    return -(-split // block_n) * block_n


def decode_forward(q: Tensor, k: Tensor, v: Tensor, key_positions: Tensor, query_rows: Tensor,
                   segment_lengths, dilation_rates, hilbert: bool, scale: float | None,
                   *, split_size: int | None = None,
                   gapless: bool = False) -> tuple[Tensor, Tensor]:
    """Dilated attention of queries that continue cached causal sequences, in two launches.

    q [B, Hq, Nq, D]; k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] (Hq a multiple of Hkv: query head h
    reads kv head h // (Hq // Hkv)); key_positions int [B, Nk]: each key row's position in its
    sequence, negative for padding; query_rows int [B, Nq]: the key row each query stands at.
    A query at a negative row, past Nk or at a padding row gets out 0 and lse -inf, as does a
    (query, head) that takes part in no branch. gapless: no padding lies between a sequence's
    tokens (lowering/sequences.Cache.gapless), so keys are found by row arithmetic and the O(Nk)
    rank tables are not built. scale None means 1 / sqrt(D). split_size: keys
    per split (a multiple of the kernel's tile), for tests; None chooses.

    Returns (out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] float32, natural log). Forward
    only: there is no backward (decoding needs none), and no autograd graph is recorded. No host
    synchronisation: it can be captured in a CUDA graph once a first call built its tables.
    """
    interpreted = interpreter_active()
    knobs = tuning()
    key_positions, query_rows = key_positions.to(torch.int64), query_rows.to(torch.int64)
    key = _key(q, k, v, key_positions, query_rows, segment_lengths, dilation_rates, hilbert, scale,
               split_size, gapless, interpreted, knobs)
    program = _programs.get(key) if key is not None else None
    # a program's key holds all that the checks read but the cache's length: a call that finds
    # one, with k, v and key_positions of one length, passes them
    if program is None or not (v.shape[2] == k.shape[2]
                               and key_positions.shape == (q.shape[0], k.shape[2])):
        _check(q, k, v, key_positions, query_rows, segment_lengths, dilation_rates, split_size,
               interpreted)
    b, hq, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    if b * hq * nq == 0 or nk == 0 or not len(segment_lengths):
        return (torch.zeros(b, hq, nq, dv, dtype=q.dtype, device=q.device),
                torch.full((b, hq, nq), NEG_INF, dtype=torch.float32, device=q.device))
    if gapless:  # keys are rows: no rank tables (the kernel does not read them)
        rank = row_of_rank = key_positions
    else:
        rank, row_of_rank = key_ranks(key_positions, torch.int32)  # contiguous [B, Nk]
    tensors = (q, k, v, key_positions, query_rows, rank, row_of_rank)
    if program is None:
        segment_lengths = tuple(int(w) for w in segment_lengths)
        dilation_rates = tuple(int(r) for r in dilation_rates)
        program = _Program(*tensors, segment_lengths, dilation_rates, bool(hilbert),
                           _scale(scale, q), split_size, gapless, interpreted, knobs)
        if key is not None:
            if len(_programs) >= 64:
                _programs.clear()
            _programs[key] = program
    return program(tensors, _values(k, v, key_positions, gapless))


def _scale(scale, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _values(k: Tensor, v: Tensor, key_positions: Tensor, gapless: bool) -> tuple:
    """A call's Values (the slots K_B ... CACHE_LEN): k's and v's batch and head strides, the
    row strides of key_positions and of the rank tables (key_positions itself when gapless,
    else contiguous: key_ranks), the cache's length."""
    nk = k.shape[2]
    return (k.stride(0), k.stride(1), v.stride(0), v.stride(1), key_positions.stride(0),
            key_positions.stride(0) if gapless else nk, nk)


def _key(q, k, v, key_positions, query_rows, segment_lengths, dilation_rates, hilbert, scale,
         split_size, gapless, interpreted, knobs) -> tuple | None:
    """A program's key: everything its launches fix (triton_launch.Launch) and everything the
    checks read, but the tensors' addresses and the Values (of which the class Triton
    specialises on); None for arguments that are no tensors of four and two dimensions."""
    try:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or key_positions.dim() != 2 \
                or query_rows.dim() != 2:
            return None
        return (q.shape, q.stride(), k.shape[:2], k.shape[3], k.stride()[2:], v.shape[:2],
                v.shape[3], v.stride()[2:], key_positions.stride(1), query_rows.shape,
                query_rows.stride(),
                *((t.dtype, t.device, t.data_ptr() % 16)
                  for t in (q, k, v, key_positions, query_rows)),
                tuple(segment_lengths), tuple(dilation_rates), bool(hilbert), _scale(scale, q),
                split_size, bool(gapless), interpreted,
                fp32_precision(q.dtype, interpreted, False, knobs), id(knobs),
                *map(int_class, _values(k, v, key_positions, gapless)))
    except (AttributeError, TypeError, ValueError):
        return None


def _check(q, k, v, key_positions, query_rows, segment_lengths, dilation_rates, split_size,
           interpreted) -> None:
    """decode_forward's checks (ValueError, or RuntimeError where the kernel cannot run)."""
    if q.device.type == "cpu" and not interpreted:
        raise RuntimeError("the Triton decode kernel on CPU tensors needs TRITON_INTERPRET=1 set "
                           "before triton is first imported")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, hq, nq, d = q.shape
    _, hkv, nk, _ = k.shape
    dv = v.shape[-1]
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != d:
        raise ValueError(f"k, v must be [B, Hkv, Nk, D] and [B, Hkv, Nk, Dv] for q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    if tuple(key_positions.shape) != (b, nk) or tuple(query_rows.shape) != (b, nq):
        raise ValueError(f"key_positions must be [B, Nk] = {(b, nk)} and query_rows [B, Nq] = "
                         f"{(b, nq)}, got {tuple(key_positions.shape)}, {tuple(query_rows.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one of {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM}, got D = {d}, Dv = {dv}")
    devices = {t.device for t in (q, k, v, key_positions, query_rows)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    segment_lengths = tuple(int(w) for w in segment_lengths)
    dilation_rates = tuple(int(r) for r in dilation_rates)
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(f"segment_lengths and dilation_rates differ in length: "
                         f"{segment_lengths}, {dilation_rates}")
    for w, r in zip(segment_lengths, dilation_rates):
        if w <= 0 or r <= 0 or w % r:
            raise ValueError(f"segment length {w} must be a positive multiple of dilation rate {r}")
    block_n = _tiles(q, dv, interpreted)[0]
    if split_size is not None and (split_size <= 0 or split_size % block_n):
        raise ValueError(f"split_size must be a positive multiple of {block_n}, got {split_size}")


def _tiles(q: Tensor, dv: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel."""
    if interpreted:
        return 16, 4, 1
    wide = max(16, _next_pow2(q.shape[-1]), _next_pow2(dv)) > 128 or q.dtype == torch.float32
    return (32 if wide else 64), 4, 2


# The launches' slots (triton_launch.Slot): a call's tensors and workspace, then the integers
# that change from one decoding step to the next against a growing cache (its length and the
# strides that follow from it), passed as they are (triton_launch.Value)
_SLOTS = ("q", "k", "v", "key_positions", "query_rows", "rank", "row_of_rank", "opart", "lpart",
          "out", "lse")
Q, K, V, KPOS, QROWS, RANK, ROW_OF_RANK, OPART, LPART, OUT, LSE = (
    Slot(i, n) for i, n in enumerate(_SLOTS))
K_B, K_H, V_B, V_H, P_B, T_B, CACHE_LEN = (
    Value(len(_SLOTS) + i, n) for i, n in enumerate(
        ("stride_kb", "stride_kh", "stride_vb", "stride_vh", "stride_pb", "stride_tb", "nk")))

# Programs by what their launches fix (decode_forward's key): a decoding step passes the same
# arguments but for the cache's length, layer after layer and token after token.
_programs: dict = {}


class _Program:
    """decode_forward's two launches for one configuration, planned once (the tables, the
    splits, the tiles and the grid; triton_launch.Launch keeps what Triton's binding found),
    then fed each call's tensors and Values."""

    def __init__(self, q, k, v, key_positions, query_rows, rank, row_of_rank, segment_lengths,
                 dilation_rates, hilbert, scale, split_size, gapless, interpreted, knobs):
        b, hq, nq, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        group = hq // hkv
        upcast = interpreted and q.dtype == torch.bfloat16
        block_d, block_dv = max(16, _next_pow2(d)), max(16, _next_pow2(dv))
        block_h = max(16, _next_pow2(group))
        block_n, num_warps, num_stages = _tiles(q, dv, interpreted)
        sizes = [w // r for w, r in zip(segment_lengths, dilation_rates)]
        programs = b * hkv * nq
        split_n = split_size or _split_size(sum(sizes), max(sizes), programs, block_n, q.device,
                                            interpreted)
        members, class_of, slot_of, meta = _launch_tables(
            segment_lengths, dilation_rates, hilbert, split_n, str(q.device))
        num_splits = meta.shape[0]
        if num_splits > 65535:
            raise ValueError(f"{num_splits} splits exceed the grid's 65535; pass a larger "
                             f"split_size")
        self.device, self.dtype, self.knobs = q.device, q.dtype, knobs
        self.out_shape, self.rows = (b, hq, nq, dv), (b, hq, nq)
        # one float32 workspace: the splits' outputs and log-sum-exps, then lse (every entry
        # written by the kernels), at 256-byte starts
        parts = b * hq * nq * num_splits
        self.spans = [(0, parts * dv), (_up(parts * dv), _up(parts * dv) + parts)]
        lse_start = _up(self.spans[1][1])
        self.lse_span = (lse_start, lse_start + b * hq * nq)
        self.workspace = self.lse_span[1]
        self.steps = [
            Launch(_decode_split_kernel,
                   [Q, K, V, KPOS, QROWS, RANK, ROW_OF_RANK, members, class_of, slot_of, meta,
                    OPART, LPART, *q.stride(), K_B, K_H, *k.stride()[2:], V_B, V_H,
                    *v.stride()[2:], P_B, key_positions.stride(1), *query_rows.stride(), T_B,
                    hq, hkv, nq, CACHE_LEN, group, num_splits, split_n, scale * LOG2E],
                   dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                        BLOCK_H=block_h, BLOCK_N=block_n, UPCAST=upcast, HOLES=not gapless,
                        PRECISION=fp32_precision(q.dtype, interpreted, upcast, knobs),
                        num_warps=num_warps, num_stages=num_stages),
                   (programs, num_splits)),
            Launch(_decode_combine_kernel, [OPART, LPART, OUT, LSE, num_splits],
                   dict(HEAD_DIM_V=dv, BLOCK_DV=block_dv,
                        BLOCK_S=min(_next_pow2(num_splits), max(1, 4096 // block_dv)),
                        num_warps=4),
                   (b * hq * nq,))]

    def __call__(self, tensors: tuple, values: tuple) -> tuple[Tensor, Tensor]:
        device = self.device
        workspace = torch.empty(self.workspace, dtype=torch.float32, device=device)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=device)
        lse = workspace[self.lse_span[0]:self.lse_span[1]].view(self.rows)
        (o0, o1), (l0, l1) = self.spans
        bufs = [*tensors, workspace[o0:o1], workspace[l0:l1], out, lse, *values]
        stream = launch_stream(device, self.knobs)
        for step in self.steps:
            step(bufs, stream)
        return out, lse


def _up(n: int) -> int:
    return -(-n // 64) * 64
