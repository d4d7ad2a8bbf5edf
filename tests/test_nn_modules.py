"""torch.nn's attention modules: nn.MultiheadAttention (need_weights, batch_first, packed and
separate in-projections, masks) and nn.TransformerEncoderLayer / DecoderLayer in training and in
eval (the fused eval fast path included). Sites found, rewritten or skipped with the reason; the
rewritten modules equal the float64 reference under a dilated configuration, and the eager module
under the identity configuration.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hilbert_fx
from reference import reference_dilated_attention

W, R = (8, 16), (1, 2)
IDENTITY = ((64,), (1,))
B, N, E, H = 2, 20, 32, 4
D = E // H


class Recorder:
    """The pass without Inductor, keeping the sites it found."""
    def __init__(self, segment_lengths=W, dilation_rates=R):
        self.inner = hilbert_fx.backend(segment_lengths, dilation_rates, lowering="sdpa")
        self.sites = []

    def __call__(self, gm, example_inputs):
        self.sites += self.inner.transform(gm).sites
        return gm.forward


def compiled(module, rec):
    torch._dynamo.reset()
    return torch.compile(module, backend=rec)


def mha_reference(mha: nn.MultiheadAttention, query, key, value, attn_mask=None, is_causal=False):
    """nn.MultiheadAttention in float64 with the reference in place of its attention."""
    bf = mha.batch_first
    q_in, k_in, v_in = (t.double() if bf else t.double().transpose(0, 1) for t in (query, key, value))
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.double().chunk(3)
    else:
        wq, wk, wv = (w.double() for w in (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight))
    bq, bk, bv = mha.in_proj_bias.double().chunk(3)

    def heads(x, w, b):
        y = F.linear(x, w, b)
        return y.view(y.shape[0], y.shape[1], H, D).transpose(1, 2)
    q, k, v = heads(q_in, wq, bq), heads(k_in, wk, bk), heads(v_in, wv, bv)
    o = reference_dilated_attention(q, k, v, W, R, hilbert=True, attn_mask=attn_mask,
                                    is_causal=is_causal)
    o = F.linear(o.transpose(1, 2).reshape(q.shape[0], q.shape[2], E),
                 mha.out_proj.weight.double(), mha.out_proj.bias.double())
    return o if bf else o.transpose(0, 1)


class SelfMHA(nn.Module):
    """x -> nn.MultiheadAttention(x', x'', x''): a self-attention, however the inputs are made."""
    def __init__(self, batch_first, separate=False, need_weights=False):
        super().__init__()
        kdim = 16 if separate else None
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.to_kv = nn.Linear(E, 16) if separate else nn.LayerNorm(E)
        self.need_weights = need_weights

    def kv(self, x):
        return self.to_kv(x)

    def forward(self, x, attn_mask=None, key_padding_mask=None, is_causal=False):
        kv = self.kv(x)
        out, weights = self.mha(x, kv, kv, need_weights=self.need_weights, attn_mask=attn_mask,
                                key_padding_mask=key_padding_mask, is_causal=is_causal)
        return out if weights is None else (out, weights)


def x_for(batch_first, n=N, seed=0):
    x = torch.randn(B, n, E, generator=torch.Generator().manual_seed(seed))
    return x if batch_first else x.transpose(0, 1).contiguous()


MASKS = ["none", "causal", "bool_mask", "padding"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("batch_first,separate", [(True, False), (False, False), (True, True), (False, True)])
def test_multihead_attention_without_weights_is_rewritten_and_exact(batch_first, separate, mask):
    torch.manual_seed(0)
    model = SelfMHA(batch_first, separate)
    x = x_for(batch_first).requires_grad_(True)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    kwargs, ref_kwargs = {}, {}
    if mask == "causal":  # nn.MultiheadAttention's convention: True = not allowed
        kwargs = dict(attn_mask=~causal, is_causal=True)
        ref_kwargs = dict(is_causal=True)
    elif mask == "bool_mask":
        allowed = torch.rand(N, N, generator=torch.Generator().manual_seed(3)) > 0.3
        allowed |= torch.eye(N, dtype=torch.bool)
        kwargs, ref_kwargs = dict(attn_mask=~allowed), dict(attn_mask=allowed)
    elif mask == "padding":
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[1, -6:] = True
        kwargs, ref_kwargs = dict(key_padding_mask=pad), dict(attn_mask=~pad[:, None, None, :])
    rec = Recorder()
    out = compiled(model, rec)(x, **kwargs)
    assert [(s.kind, s.action, s.reason) for s in rec.sites] == [("mha", "rewritten", "")]
    assert rec.sites[0].is_causal == (mask == "causal")

    x_ref = x.detach().double().requires_grad_(True)
    kv_ref = copy.deepcopy(model.to_kv).double()(x_ref)
    expected = mha_reference(model.mha, x_ref, kv_ref, kv_ref, **ref_kwargs)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    grad = torch.randn_like(expected)
    (gx,) = torch.autograd.grad(out, x, grad.float())
    (gx_ref,) = torch.autograd.grad(expected, x_ref, grad)
    torch.testing.assert_close(gx.double(), gx_ref, atol=5e-5, rtol=1e-3)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_with_weights_is_skipped_and_unchanged(batch_first):
    torch.manual_seed(0)
    model = SelfMHA(batch_first, need_weights=True)
    x = x_for(batch_first)
    rec = Recorder()
    out, weights = compiled(model, rec)(x)
    assert [(s.kind, s.action) for s in rec.sites] == [("mha", "skipped")]
    assert "need_weights=True" in rec.sites[0].reason
    eager_out, eager_weights = model(x)
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(weights, eager_weights)


def test_multihead_cross_attention_is_skipped_with_its_reason():
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x, memory = torch.randn(B, N, E), torch.randn(B, N, E)
    report = hilbert_fx.explain(lambda a, m: mha(a, m, m, need_weights=False)[0], x, memory,
                                backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [(s.kind, s.action) for s in report.sites] == [("mha", "skipped")]
    assert "cross-attention" in report.sites[0].reason


# ---------------------------------------------------------------------------------------------
# nn.TransformerEncoderLayer / DecoderLayer, identity configuration against eager
# ---------------------------------------------------------------------------------------------
def encoder(norm_first=False, activation="relu"):
    return nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.1, batch_first=True,
                                      norm_first=norm_first, activation=activation)


@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad_fast_path"])
@pytest.mark.parametrize("norm_first,activation,padded", [(False, "relu", False), (True, "gelu", True)])
def test_encoder_layer_equals_eager_under_the_identity(mode, norm_first, activation, padded):
    torch.manual_seed(0)
    layer = encoder(norm_first, activation)
    layer.train(mode == "train")
    if mode == "train":  # the op's dropout draws other masks than SDPA's: compare without it
        for m in layer.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        layer.self_attn.dropout = 0.0
    x = torch.randn(B, N, E)
    pad = None
    if padded:
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[1, -5:] = True
    rec = Recorder(*IDENTITY)
    with torch.set_grad_enabled(mode != "eval_no_grad_fast_path"):
        out = compiled(layer, rec)(x, src_key_padding_mask=pad)
        expected = layer(x, src_key_padding_mask=pad)
    assert [(s.kind, s.action, s.reason) for s in rec.sites] == [("mha", "rewritten", "")], rec.sites
    if padded and mode == "eval_no_grad_fast_path":  # eager's fast path leaves padded rows as 0
        out, expected = out[:, :-5], expected[:, :-5]
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_encoder_fast_path_is_the_fused_op_in_the_graph():
    layer = encoder().eval()
    rec = Recorder(*IDENTITY)
    with torch.no_grad():
        torch._dynamo.reset()
        gm_code = []

        def keep(gm, example_inputs):
            gm_code.append(gm.code)
            return rec(gm, example_inputs)
        torch.compile(layer, backend=keep)(torch.randn(B, N, E))
    assert "_transformer_encoder_layer_fwd" in gm_code[0]
    assert rec.sites and rec.sites[0].action == "rewritten"


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_decoder_layer_self_attention_rewritten_cross_attention_skipped(mode):
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    layer.train(mode == "train")
    tgt, memory = torch.randn(B, N, E), torch.randn(B, N + 3, E)
    causal = nn.Transformer.generate_square_subsequent_mask(N)
    rec = Recorder(*IDENTITY)
    with torch.set_grad_enabled(mode == "train"):
        out = compiled(layer, rec)(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
        expected = layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    rows = [(s.kind, s.module, s.action) for s in rec.sites]
    assert rows == [("mha", "self_attn", "rewritten"), ("mha", "multihead_attn", "skipped")], rows
    assert rec.sites[0].is_causal
    assert "different lengths" in rec.sites[1].reason or "cross-attention" in rec.sites[1].reason
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
