"""hilbert_fx in one page: compile a small GPT with backend="hilbert_dilated", see what the pass
did, check the identity property, and time dense against dilated attention at a long sequence.

    python examples/quickstart.py            # CPU by default, under a minute
    python examples/quickstart.py --device cuda --seq-len 65536
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hilbert_fx


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, width=128, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def timed(fn, repeat: int, device: str) -> float:
    fn()  # warm-up (and compilation)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=8192, help="length for the timing")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = args.device

    # 1. Compile a small GPT with the registered backend and run it.
    model = GPT().to(device).eval()
    tokens = torch.randint(0, 256, (2, 300), device=device)
    compiled = torch.compile(model, backend="hilbert_dilated")
    with torch.no_grad():
        logits = compiled(tokens)
    print(f"compiled GPT with backend='hilbert_dilated': logits {tuple(logits.shape)}\n")

    # 2. What the pass did.
    print(hilbert_fx.explain(model, tokens), "\n")

    # 3. Identity: one branch (w, 1) with w >= N is exactly SDPA.
    identity = hilbert_fx.backend(segment_lengths=(512,), dilation_rates=(1,))
    with torch.no_grad():
        eager = model(tokens)
        same = torch.compile(model, backend=identity)(tokens)
    err = (same - eager).abs().max().item()
    print(f"identity check (one branch w=512 >= N=300, r=1): max |compiled - eager| = {err:.2e}")
    assert err < 1e-4, err

    # 4. Dense against dilated attention at a long sequence.
    n, heads, dim = args.seq_len, 8, 64
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, n, dim, device=device, dtype=dtype) for _ in range(3))
    w, r = (2048, 4096, 8192, 16384), (1, 2, 4, 8)
    dense = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.repeat, device)
    dilated = timed(lambda: hilbert_fx.dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True),
                    args.repeat, device)
    print(f"\nN={n}, H={heads}, D={dim}, {dtype}, {device}, causal; branches {list(zip(w, r))}")
    print(f"  dense SDPA        {dense * 1e3:9.1f} ms")
    print(f"  dilated (hilbert) {dilated * 1e3:9.1f} ms   (dense / dilated = {dense / dilated:.2f}x)")


if __name__ == "__main__":
    main()
