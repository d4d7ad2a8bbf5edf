"""FlexAttention: the pass reads a call's mask_mod (a graph of b, h, q_idx, kv_idx, one element at
a time) and rewrites the masks the op takes: none, causal, same document by an ids tensor, a
padding mask, causal with one of them. Documents need not be contiguous: each row is put in
document order for the op and back after it. The rest (a sliding window, a score_mod that
changes the scores, a used logsumexp) is reported with its reason and left as it is.

FlexAttention runs on CPU in torch 2.13, forward only ("FlexAttention does not support backward
on CPU", raised while Dynamo traces it): gradients through a rewritten site are checked by the
op's own tests and by tests/test_hf_sequences.py's packed documents.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import hilbert_fx
from models import recorded_sites, recording_backend, register_reference_attention  # noqa: E402
from reference import reference_dilated_attention, reference_sequences

W, R = (8, 16), (1, 2)
B, H, N, D = 2, 4, 40, 8


def qkv(x, kv_heads=H):
    """Queries, keys and values from one activation (self-attention), keys/values with
    `kv_heads` heads."""
    return x, (x * 2)[:, :kv_heads], x.sin()[:, :kv_heads]


def run(fn, *args):
    torch._dynamo.reset()
    be = recording_backend(W, R)
    out = torch.compile(fn, backend=be)(*args)
    return out, recorded_sites(be)


def by_document(x, doc, causal, kv_heads=H):
    """Float64 reference: each document (tokens of one id, anywhere in the row) alone."""
    q, k, v = (t.double() for t in qkv(x, kv_heads))
    out = torch.zeros_like(q)
    for d in doc.unique():
        idx = (doc == d).nonzero().flatten()
        out[:, :, idx] = reference_dilated_attention(
            q[:, :, idx], k[:, :, idx], v[:, :, idx], W, R, hilbert=True, is_causal=causal,
            enable_gqa=kv_heads != H)
    return out


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plain_and_causal_masks(causal, kv_heads):
    def f(x):
        q, k, v = qkv(x, kv_heads)
        if not causal:
            return flex_attention(q, k, v, enable_gqa=kv_heads != H)
        block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cpu")
        return flex_attention(q, k, v, block_mask=block, enable_gqa=kv_heads != H)

    x = torch.randn(B, H, N, D)
    out, found = run(f, x)
    assert [(s.kind, s.action, s.is_causal) for s in found] == [("flex", "rewritten", causal)]
    q, k, v = (t.double() for t in qkv(x, kv_heads))
    expected = reference_dilated_attention(q, k, v, W, R, hilbert=True, is_causal=causal,
                                           enable_gqa=kv_heads != H)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


DOCS = torch.tensor([0] * 11 + [1] * 14 + [0] * 6 + [2] * 9)  # document 0 in two pieces


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_document_ids(causal):
    """Same document by an ids tensor (a graph input), causal or not: each document alone, at
    its positions among its own tokens (document 0 comes in two pieces)."""
    def f(x, doc):
        q, k, v = qkv(x)
        if causal:
            mask_mod = lambda b, h, qi, ki: (qi >= ki) & (doc[qi] == doc[ki])  # noqa: E731
        else:
            mask_mod = lambda b, h, qi, ki: doc[qi] == doc[ki]  # noqa: E731
        block = create_block_mask(mask_mod, None, None, N, N, device="cpu")
        return flex_attention(q, k, v, block_mask=block)

    x = torch.randn(B, H, N, D)
    out, found = run(f, x, DOCS)
    assert [(s.action, s.is_causal) for s in found] == [("rewritten", causal)], found
    assert "documents by id" in found[0].sequences.what
    torch.testing.assert_close(out.double(), by_document(x, DOCS, causal), atol=2e-5, rtol=1e-4)


def test_padding_mask_with_causal():
    """causal & pad[b, kv] (transformers' flex mask with a 2-D padding mask): the op takes
    position_ids from the mask; each row's real tokens get the row alone."""
    pad = torch.ones(B, N, dtype=torch.bool)
    pad[1, :13] = False  # left padding

    def f(x, pad):
        q, k, v = qkv(x)
        block = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & pad[b, ki], B, None, N, N,
                                  device="cpu")
        return flex_attention(q, k, v, block_mask=block)

    x = torch.randn(B, H, N, D)
    out, found = run(f, x, pad)
    assert [(s.action, s.is_causal) for s in found] == [("rewritten", True)], found
    assert "padding" in found[0].sequences.what
    position_ids = torch.where(pad, pad.long().cumsum(-1) - 1, -1)
    q, k, v = qkv(x)
    expected = reference_sequences(q, k, v, W, R, position_ids=position_ids, hilbert=True,
                                   is_causal=True)
    torch.testing.assert_close(out.double().transpose(1, 2)[pad], expected.transpose(1, 2)[pad],
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["sliding_window", "score_mod", "logsumexp"])
def test_what_the_op_does_not_take_is_reported(kind):
    def f(x):
        q, k, v = qkv(x)
        if kind == "sliding_window":
            block = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 5), None, None,
                                      N, N, device="cpu")
            return flex_attention(q, k, v, block_mask=block)
        if kind == "score_mod":
            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (qi - ki) * 0.1)
        out, lse = flex_attention(q, k, v, return_lse=True)
        return out * lse.exp()[..., None]

    x = torch.randn(B, H, N, D)
    out, found = run(f, x)
    assert [(s.kind, s.action) for s in found] == [("flex", "skipped")], found
    words = {"sliding_window": "mask_mod is not one the pass reads", "score_mod": "score_mod",
             "logsumexp": "logsumexp"}[kind]
    assert words in found[0].reason and "FlexAttention" in found[0].reason, found[0].reason
    torch.testing.assert_close(out, f(x), atol=1e-5, rtol=1e-5)


def test_transformers_flex_attention_padded_rows_equal_each_row_alone():
    """transformers' attn_implementation="flex_attention" (it runs on CPU): its causal mask_mod
    with a 2-D padding mask is read, and each left-padded row's real tokens get the row alone."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=96,
                                      attn_implementation="flex_attention")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    rows = [torch.randint(1, 96, (1, 27)), torch.randint(1, 96, (1, 40))]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, 40 - row.shape[1]:], mask[b, 40 - row.shape[1]:] = row[0], 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(model, backend=be)
    reference = copy.deepcopy(model).double()  # its own config: the attention set below
    reference.config._attn_implementation = register_reference_attention(W, R, hilbert=True)
    with torch.no_grad():
        batch = compiled(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        batch_sites = recorded_sites(be)
        for b, row in enumerate(rows):
            alone = compiled(input_ids=row).logits[0]
            torch.testing.assert_close(batch[b][mask[b].bool()], alone, atol=2e-5, rtol=1e-4)
            expected = reference(input_ids=row).logits[0]  # the row alone, float64 reference
            torch.testing.assert_close(alone.double(), expected, atol=2e-5, rtol=1e-4)
    assert [(s.kind, s.action) for s in batch_sites] == [("flex", "rewritten")] * 2, batch_sites
    assert all("padding" in s.sequences.what for s in batch_sites)
