"""lowering/triton_decode.py's decode kernel against a float64 reference written here from the
definition (queries continuing a cached causal sequence, SPEC sections 2 and 5): the allowed keys
of each (query, head, branch) are built as an explicit mask over all Nk key rows, then a dense
masked softmax per branch and the branches' log-sum-exp merge."""
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from lowering import plans  # noqa: E402
from lowering.triton_decode import branch_tables, decode_forward  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import hilbert_order as spec_hilbert_order  # noqa: E402
from reference import reference_dilated_attention  # noqa: E402

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- reference


def allowed_keys(key_positions, query_rows, hq, w, r, hilbert):
    """[B, Hq, Nq, Nk] bool: key row n is a key of query i, head h in branch (w, r)."""
    b, nk = key_positions.shape
    nq = query_rows.shape[1]
    pi = spec_hilbert_order(w) if hilbert else list(range(w))
    rank = [0] * w
    for t, c in enumerate(pi):
        rank[c] = t
    allowed = torch.zeros(b, hq, nq, nk, dtype=torch.bool)
    for bi in range(b):
        for i in range(nq):
            row = int(query_rows[bi, i])
            if row < 0 or row >= nk or int(key_positions[bi, row]) < 0:
                continue
            p = int(key_positions[bi, row])
            # the rows of the query's sequence by position, padding between them skipped
            row_of = {}
            at = row
            while len(row_of) <= p:
                assert at >= 0, "a query's sequence must start (position 0) in its row"
                if int(key_positions[bi, at]) >= 0:
                    row_of[int(key_positions[bi, at])] = at
                at -= 1
            j, c = divmod(p, w)
            o = rank[c] % r
            keys = [row_of[j * w + e] for e in range(c + 1) if rank[e] % r == o]
            for h in range(hq):
                if h % r == o:
                    allowed[bi, h, i, keys] = True
    return allowed


def reference_decode(q, k, v, key_positions, query_rows, segs, rates, hilbert, scale=None):
    """(out [B, Hq, Nq, Dv], lse [B, Hq, Nq]) in float64."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, nq, d = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = scale * q @ k.transpose(-1, -2)  # [B, Hq, Nq, Nk]
    outs, lses = [], []
    for w, r in zip(segs, rates):
        allowed = allowed_keys(key_positions, query_rows, hq, w, r, hilbert)
        s = scores.masked_fill(~allowed, NEG_INF)
        lse = torch.logsumexp(s, -1)
        probs = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # no key: -inf - -inf
        outs.append(probs @ v)
        lses.append(lse)
    lse_all = torch.stack(lses)
    lse = torch.logsumexp(lse_all, 0)
    weights = torch.exp(lse_all - lse).nan_to_num(0.0)
    out = (weights.unsqueeze(-1) * torch.stack(outs)).sum(0)
    return out, lse


# ----------------------------------------------------------------------------- inputs


def cache_rows(nk, nq, pad_left, used):
    """key_positions [2, nk] and query_rows [2, nq]: row 0 left-padded by pad_left (its sequence
    fills the rest), row 1 a static cache holding `used` tokens (the tail is padding). The
    queries are each row's last nq tokens."""
    kp = torch.full((2, nk), -1, dtype=torch.long)
    kp[0, pad_left:] = torch.arange(nk - pad_left)
    kp[1, :used] = torch.arange(used)
    qr = torch.stack([torch.arange(nk - nq, nk), torch.arange(used - nq, used)])
    return kp, qr


def make(b, hq, hkv, nq, nk, d, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, dv, generator=g).to(dtype)
    return q, k, v


def check(q, k, v, kp, qr, segs, rates, hilbert, atol=1e-5, rtol=1e-5, scale=None, **kw):
    out, lse = decode_forward(q, k, v, kp, qr, segs, rates, hilbert, scale, **kw)
    ref_out, ref_lse = reference_decode(q, k, v, kp, qr, segs, rates, hilbert, scale)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=rtol)
    return ref_out, ref_lse


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("w,r", [(8, 1), (8, 2), (16, 4), (12, 3), (64, 8), (5, 1)])
def test_tables(w, r, hilbert):
    members, class_of, slot_of = branch_tables(w, r, hilbert, "cpu")
    assert members.dtype == class_of.dtype == slot_of.dtype == torch.int32
    assert members.shape == (r, w // r) and class_of.shape == slot_of.shape == (w,)
    pi = spec_hilbert_order(w) if hilbert else list(range(w))
    for t, c in enumerate(pi):
        assert class_of[c] == t % r
        assert members[class_of[c], slot_of[c]] == c
    assert (members[:, 1:] > members[:, :-1]).all()
    # the same sets as the forward's plans (one whole segment)
    plan = plans.branch_plan(w, w, r, hilbert)
    assert torch.equal(members.long(), plan.positions[:, 0, :])


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("hilbert", [False, True])
def test_gqa_three_branches(nq, hilbert):
    """Group of 2; D, Dv not powers of two; segment lengths 8, 16, 32 none of which divides
    either sequence (37 and 45 tokens); the 32-key branch crosses the split edge (32 keys)."""
    nk = 45
    kp, qr = cache_rows(nk, nq, pad_left=8, used=41)
    q, k, v = make(2, 4, 2, nq, nk, 24, 40)
    check(q, k, v, kp, qr, (8, 16, 32), (1, 2, 4), hilbert)


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("hilbert", [False, True])
def test_head_in_no_branch(nq, hilbert):
    """No branch with r == 1: some (query, head) pairs take part in no branch (out 0, lse -inf).
    Group of 4 (one kv head), three query heads per class split across the group."""
    nk = 38
    kp, qr = cache_rows(nk, nq, pad_left=3, used=30)
    q, k, v = make(2, 4, 1, nq, nk, 16, 16, seed=1)
    _, ref_lse = check(q, k, v, kp, qr, (8, 16), (2, 4), hilbert)
    assert (ref_lse == NEG_INF).any(), "the case must hold a (query, head) in no branch"
    assert (ref_lse > NEG_INF).any()


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("hilbert", [False, True])
def test_gapless_reads_rows_without_rank_tables(nq, hilbert):
    """gapless=True (no position_ids given: keys are rows 0, 1, ... of each sequence) finds keys
    by row arithmetic, without the rank tables, and gives what the tables give, bit for bit,
    with rows past the cache and per-row cache lengths."""
    nk = 45
    kp = torch.where(torch.arange(nk) < torch.tensor([[41], [30]]), torch.arange(nk), -1)
    qr = torch.tensor([[41], [30]]) - nq + torch.arange(nq)
    q, k, v = make(2, 4, 2, nq, nk, 24, 40, seed=5)
    args = (q, k, v, kp, qr, (8, 16, 32), (1, 2, 4), hilbert, None)
    out, lse = decode_forward(*args, gapless=True)
    out_t, lse_t = decode_forward(*args)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    check(q, k, v, kp, qr, (8, 16, 32), (1, 2, 4), hilbert, gapless=True)


@pytest.mark.parametrize("nq", [1, 3])
def test_long_cache_many_splits(nq):
    """One (64, 1) branch over cache lengths 100 and 75: up to 64 keys in 16-key splits, and
    the query's segment starts mid-cache (j = 1)."""
    nk = 100
    kp, qr = cache_rows(nk, nq, pad_left=0, used=75)
    q, k, v = make(2, 3, 3, nq, nk, 32, 20, seed=2)
    for split in (16, 32, 64):
        check(q, k, v, kp, qr, (64,), (1,), True, split_size=split)


def test_packed_and_invalid_queries():
    """Row 0 packs sequences of 13 and 20 tokens and 3 of padding; its queries stand in both
    sequences and at a padding row. Row 1's queries stand at row -1, past Nk, and at a real
    token. Queries at invalid rows get out 0, lse -inf."""
    nk = 36
    kp = torch.full((2, nk), -1, dtype=torch.long)
    kp[0, :13] = torch.arange(13)
    kp[0, 13:33] = torch.arange(20)
    kp[1, :] = torch.arange(nk)
    qr = torch.tensor([[12, 32, 34], [-1, nk + 5, 30]])
    q, k, v = make(2, 2, 2, 3, nk, 16, 16, seed=3)
    out, lse = decode_forward(q, k, v, kp, qr, (8, 16), (1, 2), True, None)
    ref_out, ref_lse = reference_decode(q, k, v, kp, qr, (8, 16), (1, 2), True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    for bi, i in ((0, 2), (1, 0), (1, 1)):
        assert (out[bi, :, i] == 0).all() and (lse[bi, :, i] == NEG_INF).all()
    assert (lse[0, :, :2] > NEG_INF).any(-1).all() and (lse[1, :, 2] > NEG_INF).any()


@pytest.mark.parametrize("nq", [1, 2, 7, 16])
@pytest.mark.parametrize("hilbert", [False, True])
def test_padding_between_cached_tokens(nq, hilbert):
    """Padding (-1) between the cached tokens of a sequence (a padding mask with holes): the
    keys are the sequence's real tokens alone, padding rows hold NaN and are never read. Row 0
    packs two sequences with holes (the second continues past a hole into the cache's tail),
    row 1 one sequence with holes inside its segments and a static cache's junk tail (rows past
    19); queries of a chunk may stand on padding (out 0, lse -inf). GQA group of 2; branches
    (3, 1), (6, 2), (12, 4): holes fall inside segments and between dilated members."""
    kp = torch.tensor([
        [0, -1, 1, 2, -1, -1, 3, 4, 5, 0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7, 8, 9],
        [-1, 0, 1, -1, 2, 3, 4, 5, 6, 7, 8, -1, 9, 10, 11, -1, 12, 13, 14, -1, -1, -1],
    ])
    nk = kp.shape[1]
    used = 19  # row 1's cache length
    qr = torch.stack([torch.arange(nk - nq, nk), torch.arange(used - nq, used)])
    q, k, v = make(2, 4, 2, nq, nk, 16, 8, seed=7)
    k = k.masked_fill((kp < 0).view(2, 1, nk, 1), float("nan"))
    v = v.masked_fill((kp < 0).view(2, 1, nk, 1), float("nan"))
    out, lse = decode_forward(q, k, v, kp, qr, (3, 6, 12), (1, 2, 4), hilbert, None)
    assert torch.isfinite(out).all()
    ref_out, ref_lse = reference_decode(q, k.nan_to_num(0.0), v.nan_to_num(0.0), kp, qr,
                                        (3, 6, 12), (1, 2, 4), hilbert)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    on_padding = kp.gather(1, qr) < 0
    assert (lse.transpose(1, 2)[on_padding] == NEG_INF).all()
    assert (lse.transpose(1, 2)[~on_padding] > NEG_INF).any(-1).all()


def test_reads_only_selected_rows():
    """Every key row that no query may read holds NaN (k and v): the result stays finite and
    exact, so no such row enters a score or a sum."""
    nk, nq = 45, 3
    segs, rates = (8, 16, 32), (1, 2, 4)
    kp, qr = cache_rows(nk, nq, pad_left=8, used=41)
    q, k, v = make(2, 4, 2, nq, nk, 24, 40, seed=4)
    used = torch.zeros(2, 2, nk, dtype=torch.bool)  # [B, Hkv, Nk]
    for w, r in zip(segs, rates):
        used |= allowed_keys(kp, qr, 4, w, r, True).view(2, 2, 2, nq, nk).any(2).any(2)
    assert (~used).sum() > nk  # many rows unread, padding among them
    k = k.masked_fill(~used.unsqueeze(-1), float("nan"))
    v = v.masked_fill(~used.unsqueeze(-1), float("nan"))
    out, lse = decode_forward(q, k, v, kp, qr, segs, rates, True, None)
    assert torch.isfinite(out).all()
    ref_out, ref_lse = reference_decode(q, k.nan_to_num(0.0), v.nan_to_num(0.0), kp, qr, segs,
                                        rates, True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq", [1, 3])
def test_half_types(dtype, nq):
    nk = 45
    kp, qr = cache_rows(nk, nq, pad_left=8, used=41)
    q, k, v = make(2, 4, 2, nq, nk, 24, 40, dtype=dtype, seed=5)
    # the reference reads the same rounded inputs; the kernel rounds probabilities to 16 bits
    check(q, k, v, kp, qr, (8, 16, 32), (1, 2, 4), True, atol=2e-2, rtol=2e-2)


def test_strided_inputs_and_scale():
    """q, k, v as transposed views of [B, N, H, D] storage, int32 indices, an explicit scale;
    a group of 3 query heads per kv head."""
    nk, nq = 40, 3
    kp, qr = cache_rows(nk, nq, pad_left=5, used=33)
    q, k, v = make(2, 6, 2, nq, nk, 16, 24, seed=6)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not q.is_contiguous()
    check(q, k, v, kp.int(), qr.int(), (8, 16), (1, 2), False, scale=0.3)


def test_head_dim_256_many_splits():
    """D = 256, Dv = 200: the combine takes 16 splits at a time, and 17 splits (16 of the
    256-key branch, then the (8, 2) branch's one) make it loop."""
    nk, nq = 250, 1
    kp, qr = cache_rows(nk, nq, pad_left=2, used=200)
    q, k, v = make(2, 2, 1, nq, nk, 256, 200, seed=7)
    check(q, k, v, kp, qr, (256, 8), (1, 2), True, split_size=16)


@pytest.mark.parametrize("hilbert", [False, True])
def test_reference_is_the_op_on_the_whole_sequence(hilbert):
    """The reference here agrees with tests/reference.py's section-2 reference, causal, on each
    sequence alone: a query at position p gets row p of the op on its sequence."""
    segs, rates = (8, 16), (1, 4)
    n = 29
    kp, qr = cache_rows(n + 4, 3, pad_left=4, used=n)
    q, k, v = make(2, 4, 2, 3, n + 4, 8, 8, seed=8)
    out, _ = reference_decode(q, k, v, kp, qr, segs, rates, hilbert)
    for bi, start in ((0, 4), (1, 0)):
        kk, vv = k[bi:bi + 1, :, start:start + n], v[bi:bi + 1, :, start:start + n]
        qq = torch.randn(1, 4, n, 8, dtype=torch.float64)
        qq[:, :, n - 3:] = q[bi:bi + 1].double()
        whole = reference_dilated_attention(qq, kk, vv, segs, rates, hilbert=hilbert,
                                            is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[bi], whole[0, :, n - 3:], atol=1e-12, rtol=1e-12)


def test_bad_arguments():
    q, k, v = make(1, 3, 2, 1, 8, 8, 8)
    kp, qr = torch.arange(8).view(1, 8), torch.tensor([[7]])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_forward(q, k, v, kp, qr, (8,), (1,), False, None)
    q, k, v = make(1, 2, 2, 1, 8, 8, 8)
    with pytest.raises(ValueError, match="multiple of dilation rate"):
        decode_forward(q, k, v, kp, qr, (8,), (3,), False, None)
    with pytest.raises(ValueError, match="key_positions"):
        decode_forward(q, k, v, kp[:, :4], qr, (8,), (1,), False, None)
