"""mode="reduce-overhead" (Inductor's CUDA graph trees) from a fresh process, on one GPU: a small
transformers Llama trained three steps under the backend with CUDA graphs against the same model
compiled without them. Fresh caches matter: the op keeps what it builds for a configuration,
and the trees' warm-up sends every allocation to the graph's memory pool
(lowering/graph_pools.py).

    PYTHONPATH=. python scripts/graphs_check.py

Prints the losses and the largest gradient difference of each step; exits non-zero if a loss
differs by more than 1e-2 relative or a gradient by more than 5e-2 of its largest entry (bf16;
the backward's atomics add in any order).
"""
from __future__ import annotations

import copy
import sys

import torch
import transformers

import hilbert_fx


def main() -> int:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512, vocab_size=1024,
                                   max_position_embeddings=4096, attn_implementation="sdpa")
    be = hilbert_fx.backend(segment_lengths=(256, 512), dilation_rates=(1, 2), hilbert=True)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 1024, (3, 1, 1024), device="cuda")
    failures = []
    models = {mode: copy.deepcopy(base) for mode in ("reduce-overhead", "default")}
    grads = {}
    for mode, m in models.items():  # CUDA graphs first: the op's caches are empty then
        compiled = torch.compile(m, backend=be, mode=mode)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        for step in range(3):
            torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier outputs may go
            out = compiled(input_ids=ids[step], labels=ids[step], use_cache=False)
            out.loss.backward()
            grads[mode, step] = (out.loss.item(),
                                 [p.grad.float().clone() for p in m.parameters()])
            opt.step()
            opt.zero_grad()
    for step in range(3):
        (l1, g1), (l2, g2) = grads["reduce-overhead", step], grads["default", step]
        diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                   for a, b in zip(g1, g2))
        print(f"step {step}: loss {l1:.5f} with CUDA graphs, {l2:.5f} without; "
              f"largest gradient difference {diff:.2e} of its largest entry")
        if abs(l1 - l2) > 1e-2 * abs(l2) or diff > 5e-2:
            failures.append(f"training step {step}")
    print("all checks pass" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
