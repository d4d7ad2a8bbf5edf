"""`dilate`: which sites are rewritten and with which configuration (SPEC section 1)."""
from __future__ import annotations

import copy

import pytest
import torch

import hilbert_fx
from models import Block, SelfAttention, TinyTransformer
from reference import reference_dilated_attention

BACKEND = hilbert_fx.backend((8, 16), (1, 2), lowering="sdpa")
A = dict(segment_lengths=(4,), dilation_rates=(2,))
B = dict(segment_lengths=(6, 12), dilation_rates=(1, 3))


def sites_of(model, n=21):
    report = hilbert_fx.explain(model, torch.randint(0, 50, (1, n)), backend=BACKEND)
    return {s.module: s for s in report.sites}


def describe(config):
    return hilbert_fx.DilatedConfig(hilbert=True, **config).describe()


def test_without_dilate_every_site_takes_the_backend_configuration():
    sites = sites_of(TinyTransformer(layers=2))
    assert {m: s.action for m, s in sites.items()} == {"layers.0.attn": "rewritten",
                                                       "layers.1.attn": "rewritten"}
    assert all(s.config == BACKEND.config.describe() for s in sites.values())


def test_decorated_class_scopes_the_rewrite():
    @hilbert_fx.dilate(**A)
    class DilatedAttention(SelfAttention):
        pass

    model = TinyTransformer(layers=3)
    model.layers[1].attn = DilatedAttention(32, 4)
    sites = sites_of(model)
    assert sites["layers.1.attn"].action == "rewritten"
    assert sites["layers.1.attn"].config == describe(A)
    for name in ("layers.0.attn", "layers.2.attn"):
        assert sites[name].action == "skipped"
        assert "outside every module marked with hilbert_fx.dilate" in sites[name].reason


def test_decorated_instance_is_returned_and_scopes_the_rewrite():
    model = TinyTransformer(layers=2)
    target = model.layers[0]
    assert hilbert_fx.dilate(target, **A) is target
    assert type(target).__name__ == "Block" and isinstance(target, Block)
    sites = sites_of(model)
    assert (sites["layers.0.attn"].action, sites["layers.0.attn"].config) == ("rewritten", describe(A))
    assert sites["layers.1.attn"].action == "skipped"
    # the class itself is untouched: a fresh model is not scoped
    assert all(s.action == "rewritten" for s in sites_of(TinyTransformer(layers=2)).values())


def test_innermost_decorated_module_wins_and_configurations_mix():
    model = TinyTransformer(layers=3)
    hilbert_fx.dilate(model, **B)  # the whole model: every site, configuration B ...
    hilbert_fx.dilate(model.layers[1], **A)  # ... except inside layers.1: A
    hilbert_fx.dilate(model.layers[2].attn, segment_lengths=(3,), dilation_rates=(3,), hilbert=False)
    sites = sites_of(model)
    assert sites["layers.0.attn"].config == describe(B)
    assert sites["layers.1.attn"].config == describe(A)
    assert sites["layers.2.attn"].config == hilbert_fx.DilatedConfig((3,), (3,), False).describe()
    assert all(s.action == "rewritten" for s in sites.values())


def test_scoped_model_computes_each_configuration():
    """The compiled output equals a float64 copy of the model whose layer 0 runs the reference
    with configuration A and whose layer 1 stays dense (outside every dilate scope)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    hilbert_fx.dilate(model.layers[0].attn, **A)
    tokens = torch.randint(0, 50, (2, 19))
    torch._dynamo.reset()
    out = torch.compile(model, backend=BACKEND)(tokens)

    def dilated(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        assert attn_mask is None
        return reference_dilated_attention(q, k, v, A["segment_lengths"], A["dilation_rates"],
                                           hilbert=True, is_causal=is_causal)
    expected = copy.deepcopy(model).double()
    expected.layers[0].attn.attention_fn = dilated  # layer 1 stays dense SDPA
    with torch.no_grad():
        torch.testing.assert_close(out.double(), expected(tokens), atol=2e-5, rtol=1e-4)
        dense = copy.deepcopy(expected)
        dense.layers[0].attn.attention_fn = torch.nn.functional.scaled_dot_product_attention
        assert (dense(tokens) - expected(tokens)).abs().max() > 1e-3  # A matters here


def test_dilate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nn.Module"):
        hilbert_fx.dilate(42, **A)
    with pytest.raises(ValueError, match="segment_lengths"):
        hilbert_fx.dilate(segment_lengths=(4, 8), dilation_rates=(1,))
    with pytest.raises(ValueError, match="dilation_rates"):
        hilbert_fx.dilate(segment_lengths=(4,), dilation_rates=(0,))
