"""Bad arguments of hilbert_fx.dilated_attention raise ValueError naming the argument (SPEC 2)."""
import pytest
import torch

import hilbert_fx


def x(*shape):
    return torch.randn(*shape)


Q, K, V = x(1, 4, 8, 4), x(1, 4, 8, 4), x(1, 4, 8, 4)


def call(q=Q, k=K, v=V, segs=(4,), rates=(1,), **kw):
    return hilbert_fx.dilated_attention(q, k, v, list(segs), list(rates), **kw)


def test_good_call_works():
    assert call().shape == Q.shape


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
    assert call(k=k, v=k, enable_gqa=True).shape == Q.shape  # and fine with it


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
    from hilbert_fx.lowering import triton_lowering
    monkeypatch.setenv("HILBERT_FX_TRITON_FWD", value)
    with pytest.raises(ValueError, match=f"HILBERT_FX_TRITON_FWD.*{match}|{match}.*HILBERT_FX_TRITON_FWD"):
        triton_lowering.tile_config("fwd", torch.device("cpu"), torch.float32, 64, interpreted=True)
