"""Edge inputs of hilbert_fx.dilated_attention (lowering.op.dilated_attention), on both CPU
lowerings ("triton" under the Triton interpreter): empty tensors, masks that do not broadcast to
the scores, v with its own head dim, scale 0, flags that are not bools, logits of large
magnitude, meta tensors, numpy integers as branch sizes. Results are checked against the float64
reference (tests/reference.py) or F.scaled_dot_product_attention, errors by type and argument."""
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hilbert_fx  # noqa: E402
from hilbert_fx.lowering import block_attention, check_branches  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import reference_dilated_attention  # noqa: E402

LOWERINGS = ["sdpa", "triton"]


def op(q, k, v, segs, rates, **kw):
    return hilbert_fx.dilated_attention(q, k, v, list(segs), list(rates), **kw)


def leaves(*shapes, dtype=torch.float32, device="cpu", scale=1.0, seed=0):
    torch.manual_seed(seed)
    return [(torch.randn(s, dtype=dtype) * scale).to(device).requires_grad_() for s in shapes]


def rel_err(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def check_against_reference(q, k, v, segs, rates, *, tol=1e-5, **kw):
    """The op's output and gradients against the float64 reference on the same values."""
    out = op(q, k, v, segs, rates, **kw)
    kw.pop("lowering")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_dilated_attention(q64, k64, v64, segs, rates, **kw)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    g = torch.randn(ref.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), g)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))


# ----------------------------------------------------------------------------- 1. empty inputs


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("b,hq,hkv,n,dv", [(1, 4, 2, 0, 8), (0, 4, 2, 6, 8), (0, 4, 2, 0, 8),
                                           (1, 0, 0, 6, 8), (1, 4, 2, 6, 0)],
                         ids=["N0", "B0", "B0N0", "H0", "Dv0"])
@pytest.mark.parametrize("variant", ["plain", "causal", "mask"])
def test_empty_inputs_give_empty_outputs_and_gradients(lowering, b, hq, hkv, n, dv, variant):
    """As SDPA: an output with no element, and gradients of the inputs' shapes, all 0 (forward
    and backward). N = 0 was an IndexError in the SDPA lowering, H = 0 a ZeroDivisionError."""
    q, k, v = leaves((b, hq, n, 8), (b, hkv, n, 8), (b, hkv, n, dv))
    kw = dict(is_causal=variant == "causal", enable_gqa=True, lowering=lowering)
    if variant == "mask":
        kw["attn_mask"] = torch.ones(n, n, dtype=torch.bool)
    out = op(q, k, v, [4, 8], [1, 2], hilbert=True, **kw)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=kw["is_causal"],
                                          attn_mask=kw.get("attn_mask"), enable_gqa=True)
    assert out.shape == want.shape and out.dtype == want.dtype and out.numel() == 0
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


# ----------------------------------------------------------------------------- 2. mask shapes


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("shape", [(2, 1, 6, 6), (1, 3, 6, 6), (2, 2, 6, 6), (3, 6, 6)])
def test_mask_larger_than_the_scores_is_refused(lowering, shape):
    """[2, 1, N, N] with B = 1 broadcasts WITH [B, Hq, N, N] but not TO it."""
    q, k, v = leaves((1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4))
    with pytest.raises(ValueError, match="attn_mask"):
        op(q, k, v, [4], [1], attn_mask=torch.ones(shape, dtype=torch.bool), lowering=lowering)


@pytest.mark.parametrize("shape", [(6,), (6, 6), (1, 6, 6), (2, 1, 6), (1, 1, 6, 6), (2, 1, 1, 6)])
def test_masks_that_broadcast_to_the_scores_still_work(shape):
    q, k, v = leaves((2, 2, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4))
    torch.manual_seed(1)
    mask = torch.rand(shape) > 0.3
    check_against_reference(q, k, v, [4, 8], [1, 2], attn_mask=mask, lowering="sdpa")


# ----------------------------------------------------------------------------- 3. Dv != D


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("d,dv", [(8, 12), (8, 4)])
@pytest.mark.parametrize("variant", ["plain", "causal", "mask"])
def test_v_with_its_own_head_dim(lowering, d, dv, variant):
    """SDPA allows Dv != D (SPEC section 2): forward and backward on every lowering."""
    n = 7  # partial last segments: the SDPA lowering's padded blocks too
    b, hq = (2, 4) if lowering == "sdpa" else (1, 2)  # the interpreter is slow
    q, k, v = leaves((b, hq, n, d), (b, hq // 2, n, d), (b, hq // 2, n, dv))
    kw = dict(is_causal=variant == "causal", enable_gqa=True, hilbert=True, lowering=lowering)
    if variant == "mask":
        torch.manual_seed(2)
        kw["attn_mask"] = torch.randn(1, hq, n, n)
    check_against_reference(q, k, v, [4, 8], [1, 2], **kw)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_v_with_its_own_head_dim_is_sdpa_with_one_branch(lowering):
    q, k, v = leaves((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 3))
    out = op(q, k, v, [8], [1], is_causal=True, lowering=lowering)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


def test_v_with_its_own_head_dim_fake_shapes():
    """The fake (meta) implementations: out [B, Hq, N, Dv], gradients the inputs' shapes."""
    q, k, v = leaves((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 5), device="meta")
    out = op(q, k, v, [4, 8], [1, 2], enable_gqa=True, lowering="sdpa")
    assert out.shape == (2, 4, 6, 5) and out.device.type == "meta"
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_block_kernels_pad_to_one_head_dim():
    """block_attention pads q, k (Dv > D) or v (D > Dv) with zeros for the SDPA kernels, which
    take one head dim: the same results as its float32 math path."""
    for d, dv in ((4, 6), (6, 4)):
        q, k, v = leaves((1, 3, 5, d), (1, 3, 5, d), (1, 3, 5, dv))
        o, lse = block_attention.forward(q, k, v, bias=None, is_causal=True, scale=0.3)
        assert o.shape == (1, 3, 5, dv)
        o_ref, lse_ref = block_attention.forward(q, k, v, bias=None, is_causal=True, scale=0.3,
                                                 keep=torch.ones(1, 3, 5, 5), dropout_p=0.0)
        torch.testing.assert_close(o, o_ref)
        torch.testing.assert_close(lse, lse_ref)


# ----------------------------------------------------------------------------- 4. scale 0


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_scale_zero(lowering, causal):
    """Scores all 0: each query takes the mean of its allowed values, as SDPA's definition says
    (PyTorch's CPU kernel, and so F.scaled_dot_product_attention on CPU, gives NaN with
    is_causal: it scales scores already set to -inf, and -inf * 0 is NaN)."""
    q, k, v = leaves((1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 4))
    check_against_reference(q, k, v, [4, 8], [1, 2], scale=0.0, is_causal=causal, hilbert=True,
                            lowering=lowering)
    out = op(q, k, v, [16], [1], scale=0.0, is_causal=causal, lowering=lowering)
    if causal:  # F.scaled_dot_product_attention itself gives NaN here on CPU
        want = v.cumsum(2) / torch.arange(1, 10).view(9, 1)
    else:
        want = F.scaled_dot_product_attention(q, k, v, scale=0.0)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- 5. flags


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("name", ["hilbert", "is_causal", "enable_gqa"])
@pytest.mark.parametrize("value", ["no", 0, 1, None, 1.0, torch.tensor(True)],
                         ids=["str", "int0", "int1", "None", "float", "tensor"])
def test_flags_must_be_bools(lowering, name, value):
    """bool('no') is True: coercing ran is_causal='no' causal. Every non-bool is refused."""
    q, k, v = leaves((1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4))
    with pytest.raises(ValueError, match=name):
        op(q, k, v, [4], [1], lowering=lowering, **{name: value})


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_numpy_bools_are_bools(lowering):
    q, k, v = leaves((1, 2, 6, 4), (1, 1, 6, 4), (1, 1, 6, 4))
    got = op(q, k, v, [4, 8], [1, 2], hilbert=np.bool_(True), is_causal=np.bool_(True),
             enable_gqa=np.bool_(True), lowering=lowering)
    want = op(q, k, v, [4, 8], [1, 2], hilbert=True, is_causal=True, enable_gqa=True,
              lowering=lowering)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- 6. large logits


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("segs,rates", [([8], [1]), ([16], [2]), ([8, 16], [1, 2]),
                                        ([8, 16, 32], [1, 2, 4])])
def test_large_logits_several_branches_as_accurate_as_one(lowering, hilbert, segs, rates):
    """q, k scaled by 1e3: lse ~ 5e6, where float32's ulp is 0.5. One branch agrees with the
    float64 reference exactly (the softmax is one-hot); merging branches must not lose that
    (normalising by the rounded merged lse was 2.3e-2 off on the SDPA lowering)."""
    torch.manual_seed(0)
    b, h, n, d = (2, 4, 61, 16) if lowering == "sdpa" else (1, 2, 37, 16)
    q, k = (torch.randn(b, h, n, d) * 1e3 for _ in range(2))
    v = torch.randn(b, h, n, d)
    out = op(q, k, v, segs, rates, hilbert=hilbert, lowering=lowering)
    ref = reference_dilated_attention(q, k, v, segs, rates, hilbert=hilbert)
    assert rel_err(out, ref) < 1e-6, rel_err(out, ref)


def test_large_logits_magnitude_free_merges():
    """The merges of the SDPA lowering's blocks and of the ring's (block_attention.merge): two
    partial results with equal lse ~ 5e6 weigh 1/2 each, whatever the rounding of their
    logaddexp (5e6 + log 2 rounds to 5e6 + 0.5 in float32)."""
    lse = torch.full((3,), 5e6 + 1.5)
    o1, o2 = torch.randn(3, 4), torch.randn(3, 4)
    o, new_lse = block_attention.merge(o1, lse, o2, lse)
    torch.testing.assert_close(o, (o1 + o2) / 2, atol=1e-7, rtol=1e-6)
    assert torch.equal(new_lse, lse + 0.5)  # 5e6 + 1.5 + log 2, rounded to float32
    # no key on either side: o 0, lse -inf
    none = torch.full((3,), float("-inf"))
    o, new_lse = block_attention.merge(torch.zeros(3, 4), none, torch.zeros(3, 4), none)
    assert torch.equal(o, torch.zeros(3, 4)) and torch.isneginf(new_lse).all()


# ----------------------------------------------------------------------------- 7. meta tensors


@pytest.mark.parametrize("lowering", ["auto"] + LOWERINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_meta_tensors(lowering, causal):
    """What FSDP and model-initialisation tools pass around: meta in, meta out, as SDPA."""
    q, k, v = leaves((2, 4, 12, 8), (2, 2, 12, 8), (2, 2, 12, 8), device="meta")
    out = op(q, k, v, [4, 8], [1, 2], hilbert=True, is_causal=causal, enable_gqa=True,
             lowering=lowering)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.device.type == "meta" and out.shape == want.shape and out.dtype == want.dtype
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.device.type == "meta" and t.grad.shape == t.shape


def test_meta_tensors_under_autocast():
    q, k, v = leaves((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(q, k, v, [4], [1], lowering="sdpa")
    assert out.device.type == "meta" and out.shape == (1, 2, 8, 4)


# ----------------------------------------------------------------------------- 8. numpy integers


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint8])
def test_numpy_integer_branches(lowering, kind):
    q, k, v = leaves((1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 4))
    got = op(q, k, v, [kind(4), kind(8)], [kind(1), kind(2)], hilbert=True, lowering=lowering)
    want = op(q, k, v, [4, 8], [1, 2], hilbert=True, lowering=lowering)
    assert torch.equal(got, want)


@pytest.mark.parametrize("which", ["segment_lengths", "dilation_rates"])
@pytest.mark.parametrize("bad", [4.0, np.float64(4.0), True, np.bool_(True), "4", None],
                         ids=["float", "np.float64", "bool", "np.bool_", "str", "None"])
def test_branch_sizes_that_are_not_integers(which, bad):
    q, k, v = leaves((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4))
    segs, rates = ([bad], [1]) if which == "segment_lengths" else ([4], [bad])
    with pytest.raises(ValueError, match=which):
        op(q, k, v, segs, rates)


def test_numpy_integer_branches_are_plain_ints():
    """check_branches returns Python ints (the custom op's schema takes int[])."""
    w, r = check_branches([np.int64(8)], [np.int16(2)])
    assert w == (8,) and r == (2,) and type(w[0]) is int and type(r[0]) is int


# ----------------------------------------------------------------------------- the op's registration


def _opcheck_cases():
    torch.manual_seed(0)
    q, k = (torch.randn(2, 4, 9, 8, requires_grad=True) for _ in range(2))
    v_wide, v_narrow = (torch.randn(2, 4, 9, dv, requires_grad=True) for dv in (12, 4))
    e = torch.randn(1, 4, 0, 8, requires_grad=True)
    yield "dv_wide", (q, k, v_wide, [4, 8], [1, 2], True, True, None, 0.0, None, 0.3, "sdpa")
    yield "dv_narrow", (q, k, v_narrow, [4, 8], [1, 2], False, False, None, 0.0, None, 0.3, "sdpa")
    yield "n0", (e, e, e, [4, 8], [1, 2], True, False, None, 0.0, None, 0.3, "sdpa")
    yield "scale0", (q, k, v_wide, [4, 8], [1, 2], True, True, None, 0.0, None, 0.0, "sdpa")


@pytest.mark.parametrize("name,args", list(_opcheck_cases()), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck_edges(name, args):
    """Schema, fake implementations (out [B, Hq, N, Dv], gradients the inputs' shapes), autograd
    registration and AOT dispatch agree with the real implementation on these inputs."""
    torch.library.opcheck(torch.ops.hilbert_fx.dilated_attention.default, args)
