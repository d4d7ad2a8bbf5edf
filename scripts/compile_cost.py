"""The pass's own compile cost: detection + rewrite against the whole torch.compile time
(Dynamo, the pass, AOTAutograd and Inductor) of a 12-layer model, on CPU.

    python scripts/compile_cost.py [--layers 12] [--impl eager sdpa] [--backward]

Prints, per attention implementation, the pass's time (find_sites, rewrite), the whole first
call's time, and the pass's share; the target is under 5%.
"""
from __future__ import annotations

import argparse
import importlib
import time

import torch

import hilbert_fx

backend_module = importlib.import_module("hilbert_fx.backend")
FIND, REWRITE = backend_module.find_sites, backend_module.rewrite


def timed_backend(config):
    be = hilbert_fx.backend(*config, lowering="sdpa")
    spent = {"find": 0.0, "rewrite": 0.0, "sites": 0}
    find, rewrite = FIND, REWRITE

    def timed_find(graph):
        t = time.perf_counter()
        sites = find(graph)
        spent["find"] += time.perf_counter() - t
        spent["sites"] += len(sites)
        return sites

    def timed_rewrite(*args):
        t = time.perf_counter()
        out = rewrite(*args)
        spent["rewrite"] += time.perf_counter() - t
        return out
    backend_module.find_sites, backend_module.rewrite = timed_find, timed_rewrite
    return be, spent


def gpt2(layers: int, impl: str):
    import transformers
    config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=512,
                                     n_positions=256, bos_token_id=0, eos_token_id=0,
                                     attn_implementation=impl)
    return transformers.GPT2LMHeadModel(config)


def measure(layers: int, impl: str, backward: bool, n: int = 128):
    torch.manual_seed(0)
    model = gpt2(layers, impl)
    model.train(backward)
    ids = torch.randint(0, 512, (2, n))
    torch._dynamo.reset()
    be, spent = timed_backend(((n,), (1,)))
    compiled = torch.compile(model, backend=be)
    t = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = compiled(input_ids=ids).logits
        if backward:
            out.square().mean().backward()
    total = time.perf_counter() - t
    t = time.perf_counter()  # a second call: run time, for scale
    with torch.set_grad_enabled(backward):
        compiled(input_ids=ids)
    run = time.perf_counter() - t
    own = spent["find"] + spent["rewrite"]
    return dict(impl=impl, sites=spent["sites"], find=spent["find"], rewrite=spent["rewrite"],
                own=own, total=total, run=run, share=own / total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--impl", nargs="+", default=["eager", "sdpa"])
    parser.add_argument("--backward", action="store_true", help="train mode, first backward included")
    args = parser.parse_args()
    print(f"GPT-2, {args.layers} layers, width 64, N=128, CPU, torch {torch.__version__}, "
          f"{'forward + backward' if args.backward else 'forward'}")
    worst = 0.0
    for impl in args.impl:
        r = measure(args.layers, impl, args.backward)
        worst = max(worst, r["share"])
        print(f"  {impl:6s} sites {r['sites']:3d}  pass {r['own'] * 1e3:7.1f} ms "
              f"(find {r['find'] * 1e3:6.1f} ms, rewrite {r['rewrite'] * 1e3:6.1f} ms)  "
              f"whole compile {r['total']:6.2f} s  share {100 * r['share']:.2f}%")
    print(f"pass share of compile time: {100 * worst:.2f}% (target < 5%)")


if __name__ == "__main__":
    main()
