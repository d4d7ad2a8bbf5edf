"""Hugging Face transformers models from small configs with random weights (nothing downloaded),
in their eager and SDPA attention implementations: every self-attention layer is found and
rewritten, what cannot be (cross-attention, DeBERTa's content-to-position terms) is skipped with
its reason, and under the identity configuration (one branch w >= N, r = 1) the compiled model
equals the eager one within float32 rounding, with and without a padding mask.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hilbert_fx  # noqa: E402

N, BATCH, VOCAB = 12, 2, 96
IDENTITY = dict(segment_lengths=(64,), dilation_rates=(1,))
LAYERS = 2
IMPLS = ("eager", "sdpa")


def expect(rewritten, skipped=(), padded_rows_zeroed=False):
    """What the pass must find: how many sites it rewrites, (module part, reason part) of each site
    it skips, in graph order, and whether the model's padding queries have no key at all (their
    rows are then the op's zeros, SPEC sections 2 and 5, not eager's average of every value)."""
    return {"rewritten": rewritten, "skipped": list(skipped),
            "padded_rows_zeroed": padded_rows_zeroed}


def gpt2(impl):
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=VOCAB,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     attn_implementation=impl)
    # padding rows: the op gives them 0 (SPEC section 5: padding belongs to no sequence)
    return transformers.GPT2Model(config), expect(LAYERS, padded_rows_zeroed=True)


def llama_gqa(impl):
    config = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB,
                                      max_position_embeddings=64, attn_implementation=impl)
    return transformers.LlamaModel(config), expect(LAYERS, padded_rows_zeroed=True)


def bert(impl):
    config = transformers.BertConfig(num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=VOCAB,
                                     max_position_embeddings=64, attn_implementation=impl)
    # padding rows: the op gives them 0 (SPEC section 5: the padding mask is read as the row's
    # sequence, position_ids -1 on padding)
    return transformers.BertModel(config, add_pooling_layer=False), expect(
        LAYERS, padded_rows_zeroed=True)


def vit(impl):
    config = transformers.ViTConfig(num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=4,
                                    attn_implementation=impl)
    return transformers.ViTModel(config, add_pooling_layer=False), expect(LAYERS)


def t5(impl):
    config = transformers.T5Config(num_layers=LAYERS, num_decoder_layers=LAYERS, d_model=32, d_kv=8,
                                   num_heads=4, d_ff=64, vocab_size=VOCAB,
                                   relative_attention_num_buckets=8, attn_implementation=impl)
    # encoder self-attention, decoder self-attention, decoder cross-attention in every layer
    return transformers.T5Model(config), expect(2 * LAYERS,
                                                 [("EncDecAttention", "cross-attention")] * LAYERS)


def bloom(impl):  # ALiBi as baddbmm's input over [B*H, N, N], beta 1, the scale as alpha
    config = transformers.BloomConfig(n_layer=LAYERS, hidden_size=32, n_head=4, vocab_size=VOCAB,
                                      attn_implementation=impl)
    return transformers.BloomModel(config), expect(LAYERS)


def deberta_v2(impl):  # bmm(q, k^T / scale) over [B*H, N, N], masked_fill over [B, H, N, N]
    config = transformers.DebertaV2Config(num_hidden_layers=LAYERS, hidden_size=32,
                                          num_attention_heads=4, intermediate_size=64,
                                          vocab_size=VOCAB, max_position_embeddings=64,
                                          relative_attention=False, pos_att_type=None,
                                          attn_implementation=impl)
    # its mask is m m^T: a padding query has no key
    return transformers.DebertaV2Model(config), expect(LAYERS, padded_rows_zeroed=True)


def deberta_v2_relative(impl):  # disentangled attention: c2p and p2c are products with q and k
    config = transformers.DebertaV2Config(num_hidden_layers=LAYERS, hidden_size=32,
                                          num_attention_heads=4, intermediate_size=64,
                                          vocab_size=VOCAB, max_position_embeddings=64,
                                          relative_attention=True, pos_att_type=["c2p", "p2c"],
                                          max_relative_positions=16, position_buckets=8,
                                          attn_implementation=impl)
    return transformers.DebertaV2Model(config), expect(
        0, [("attention.self", "computed from the queries or keys")] * LAYERS)


def falcon_alibi(impl):  # eager: ALiBi added to the [B, H, N, N] scores, then scaled in place
    config = transformers.FalconConfig(num_hidden_layers=LAYERS, hidden_size=32,
                                       num_attention_heads=4, vocab_size=VOCAB, alibi=True,
                                       attn_implementation=impl)
    return transformers.FalconModel(config), expect(LAYERS)


def gemma2(impl):  # eager: tanh soft-capping of the scores, which the op does not compute
    config = transformers.Gemma2Config(num_hidden_layers=LAYERS, hidden_size=32, head_dim=8,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=VOCAB,
                                       max_position_embeddings=64, attn_logit_softcapping=50.0,
                                       attn_implementation=impl)
    return transformers.Gemma2Model(config), expect(0, [(f"layers.{i}", "tanh")
                                                        for i in range(LAYERS)])


def gpt_oss(impl):  # eager: a sink logit per head beside the keys', sliced off after the softmax
    config = transformers.GptOssConfig(num_hidden_layers=LAYERS, hidden_size=32, head_dim=8,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=VOCAB, num_local_experts=2,
                                       num_experts_per_tok=1, max_position_embeddings=64,
                                       attn_implementation=impl)
    return transformers.GptOssModel(config), expect(0, [(f"layers.{i}", "attention sinks")
                                                        for i in range(LAYERS)])


FAMILIES = {"gpt2": gpt2, "llama_gqa": llama_gqa, "bert": bert, "vit": vit, "t5": t5,
            "bloom": bloom, "deberta_v2": deberta_v2, "deberta_v2_relative": deberta_v2_relative,
            "falcon_alibi": falcon_alibi, "gemma2": gemma2, "gpt_oss": gpt_oss}
# Bloom, DeBERTa-v2, Gemma2 and gpt-oss have no SDPA implementation in transformers
FAMILY_IMPLS = {"bloom": ("eager",), "deberta_v2": ("eager",), "deberta_v2_relative": ("eager",),
                "gemma2": ("eager",), "gpt_oss": ("eager",)}


def inputs(family, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}
    kwargs = {"input_ids": torch.randint(1, VOCAB, (BATCH, N), generator=g)}
    if padded:  # the second sequence is 4 tokens shorter, padded on the right
        mask = torch.ones(BATCH, N, dtype=torch.long)
        mask[1, -4:] = 0
        kwargs["attention_mask"] = mask
    if family == "t5":
        kwargs["decoder_input_ids"] = torch.randint(1, VOCAB, (BATCH, N), generator=g)
    return kwargs


class Recorder:
    """The pass without Inductor, keeping the sites it found."""
    def __init__(self, **config):
        self.inner = hilbert_fx.backend(**config, lowering="sdpa")
        self.sites = []

    def __call__(self, gm, example_inputs):
        self.sites += self.inner.transform(gm).sites
        return gm.forward


def output(result):
    return result.last_hidden_state


CASES = [(f, i, p) for f in FAMILIES for i in FAMILY_IMPLS.get(f, IMPLS)
         for p in ((False, True) if f != "vit" else (False,))]


@pytest.mark.parametrize("family,impl,padded", CASES,
                         ids=[f"{f}-{i}-{'padded' if p else 'plain'}" for f, i, p in CASES])
def test_sites_and_identity_configuration_equal_eager(family, impl, padded):
    torch.manual_seed(0)
    model, expected = FAMILIES[family](impl)
    model.eval()
    kwargs = inputs(family, padded)
    torch._dynamo.reset()
    rec = Recorder(**IDENTITY)
    with torch.no_grad():
        eager = output(model(**kwargs))
        compiled = output(torch.compile(model, backend=rec, fullgraph=True)(**kwargs))
    rewritten = [s for s in rec.sites if s.action == "rewritten"]
    skipped = [s for s in rec.sites if s.action == "skipped"]
    described = [(s.kind, s.module, s.action, s.reason) for s in rec.sites]
    assert len(rewritten) == expected["rewritten"], described
    assert len(skipped) == len(expected["skipped"]), described
    assert all(s.kind == ("sdpa" if impl == "sdpa" else "manual") for s in rec.sites), described
    for s, (module, reason) in zip(skipped, expected["skipped"]):
        assert module in s.module and reason in s.reason, described
    if family in ("gpt2", "llama_gqa") and not padded:  # causal: is_causal, no mask
        assert all(s.is_causal and s.attn_mask is None for s in rewritten), described
    if family == "llama_gqa":  # the op reads the 2 key/value heads itself
        assert all(s.enable_gqa for s in rewritten), described
    if padded and expected["padded_rows_zeroed"]:
        real = kwargs["attention_mask"].bool()
        assert torch.isfinite(compiled[~real]).all()
        compiled, eager = compiled[real], eager[real]
    torch.testing.assert_close(compiled, eager, atol=2e-5, rtol=1e-4)


def equal_to_eager_at_two_lengths(model, dynamic):
    """Compile under the identity configuration, run two lengths, compare with eager; the
    recorder of the sites found."""
    model.eval()
    torch._dynamo.reset()
    rec = Recorder(**IDENTITY)
    compiled = torch.compile(model, backend=rec, dynamic=dynamic)
    with torch.no_grad():
        for n in (N, N + 5):
            ids = torch.randint(1, VOCAB, (BATCH, n))
            torch.testing.assert_close(output(compiled(input_ids=ids)), output(model(input_ids=ids)),
                                       atol=2e-5, rtol=1e-4)
    return rec


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_causal_language_models_stay_causal_at_a_second_length(family, impl, dynamic):
    """A second length recompiles with a symbolic length (dynamic=True: from the start, float
    attributes such as the scale included): the causal mask is still proved, the scale kept."""
    torch.manual_seed(0)
    model, _ = FAMILIES[family](impl)
    rec = equal_to_eager_at_two_lengths(model, dynamic)
    assert len(rec.sites) == (2 * LAYERS if dynamic is None else LAYERS)
    assert all(s.action == "rewritten" and s.is_causal for s in rec.sites), [s.reason for s in rec.sites]


def test_deberta_v2_is_rewritten_at_symbolic_lengths():
    """dynamic=True: the views that unfold and fold the heads have symbolic sizes, and the
    dropout's p (a float attribute, out of training) is a run-time value: both are still read."""
    torch.manual_seed(0)
    model, _ = deberta_v2("eager")
    rec = equal_to_eager_at_two_lengths(model, dynamic=True)
    assert [(s.action, s.reason) for s in rec.sites] == [("rewritten", "")] * LAYERS
    assert isinstance(rec.sites[0].shapes["q"][2], torch.SymInt)


def test_explain_reports_t5_sites_with_module_paths_and_reasons():
    torch.manual_seed(0)
    model, _ = t5("sdpa")
    model.eval()
    with torch.no_grad():
        report = hilbert_fx.explain(model, **inputs("t5", True),
                                    backend=hilbert_fx.backend(**IDENTITY, lowering="sdpa"))
    rows = {s.module: (s.action, s.reason) for s in report.sites}
    for layer in range(LAYERS):
        assert rows[f"encoder.block.{layer}.layer.0.SelfAttention"] == ("rewritten", "")
        assert rows[f"decoder.block.{layer}.layer.0.SelfAttention"] == ("rewritten", "")
        action, reason = rows[f"decoder.block.{layer}.layer.1.EncDecAttention"]
        assert action == "skipped" and "cross-attention" in reason
    assert "cross-attention" in str(report)


@pytest.mark.parametrize("family,layer_module", [
    ("bloom", "h.{}.self_attention"), ("falcon_alibi", "h.{}.self_attention"),
    ("deberta_v2", "encoder.layer.{}.attention.self"),
    ("deberta_v2_relative", "encoder.layer.{}.attention.self")])
def test_explain_reports_a_row_for_every_attention_layer(family, layer_module):
    """No self-attention is walked past: each layer has its row in `explain`, rewritten, or
    skipped with the reason (DeBERTa's disentangled attention adds terms computed from q and k,
    which no mask can carry)."""
    torch.manual_seed(0)
    model, expected = FAMILIES[family]("eager")
    with torch.no_grad():
        report = hilbert_fx.explain(model.eval(), **inputs(family, True),
                                    backend=hilbert_fx.backend(**IDENTITY, lowering="sdpa"))
    assert len(report.sites) == LAYERS, report
    for layer, s in enumerate(report.sites):
        assert s.kind == "manual" and s.module.endswith(layer_module.format(layer)), report
        if expected["rewritten"]:
            assert (s.action, s.reason) == ("rewritten", ""), report
        else:
            assert s.action == "skipped" and "computed from the queries or keys" in s.reason, report
            assert "c2p" in str(report)


def test_t5_in_training_keeps_its_learned_position_bias_and_says_why():
    """T5's relative position bias is a learned mask: with gradients on, the op (which does not
    differentiate its mask) cannot take it, so those sites are skipped with that reason."""
    torch.manual_seed(0)
    model, _ = t5("eager")
    report = hilbert_fx.explain(model.train(), **inputs("t5", False),
                                backend=hilbert_fx.backend(**IDENTITY, lowering="sdpa"))
    self_attention = [s for s in report.sites if "SelfAttention" in s.module]
    assert len(report.sites) == 3 * LAYERS and len(self_attention) == 2 * LAYERS, report
    for s in report.sites:
        assert s.action == "skipped"
        assert ("requires grad" in s.reason) if "SelfAttention" in s.module else (
            "cross-attention" in s.reason), s


def test_llama_gqa_through_inductor_trains_like_eager():
    """The whole backend (Inductor included), forward and backward, identity configuration:
    both sites rewritten (the identity configuration equals dense attention, so the values
    alone would not tell a rewritten site from one left as it was)."""
    torch.manual_seed(0)
    model, _ = llama_gqa("sdpa")
    kwargs = inputs("llama_gqa", False)
    torch._dynamo.reset()
    be = hilbert_fx.backend(**IDENTITY, lowering="sdpa")
    be.keep_records = True
    out = output(torch.compile(model, backend=be)(**kwargs))
    sites = [s for record in be.records for s in record.sites]
    assert [s.action for s in sites] == ["rewritten"] * LAYERS, [s.reason for s in sites]
    assert all("hilbert_fx.dilated_attention" in r.graph_after for r in be.records)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    eager = output(model(**kwargs))
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager, atol=2e-5, rtol=1e-4)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-3)
