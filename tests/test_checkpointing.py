"""Activation checkpointing: Dynamo puts each checkpointed region in a subgraph of a higher-order
op; the pass finds attention there too, and the compiled model trains (through Inductor) as the
same model with the float64 reference in place of its attention."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

import hilbert_fx
from models import TinyTransformer, register_reference_attention
from reference import reference_dilated_attention
from test_backend import with_reference

W, R = (8, 16), (1, 2)
N = 37


class Checkpointed(nn.Module):
    """TinyTransformer whose layers run under torch.utils.checkpoint."""
    def __init__(self, model: TinyTransformer, use_reentrant: bool):
        super().__init__()
        self.model, self.use_reentrant = model, use_reentrant

    def forward(self, tokens):
        x = self.model.embed(tokens)
        for layer in self.model.layers:
            x = checkpoint.checkpoint(layer, x, use_reentrant=self.use_reentrant)
        return self.model.head(x)


def assert_grads_close(model, reference):
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.double(), p_ref.grad, atol=5e-5, rtol=1e-3, msg=name)


def tiny(causal: bool):
    """A TinyTransformer, its float64 reference copy and tokens."""
    torch.manual_seed(0)
    model = TinyTransformer(width=32, heads=4, layers=2, causal=causal)
    return model, with_reference(model, W, R, hilbert=True), torch.randint(0, 50, (2, N))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_layers_are_rewritten_and_train_as_the_reference(use_reentrant):
    model, reference, tokens = tiny(causal=True)
    be = hilbert_fx.backend(W, R, lowering="sdpa")

    report = hilbert_fx.explain(Checkpointed(model, use_reentrant), tokens, backend=be)
    assert [(s.module, s.action) for s in report.sites] == [
        ("model.layers.0.attn", "rewritten"), ("model.layers.1.attn", "rewritten")], str(report)
    assert "torch.ops.hilbert_fx.dilated_attention" in "".join(report.graph_after)

    torch._dynamo.reset()
    out = torch.compile(Checkpointed(model, use_reentrant), backend=be)(tokens)
    expected = reference(tokens)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    grad = torch.randn_like(expected)
    out.backward(grad.float())
    expected.backward(grad)
    assert_grads_close(model, reference)


class CheckpointedWithMask(Checkpointed):
    """The causal mask is built once, outside the checkpointed regions, and passed into each
    (as transformers does): the pass must read it where it was built."""
    def forward(self, tokens):
        n = tokens.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        x = self.model.embed(tokens)
        for layer in self.model.layers:
            x = checkpoint.checkpoint(layer, x, mask, use_reentrant=self.use_reentrant)
        return self.model.head(x)


class Recorder:
    """The pass without Inductor, keeping the sites it found."""
    def __init__(self, backend):
        self.backend, self.sites = backend, []

    def __call__(self, gm, example_inputs):
        self.sites += self.backend.transform(gm).sites
        return gm.forward


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_causal_mask_built_outside_the_checkpointed_regions_becomes_is_causal(use_reentrant):
    model, reference, tokens = tiny(causal=False)
    rec = Recorder(hilbert_fx.backend(W, R, lowering="sdpa"))
    torch._dynamo.reset()
    out = torch.compile(CheckpointedWithMask(model, use_reentrant), backend=rec)(tokens)
    assert [(s.action, s.is_causal, s.attn_mask) for s in rec.sites] == [
        ("rewritten", True, None)] * 2, [(s.module, s.reason) for s in rec.sites]
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    torch.testing.assert_close(out.double(), reference(tokens, mask), atol=2e-5, rtol=1e-4)


def hf_llama(attn_implementation):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=96,
                                      max_position_embeddings=64,
                                      attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config)


def test_transformers_gradient_checkpointing_trains_as_the_reference():
    torch.manual_seed(0)
    model = hf_llama("sdpa")
    reference = copy.deepcopy(model).double()
    reference.config._attn_implementation = register_reference_attention(W, R, hilbert=True)
    model.gradient_checkpointing_enable()
    reference.gradient_checkpointing_enable()
    model.train()
    reference.train()
    ids = torch.randint(1, 96, (2, N))
    be = hilbert_fx.backend(W, R, lowering="sdpa")

    report = hilbert_fx.explain(model, input_ids=ids, labels=ids, backend=be)
    rows = [(s.module, s.action) for s in report.sites]
    assert rows == [("model.layers.0.self_attn", "rewritten"),
                    ("model.layers.1.self_attn", "rewritten")], str(report)

    torch._dynamo.reset()
    loss = torch.compile(model, backend=be)(input_ids=ids, labels=ids).loss
    expected = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss.double(), expected.double(), atol=2e-5, rtol=1e-5)
    loss.backward()
    expected.backward()
    assert_grads_close(model, reference)


class DropoutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
        return out.transpose(1, 2).reshape(b, n, 16)


def test_dropout_in_a_checkpointed_region_keeps_its_mask_in_the_backward():
    """The seed is drawn once in the forward: the recomputation in the backward must not draw a
    new one, so the gradients equal those of the same step without checkpointing."""
    torch.manual_seed(0)
    attention = DropoutAttention()
    x = torch.randn(1, 20, 16)
    results = []
    for use_checkpoint in (False, True):
        model = copy.deepcopy(attention)

        def run(x, model=model, use_checkpoint=use_checkpoint):
            return checkpoint.checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)

        torch._dynamo.reset()
        compiled = torch.compile(run, backend=hilbert_fx.backend((8,), (1,), lowering="sdpa"))
        torch.manual_seed(5)
        out = compiled(x)
        out.square().sum().backward()
        results.append((out.detach(), model.qkv.weight.grad.clone()))
        torch.manual_seed(6)
        assert not torch.equal(compiled(x), out), "dropout must draw another mask for another seed"
    (out, grad), (out_ckpt, grad_ckpt) = results
    torch.testing.assert_close(out_ckpt, out)
    torch.testing.assert_close(grad_ckpt, grad)
    report = hilbert_fx.explain(model, x, backend=hilbert_fx.backend((8,), (1,), lowering="sdpa"))
    assert [s.action for s in report.sites] == ["rewritten"], report
    # the gradient is the derivative of the forward with its own mask: a central difference
    # along a random direction, each side drawing the same seed (float64 weights and input)
    model64 = copy.deepcopy(attention).double()
    torch._dynamo.reset()
    compiled = torch.compile(model64, backend=hilbert_fx.backend((8,), (1,), lowering="sdpa"))

    def loss(weight):
        with torch.no_grad():
            model64.qkv.weight.copy_(weight)
        torch.manual_seed(5)
        return compiled(x.double()).square().sum()
    weight = model64.qkv.weight.detach().clone()
    model64.qkv.weight.grad = None
    loss(weight).backward()
    direction = torch.randn_like(weight)
    eps = 1e-6
    slope = (loss(weight + eps * direction) - loss(weight - eps * direction)) / (2 * eps)
    torch.testing.assert_close((model64.qkv.weight.grad * direction).sum(), slope.detach(),
                               rtol=1e-5, atol=1e-8)
