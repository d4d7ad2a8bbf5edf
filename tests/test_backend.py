"""The backend end to end: registration, rewriting SDPA sites, and compiled models against the
same models run eagerly with the float64 reference in place of SDPA."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import hilbert_fx
from models import EncoderDecoder, TinyTransformer
from reference import reference_dilated_attention

W, R = (8, 16), (1, 2)


def with_reference(model, segment_lengths, dilation_rates, hilbert):
    """A float64 copy of `model` whose attentions run the reference."""
    ref = copy.deepcopy(model).double()

    def attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        return reference_dilated_attention(q, k, v, segment_lengths, dilation_rates, hilbert=hilbert,
                                           is_causal=is_causal, attn_mask=attn_mask,
                                           enable_gqa=enable_gqa)
    for attn in ref.attentions():
        attn.attention_fn = attention
    return ref


def test_registered_backend_works_in_a_fresh_process():
    code = (
        "import sys, torch\n"
        "assert 'hilbert_dilated' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "assert 'hilbert_fx' not in sys.modules\n"
        "m = torch.nn.MultiheadAttention(16, 2, batch_first=True)\n"
        "f = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)\n"
        "x = torch.randn(1, 2, 9, 8)\n"
        "out = torch.compile(f, backend='hilbert_dilated')(x, x, x)\n"
        "assert 'hilbert_fx' in sys.modules\n"
        "from reference import reference_dilated_attention as ref\n"
        "expected = ref(x, x, x, (2048, 4096, 8192, 16384), (1, 2, 4, 8), hilbert=True)\n"
        "assert torch.allclose(out.double(), expected, atol=1e-5), (out - expected).abs().max()\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(__file__))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_backend_defaults():
    config = hilbert_fx.backend().config
    assert config.segment_lengths == (2048, 4096, 8192, 16384)
    assert config.dilation_rates == (1, 2, 4, 8)
    assert config.hilbert is True and config.lowering == "auto" and config.mesh is None


def test_backend_rejects_bad_configuration():
    with pytest.raises(ValueError, match="segment_lengths"):
        hilbert_fx.backend(segment_lengths=(8, 6), dilation_rates=(1, 4))
    with pytest.raises(ValueError, match="lowering"):
        hilbert_fx.backend(lowering="cuda")


@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("case", ["causal", "padding_mask", "gqa"])
def test_compiled_model_matches_reference_forward_and_backward(case, hilbert):
    # a seed fixed per case (str hashes change from process to process)
    torch.manual_seed(10 * ["causal", "padding_mask", "gqa"].index(case) + hilbert)
    causal = case != "padding_mask"
    model = TinyTransformer(width=32, heads=4, layers=2, causal=causal,
                            kv_heads=2 if case == "gqa" else None)
    reference = with_reference(model, W, R, hilbert)
    n = 37
    tokens = torch.randint(0, 50, (2, n))
    mask = None
    if case == "padding_mask":  # batch 1 has its last 9 positions padded out
        keep = torch.ones(2, n, dtype=torch.bool)
        keep[1, -9:] = False
        mask = keep[:, None, None, :]

    be = hilbert_fx.backend(W, R, hilbert=hilbert, lowering="sdpa")
    torch._dynamo.reset()
    out = torch.compile(model, backend=be)(tokens, mask)
    expected = reference(tokens, mask)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)

    grad = torch.randn_like(expected)
    out.backward(grad.float())
    expected.backward(grad)
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.double(), p_ref.grad, atol=5e-5, rtol=1e-3, msg=name)


def test_rewritten_graph_names_the_lowering():
    report = hilbert_fx.explain(TinyTransformer(), torch.randint(0, 50, (1, 20)),
                                backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [s.lowering for s in report.sites] == ["sdpa", "sdpa"]
    assert report.graph_after[0].count("torch.ops.hilbert_fx.dilated_attention.default") == 2
    assert "'sdpa')" in report.graph_after[0]
    assert "scaled_dot_product_attention" in report.graph_before[0]
    assert "scaled_dot_product_attention" not in report.graph_after[0]


def test_compiling_a_rewritten_graph_tags_inductor_s_caches_with_the_op_s_definition():
    """Inductor's and AOTAutograd's cache keys do not cover a custom op's fake implementation:
    the backend adds a digest of the op's definition to torch.compiler.config.cache_key_tag, so
    that a graph compiled against another version of the op is compiled again, not loaded with
    that version's output strides (which its stride checks would refuse)."""
    before = torch.compiler.config.cache_key_tag
    try:
        torch.compiler.config.cache_key_tag = ""
        torch._dynamo.reset()
        model = TinyTransformer().eval()
        torch.compile(model, backend=hilbert_fx.backend(W, R))(torch.randint(0, 50, (1, 20)))
        tag = torch.compiler.config.cache_key_tag
        assert tag.startswith("hilbert_fx-op-") and len(tag) == len("hilbert_fx-op-") + 16, tag
        torch._dynamo.reset()
        torch.compile(model, backend=hilbert_fx.backend(W, R))(torch.randint(0, 50, (1, 20)))
        assert torch.compiler.config.cache_key_tag == tag  # added once
    finally:
        torch.compiler.config.cache_key_tag = before
        torch._dynamo.reset()


def test_cross_attention_is_left_alone_with_its_reason():
    torch.manual_seed(0)
    model = EncoderDecoder()
    for n_src in (13, 11):  # the same length as the target, and another
        report = hilbert_fx.explain(model, torch.randn(1, n_src, 32), torch.randn(1, 11, 32),
                                    backend=hilbert_fx.backend(W, R))
        actions = {s.module: (s.action, s.reason) for s in report.sites}
        assert actions["encoder.attn"] == ("rewritten", "")
        assert actions["self_attn"] == ("rewritten", "")
        assert actions["cross_attn"][0] == "skipped"
        expected = "cross-attention" if n_src == 11 else "different lengths"
        assert expected in actions["cross_attn"][1], actions["cross_attn"]


def test_dropout_in_training_draws_fresh_masks_and_trains():
    """SDPA's dropout_p goes to the op (q, k, v from one sequence: a self-attention the pass
    rewrites, as explain's row says, dropout included): the same torch seed gives the same
    dropout, each call a fresh one, and the gradients flow."""
    torch.manual_seed(0)
    n = 29

    def attention(x):
        q, k, v = x.split(8, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)

    be = hilbert_fx.backend(W, R, lowering="sdpa")
    compiled = torch.compile(attention, backend=be)
    x = torch.randn(1, 2, n, 24, requires_grad=True)
    torch.manual_seed(1)
    a = compiled(x)
    torch.manual_seed(1)
    b = compiled(x)
    c = compiled(x)
    assert torch.equal(a, b), "the same torch seed must give the same dropout"
    assert not torch.equal(a, c), "each call must draw a fresh dropout mask"
    no_dropout = hilbert_fx.dilated_attention(*x.split(8, dim=-1), W, R, hilbert=True,
                                              is_causal=True)
    assert not torch.allclose(a, no_dropout)
    a.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    report = str(hilbert_fx.explain(attention, x, backend=be))
    assert "dropout_p=0.5" in report and "1 rewritten" in report, report
