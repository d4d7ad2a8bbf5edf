"""Checks of tests/reference.py itself against hand-derived facts and torch SDPA."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from reference import count_matrix, hilbert_order, reference_dilated_attention, selected_sets


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
