"""Independent float64 reference for hilbert_fx's dilated attention, written from SPEC.md section 2.

Slow and explicit on purpose: key sets are built as Python sets of positions, then turned into a
dense per-head "count" matrix C[h, p, p'] = number of branches whose key set for query p (head h)
contains p'. One softmax per query over that multiset, in float64, differentiable through autograd.
"""
import math

import torch


def d2xy(n, d):  # SPEC section 2, verbatim: classic Hilbert curve, n a power of two
    x = y = 0
    s = 1
    while s < n:
        rx = 1 & (d // 2)
        ry = 1 & (d ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x += s * rx
        y += s * ry
        d //= 4
        s *= 2
    return x, y


def hilbert_order(w):
    """pi_w as a list: pi_w[t] = offset (within the segment) that rank t stands for."""
    s = 1
    while s * s < w:
        s *= 2
    order = []
    for d in range(s * s):
        x, y = d2xy(s, d)
        if y * s + x < w:
            order.append(y * s + x)
    return order


def selected_sets(n, w, r, h, hilbert):
    """For one branch (w, r) and query head h: list of per-segment sets of selected positions."""
    pi = hilbert_order(w) if hilbert else list(range(w))
    o = h % r
    segments = []
    for j in range((n + w - 1) // w):
        sel = set()
        for t in range(w):
            pos = j * w + pi[t]
            if t % r == o and pos < n:
                sel.add(pos)
        segments.append(sel)
    return segments


def count_matrix(n, hq, segment_lengths, dilation_rates, hilbert):
    """C[h, p, p'] = number of branches i with p' in K_i(p, h) (before causal / mask)."""
    c = [[[0] * n for _ in range(n)] for _ in range(hq)]  # plain lists: fast enough to loop
    for h in range(hq):
        for w, r in zip(segment_lengths, dilation_rates):
            for sel in selected_sets(n, w, r, h, hilbert):
                for p in sel:
                    for p2 in sel:
                        c[h][p][p2] += 1
    return torch.tensor(c, dtype=torch.float64).reshape(hq, n, n)


def reference_dilated_attention(q, k, v, segment_lengths, dilation_rates, *, hilbert=False,
                                is_causal=False, attn_mask=None, scale=None, enable_gqa=False,
                                dropout_p=0.0, dropout_keep=None):
    segment_lengths, dilation_rates = list(segment_lengths), list(dilation_rates)
    assert len(segment_lengths) == len(dilation_rates) and len(segment_lengths) > 0
    assert all(w > 0 and r > 0 and w % r == 0 for w, r in zip(segment_lengths, dilation_rates))
    assert not (is_causal and attn_mask is not None)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    assert k.shape == (b, hkv, n, d) and v.shape[:3] == (b, hkv, n)
    assert hq % hkv == 0 and (enable_gqa or hq == hkv)
    q, k, v = q.double(), k.double(), v.double()
    g = hq // hkv
    kv_head = [h // g for h in range(hq)]
    k, v = k[:, kv_head], v[:, kv_head]  # query head h reads kv head h // g
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    allowed = count_matrix(n, hq, segment_lengths, dilation_rates, hilbert).expand(b, hq, n, n)
    s = scale * (q @ k.transpose(-1, -2))
    if is_causal:  # keep p' <= p
        allowed = allowed * torch.ones(n, n, dtype=torch.float64).tril()
    if attn_mask is not None:
        m = attn_mask.expand(b, hq, n, n)
        if m.dtype == torch.bool:
            allowed = allowed * m.double()
        else:
            m = m.double()
            allowed = allowed * (m != float("-inf")).double()  # exp(-inf) == 0: key forbidden
            s = s + torch.where(m == float("-inf"), torch.zeros_like(m), m)
    ok = allowed > 0
    rowmax = torch.where(ok, s, torch.full_like(s, float("-inf"))).amax(-1, keepdim=True)
    rowmax = torch.where(torch.isinf(rowmax), torch.zeros_like(rowmax), rowmax).detach()
    z = torch.where(ok, s - rowmax, torch.zeros_like(s))
    weights = allowed * torch.exp(z)  # counts * exp, exactly 0 where no branch selects p'
    denom = weights.sum(-1, keepdim=True)
    empty = denom == 0
    probs = weights / torch.where(empty, torch.ones_like(denom), denom)  # empty rows -> all 0
    if dropout_keep is not None:
        probs = probs * dropout_keep.double() / (1.0 - dropout_p)
    return probs @ v


# ------------------------------------------------------------------ dropout's keep bits
#
# The bits are not in the SPEC (it asks for dropout as SDPA does); they are the package's
# definition, lowering/dropout.py's docstring: a 'lowbias32' hash of the seed, then of
# (batch << 16) + head, then of the query's position, then of the key's, an entry kept when
# the hash's top 24 bits reach round(dropout_p * 2**24). Written again here in plain Python
# integers, sharing no code with the package, for rows that stand for any positions.

def _lowbias32(x):
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def dropout_keep_of_positions(seed, batch, heads, positions, dropout_p):
    """[batch, heads, N, N] bool: the keep bit of (query row i, key row j) of each batch row and
    head, where row i stands for position positions[i] (a ring's rows stand for their global
    positions; on one device positions[i] = i). For reference_dilated_attention's dropout_keep."""
    positions = [int(p) for p in positions]
    n = len(positions)
    threshold = int(round(dropout_p * (1 << 24)))
    keep = torch.zeros(batch, heads, n, n, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            head_hash = _lowbias32(int(seed) ^ _lowbias32((b << 16) + h))
            for i, p in enumerate(positions):
                query_hash = _lowbias32(head_hash ^ (p & 0xFFFFFFFF))
                keep[b, h, i] = torch.tensor(
                    [(_lowbias32(query_hash ^ (p2 & 0xFFFFFFFF)) >> 8) >= threshold
                     for p2 in positions])
    return keep


# ------------------------------------------------------------------ SPEC section 5: sequences
#
# Built from the section-2 reference above applied to each sequence alone: split each batch row
# into its sequences (by per-token positions), run reference_dilated_attention on each sequence's
# own keys and values, and put each query's row back where the query sits. Nothing is shared with
# the package: the split is done here, in plain Python, from the definitions.

def sequences_of_row(positions, used):
    """[(start, length)] of the sequences among rows [0, used) of one batch row.

    positions[i] is row i's position in its own sequence, negative for padding. A sequence is a
    run of consecutive rows with positions 0, 1, 2, ...; a row with position 0 starts a new one.
    Rows at or past `used` (a static cache's unused tail) are in no sequence.
    """
    positions = [int(p) for p in positions]
    assert 0 <= used <= len(positions)
    seqs = []
    for i in range(used):
        p = positions[i]
        if p < 0:
            continue  # padding: no sequence
        if p == 0:
            seqs.append([i, 1])
        else:
            assert seqs and seqs[-1][0] + seqs[-1][1] == i and positions[i - 1] == p - 1, \
                f"row {i} has position {p} but does not continue a sequence: {positions}"
            seqs[-1][1] += 1
    return [tuple(s) for s in seqs]


def position_ids_from_cu_seqlens(cu_seqlens, batch, n):
    """FlashAttention's varlen convention: cu_seqlens [S + 1] are cumulative lengths over the
    batch * n tokens read row after row; token t of sequence s is flat token cu[s] + t and has
    position t; tokens from cu[-1] on are padding (-1). Each sequence lies inside one row."""
    cu = [int(c) for c in cu_seqlens]
    assert cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= batch * n
    flat = [-1] * (batch * n)
    for a, b in zip(cu, cu[1:]):
        assert a == b or a // n == (b - 1) // n, f"sequence [{a}, {b}) spans two rows of {n}"
        for t in range(a, b):
            flat[t] = t - a
    return torch.tensor(flat, dtype=torch.int64).reshape(batch, n)


def reference_sequences(q, k, v, segment_lengths, dilation_rates, *, position_ids=None,
                        seqused_k=None, hilbert=False, is_causal=False, scale=None,
                        enable_gqa=False):
    """Float64 output [B, Hq, Nq, Dv] of SPEC section 5: every query gets what section 2 computes
    for it on its own sequence alone, at its position there; padding queries get 0.

    q [B, Hq, Nq, D]; k, v [B, Hkv, Nk, *]. position_ids [B, Nk] or [Nk] (each key row's position
    in its sequence, negative = padding; None: each row is one sequence). seqused_k [B] (row b's
    keys are rows [0, seqused_k[b]); None: all Nk rows). The Nq queries of row b are key rows
    used_b - Nq + i (the last Nq tokens; with Nq == Nk and all rows used, row i itself). A query
    whose row is padding, or lies before row 0, gets 0.

    A cache query at position p of a sequence gets row p of the causal op on that sequence: the
    sequence's q is filled with zeros where no query is given (a causal row p reads q_p and keys
    <= p only, so those rows change nothing for the rows we keep).
    """
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    Dv = v.shape[3]
    assert k.shape[0] == v.shape[0] == B and v.shape[2] == Nk and Nq <= Nk
    if Nq < Nk or seqused_k is not None:
        assert is_causal, "queries continuing a cache need is_causal"
    q, k, v = q.double(), k.double(), v.double()
    if position_ids is None:
        pos = [list(range(Nk))] * B
    else:
        position_ids = torch.as_tensor(position_ids)
        if position_ids.dim() == 1:
            position_ids = position_ids.expand(B, Nk)
        assert tuple(position_ids.shape) == (B, Nk)
        pos = position_ids.tolist()
    used = [Nk] * B if seqused_k is None else [int(u) for u in torch.as_tensor(seqused_k).tolist()]
    assert len(used) == B

    zero_q = q.new_zeros(Hq, D)
    zero_out = q.new_zeros(Hq, Dv)
    rows = []
    for b in range(B):
        query_of_row = {used[b] - Nq + i: i for i in range(Nq)}  # key row -> query index
        got = [zero_out] * Nq
        for start, n in sequences_of_row(pos[b], used[b]):
            qi = [query_of_row.get(r) for r in range(start, start + n)]
            if all(i is None for i in qi):
                continue
            qs = torch.stack([zero_q if i is None else q[b, :, i] for i in qi], dim=1)[None]
            out = reference_dilated_attention(
                qs, k[b:b + 1, :, start:start + n], v[b:b + 1, :, start:start + n],
                segment_lengths, dilation_rates, hilbert=hilbert, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)
            for t, i in enumerate(qi):
                if i is not None:
                    got[i] = out[0, :, t]
        rows.append(torch.stack(got, dim=1))  # [Hq, Nq, Dv]
    return torch.stack(rows, dim=0)
