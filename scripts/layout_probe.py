"""Triton lowering time by input layout: [B, H, N, D] contiguous against the transposed view of a
[B, N, H, D] tensor (what a model's q.view(B, N, H, D).transpose(1, 2) hands the op).

    PYTHONPATH=. python scripts/layout_probe.py
"""
import torch
import triton.testing

import hilbert_fx

B, H, N, D = 1, 16, 32768, 64
W, R = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]


def inputs(layout):
    if layout == "bhnd":
        return [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    return [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            for _ in range(3)]


for layout in ("bhnd", "bnhd"):
    q, k, v = inputs(layout)
    f = lambda: hilbert_fx.dilated_attention(q, k, v, W, R, hilbert=True, is_causal=True, lowering="triton")  # noqa: E731
    with torch.no_grad():
        fwd = triton.testing.do_bench(f, warmup=10, rep=50)
    g = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    both = triton.testing.do_bench(lambda: f().backward(g), warmup=10, rep=50, grad_to_none=[q, k, v])
    print(f"{layout}: strides {q.stride()}  fwd {fwd:.2f} ms  fwd+bwd {both:.2f} ms", flush=True)
