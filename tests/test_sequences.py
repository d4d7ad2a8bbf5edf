"""SPEC section 5 at the op: packed documents, padding and a KV cache, through the sequence
interface of hilbert_fx.dilated_attention (position_ids, cu_seqlens, seqused_k; see
/work/notes/sequences_api.md), against the independent float64 reference (tests/reference.py:
section 2's reference on each sequence alone), forward and backward, both lowerings.

Shapes are deliberately not multiples of the segments or of any tile; padding and a static
cache's unused rows hold large junk, so that a leak into any real row shows.
"""
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hilbert_fx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import (position_ids_from_cu_seqlens, reference_dilated_attention,  # noqa: E402
                       reference_sequences)

BR_A = ([4, 8], [1, 2])
BR_B = ([3, 6, 12], [1, 2, 4])
JUNK = 30.0  # padding / unused cache rows are scaled by this: a leak cannot hide in rounding

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def require_triton():
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        pytest.skip(f"triton not importable: {e!r}")


# ----------------------------------------------------------------------------- layouts

def row_positions(items, n):
    """Position ids of one row from a layout: a positive item is a document of that many tokens,
    a negative one that many padding tokens (-1)."""
    out = []
    for x in items:
        out += list(range(x)) if x > 0 else [-1] * (-x)
    assert len(out) == n, (items, n)
    return out


def position_ids_of(layouts, n):
    return torch.tensor([row_positions(items, n) for items in layouts], dtype=torch.int64)


def cu_seqlens_of(layouts, n):
    """FlashAttention's cu_seqlens for the same layouts (padding only at the very end)."""
    cu, flat = [0], 0
    for b, items in enumerate(layouts):
        for x in items:
            if x > 0:
                assert cu[-1] == flat, "cu_seqlens can hold padding only after the last sequence"
                flat += x
                cu.append(flat)
            else:
                flat += -x
        assert flat == (b + 1) * n
    return torch.tensor(cu, dtype=torch.int32)


# ----------------------------------------------------------------------------- comparison

def assert_matches(got, ref, what, dtype, scale=None):
    """||got - ref|| <= tol * ||ref|| (+ tol * scale per element) and element-wise close, tol
    1e-5 in float32, 1e-10 in float64; scale: the size of the numbers involved (largest |ref|
    of the problem, at least 1)."""
    tol = TOL[dtype]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    got, ref = got.detach().double(), ref.detach().double()
    if scale is None:
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    err, nrm = (got - ref).norm().item(), ref.norm().item()
    assert err <= tol * nrm + tol * scale * math.sqrt(max(ref.numel(), 1)), \
        f"{what}: ||got-ref|| = {err:.3g}, ||ref|| = {nrm:.3g}"
    torch.testing.assert_close(got, ref, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


def query_key_rows(B, Nq, Nk, seqused_k):
    used = [Nk] * B if seqused_k is None else [int(u) for u in seqused_k]
    return [[used[b] - Nq + i for i in range(Nq)] for b in range(B)], used


def run_case(*, B, Hq, Hkv, Nq, Nk, D, segs_rates, dtype=torch.float32, lowering="sdpa",
             hilbert=False, causal=False, position_ids=None, cu_seqlens=None, seqused_k=None,
             ref_position_ids=None, seed=0, Dv=None, op_position_ids=None):
    """Draws q, k, v (junk on padding and unused cache rows), runs the op with the sequence
    arguments given, the reference with position_ids (or ref_position_ids), and compares the
    outputs and the gradients of sum(out * g) for one random g."""
    torch.manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, Hq, Nq, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, Dv, dtype=torch.float64)
    ref_pos = position_ids if ref_position_ids is None else ref_position_ids
    pos_rows = (torch.arange(Nk).expand(B, Nk) if ref_pos is None
                else torch.as_tensor(ref_pos).expand(B, Nk)).tolist()
    qrows, used = query_key_rows(B, Nq, Nk, None if seqused_k is None else seqused_k.tolist())
    for b in range(B):
        for r in range(Nk):
            if pos_rows[b][r] < 0 or r >= used[b]:  # no key: padding or past the cache's end
                k[b, :, r] *= JUNK
                v[b, :, r] *= JUNK
        for i, r in enumerate(qrows[b]):
            if r < 0 or pos_rows[b][r] < 0:
                q[b, :, i] *= JUNK
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    kw = dict(hilbert=hilbert, is_causal=causal, enable_gqa=Hq != Hkv)
    seq_kw = {name: val for name, val in (("position_ids", position_ids if op_position_ids is None
                                            else op_position_ids),
                                           ("cu_seqlens", cu_seqlens), ("seqused_k", seqused_k))
              if val is not None}
    out = hilbert_fx.dilated_attention(q, k, v, *segs_rates, lowering=lowering, **seq_kw, **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_sequences(q64, k64, v64, *segs_rates, position_ids=ref_pos,
                              seqused_k=seqused_k, **kw)
    what = f"{lowering} {dtype} hilbert={hilbert} causal={causal} Hq={Hq} Hkv={Hkv} " \
           f"pos={ref_pos.tolist() if ref_pos is not None else None} " \
           f"cu={cu_seqlens.tolist() if cu_seqlens is not None else None} " \
           f"seqused_k={seqused_k.tolist() if seqused_k is not None else None} Nq={Nq} Nk={Nk}"
    assert_matches(out, ref, f"out [{what}]", dtype)
    g = torch.randn(out.shape, dtype=torch.float64)
    g_out = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    g_ref = torch.autograd.grad(ref, (q64, k64, v64), g)
    scale = max([1.0] + [t.abs().max().item() for t in (ref, *g_ref) if t.numel()])
    for name, a, e in zip("qkv", g_out, g_ref):
        assert_matches(a, e, f"d{name} [{what}]", dtype, scale=scale)
    return out, ref, g_out, g_ref


# ----------------------------------------------------------------------------- packing

N = 13
PACKED = {  # B = 2, each row its own packing; documents shorter than a segment and spanning several
    "ragged": [[5, 2, 6], [11, 1, 1]],
    "short": [[1, 2, 3, 2, 1, 3, 1], [2, 2, 2, 2, 2, 3]],
    "one_and_many": [[13], [4, 4, 5]],
}
PADDED = {  # padding anywhere: left, right, between documents
    "left_right": [[-3, 10], [7, -6]],
    "between": [[4, -2, 7], [-1, 5, -2, 5]],
    "all_padding_row": [[-13], [6, 7]],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("branches", ["A", "B"])
@pytest.mark.parametrize("layout", list(PACKED) + list(PADDED))
def test_position_ids_sdpa(layout, branches, hilbert, causal, gqa, dtype):
    layouts = {**PACKED, **PADDED}[layout]
    Hkv = 2
    run_case(B=2, Hq=2 * Hkv if gqa else Hkv, Hkv=Hkv, Nq=N, Nk=N, D=4,
             segs_rates=BR_A if branches == "A" else BR_B, dtype=dtype, hilbert=hilbert,
             causal=causal, position_ids=position_ids_of(layouts, N),
             seed=sorted({**PACKED, **PADDED}).index(layout))


CU_LAYOUTS = {  # padding only after the last sequence, as cu_seqlens can say
    "ragged": [[5, 2, 6], [11, 1, 1]],
    "short": [[1, 2, 3, 2, 1, 3, 1], [2, 2, 2, 2, 2, 3]],
    "tail_padding": [[13], [4, 3, -6]],
    "second_row_padding": [[2, 11], [-13]],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", list(CU_LAYOUTS))
def test_cu_seqlens_sdpa(layout, cu_dtype, hilbert, causal, dtype):
    layouts = CU_LAYOUTS[layout]
    cu = cu_seqlens_of(layouts, N).to(cu_dtype)
    pos = position_ids_from_cu_seqlens(cu, 2, N)  # the reference's own reading of cu_seqlens
    assert torch.equal(pos, position_ids_of(layouts, N))
    run_case(B=2, Hq=4, Hkv=2, Nq=N, Nk=N, D=4, segs_rates=BR_B, dtype=dtype, hilbert=hilbert,
             causal=causal, cu_seqlens=cu, ref_position_ids=pos, seed=7)


@pytest.mark.parametrize("causal", [False, True])
def test_position_ids_1d_broadcast_over_batch(causal):
    pos = torch.tensor(row_positions([-2, 4, 7], N))
    run_case(B=2, Hq=2, Hkv=2, Nq=N, Nk=N, D=4, segs_rates=BR_A, hilbert=True, causal=causal,
             position_ids=pos, ref_position_ids=pos.expand(2, N), seed=3)


@pytest.mark.parametrize("causal", [False, True])
def test_own_value_head_dim(causal):
    """v with its own head dim (Dv = 6 against D = 4), packed and padded."""
    run_case(B=2, Hq=4, Hkv=2, Nq=N, Nk=N, D=4, Dv=6, segs_rates=BR_B, hilbert=True,
             causal=causal, position_ids=position_ids_of(PADDED["between"], N), seed=5)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_position_ids_int32(pos_dtype):
    pos = position_ids_of(PACKED["ragged"], N).to(pos_dtype)
    run_case(B=2, Hq=2, Hkv=2, Nq=N, Nk=N, D=4, segs_rates=BR_A, hilbert=True, position_ids=pos,
             ref_position_ids=pos.long(), seed=4)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_rows_equal_each_document_alone(hilbert, causal):
    """Spelled out without reference_sequences: each document's rows of the packed call equal the
    section-2 reference on that document alone (float32 op, float64 reference)."""
    torch.manual_seed(21)
    layouts = [[5, 2, 6], [1, 11, 1]]
    q, k, v = (torch.randn(2, 4, N, 4, requires_grad=True) for _ in range(3))
    out = hilbert_fx.dilated_attention(q, k, v, *BR_B, hilbert=hilbert, is_causal=causal,
                                       position_ids=position_ids_of(layouts, N), lowering="sdpa")
    g = torch.randn(out.shape)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), g)
    for b, items in enumerate(layouts):
        start = 0
        for n in items:
            sl = slice(start, start + n)
            qd, kd, vd = (t[b:b + 1, :, sl].detach().double().requires_grad_() for t in (q, k, v))
            ref = reference_dilated_attention(qd, kd, vd, *BR_B, hilbert=hilbert,
                                              is_causal=causal)
            what = f"row {b} document [{start}, {start + n})"
            assert_matches(out[b:b + 1, :, sl], ref, what, torch.float32)
            eq, ek, ev = torch.autograd.grad(ref, (qd, kd, vd), g[b:b + 1, :, sl].double())
            sc = max(1.0, *(t.abs().max().item() for t in (ref, eq, ek, ev)))
            for name, a, e in (("q", gq, eq), ("k", gk, ek), ("v", gv, ev)):
                assert_matches(a[b:b + 1, :, sl], e, f"d{name} {what}", torch.float32, scale=sc)
            start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_padding_equals_unpadded(side, causal, hilbert, dtype):
    """The real tokens' rows (and gradients) of a padded row equal the op on the unpadded
    sequence; padding rows are 0 and get no gradient."""
    torch.manual_seed(22)
    n = 9
    before, after = {"left": (4, 0), "right": (0, 4), "both": (2, 2)}[side]
    Np = before + n + after
    sl = slice(before, before + n)
    q0, k0, v0 = (torch.randn(1, 2, n, 4, dtype=dtype) for _ in range(3))

    def pad(t):
        junk = JUNK * torch.randn(1, 2, Np, 4, dtype=dtype)
        junk[:, :, sl] = t
        return junk.requires_grad_()

    q, k, v = pad(q0), pad(k0), pad(v0)
    pos = torch.full((1, Np), -1)
    pos[0, sl] = torch.arange(n)
    out = hilbert_fx.dilated_attention(q, k, v, *BR_A, hilbert=hilbert, is_causal=causal,
                                       position_ids=pos, lowering="sdpa")
    qd, kd, vd = (t.double().requires_grad_() for t in (q0, k0, v0))
    ref = reference_dilated_attention(qd, kd, vd, *BR_A, hilbert=hilbert, is_causal=causal)
    assert_matches(out[:, :, sl], ref, "real rows", dtype)
    padding = torch.ones(Np, dtype=torch.bool)
    padding[sl] = False
    assert_matches(out[:, :, padding], torch.zeros(1, 2, Np - n, 4), "padding rows", dtype)
    g = torch.randn(out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    exp = torch.autograd.grad(ref, (qd, kd, vd), g[:, :, sl].double())
    sc = max(1.0, *(t.abs().max().item() for t in (ref, *exp)))
    for name, a, e in zip("qkv", grads, exp):
        assert_matches(a[:, :, sl], e, f"d{name} real rows", dtype, scale=sc)
        assert_matches(a[:, :, padding], torch.zeros(1, 2, Np - n, 4), f"d{name} padding", dtype)


# Padding between the tokens of one sequence (a padding mask with holes, [1, 0, 1, 1]): the
# positions skip it, and the sequence is its real tokens alone, as if the padding were removed.
HOLES = torch.tensor([
    [0, -1, 1, 2, -1, -1, 3, 4, 5, 0, 1, -1, 2, 3, -1],  # two sequences, each with holes
    [-1, 0, 1, -1, 2, 3, 4, 5, 6, 7, 8, -1, 9, 10, 11],  # one, holes inside its segments
])


def holes_case(pos, *, causal, hilbert, lowering="sdpa", dtype=torch.float32, Hq=4, Hkv=2,
               seed=0):
    """The op on rows whose sequences have padding between their tokens, against the float64
    reference on each row with its padding removed; padding rows 0, with no gradient."""
    torch.manual_seed(seed)
    B, n = pos.shape
    q = torch.randn(B, Hq, n, 4, dtype=dtype)
    k, v = (torch.randn(B, Hkv, n, 4, dtype=dtype) for _ in range(2))
    pad = pos < 0
    for t in (q, k, v):
        t.transpose(1, 2)[pad] *= JUNK
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = dict(hilbert=hilbert, is_causal=causal, enable_gqa=Hq != Hkv)
    out = hilbert_fx.dilated_attention(q, k, v, *BR_B, position_ids=pos, lowering=lowering, **kw)
    g = torch.randn(out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for b in range(B):
        real = ~pad[b]
        qd, kd, vd = (t.detach()[b:b + 1, :, real].double().requires_grad_() for t in (q, k, v))
        ref = reference_sequences(qd, kd, vd, *BR_B, position_ids=pos[b, real], **kw)
        exp = torch.autograd.grad(ref, (qd, kd, vd), g[b:b + 1, :, real].double())
        what = f"row {b} {lowering} causal={causal} hilbert={hilbert}"
        assert_matches(out[b:b + 1, :, real], ref, what, dtype)
        assert torch.equal(out[b, :, ~real], torch.zeros_like(out[b, :, ~real])), what
        sc = max(1.0, *(t.abs().max().item() for t in (ref, *exp)))
        for name, a, e in zip("qkv", grads, exp):
            assert_matches(a[b:b + 1, :, real], e, f"d{name} {what}", dtype, scale=sc)
            assert torch.equal(a[b, :, ~real], torch.zeros_like(a[b, :, ~real])), f"d{name} {what}"


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_between_tokens_is_skipped(causal, hilbert):
    holes_case(HOLES, causal=causal, hilbert=hilbert, seed=23)


def test_padding_between_tokens_is_skipped_triton():
    require_triton()
    holes_case(HOLES[1:], causal=True, hilbert=True, lowering="triton", Hq=2, seed=24)


@pytest.mark.parametrize("nq", [17])
def test_long_chunk_with_padding_between_cached_tokens(nq):
    """A chunk of more queries than a decode step takes, against a cache whose rows hold padding
    between a sequence's tokens: the chunk runs as rows of the sequences' sets."""
    nk = HOLES.shape[1] + 6
    pos = torch.cat([HOLES, HOLES[:, -1:] + 1 + torch.arange(6)], 1)
    q_rows = torch.arange(nk - nq, nk)
    torch.manual_seed(25)
    q = torch.randn(2, 2, nq, 4, dtype=torch.float64)
    k, v = (torch.randn(2, 2, nk, 4, dtype=torch.float64) for _ in range(2))
    out = hilbert_fx.dilated_attention(q, k, v, *BR_B, hilbert=True, is_causal=True,
                                       position_ids=pos, lowering="sdpa")
    for b in range(2):
        real = pos[b] >= 0
        full_q = torch.zeros(1, 2, nk, 4, dtype=torch.float64)
        full_q[0, :, q_rows] = q[b]
        ref = reference_sequences(full_q[:, :, real], k[b:b + 1, :, real], v[b:b + 1, :, real],
                                  *BR_B, position_ids=pos[b, real], hilbert=True, is_causal=True)
        asked = real[q_rows]
        rows_of_real = real.cumsum(0) - 1  # where each real row lands once padding is removed
        assert_matches(out[b][:, asked], ref[0][:, rows_of_real[q_rows][asked]], f"row {b}",
                       torch.float64)
        assert torch.equal(out[b][:, ~asked], torch.zeros_like(out[b][:, ~asked]))


def test_decode_with_padding_between_cached_tokens():
    """One query against a cache whose last segment holds a padding row: the query's keys are
    the real rows alone."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, 10, 11, 12]])
    torch.manual_seed(26)
    q = torch.randn(1, 2, 1, 4, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 14, 4, dtype=torch.float64) for _ in range(2))
    out = hilbert_fx.dilated_attention(q, k, v, *BR_A, hilbert=True, is_causal=True,
                                       position_ids=pos, lowering="sdpa")
    real = pos[0] >= 0
    ref = reference_sequences(q, k[:, :, real], v[:, :, real], *BR_A, hilbert=True,
                              is_causal=True)
    assert_matches(out, ref, "decode", torch.float64)


# A cache with padding between a sequence's tokens: row 0 packs two sequences with holes, the
# second going on past a hole into the tail; row 1 one sequence with holes inside its segments,
# then a static cache's unused tail (seqused_k 19 of 22; its position_ids go on counting there).
HOLES_CACHE = torch.tensor([
    [0, -1, 1, 2, -1, -1, 3, 4, 5, 0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7, 8, 9],
    [-1, 0, 1, -1, 2, 3, 4, 5, 6, 7, 8, -1, 9, 10, 11, -1, 12, 13, 14, 15, 16, 17],
])
HOLES_USED = torch.tensor([22, 19])


def decode_holes_case(nq, *, hilbert, gqa, lowering="sdpa", dtype=torch.float64, seed=0):
    """nq queries (each row's last nq used key rows) against HOLES_CACHE: forward and the
    gradients of sum(out * g), against the float64 reference on each row's real used tokens
    (padding and the unused tail removed); queries standing on padding get 0."""
    pos, used = HOLES_CACHE, HOLES_USED
    B, nk = pos.shape
    Hkv = 2
    Hq = 2 * Hkv if gqa else Hkv
    torch.manual_seed(seed)
    q = torch.randn(B, Hq, nq, 4, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, nk, 4, dtype=torch.float64) for _ in range(2))
    real = (pos >= 0) & (torch.arange(nk) < used.view(B, 1))
    qrows = used.view(B, 1) - nq + torch.arange(nq)
    asked = real.gather(1, qrows)
    k.transpose(1, 2)[~real] *= JUNK
    v.transpose(1, 2)[~real] *= JUNK
    q.transpose(1, 2)[~asked] *= JUNK
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    kw = dict(hilbert=hilbert, is_causal=True, enable_gqa=gqa)
    out = hilbert_fx.dilated_attention(q, k, v, *BR_B, position_ids=pos, seqused_k=used,
                                       lowering=lowering, **kw)
    g = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    what = f"{lowering} {dtype} nq={nq} hilbert={hilbert} gqa={gqa}"
    for b in range(B):
        n = int(real[b].sum())
        at = (real[b].cumsum(0) - 1)[qrows[b][asked[b]]]  # the queries among the real tokens
        qd = torch.zeros(1, Hq, n, 4, dtype=torch.float64)
        qd[0, :, at] = q[b, :, asked[b]].detach().double()
        kd, vd = (t.detach()[b:b + 1, :, real[b]].double() for t in (k, v))
        qd, kd, vd = (t.requires_grad_() for t in (qd, kd, vd))
        ref = reference_sequences(qd, kd, vd, *BR_B, position_ids=pos[b, real[b]], **kw)
        gd = torch.zeros_like(ref)
        gd[0, :, at] = g[b, :, asked[b]]
        exp = torch.autograd.grad(ref, (qd, kd, vd), gd)
        assert_matches(out[b:b + 1, :, asked[b]], ref[:, :, at], f"out row {b} {what}", dtype)
        assert torch.equal(out[b, :, ~asked[b]], torch.zeros_like(out[b, :, ~asked[b]])), what
        sc = max(1.0, *(t.abs().max().item() for t in (ref, *exp)))
        (dq, dk, dv), (eq, ek, ev) = grads, exp
        assert_matches(dq[b:b + 1, :, asked[b]], eq[:, :, at], f"dq row {b} {what}", dtype,
                       scale=sc)
        assert torch.equal(dq[b, :, ~asked[b]], torch.zeros_like(dq[b, :, ~asked[b]])), what
        for name, a, e in (("dk", dk, ek), ("dv", dv, ev)):
            assert_matches(a[b:b + 1, :, real[b]], e, f"{name} row {b} {what}", dtype, scale=sc)
            assert torch.equal(a[b, :, ~real[b]], torch.zeros_like(a[b, :, ~real[b]])), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 2, 7, 16])
def test_decode_with_holes_per_row_cache_lengths(nq, hilbert, gqa, dtype):
    """The decode path (lowering/decode.py) with padding between the cached tokens of a
    sequence, per-row cache lengths, chunks up to DECODE_MAX_QUERIES: forward and backward."""
    decode_holes_case(nq, hilbert=hilbert, gqa=gqa, dtype=dtype, seed=50 + nq)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 16])
def test_decode_with_holes_triton(nq, hilbert):
    """The same through the Triton lowering: its decode kernel forward, decode.py's backward."""
    require_triton()
    decode_holes_case(nq, hilbert=hilbert, gqa=True, lowering="triton", dtype=torch.float32,
                      seed=60 + nq)


# ----------------------------------------------------------------------------- a KV cache

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("branches", ["A", "B"])
def test_static_cache_seqused_k_sdpa(branches, nq, hilbert, gqa, dtype):
    """A static cache of 16 rows holding 13 and 6 tokens (different lengths per row); the step's
    nq queries are each row's last nq tokens; rows past seqused_k are junk."""
    Hkv = 2
    run_case(B=2, Hq=2 * Hkv if gqa else Hkv, Hkv=Hkv, Nq=nq, Nk=16, D=4,
             segs_rates=BR_A if branches == "A" else BR_B, dtype=dtype, hilbert=hilbert,
             causal=True, seqused_k=torch.tensor([13, 6], dtype=torch.int32), seed=nq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 4, 12])
def test_dynamic_cache_sdpa(nq, hilbert, gqa, dtype):
    """k = cat(past, new) without seqused_k: every key row is used, the queries are the last nq."""
    Hkv = 2
    run_case(B=2, Hq=2 * Hkv if gqa else Hkv, Hkv=Hkv, Nq=nq, Nk=N, D=4, segs_rates=BR_B,
             dtype=dtype, hilbert=hilbert, causal=True, seed=10 + nq)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 2])
def test_cache_with_left_padding_position_ids(nq, hilbert):
    """Batched generation with left padding: position_ids -1 on the padding, a dynamic cache."""
    layouts = [[-4, 9], [13]]
    run_case(B=2, Hq=4, Hkv=2, Nq=nq, Nk=N, D=4, segs_rates=BR_A, hilbert=hilbert, causal=True,
             position_ids=position_ids_of(layouts, N), seed=30 + nq)


@pytest.mark.parametrize("nq", [1, 3])
def test_static_cache_with_position_ids_and_seqused_k(nq):
    """Left padding and a static cache: row 0 holds 2 padding tokens then 9 real ones of 16
    rows, row 1 holds 12 real ones; the tail past seqused_k is junk."""
    pos = torch.tensor([row_positions([-2, 14], 16), row_positions([16], 16)])
    run_case(B=2, Hq=2, Hkv=2, Nq=nq, Nk=16, D=4, segs_rates=BR_B, hilbert=True, causal=True,
             position_ids=pos, seqused_k=torch.tensor([11, 12]), seed=40 + nq)


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("nq", [1, 5])
def test_cache_rows_equal_full_rows(nq, hilbert):
    """Spelled out without reference_sequences: a step's rows equal rows L - nq .. L - 1 of the
    causal reference on the whole sequence (its earlier queries included), per row of the batch,
    for a static cache with different lengths per row."""
    torch.manual_seed(50)
    lengths, Nk, Hq, Hkv, D = [14, 7], 16, 4, 2, 4
    q_full = torch.randn(2, Hq, Nk, D)
    k = torch.randn(2, Hkv, Nk, D)
    v = torch.randn(2, Hkv, Nk, D)
    for b, L in enumerate(lengths):
        k[b, :, L:] *= JUNK
        v[b, :, L:] *= JUNK
    q = torch.stack([q_full[b, :, L - nq:L] for b, L in enumerate(lengths)]).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = hilbert_fx.dilated_attention(q, k, v, *BR_B, hilbert=hilbert, is_causal=True,
                                       enable_gqa=True, seqused_k=torch.tensor(lengths),
                                       lowering="sdpa")
    g = torch.randn(out.shape)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), g)
    for b, L in enumerate(lengths):
        qf = q_full[b:b + 1, :, :L].double()
        qf[:, :, L - nq:] = q[b:b + 1].detach().double()
        kf, vf = (t[b:b + 1, :, :L].detach().double() for t in (k, v))
        qf, kf, vf = (t.requires_grad_() for t in (qf, kf, vf))
        full = reference_dilated_attention(qf, kf, vf, *BR_B, hilbert=hilbert, is_causal=True,
                                           enable_gqa=True)
        assert_matches(out[b:b + 1], full[:, :, L - nq:], f"row {b}", torch.float32)
        eq, ek, ev = torch.autograd.grad(full[:, :, L - nq:], (qf, kf, vf), g[b:b + 1].double())
        sc = max(1.0, *(t.abs().max().item() for t in (full, eq, ek, ev)))
        assert_matches(gq[b:b + 1], eq[:, :, L - nq:], f"dq row {b}", torch.float32, scale=sc)
        assert_matches(gk[b:b + 1, :, :L], ek, f"dk row {b}", torch.float32, scale=sc)
        assert_matches(gv[b:b + 1, :, :L], ev, f"dv row {b}", torch.float32, scale=sc)
        zeros = torch.zeros(1, Hkv, Nk - L, D)
        assert_matches(gk[b:b + 1, :, L:], zeros, f"dk unused cache rows {b}", torch.float32)
        assert_matches(gv[b:b + 1, :, L:], zeros, f"dv unused cache rows {b}", torch.float32)


def test_decode_step_by_step_equals_full_causal_op():
    """A model decoded token by token computes what it was trained to compute: each decoding step
    (nq = 1, dynamic cache) equals that row of the op on the whole sequence (causal)."""
    torch.manual_seed(51)
    q, k, v = (torch.randn(1, 2, N, 4, dtype=torch.float64) for _ in range(3))
    full = reference_dilated_attention(q, k, v, *BR_A, hilbert=True, is_causal=True)
    for L in range(1, N + 1):
        step = hilbert_fx.dilated_attention(q[:, :, L - 1:L], k[:, :, :L], v[:, :, :L], *BR_A,
                                            hilbert=True, is_causal=True, lowering="sdpa")
        assert_matches(step, full[:, :, L - 1:L], f"step {L}", torch.float64)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("nq", [14, 20])
def test_long_chunk_across_documents(nq, static):
    """A chunk of a prefill against a cache whose rows hold packed documents, the chunk starting
    inside one document and ending in the next (and, with nq = 20, more queries than a decode
    step takes: the chunk runs as rows of the sequences' sets)."""
    Nk = 24
    pos = torch.tensor([row_positions([3, 9, 12], Nk), row_positions([-2, 7, 15], Nk)])
    seqused_k = torch.tensor([24, 22]) if static else None
    if static:  # row 1 holds 2 + 7 + 13 tokens of 24 rows: the last document is still growing
        pos[1, 22:] = -1
    run_case(B=2, Hq=4, Hkv=2, Nq=nq, Nk=Nk, D=4, segs_rates=BR_B, hilbert=True, causal=True,
             position_ids=pos, seqused_k=seqused_k, seed=70 + nq)


@pytest.mark.parametrize("nq", [17, 23])
def test_long_chunk_dynamic_cache(nq):
    """More queries than a decode step takes, against a dynamic cache and a static one."""
    run_case(B=2, Hq=2, Hkv=2, Nq=nq, Nk=25, D=4, segs_rates=BR_A, hilbert=True, causal=True,
             seed=80 + nq)
    run_case(B=2, Hq=4, Hkv=2, Nq=nq, Nk=30, D=4, segs_rates=BR_B, causal=True,
             seqused_k=torch.tensor([25, 28]), seed=90 + nq)


ALL_PADDING = """
import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch, hilbert_fx
q, k, v = (torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
out = hilbert_fx.dilated_attention(q, k, v, [4, 8], [1, 2], position_ids=torch.full((2, 5), -1),
                                   lowering=sys.argv[1])
assert torch.equal(out, torch.zeros_like(out)), out
out.sum().backward()
assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))
print("ok")
"""


@pytest.mark.parametrize("lowering", ["sdpa", "triton"])
def test_all_padding_batch(lowering):
    """A batch of padding only (no sequence at all): rows 0, gradients 0. Run in a child
    process: the SDPA lowering has died of SIGFPE here (a zero-size flash call)."""
    import subprocess
    if lowering == "triton":
        require_triton()
    res = subprocess.run([sys.executable, "-c", ALL_PADDING, lowering], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, \
        f"rc={res.returncode}\nstdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}"


def expected_sets(positions, w, r, hilbert):
    """{offset: sorted list of the sets (tuples of tokens of the B * N row)} of a branch, from
    section 5 token by token: a sequence's tokens since its position 0, segment p // w, offset
    class of p % w by the rank table."""
    from reference import hilbert_order
    ranks = hilbert_order(w) if hilbert else list(range(w))  # the position rank t stands for
    cls_of = {ranks[t]: t % r for t in range(w)}
    sets = {}
    doc = -1
    for t, p in enumerate(positions.reshape(-1).tolist()):
        if p < 0:
            continue
        doc += p == 0
        sets.setdefault((cls_of[p % w], doc, p // w), []).append(t)
    out = {o: [] for o in range(r)}
    for (o, _, _), members in sets.items():
        out[o].append(tuple(members))
    return {o: sorted(v) for o, v in out.items()}


def planned_sets(plans, r):
    """The same from the two plans of one branch: whole sets, and the groups of binned sets."""
    out = {o: [] for o in range(r)}
    for plan in plans:
        for o in range(r):
            for j in range(plan.num_segments):
                c = int(plan.counts[o, j])
                members = plan.positions[o, j, :c].tolist()
                assert plan.positions[o, j, c:].eq(plan.seq_len).all()
                if plan.groups is None:
                    if c:
                        out[o].append(tuple(members))
                    continue
                starts, ends = plan.groups[:, o, j, :c].tolist()
                for m in range(c):
                    assert starts[m] <= m < ends[m] <= c
                    if starts[m] == m:
                        run = members[m:ends[m]]
                        assert run == sorted(run) and all(starts[x] == m for x in range(m, ends[m]))
                        out[o].append(tuple(run))
    return {o: sorted(v) for o, v in out.items()}


SET_LAYOUTS = {**{f"packed_{k}": v for k, v in PACKED.items()},
               **{f"padded_{k}": v for k, v in PADDED.items()}}


@pytest.mark.parametrize("layout", list(SET_LAYOUTS))
def test_sequence_plans_read_nothing_on_the_host(layout, monkeypatch):
    """The plans of position_ids are built without a host read, which on a GPU would wait for
    it (the check of CPU positions aside, which a GPU call skips); their sizes follow from
    B * N alone (2 (T // w) + 1 sets, T // (w / r) + 1 bins of 2 w / r slots); and
    they hold exactly section 5's sets, each once, those past the sets as groups of the bins."""
    from hilbert_fx.lowering import sequences
    positions = position_ids_of(SET_LAYOUTS[layout], N)
    segs, rates = (3, 4, 8), (1, 2, 2)
    for w, r in zip(segs, rates):
        sequences.tables(w, r, True, "cpu")
    monkeypatch.setattr(sequences, "_check_positions", lambda positions: None)

    def read(*args, **kwargs):
        raise AssertionError("a host read while building the plans")
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, read)
    plans = sequences.sequence_plans(positions, segs, rates, True)
    monkeypatch.undo()
    total = positions.numel()
    for i, (w, r) in enumerate(zip(segs, rates)):
        sets, bins = plans[2 * i], plans[2 * i + 1]
        m = w // r
        assert sets.positions.shape == (r, 2 * (total // w) + 1, m) and sets.groups is None
        assert bins.positions.shape == (r, total // m + 1, 2 * m)
        assert planned_sets([sets, bins], r) == expected_sets(positions, w, r, True)
        if layout == "packed_short" and w == 8:  # 13 segments for 7 sets: bins hold some
            assert bins.counts.sum() > 0


def test_cu_seqlens_under_inference_mode():
    """Inference tensors count no versions: the positions of cu_seqlens are then made again
    each call (no cache), still without a host read for the plans."""
    cu = cu_seqlens_of(CU_LAYOUTS["ragged"], N)
    pos = position_ids_of(CU_LAYOUTS["ragged"], N)
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 2, N, 4, dtype=torch.float64) for _ in range(3))
    with torch.inference_mode():
        out = hilbert_fx.dilated_attention(q.clone(), k.clone(), v.clone(), *BR_B, hilbert=True,
                                           is_causal=True, cu_seqlens=cu.clone(),
                                           lowering="sdpa")
    ref = reference_sequences(q, k, v, *BR_B, hilbert=True, is_causal=True, position_ids=pos)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("cu", [[1, 5, 13], [0, 9, 5, 13], [0, 13, 27], [0, 4, 17, 26]],
                         ids=["not_from_0", "falling", "past_the_rows", "across_rows"])
def test_error_cu_seqlens_values_name_it(cu):
    q, k, v = _qkv(B=2, Nq=N, Nk=N)
    _raises("cu_seqlens", q, k, v, cu_seqlens=torch.tensor(cu))


# ----------------------------------------------------------------------------- Triton

TRITON_CASES = {  # few and small: the kernels run under the interpreter on CPU
    "packed_hilbert": dict(B=2, Hq=2, Hkv=2, Nq=N, Nk=N, hilbert=True, causal=False,
                           position_ids=position_ids_of(PACKED["ragged"], N)),
    "padded_causal_gqa": dict(B=2, Hq=4, Hkv=2, Nq=N, Nk=N, hilbert=False, causal=True,
                              position_ids=position_ids_of(PADDED["between"], N)),
    "short_documents_causal_gqa": dict(B=2, Hq=4, Hkv=2, Nq=N, Nk=N, hilbert=True, causal=True,
                                       position_ids=position_ids_of(PACKED["short"], N)),
    "cu_seqlens": dict(B=2, Hq=2, Hkv=2, Nq=N, Nk=N, hilbert=True, causal=True,
                       cu_seqlens=cu_seqlens_of(CU_LAYOUTS["tail_padding"], N),
                       ref_position_ids=position_ids_of(CU_LAYOUTS["tail_padding"], N)),
    "decode_seqused_k": dict(B=2, Hq=4, Hkv=2, Nq=1, Nk=16, hilbert=True, causal=True,
                             seqused_k=torch.tensor([13, 6], dtype=torch.int32)),
    "prefill_chunk_dynamic": dict(B=2, Hq=2, Hkv=2, Nq=3, Nk=N, hilbert=False, causal=True),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton(case):
    require_triton()
    run_case(D=4, segs_rates=BR_A, lowering="triton", seed=60, **TRITON_CASES[case])


# ----------------------------------------------------------------------------- errors

def _qkv(B=2, H=2, Nq=6, Nk=6, D=4):
    return torch.randn(B, H, Nq, D), torch.randn(B, H, Nk, D), torch.randn(B, H, Nk, D)


def _raises(match, q, k, v, **kw):
    kw.setdefault("lowering", "sdpa")
    with pytest.raises(ValueError, match=match):
        hilbert_fx.dilated_attention(q, k, v, [4], [1], **kw)


@pytest.mark.parametrize("arg", ["position_ids", "cu_seqlens"])
def test_error_attn_mask_with_sequence_argument(arg):
    """Positions are a structure that replaces the mask; seqused_k beside a mask is a cache's
    rows of section 2 with it (test_cache_with_a_mask_gives_its_rows_of_section_2)."""
    q, k, v = _qkv()
    value = {"position_ids": torch.arange(6).expand(2, 6),
             "cu_seqlens": torch.tensor([0, 6, 12], dtype=torch.int32)}[arg]
    mask = torch.ones(6, 6, dtype=torch.bool)
    _raises(rf"(?s)(attn_mask.*{arg}|{arg}.*attn_mask)", q, k, v, attn_mask=mask, **{arg: value})


def test_error_shorter_q_without_is_causal():
    q, k, v = _qkv(Nq=2, Nk=6)
    _raises("is_causal", q, k, v)
    _raises("is_causal", q, k, v, seqused_k=torch.tensor([6, 5]))


def test_error_a_cache_mask_must_cover_the_queries_rows():
    """Beside a cache the mask is [.., Nq, Nk]: a square one is not the queries' rows."""
    q, k, v = _qkv(Nq=2, Nk=6)
    _raises(r"attn_mask.*\[B, Hq, Nq, Nk\]", q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    _raises("is_causal", q, k, v, attn_mask=torch.ones(2, 6, dtype=torch.bool), is_causal=True)


def _cache_mask(kind: str, hq: int, n: int) -> torch.Tensor:
    """A model's mask over a whole sequence of n tokens: causal with a sliding window of 6 keys
    (boolean, one head), or ALiBi (a float bias per head, -inf above the diagonal)."""
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    if kind == "window":
        return ((j <= i) & (j > i - 6)).view(1, 1, n, n)
    slopes = 2.0 ** (-torch.arange(1, hq + 1, dtype=torch.float64)).view(hq, 1, 1)
    bias = -slopes * (i - j).to(torch.float64)
    return torch.where(j <= i, bias, float("-inf")).view(1, hq, n, n)


def cache_mask_case(nq, kind, static, *, lowering="sdpa", dtype=torch.float64, seed=0):
    """Queries at each batch row's last nq used rows, with their rows of a model's mask over the
    whole sequence, against the float64 reference of that sequence with its whole mask, rows
    [used - nq, used): out and the gradients of q, k and v (0 past seqused_k)."""
    torch.manual_seed(seed)
    B, Hq, Hkv, Nk, D = 2, 4, 2, 45, 8
    segs, rates = (8, 16, 32), (1, 2, 4)
    used = torch.tensor([Nk, 33]) if static else torch.tensor([Nk, Nk])
    rows = used.view(B, 1) - nq + torch.arange(nq)
    q = torch.randn(B, Hq, nq, D, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Nk, D, dtype=dtype, requires_grad=True) for _ in range(2))
    whole = _cache_mask(kind, Hq, Nk)
    mask = torch.stack([whole[0, :, rows[b]] for b in range(B)]).to(
        dtype if whole.is_floating_point() else torch.bool)
    out = hilbert_fx.dilated_attention(q, k, v, segs, rates, hilbert=True, attn_mask=mask,
                                       enable_gqa=True, seqused_k=used if static else None,
                                       lowering=lowering)
    g = torch.randn_like(out)
    out.backward(g)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    refs = []
    for b in range(B):
        n = int(used[b])
        q_whole = torch.cat([torch.zeros(1, Hq, n - nq, D, dtype=torch.float64), qr[b:b + 1]], 2)
        refs.append(reference_dilated_attention(
            q_whole, kr[b:b + 1, :, :n], vr[b:b + 1, :, :n], segs, rates, hilbert=True,
            attn_mask=whole[:, :, :n, :n], enable_gqa=True)[:, :, n - nq:])
    ref = torch.cat(refs)
    ref.backward(g.double())
    for what, got, want in (("out", out, ref), ("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad),
                            ("dv", v.grad, vr.grad)):
        assert_matches(got, want, what, dtype)
    # the model's mask forbids keys past each query: the rows equal the causal op's, so a model
    # decoded with its window or ALiBi kept computes what its whole forward computes
    if static:
        assert k.grad[1, :, 33:].abs().max() == 0 and v.grad[1, :, 33:].abs().max() == 0


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["window", "alibi"])
@pytest.mark.parametrize("nq", [1, 3, 20], ids=["step", "steps", "chunk"])
def test_cache_with_a_mask_gives_its_rows_of_section_2(nq, kind, static):
    """A sliding window or ALiBi beside a cache (a decoding step of Mistral, Gemma's local
    layers, Bloom): the queries' rows of section 2 with the model's mask, over the sequence's
    rows (decode.py for a step, the lowering over the placed rows for a chunk)."""
    cache_mask_case(nq, kind, static, seed=nq)


@pytest.mark.parametrize("nq", [1, 20], ids=["step", "chunk"])
def test_cache_with_a_mask_triton(nq):
    require_triton()
    cache_mask_case(nq, "window", True, lowering="triton", dtype=torch.float32, seed=40 + nq)
    cache_mask_case(nq, "alibi", False, lowering="triton", dtype=torch.float32, seed=50 + nq)


def test_error_seqused_k_without_is_causal():
    q, k, v = _qkv(Nq=6, Nk=6)
    _raises("(?s)(seqused_k.*is_causal|is_causal.*seqused_k)", q, k, v,
            seqused_k=torch.tensor([6, 6]))


def test_error_longer_q_than_k():
    q, k, v = _qkv(Nq=7, Nk=6)
    _raises(r"(?s)\bq\b.*\bk\b", q, k, v, is_causal=True)
    _raises(r"(?s)\bq\b.*\bk\b", q, k, v)


def test_error_position_ids_and_cu_seqlens():
    q, k, v = _qkv()
    _raises("(?s)(position_ids.*cu_seqlens|cu_seqlens.*position_ids)", q, k, v,
            position_ids=torch.arange(6).expand(2, 6),
            cu_seqlens=torch.tensor([0, 6, 12], dtype=torch.int32))


@pytest.mark.parametrize("bad", ["float", "bool", "batch", "length", "3d", "0d"])
def test_error_position_ids_shape_dtype(bad):
    q, k, v = _qkv(B=2, Nq=6, Nk=6)
    good = torch.arange(6).expand(2, 6)
    value = {"float": good.float(), "bool": good >= 0, "batch": torch.arange(6).expand(3, 6),
             "length": torch.arange(7).expand(2, 7), "3d": good[None],
             "0d": torch.tensor(0)}[bad]
    _raises("position_ids", q, k, v, position_ids=value)


def test_error_position_ids_length_against_k_in_a_cache():
    """position_ids describe the KEY rows: [B, Nk], not [B, Nq]."""
    q, k, v = _qkv(Nq=2, Nk=6)
    _raises("position_ids", q, k, v, is_causal=True, position_ids=torch.arange(2).expand(2, 2))


@pytest.mark.parametrize("bad", ["float", "2d", "0d"])
def test_error_cu_seqlens_shape_dtype(bad):
    q, k, v = _qkv()
    good = torch.tensor([0, 6, 12], dtype=torch.int32)
    value = {"float": good.float(), "2d": good[None], "0d": torch.tensor(12)}[bad]
    _raises("cu_seqlens", q, k, v, cu_seqlens=value)


@pytest.mark.parametrize("bad", ["float", "batch", "2d", "0d"])
def test_error_seqused_k_shape_dtype(bad):
    q, k, v = _qkv(Nq=1, Nk=6)
    good = torch.tensor([6, 4], dtype=torch.int32)
    value = {"float": good.float(), "batch": torch.tensor([6, 4, 5]), "2d": good[None],
             "0d": torch.tensor(6)}[bad]
    _raises("seqused_k", q, k, v, is_causal=True, seqused_k=value)


@pytest.mark.parametrize("row", [[0, 2, 3, 4], [1, 2, 3, 4], [0, 1, -1, 3], [-1, 1, 2, 3]],
                         ids=["skips", "no_start", "skips_over_padding", "starts_after_padding"])
def test_error_positions_that_do_not_count_along_a_sequence(row):
    """A positive position continues the row's last real token before it, padding between them
    skipped; anything else is no sequence."""
    q, k, v = _qkv(B=1, Nq=4, Nk=4)
    _raises("position_ids", q, k, v, position_ids=torch.tensor([row]))


def test_error_a_sequence_does_not_cross_batch_rows():
    q, k, v = _qkv(B=2, Nq=3, Nk=3)
    _raises("position_ids", q, k, v, position_ids=torch.tensor([[0, 1, 2], [3, 4, 5]]))
    _raises("position_ids", q, k, v, position_ids=torch.tensor([[0, 1, 2], [-1, 3, 4]]))


def test_error_cu_seqlens_sequence_across_rows_names_cu_seqlens():
    """A cu_seqlens sequence that crosses a batch row: the error names the argument the user
    passed (cu_seqlens), not the position_ids the front derives from it."""
    q, k, v = _qkv(B=2, Nq=6, Nk=6)
    _raises("cu_seqlens", q, k, v, cu_seqlens=torch.tensor([0, 4, 8, 12], dtype=torch.int32))


@pytest.mark.parametrize("nq", [3, 20], ids=["decode_path", "rows_path"])
def test_cache_shorter_than_the_queries_gives_zero_rows(nq):
    """seqused_k below Nq: the queries before the sequence's first row get 0 (and no gradient),
    and never take the place of a real query (the chunk path places queries at their rows)."""
    torch.manual_seed(3)
    q = torch.randn(2, 2, nq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 30, 8, dtype=torch.float64, requires_grad=True)
    used = torch.tensor([nq - 2, 30])
    out = hilbert_fx.dilated_attention(q, k, k, (8, 16), (1, 2), hilbert=True, is_causal=True,
                                       seqused_k=used, lowering="sdpa")
    g = torch.randn_like(out)
    out.backward(g)
    qd, kd = (x.detach().clone().requires_grad_() for x in (q, k))
    ref = reference_sequences(qd, kd, kd, (8, 16), (1, 2), hilbert=True, is_causal=True,
                              seqused_k=used)
    ref.backward(g)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    torch.testing.assert_close(q.grad, qd.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(k.grad, kd.grad, atol=1e-10, rtol=1e-10)
