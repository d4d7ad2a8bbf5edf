"""The Triton lowering's dropout at the positions rows stand for (`dropout_rows`, what the ring
passes): the keep bits hash those positions instead of the row indices, forward and backward,
as the SDPA lowering does and as one device draws them.

Checked against the float64 reference (tests/reference.py, whose keep bits are written again
there from their definition) and against the SDPA lowering on a ring's own plans (a shard's sets
alone; the sets with peers' rows, on an extended row), on shapes that are not multiples of the
interpreter's tiles. Without dropout_rows the kernels hash the row indices as before."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hilbert_fx.lowering import sdpa_lowering, triton_lowering  # noqa: E402
from hilbert_fx.lowering.plans import branch_plans  # noqa: E402
from hilbert_fx.lowering.ring_plan import ring_plan  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import dropout_keep_of_positions, reference_dilated_attention  # noqa: E402
from test_op_exact import assert_matches, common_scale, require_lowering  # noqa: E402

P_DROP, SEED = 0.3, 1234


def _inputs(b, hq, hkv, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv, hq)]


def _both(lowering, q, k, v, dout, plans, **kw):
    """(out, lse, dq, dk, dv) of one lowering's forward and backward."""
    out, lse = lowering.forward(q, k, v, plans, **kw)
    return (out, lse, *lowering.backward(dout, q, k, v, out, lse, plans, **kw))


# Rows standing for positions far from their indices: a shuffle of positions up to 10**6, a
# shard's (its indices shifted), and positions past 2**32, of which the hash takes the low 32 bits.
def _positions(kind: str, n: int) -> torch.Tensor:
    if kind == "shuffled":
        return torch.randperm(10**6, generator=torch.Generator().manual_seed(n))[:n]
    if kind == "shard":
        return torch.arange(n, dtype=torch.int32) + 3 * n
    return 2**32 + 7 * torch.arange(n)


CASES = [  # (B, Hq, Hkv, N, D, segments, rates, hilbert, causal, positions)
    (2, 4, 2, 45, 12, [8, 18, 40], [1, 2, 4], True, False, "shuffled"),
    (1, 3, 3, 41, 8, [6, 24], [2, 3], False, True, "shard"),
    (1, 2, 1, 37, 16, [16, 64], [1, 4], True, True, "past-32-bits"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[3]}-{c[9]}")
def test_matches_the_reference_at_the_positions_given(case):
    """Out, dq, dk, dv equal the float64 reference whose dropout keeps entry (p, p') as the hash
    of (positions[p], positions[p']) says."""
    require_lowering("triton")
    b, hq, hkv, n, d, segs, rates, hilbert, causal, kind = case
    q, k, v, dout = _inputs(b, hq, hkv, n, d, seed=n)
    rows = _positions(kind, n)
    kw = dict(is_causal=causal, attn_mask=None, scale=0.35, dropout_p=P_DROP,
              seed=torch.tensor(SEED), dropout_rows=rows)
    got = _both(triton_lowering, q, k, v, dout, branch_plans(n, segs, rates, hilbert), **kw)

    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    keep = dropout_keep_of_positions(SEED, b, hq, rows, P_DROP)
    ref = reference_dilated_attention(q64, k64, v64, segs, rates, hilbert=hilbert,
                                      is_causal=causal, scale=0.35, enable_gqa=hq != hkv,
                                      dropout_p=P_DROP, dropout_keep=keep)
    grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert_matches(got[0], ref, "out")
    sc = common_scale(ref, *grads)
    for name, a, r in zip(("dq", "dk", "dv"), got[2:], grads):
        assert_matches(a, r, name, scale=sc)
    # the same rows at their own indices draw other bits: the positions were used
    other = triton_lowering.forward(q, k, v, branch_plans(n, segs, rates, hilbert),
                                    **dict(kw, dropout_rows=None))[0]
    assert not torch.allclose(other, got[0], atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rank", [1, 3])
def test_equals_sdpa_on_the_ring_plans(rank, causal):
    """A ring's two calls on one rank (4 ranks of 10 rows): the shard's sets alone at the shard's
    global positions, and the sets with peers' rows on the extended row at theirs. The Triton
    lowering gives the SDPA lowering's out, lse and gradients with the same dropout_rows."""
    require_lowering("triton")
    hq, hkv, d = 4, 2, 8
    plan = ring_plan(10, 4, rank, (6, 24, 40), (1, 2, 4), True, causal, hq, hkv)
    for plans, rows in ((plan.local_plans, plan.local_positions),
                        (plan.cross_plans, plan.ext_positions)):
        q, k, v, dout = _inputs(2, hq, hkv, rows.numel(), d, seed=rank)
        kw = dict(is_causal=causal, attn_mask=None, scale=0.4, dropout_p=P_DROP,
                  seed=torch.tensor(SEED), dropout_rows=rows)
        got = _both(triton_lowering, q, k, v, dout, list(plans), **kw)
        want = _both(sdpa_lowering, q, k, v, dout, list(plans), **kw)
        assert torch.equal(got[1] == float("-inf"), want[1] == float("-inf"))
        finite = want[1] > float("-inf")
        torch.testing.assert_close(got[1][finite], want[1][finite])
        sc = common_scale(*want[2:])
        for name, a, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]),
                              (want[0], *want[2:])):
            assert_matches(a, w, f"rank {rank} {name}", scale=sc)


def test_row_indices_by_default():
    """Without dropout_rows the bits are those of the row indices: dropout_rows = arange(N)
    gives bitwise the same out and gradients (through the kernels' other variant, ROWS)."""
    require_lowering("triton")
    n = 29
    q, k, v, dout = _inputs(1, 2, 2, n, 8, seed=5)
    plans = branch_plans(n, [8, 32], [1, 2], True)
    kw = dict(is_causal=True, attn_mask=None, scale=0.3, dropout_p=P_DROP,
              seed=torch.tensor(SEED))
    plain = _both(triton_lowering, q, k, v, dout, plans, **kw)
    indexed = _both(triton_lowering, q, k, v, dout, plans, dropout_rows=torch.arange(n), **kw)
    for a, b in zip(plain, indexed):
        assert torch.equal(a, b)


def test_without_dropout_the_rows_are_not_read():
    """dropout_p = 0: dropout_rows changes nothing and is not checked (the ring passes it only
    with dropout; another caller may pass it always)."""
    require_lowering("triton")
    q, k, v, _ = _inputs(1, 2, 2, 20, 8, seed=6)
    plans = branch_plans(20, [8], [2], False)
    kw = dict(is_causal=False, attn_mask=None, scale=0.3)
    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    out_r, lse_r = triton_lowering.forward(q, k, v, plans, dropout_rows=torch.ones(3), **kw)
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r)


@pytest.mark.parametrize("rows", [torch.arange(19), torch.arange(20.0),
                                  torch.arange(40).view(2, 20), [0] * 20],
                         ids=["short", "float", "2-D", "list"])
def test_bad_rows_are_refused(rows):
    require_lowering("triton")
    q, k, v, _ = _inputs(1, 2, 2, 20, 8, seed=7)
    with pytest.raises(ValueError, match="dropout_rows"):
        triton_lowering.forward(q, k, v, branch_plans(20, [8], [2], False), is_causal=False,
                                attn_mask=None, scale=0.3, dropout_p=P_DROP,
                                seed=torch.tensor(SEED), dropout_rows=rows)
