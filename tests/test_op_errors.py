"""Bad arguments of hilbert_fx.dilated_attention raise ValueError naming the argument (SPEC 2)."""
import pytest
import torch

import hilbert_fx
from reference import reference_dilated_attention


def x(*shape):
    return torch.randn(*shape)


Q, K, V = x(1, 4, 8, 4), x(1, 4, 8, 4), x(1, 4, 8, 4)


def call(q=Q, k=K, v=V, segs=(4,), rates=(1,), **kw):
    return hilbert_fx.dilated_attention(q, k, v, list(segs), list(rates), **kw)


def test_good_call_works():
    # (4,), (1,) at N = 8: two segments of 4, not dense attention
    expected = reference_dilated_attention(Q, K, V, (4,), (1,))
    torch.testing.assert_close(call().double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("segs,rates", [((4, 8), (1,)), ((4,), (1, 2)), ((4, 8, 16), (1, 2))])
def test_unequal_list_lengths(segs, rates):
    with pytest.raises(ValueError, match="segment_lengths|dilation_rates"):
        call(segs=segs, rates=rates)


@pytest.mark.parametrize("bad", [0, -4])
def test_non_positive_segment_length(bad):
    with pytest.raises(ValueError, match="segment_lengths"):
        call(segs=(4, bad), rates=(1, 1))


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_dilation_rate(bad):
    with pytest.raises(ValueError, match="dilation_rates"):
        call(segs=(4, 8), rates=(1, bad))


@pytest.mark.parametrize("segs,rates", [((6,), (4,)), ((4, 9), (1, 2)), ((3,), (6,))])
def test_segment_not_multiple_of_rate(segs, rates):
    with pytest.raises(ValueError, match="segment_lengths|dilation_rates"):
        call(segs=segs, rates=rates)


def test_heads_not_a_multiple():
    k = x(1, 3, 8, 4)
    with pytest.raises(ValueError, match=r"\bq\b|\bk\b|head"):
        call(k=k, v=k, enable_gqa=True)


def test_gqa_heads_without_enable_gqa():
    k = x(1, 2, 8, 4)
    with pytest.raises(ValueError, match="enable_gqa"):
        call(k=k, v=k)
    expected = reference_dilated_attention(Q, k, k, (4,), (1,), enable_gqa=True)
    torch.testing.assert_close(call(k=k, v=k, enable_gqa=True).double(), expected,
                               atol=1e-5, rtol=1e-5)  # and fine with it


@pytest.mark.parametrize("nk", [7, 9])
def test_q_k_different_lengths(nk):
    k = x(1, 4, nk, 4)
    with pytest.raises(ValueError, match=r"\bq\b|\bk\b"):
        call(k=k, v=k)


def test_v_length_differs_from_k():
    with pytest.raises(ValueError, match=r"\bv\b|\bk\b"):
        call(v=x(1, 4, 9, 4))


@pytest.mark.parametrize("mask", [torch.ones(8, 8, dtype=torch.bool), torch.zeros(8, 8)])
def test_mask_and_is_causal(mask):
    with pytest.raises(ValueError, match="attn_mask|is_causal"):
        call(attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(4, 8, 4), (1, 1, 4, 8, 4), (8, 4)])
def test_wrong_rank(which, shape):
    args = dict(q=Q, k=K, v=V)
    args[which] = x(*shape)
    with pytest.raises(ValueError, match=rf"\b{which}\b"):
        call(**args)


@pytest.mark.parametrize("value,match", [("512,64,4,3", "powers of two"), ("128,48,4,3", "powers of two"),
                                         ("128,64,4", "BLOCK_M,BLOCK_N,num_warps,num_stages")])
def test_tile_override_rejected(monkeypatch, value, match):
    """HILBERT_FX_TRITON_FWD: tiles past 256 would read past the plan's padded positions."""
    from hilbert_fx.lowering import triton_lowering, tuning
    monkeypatch.setenv("HILBERT_FX_TRITON_FWD", value)
    monkeypatch.setattr(tuning, "_current", None)  # the knobs are read once: read them again
    with pytest.raises(ValueError, match=f"HILBERT_FX_TRITON_FWD.*{match}|{match}.*HILBERT_FX_TRITON_FWD"):
        triton_lowering.tile_config("fwd", torch.device("cpu"), torch.float32, 64, interpreted=True)


# ---------------------------------------------------------------------------------------------
# One rule book: lowering.arguments.problem says what is wrong with a call; the op raises it, the
# ring agrees on it, the Triton lowering checks its shared rules with it, and the pass records it
# from shapes it saw (TensorSpecs without dtypes).

BAD_CALLS = [
    ("q_3d", dict(q=x(4, 8, 4)), r"\bq\b.*4 dimensions"),
    ("lengths", dict(k=x(1, 4, 6, 4), v=x(1, 4, 6, 4)), r"q and k have different lengths"),
    ("v_length", dict(v=x(1, 4, 6, 4)), r"k and v must have the same length"),
    ("batch", dict(k=x(2, 4, 8, 4), v=x(2, 4, 8, 4)), r"batch size"),
    ("head_dim", dict(k=x(1, 4, 8, 2)), r"head dim"),
    ("kv_heads", dict(k=x(1, 2, 8, 4)), r"number of heads"),
    ("gqa", dict(k=x(1, 3, 8, 4), v=x(1, 3, 8, 4), enable_gqa=True), r"Hq % Hkv"),
    ("mask_shape", dict(attn_mask=torch.ones(2, 4, 8, 8, dtype=torch.bool)), r"attn_mask.*broadcast"),
    ("mask_grad", dict(attn_mask=torch.zeros(8, 8, requires_grad=True)), r"attn_mask.*requires grad"),
    ("mask_dtype", dict(attn_mask=torch.ones(8, 8, dtype=torch.int32)), r"attn_mask.*boolean"),
    ("mask_causal", dict(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True), r"attn_mask"),
    ("dropout", dict(dropout_p=1.0), r"dropout_p"),
    ("scale", dict(scale=float("inf")), r"scale"),
]


@pytest.mark.parametrize("name,args,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_one_rule_book_for_tensors_and_specs(name, args, match):
    """The op raises problem's text; the same text comes from TensorSpecs of the tensors, and from
    shapes alone (the pass's recorded shapes) wherever the rule does not read a dtype."""
    from hilbert_fx.lowering.arguments import TensorSpec, problem
    args = dict(args)
    q, k, v = args.pop("q", Q), args.pop("k", K), args.pop("v", V)
    mask = args.pop("attn_mask", None)
    with pytest.raises(ValueError, match=match) as raised:
        call(q=q, k=k, v=v, attn_mask=mask, **args)
    flags = {"is_causal": False, "dropout_p": 0.0, "enable_gqa": False, "scale": None, **args}
    assert problem(q, k, v, mask, **flags) == str(raised.value)
    specs = [TensorSpec.of(t) for t in (q, k, v)]
    assert problem(*specs, None if mask is None else TensorSpec.of(mask), **flags) == str(raised.value)
    if name != "mask_dtype":
        shapes = [TensorSpec(tuple(t.shape)) for t in (q, k, v)]
        m = None if mask is None else TensorSpec(tuple(mask.shape), requires_grad=mask.requires_grad)
        assert problem(*shapes, m, **flags) == str(raised.value)


def test_rule_book_accepts_a_good_call_and_unknown_dtypes():
    from hilbert_fx.lowering.arguments import TensorSpec, problem
    assert problem(Q, K, V) == ""
    assert problem(TensorSpec((1, 4, 8, 4)), TensorSpec((1, 2, 8, 4)), TensorSpec((1, 2, 8, 6)),
                   TensorSpec((8, 8), torch.bool), enable_gqa=True) == ""
    # dtypes that differ: the op's rule, unless the caller says autocast casts them (the pass)
    half = Q.half()
    assert "same dtype" in problem(half, K, V)
    assert problem(half, K, V, same_dtype=False) == ""
    assert "must be a tensor" in problem([1], K, V)
    assert "floating-point" in problem(TensorSpec((1, 4, 8, 4), torch.int64), K, V)


def test_ring_local_check_reads_the_rule_book():
    """The ring's local check before agreeing across ranks returns problem's text (no mesh
    needed: it runs before any collective)."""
    from hilbert_fx.lowering.arguments import problem
    from hilbert_fx.lowering.ring_agree import local_error
    k = x(1, 3, 8, 4)
    error = local_error(Q, k, k, (4,), (1,), False, None, 0.0, 0.5, "sdpa")
    assert error == problem(Q, k, k, enable_gqa=True) and "Hq % Hkv" in error
    assert local_error(Q, K, V, (4,), (1,), True, None, 0.0, 0.5, "sdpa") is None
    assert "dropout_p" in local_error(Q, K, V, (4,), (1,), False, None, 1.5, 0.5, "sdpa")
    assert "multiple of its dilation rate" in local_error(Q, K, V, (6,), (4,), False, None,
                                                                0.0, 0.5, "sdpa")


def test_triton_lowering_checks_shared_rules_with_the_rule_book():
    pytest.importorskip("triton")
    from hilbert_fx.lowering import triton_lowering
    with pytest.raises(ValueError, match=r"Hq % Hkv"):
        triton_lowering._check_inputs(Q, x(1, 3, 8, 4), x(1, 3, 8, 4))
    with pytest.raises(ValueError, match=r"same dtype"):
        triton_lowering._check_inputs(Q, K, V.double())
    with pytest.raises(ValueError, match=r"lowering='triton' supports float16"):
        triton_lowering._check_inputs(Q.double(), K.double(), V.double())
