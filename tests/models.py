"""Small home-made models for the front-end tests. Attention goes through `attention_fn`, so a
test can put the float64 reference in place of SDPA when it runs the model eagerly."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool = True, kv_heads: int | None = None):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * self.kv_heads * self.head_dim)
        self.out = nn.Linear(width, width)
        self.causal = causal
        self.attention_fn = F.scaled_dot_product_attention

    def forward(self, x, mask=None):
        b, n, c = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.attention_fn(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                              enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


class CrossAttention(SelfAttention):
    def forward(self, x, memory):
        b, n, c = x.shape
        m = memory.shape[1]
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(memory).view(b, m, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.attention_fn(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool = True, kv_heads=None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, width=32, heads=4, layers=2, causal=True, kv_heads=None, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, causal, kv_heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, mask=None):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)

    def attentions(self):
        return [layer.attn for layer in self.layers]


class EncoderDecoder(nn.Module):
    """A decoder layer with self- and cross-attention over an encoder's output."""
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.encoder = Block(width, heads, causal=False)
        self.self_attn = SelfAttention(width, heads, causal=True)
        self.cross_attn = CrossAttention(width, heads, causal=False)

    def forward(self, src, tgt):
        memory = self.encoder(src)
        x = tgt + self.self_attn(tgt)
        return x + self.cross_attn(x, memory)


def recording_backend(segment_lengths, dilation_rates):
    """The configured backend (Hilbert order, SDPA lowering) keeping what the pass did to each
    graph, without Inductor: tests read its sites and run the rewritten graphs as they are."""
    import hilbert_fx
    be = hilbert_fx.backend(segment_lengths, dilation_rates, hilbert=True, lowering="sdpa")
    be.compile_with_inductor = False
    be.keep_records = True
    return be


def recorded_sites(be):
    return [s for record in be.records for s in record.sites]


def register_reference_attention(segment_lengths, dilation_rates, hilbert, causal=True):
    """A transformers attention implementation that runs the float64 reference on sequences
    without padding, causal (decoders) or not (encoders such as ViT, which pass no mask);
    returns its name, for config._attn_implementation."""
    import transformers
    from reference import reference_dilated_attention

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if not causal:
            assert attention_mask is None and not getattr(module, "is_causal", False), \
                "the bidirectional reference takes no mask and no causal module"
        out = reference_dilated_attention(query, key, value, segment_lengths, dilation_rates,
                                          hilbert=hilbert, is_causal=causal, scale=scaling,
                                          enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    name = "hilbert_fx_reference" if causal else "hilbert_fx_reference_bidirectional"
    transformers.AttentionInterface.register(name, attention)
    if causal:
        transformers.AttentionMaskInterface.register(name, transformers.masking_utils.sdpa_mask)
    return name
