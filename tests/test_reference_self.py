"""Checks of tests/reference.py itself against hand-derived facts and torch SDPA."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from reference import (count_matrix, hilbert_order, position_ids_from_cu_seqlens,
                       reference_dilated_attention, reference_sequences, selected_sets,
                       sequences_of_row)


# ---------------------------------------------------------------- (a) Hilbert order

def test_hilbert_w4():
    assert hilbert_order(4) == [0, 2, 3, 1]


def test_hilbert_w16_classic_curve():
    # The classic 4x4 Hilbert curve (x right, y up), from bottom-left to bottom-right, cells in
    # walk order: bottom-left quadrant, top-left, top-right, bottom-right.
    cells = [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2),
             (2, 2), (2, 3), (3, 3), (3, 2), (3, 1), (2, 1), (2, 0), (3, 0)]
    assert hilbert_order(16) == [y * 4 + x for x, y in cells]
    assert hilbert_order(16) == [0, 1, 5, 4, 8, 12, 13, 9, 10, 14, 15, 11, 7, 6, 2, 3]


def test_hilbert_small_by_hand():
    assert hilbert_order(1) == [0]
    assert hilbert_order(2) == [0, 1]      # 2x2 walk 0,2,3,1 keeping < 2
    assert hilbert_order(3) == [0, 2, 1]   # 2x2 walk 0,2,3,1 keeping < 3
    assert hilbert_order(5) == [0, 1, 4, 2, 3]  # 4x4 walk 0,1,5,4,8,..,2,3 keeping < 5


@pytest.mark.parametrize("w", range(1, 71))
def test_hilbert_is_permutation(w):
    assert sorted(hilbert_order(w)) == list(range(w))


@pytest.mark.parametrize("s", [2, 4, 8, 16])
def test_hilbert_full_square_is_a_path(s):
    order = hilbert_order(s * s)
    for a, b in zip(order, order[1:]):
        (ya, xa), (yb, xb) = divmod(a, s), divmod(b, s)
        assert abs(xa - xb) + abs(ya - yb) == 1


def test_selected_sets_short_segment_and_offsets():
    # N=6, branch (4, 2), identity order: segments [0,4), [4,6) (cut at N)
    assert selected_sets(6, 4, 2, 0, False) == [{0, 2}, {4}]
    assert selected_sets(6, 4, 2, 1, False) == [{1, 3}, {5}]
    assert selected_sets(6, 4, 2, 3, False) == [{1, 3}, {5}]   # h mod r
    # Hilbert pi_4 = [0,2,3,1]: ranks 0,2 -> offsets 0,3 ; ranks 1,3 -> offsets 2,1
    assert selected_sets(6, 4, 2, 0, True) == [{0, 3}, {4}]
    assert selected_sets(6, 4, 2, 1, True) == [{1, 2}, {5}]
    # N < w: one short segment
    assert selected_sets(3, 8, 1, 0, False) == [{0, 1, 2}]


# ---------------------------------------------------------------- (b) identity vs SDPA

def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("w", [7, 8, 13, 32])
@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "gqa", "scale"])
def test_identity_equals_sdpa(hilbert, w, case):
    torch.manual_seed(0)
    B, Hq, Hkv, N, D = 2, 4, 4, 7, 8
    kw = {}
    if case == "gqa":
        Hkv = 2
        kw["enable_gqa"] = True
    q = _rand(B, Hq, N, D).requires_grad_()
    k = _rand(B, Hkv, N, D).requires_grad_()
    v = _rand(B, Hkv, N, D).requires_grad_()
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool":
        m = torch.rand(B, 1, N, N) > 0.4
        m[..., 0] = True
        m[0, 0, 3] = False  # one fully masked row: SDPA gives 0 there too
        kw["attn_mask"] = m
    elif case == "float":
        m = _rand(1, Hq, N, N)
        m[0, 1, 2, :3] = float("-inf")
        kw["attn_mask"] = m
    elif case == "scale":
        kw["scale"] = 0.37
    ref = reference_dilated_attention(q, k, v, [w], [1], hilbert=hilbert, **kw)
    exp = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(ref, exp, rtol=1e-12, atol=1e-12)
    g = _rand(*ref.shape)
    gr = torch.autograd.grad(ref, (q, k, v), g)
    ge = torch.autograd.grad(exp, (q, k, v), g)
    for a, b in zip(gr, ge):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- (c) hand-written key sets

def _by_hand(q, k, v, keys, scale):
    """keys[(h, p)] = list of key positions (with repeats). Per-query explicit softmax."""
    B, H, N, D = q.shape
    out = torch.zeros(B, H, N, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for p in range(N):
                ks = keys.get((h, p), [])
                if not ks:
                    continue
                e = [math.exp(scale * float(q[b, h, p] @ k[b, h, p2])) for p2 in ks]
                num = sum(ei * v[b, h, p2] for ei, p2 in zip(e, ks))
                out[b, h, p] = num / sum(e)
    return out


# N=4, branches (2,1) and (4,2), identity order.
#   (2,1): segments {0,1}, {2,3}, every position selected, both heads.
#   (4,2): one segment; head 0 selects ranks 0,2 -> {0,2}; head 1 ranks 1,3 -> {1,3}.
KEYS_N4 = {
    (0, 0): [0, 1] + [0, 2], (0, 1): [0, 1], (0, 2): [2, 3] + [0, 2], (0, 3): [2, 3],
    (1, 0): [0, 1], (1, 1): [0, 1] + [1, 3], (1, 2): [2, 3], (1, 3): [2, 3] + [1, 3],
}
# Same with hilbert=True: pi_2 = [0,1]; pi_4 = [0,2,3,1] so (4,2) head 0 -> ranks 0,2 ->
# positions {0,3}; head 1 -> ranks 1,3 -> positions {2,1}.
KEYS_N4_HILBERT = {
    (0, 0): [0, 1] + [0, 3], (0, 1): [0, 1], (0, 2): [2, 3], (0, 3): [2, 3] + [0, 3],
    (1, 0): [0, 1], (1, 1): [0, 1] + [1, 2], (1, 2): [2, 3] + [1, 2], (1, 3): [2, 3],
}
# N=3 (short segments), branches (2,1), (4,2), hilbert=True:
#   (2,1): segments {0,1}, {2}.  (4,2): one short segment; head 0 -> {0,3}\{3} = {0};
#   head 1 -> {1,2}.
KEYS_N3_HILBERT = {
    (0, 0): [0, 1] + [0], (0, 1): [0, 1], (0, 2): [2],
    (1, 0): [0, 1], (1, 1): [0, 1] + [1, 2], (1, 2): [2] + [1, 2],
}


def _causal(keys):
    return {hp: [p2 for p2 in ks if p2 <= hp[1]] for hp, ks in keys.items()}


@pytest.mark.parametrize("N,hilbert,keys", [(4, False, KEYS_N4), (4, True, KEYS_N4_HILBERT),
                                            (3, True, KEYS_N3_HILBERT)])
@pytest.mark.parametrize("causal", [False, True])
def test_two_branches_by_hand(N, hilbert, keys, causal):
    torch.manual_seed(1)
    q, k, v = _rand(2, 2, N, 4), _rand(2, 2, N, 4), _rand(2, 2, N, 4)
    ref = reference_dilated_attention(q, k, v, [2, 4], [1, 2], hilbert=hilbert, is_causal=causal)
    exp = _by_hand(q, k, v, _causal(keys) if causal else keys, 0.5)
    torch.testing.assert_close(ref, exp, rtol=1e-12, atol=1e-12)
    # and the count matrix is exactly the multiset sizes
    c = count_matrix(N, 2, [2, 4], [1, 2], hilbert)
    for (h, p), ks in keys.items():
        for p2 in range(N):
            assert c[h, p, p2] == ks.count(p2)


def test_query_without_keys_is_zero_and_grads_finite():
    # N=4, branch (4, 4): head 0 selects only rank 0 -> position 0; positions 1..3 have no keys.
    torch.manual_seed(2)
    q, k, v = (_rand(1, 1, 4, 4).requires_grad_() for _ in range(3))
    out = reference_dilated_attention(q, k, v, [4], [4])
    assert torch.equal(out[0, 0, 1:], torch.zeros(3, 4, dtype=torch.float64))
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_float_mask_fully_minus_inf_row_and_grads():
    torch.manual_seed(3)
    q, k, v = (_rand(1, 2, 5, 4).requires_grad_() for _ in range(3))
    m = _rand(1, 1, 5, 5)
    m[..., 2, :] = float("-inf")
    out = reference_dilated_attention(q, k, v, [3, 5], [1, 1], attn_mask=m)
    assert torch.equal(out[:, :, 2], torch.zeros(1, 2, 4, dtype=torch.float64))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gradcheck():
    torch.manual_seed(4)
    q = _rand(1, 2, 5, 3).requires_grad_()
    k = _rand(1, 1, 5, 3).requires_grad_()
    v = _rand(1, 1, 5, 3).requires_grad_()
    m = _rand(5, 5).requires_grad_()
    f = lambda q, k, v, m: reference_dilated_attention(  # noqa: E731
        q, k, v, [2, 4], [1, 2], hilbert=True, attn_mask=m, enable_gqa=True)
    assert torch.autograd.gradcheck(f, (q, k, v, m))


def test_dropout_keep_all_is_identity_and_keep_matches_manual():
    torch.manual_seed(5)
    q, k, v = _rand(1, 2, 6, 4), _rand(1, 2, 6, 4), _rand(1, 2, 6, 4)
    base = reference_dilated_attention(q, k, v, [4], [2])
    keep = torch.ones(1, 2, 6, 6, dtype=torch.bool)
    same = reference_dilated_attention(q, k, v, [4], [2], dropout_p=0.3, dropout_keep=keep)
    torch.testing.assert_close(same, base / 0.7, rtol=1e-12, atol=1e-12)
    # One-branch full window: equals SDPA's math (softmax, then keep / (1-p), then @ v)
    keep = torch.rand(1, 2, 6, 6) > 0.3
    got = reference_dilated_attention(q, k, v, [8], [1], dropout_p=0.3, dropout_keep=keep)
    p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)
    torch.testing.assert_close(got, (p * keep / 0.7) @ v, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- (d) SPEC section 5: sequences

BRANCHES = ([3, 8], [1, 2])


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def test_sequences_of_row():
    assert sequences_of_row([0, 1, 2, 0, 1, 0], 6) == [(0, 3), (3, 2), (5, 1)]
    assert sequences_of_row([-1, -1, 0, 1, 2], 5) == [(2, 3)]
    assert sequences_of_row([0, 1, -1, 0, 1, 2, -1], 7) == [(0, 2), (3, 3)]
    assert sequences_of_row([0, 1, 2, 3, 4], 3) == [(0, 3)]   # a static cache's unused tail
    assert sequences_of_row([0, 1, 2], 0) == []
    for bad in ([1, 2], [0, 2], [0, -1, 1]):
        with pytest.raises(AssertionError):
            sequences_of_row(bad, len(bad))


def test_position_ids_from_cu_seqlens():
    with pytest.raises(AssertionError):  # sequence [5, 9) would span rows 0 and 1
        position_ids_from_cu_seqlens(torch.tensor([0, 3, 5, 9]), 2, 6)
    got = position_ids_from_cu_seqlens(torch.tensor([0, 3, 6, 8, 10]), 2, 6)
    assert got.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, -1, -1]]


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("how", ["none", "arange", "arange_1d", "seqused_full"])
def test_sequences_one_sequence_filling_the_row_is_plain(hilbert, causal, how):
    if how == "seqused_full" and not causal:
        pytest.skip("seqused_k needs is_causal")
    torch.manual_seed(10)
    B, Hq, Hkv, N, D = 2, 4, 2, 11, 3
    q, k, v = _rand(B, Hq, N, D), _rand(B, Hkv, N, D), _rand(B, Hkv, N, 5)
    kw = dict(hilbert=hilbert, is_causal=causal, enable_gqa=True)
    seq_kw = {"none": {}, "arange": dict(position_ids=torch.arange(N).expand(B, N)),
              "arange_1d": dict(position_ids=torch.arange(N)),
              "seqused_full": dict(seqused_k=torch.tensor([N, N]))}[how]
    got = reference_sequences(q, k, v, *BRANCHES, **seq_kw, **kw)
    exp = reference_dilated_attention(q, k, v, *BRANCHES, **kw)
    torch.testing.assert_close(got, exp, rtol=0, atol=0)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_sequences_padded_row_equals_unpadded(hilbert, causal, side):
    torch.manual_seed(11)
    H, n, D = 2, 9, 4
    before, after = {"left": (4, 0), "right": (0, 4), "both": (2, 3)}[side]
    N = before + n + after
    q, k, v = _leaves(_rand(1, H, N, D) * 30, _rand(1, H, N, D) * 30, _rand(1, H, N, D) * 30)
    sl = slice(before, before + n)
    with torch.no_grad():  # real tokens: ordinary sizes; padding: large junk
        for t in (q, k, v):
            t[:, :, sl] /= 30
    pos = torch.full((1, N), -1)
    pos[0, sl] = torch.arange(n)
    got = reference_sequences(q, k, v, *BRANCHES, position_ids=pos, hilbert=hilbert,
                              is_causal=causal)
    q0, k0, v0 = _leaves(q[:, :, sl].detach(), k[:, :, sl].detach(), v[:, :, sl].detach())
    exp = reference_dilated_attention(q0, k0, v0, *BRANCHES, hilbert=hilbert, is_causal=causal)
    torch.testing.assert_close(got[:, :, sl], exp, rtol=0, atol=0)
    pad = torch.ones(N, dtype=torch.bool)
    pad[sl] = False
    assert torch.equal(got[:, :, pad], torch.zeros_like(got[:, :, pad]))
    g = _rand(*got.shape)
    gq, gk, gv = torch.autograd.grad(got, (q, k, v), g)
    eq, ek, ev = torch.autograd.grad(exp, (q0, k0, v0), g[:, :, sl])
    for a, e in ((gq, eq), (gk, ek), (gv, ev)):
        torch.testing.assert_close(a[:, :, sl], e, rtol=0, atol=0)
        # padding: no key, no query
        assert torch.equal(a[:, :, pad], torch.zeros_like(a[:, :, pad]))


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_sequences_packed_row_equals_each_document_alone(hilbert, causal):
    torch.manual_seed(12)
    H, D = 2, 3
    docs = [2, 9, 1, 5]  # shorter than a segment, spanning several, a single token
    N = sum(docs) + 2     # two padding tokens at the end
    q, k, v = _leaves(_rand(1, H, N, D), _rand(1, H, N, D), _rand(1, H, N, D))
    pos = torch.cat([torch.arange(n) for n in docs] + [torch.tensor([-1, -1])])[None]
    got = reference_sequences(q, k, v, *BRANCHES, position_ids=pos, hilbert=hilbert,
                              is_causal=causal)
    start = 0
    for n in docs:
        sl = slice(start, start + n)
        exp = reference_dilated_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], *BRANCHES,
                                          hilbert=hilbert, is_causal=causal)
        torch.testing.assert_close(got[:, :, sl], exp, rtol=0, atol=0)
        start += n
    assert torch.equal(got[:, :, -2:], torch.zeros_like(got[:, :, -2:]))
    # and the keys really stop at the documents' edges: changing a key of the last document
    # (rows 12..16) changes rows of that document and nothing else
    k2 = k.detach().clone()
    k2[:, :, 13] += 1.0
    got2 = reference_sequences(q, k2, v, *BRANCHES, position_ids=pos, hilbert=hilbert,
                               is_causal=causal)
    keep = torch.ones(N, dtype=torch.bool)
    keep[12:17] = False
    assert torch.equal(got2[:, :, keep], got[:, :, keep])
    assert not torch.equal(got2[:, :, 12:17], got[:, :, 12:17])


def test_sequences_packed_via_cu_seqlens_equals_position_ids():
    torch.manual_seed(13)
    q, k, v = _rand(2, 2, 7, 3), _rand(2, 2, 7, 3), _rand(2, 2, 7, 3)
    cu = torch.tensor([0, 4, 7, 8, 12])  # row 0: 4 + 3; row 1: 1 + 4, then 2 padding
    pos = position_ids_from_cu_seqlens(cu, 2, 7)
    assert pos.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 0, 1, 2, 3, -1, -1]]
    got = reference_sequences(q, k, v, *BRANCHES, position_ids=pos, hilbert=True)
    exp = reference_dilated_attention(q[1:, :, 1:5], k[1:, :, 1:5], v[1:, :, 1:5], *BRANCHES,
                                      hilbert=True)
    torch.testing.assert_close(got[1:, :, 1:5], exp, rtol=0, atol=0)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("static", [False, True])
def test_sequences_cache_rows_equal_last_rows_of_full_causal(hilbert, nq, static):
    torch.manual_seed(14)
    B, Hq, Hkv, D = 2, 4, 2, 3
    lengths = [13, 6] if static else [13, 13]   # tokens each row's cache holds, the new ones too
    Nk = 16 if static else 13
    qf = _rand(B, Hq, Nk, D)      # queries of the whole sequences (the full rows' inputs)
    k, v = _rand(B, Hkv, Nk, D), _rand(B, Hkv, Nk, D)
    q = torch.stack([qf[b, :, L - nq:L] for b, L in enumerate(lengths)])  # the step's queries
    q, k, v = _leaves(q, k, v)
    kw = dict(hilbert=hilbert, is_causal=True, enable_gqa=True)
    got = reference_sequences(q, k, v, *BRANCHES, seqused_k=torch.tensor(lengths) if static
                              else None, **kw)
    g = _rand(*got.shape)
    gq, gk, gv = torch.autograd.grad(got, (q, k, v), g)
    for b, L in enumerate(lengths):
        qb = qf[b:b + 1, :, :L].clone()
        qb[:, :, L - nq:] = q[b:b + 1].detach()
        qb, kb, vb = _leaves(qb, k[b:b + 1, :, :L].detach(), v[b:b + 1, :, :L].detach())
        full = reference_dilated_attention(qb, kb, vb, *BRANCHES, **kw)
        torch.testing.assert_close(got[b:b + 1], full[:, :, L - nq:], rtol=0, atol=0)
        eq, ek, ev = torch.autograd.grad(full[:, :, L - nq:], (qb, kb, vb), g[b:b + 1])
        torch.testing.assert_close(gq[b:b + 1], eq[:, :, L - nq:], rtol=0, atol=0)
        assert torch.equal(eq[:, :, :L - nq], torch.zeros_like(eq[:, :, :L - nq]))
        torch.testing.assert_close(gk[b:b + 1, :, :L], ek, rtol=0, atol=0)
        torch.testing.assert_close(gv[b:b + 1, :, :L], ev, rtol=0, atol=0)
        assert torch.equal(gk[b, :, L:], torch.zeros_like(gk[b, :, L:]))  # unused cache rows
        assert torch.equal(gv[b, :, L:], torch.zeros_like(gv[b, :, L:]))


def test_sequences_cache_with_left_padding():
    """A left-padded row of a batched generation: position_ids -1 on the padding, a dynamic cache
    (every key row used); the step's query is the row's last token."""
    torch.manual_seed(15)
    H, D, pad, n = 2, 3, 3, 8
    N = pad + n
    q, k, v = _rand(1, H, 2, D), _rand(1, H, N, D), _rand(1, H, N, D)
    pos = torch.tensor([[-1] * pad + list(range(n))])
    got = reference_sequences(q, k, v, *BRANCHES, position_ids=pos, is_causal=True, hilbert=True)
    qf = torch.cat([_rand(1, H, n - 2, D), q], dim=2)
    full = reference_dilated_attention(qf, k[:, :, pad:], v[:, :, pad:], *BRANCHES,
                                       is_causal=True, hilbert=True)
    torch.testing.assert_close(got, full[:, :, -2:], rtol=0, atol=0)
