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
