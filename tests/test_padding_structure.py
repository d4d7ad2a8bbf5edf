"""Padding beside the other sequence structures (SPEC section 5), at the pass: the positions it
computes from a 2-D padding mask, alone or with packed documents, and FlexAttention's masks that
combine them. Padding is in no sequence wherever it lies, between a sequence's tokens included:
the real tokens of a document count 0, 1, 2, ... and each gets the document alone.

FlexAttention runs forward only on CPU (tests/test_flex.py says why).
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hilbert_fx.structure import padded_document_positions, padded_run_positions, padding_positions
from models import recorded_sites, recording_backend
from reference import reference_sequences

W, R = (8, 16), (1, 2)


def test_padding_positions_skip_padding_anywhere():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    assert padding_positions(mask).tolist() == [
        [-1, -1, 0, 1, 2], [0, 1, 2, -1, -1], [0, -1, 1, 2, -1]]


def test_padded_run_positions():
    """Padding shares a run with real tokens before, after or inside it: the real tokens of each
    run count from 0. A position_ids row of one batch row serves every row of the mask."""
    position_ids = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    assert padded_run_positions(position_ids, mask).tolist() == [
        [-1, -1, 0, 1, 2, -1, -1, 0, -1, 1, 2, 0, 1],
        [0, 0, 0, 1, 2, 3, 4, 0, 1, 2, 3, -1, -1]]


def test_padded_document_positions():
    """Read in document order (a stable sort by id): each document's real tokens count from 0."""
    ids = torch.tensor([[0, 1, 1, 0, 2, 0, 1]])
    mask = torch.tensor([[1, 0, 1, 1, 1, 0, 1]])
    # document order: tokens 0, 3, 5 (id 0), 1, 2, 6 (id 1), 4 (id 2)
    assert padded_document_positions(ids, mask).tolist() == [[0, 1, -1, -1, 0, 1, 0]]


B, H, N, D = 2, 4, 40, 8
DOCS = torch.tensor([0] * 11 + [1] * 14 + [0] * 6 + [2] * 9)  # document 0 in two pieces
PAD = torch.ones(B, N, dtype=torch.bool)
PAD[0, :5] = False  # left padding
PAD[1, 20:23] = False  # padding inside document 1
PAD[1, 36:] = False  # right padding


def run(fn, *args):
    torch._dynamo.reset()
    be = recording_backend(W, R)
    out = torch.compile(fn, backend=be)(*args)
    return out, recorded_sites(be)


def by_document_real_tokens(x, doc, pad, causal):
    """Float64 reference: each document's real tokens alone (padding removed); padding rows 0."""
    q, k, v = x.double(), (x * 2).double(), x.sin().double()
    out = torch.zeros_like(q)
    for b in range(B):
        for d in doc.unique():
            idx = ((doc == d) & pad[b]).nonzero().flatten()
            out[b, :, idx] = reference_sequences(
                q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], W, R,
                hilbert=True, is_causal=causal)[0]
    return out


def test_flex_documents_and_padding():
    """Same document by an ids tensor, causal, and the key not padding: rows sorted by document,
    position_ids = the place among the document's real tokens, -1 on padding."""
    def f(x, doc, pad):
        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & pad[b, ki] & (qi >= ki)
        block = create_block_mask(mask_mod, B, None, N, N, device="cpu")
        return flex_attention(x, x * 2, x.sin(), block_mask=block)

    x = torch.randn(B, H, N, D)
    out, found = run(f, x, DOCS, PAD)
    assert [(s.action, s.is_causal) for s in found] == [("rewritten", True)], found
    assert "causal, documents by id with padding" in found[0].sequences.what
    expected = by_document_real_tokens(x, DOCS, PAD, True)
    torch.testing.assert_close(out.double().transpose(1, 2)[PAD],
                               expected.transpose(1, 2)[PAD], atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_flex_bidirectional_padding():
    """pad[b, kv] alone (an encoder's padding mask): each row's real tokens are its sequence."""
    def f(x, pad):
        block = create_block_mask(lambda b, h, qi, ki: pad[b, ki], B, None, N, N, device="cpu")
        return flex_attention(x, x * 2, x.sin(), block_mask=block)

    x = torch.randn(B, H, N, D)
    out, found = run(f, x, PAD)
    assert [(s.action, s.is_causal) for s in found] == [("rewritten", False)], found
    assert "bidirectional with padding" in found[0].sequences.what
    expected = by_document_real_tokens(x, torch.zeros(N, dtype=torch.long), PAD, False)
    torch.testing.assert_close(out.double().transpose(1, 2)[PAD],
                               expected.transpose(1, 2)[PAD], atol=2e-5, rtol=1e-4)
