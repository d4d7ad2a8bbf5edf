"""A ViT (transformers, random weights) compiled with dilated attention over its patches, where
hilbert=True reads each segment along a Hilbert curve, so dilation picks spatially spread keys.

The image is 64 patches tall and 16 wide; a segment of 256 tokens is then a 16 x 16 tile of
patches (SPEC: a segment is read as a grid s = 16 cells wide, exactly the tile's Hilbert curve).
ViT puts a class token first, which shifts every patch by one position; the picture shows patch
tokens only.

    python examples/vit_hilbert.py --out .      # writes vit_pattern.png
"""
from __future__ import annotations

import argparse
import os

import torch

import hilbert_fx

WIDTH, HEIGHT, PATCH = 16, 64, 4
SEGMENTS, RATES = (256, 1024), (1, 8)


def build(device):
    """The ViT (random weights, eval mode), two random images, and the dilated backend."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=(HEIGHT * PATCH, WIDTH * PATCH), patch_size=PATCH, hidden_size=128,
                       num_hidden_layers=2, num_attention_heads=8, intermediate_size=256,
                       attn_implementation="sdpa")
    torch.manual_seed(0)
    model = ViTModel(config).to(device).eval()
    images = torch.randn(2, 3, HEIGHT * PATCH, WIDTH * PATCH, device=device)
    backend = hilbert_fx.backend(segment_lengths=SEGMENTS, dilation_rates=RATES, hilbert=True)
    return model, images, backend


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    model, images, backend = build(args.device)

    print(hilbert_fx.explain(model, pixel_values=images, backend=backend))
    with torch.no_grad():
        dense = model(pixel_values=images).last_hidden_state
        dilated = torch.compile(model, backend=backend)(pixel_values=images).last_hidden_state
    n = dense.shape[1]
    print(f"\n{n} tokens ({HEIGHT}x{WIDTH} patches + class token); dilated output finite: "
          f"{bool(torch.isfinite(dilated).all())}; mean |dilated - dense| = "
          f"{(dilated - dense).abs().mean().item():.3f} (different attention, not an error)")

    path = hilbert_fx.plot_pattern(SEGMENTS, RATES, HEIGHT * WIDTH, os.path.join(args.out, "vit_pattern.png"),
                                   image_width=WIDTH, head=0)
    print(f"attention pattern of head 0 over the patch grid: {path}")


if __name__ == "__main__":
    main()
