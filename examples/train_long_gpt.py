"""Train a GPT-style decoder at long context with backend="hilbert_dilated", against dense.

The model: a transformers Llama (random initialisation), by default 12 layers, width 1024, 16 heads.
The task: copying at distance d. Each sequence is a block of d uniform random tokens (vocab 64)
repeated to length N, so every token from position d on equals the token d positions back; the
loss is taken on positions d+1.. only. A model that does not use the context cannot go below
ln(vocab) = 4.159 (the unigram floor, printed at the start): a loss clearly under that line is
retrieval from d tokens back. Sitting at 4.16 means nothing was retrieved.

The curriculum (default): train at distance --d0 (33) first and double d (kept = 1 mod max(rate))
each time the mean loss of the last 10 steps falls under --advance (1.5), up to N/2 + 1. Each
log line prints the d of that step, and the summary the lowest mean loss of 10 steps at each d.
On an H200 at 32K tokens the default run took the loss at d = 33 from 4.26 to under 1.5 by step
1100 in one run and 1393 in another (the backward adds dq by atomics, so runs differ), then
started d = 65 at the floor (BENCHMARKS.md: in 4200 steps one run got to d = 513, starting from
the floor again after each doubling). --d0 0 trains at d = N/2 + --shift from the start.

Why d = 1 mod max(rate) and hilbert=False (1-D text): to predict token p+1 the model reads position
p + 1 - d. With d = 1 mod max(rate), that position has the same residue mod r as p for every
branch, so the query and its answer share a selected set in the whole-sequence branch (r = 16,
the head with offset p mod 16) and retrieval is one hop. With d = N/2 (or Hilbert-ordered sets)
the answer is never in the query's own set there and must be routed through a second hop.

In the same run (GPU): the first of --backends trains --steps steps, the others --compare-steps
(40: enough for their step time and peak memory); then the step time and peak memory of the
dilated backend and of backend="inductor" (dense, FlashAttention through SDPA) at the training
length, and, with --probe, the longest context each can train one step on.

    python examples/train_long_gpt.py --seq-len 32768 --probe 131072 262144 393216
    python examples/train_long_gpt.py --device cpu --layers 2 --width 128 --heads 16 --seq-len 512 --steps 30 \
        --segment-lengths 32 64 128 256 512 --backends hilbert_dilated
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

try:
    import hilbert_fx
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    import hilbert_fx


def _causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Dense attention for the baseline: SDPA with is_causal=True (FlashAttention), no mask.
    Exact here: the task's sequences have no padding and no packed documents."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def attention_implementation(args) -> str:
    """"sdpa" (transformers' own) for the dilated backend, which reads the model's mask; for the
    dense baseline --dense-attention causal registers _causal_sdpa. Why: under torch.compile
    some transformers versions (5.17 on the GPU machine) hand SDPA an N x N boolean mask (causal
    and same document) instead of is_causal, and SDPA then runs a masked kernel: slower, and
    the mask alone is 16 GiB at 128K tokens. --dense-attention model keeps that path."""
    if getattr(args, "backend", "") != "inductor" or getattr(args, "dense_attention", "causal") == "model":
        return "sdpa"
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register("causal_sdpa", _causal_sdpa)
    AttentionMaskInterface.register("causal_sdpa", lambda *a, **k: None)
    return "causal_sdpa"


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=max(args.probe + [args.seq_len]),
                         attn_implementation=attention_implementation(args), use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def copy_distance(args, n):
    return n // 2 + getattr(args, "shift", 1)


def batch(args, n, device, generator, d=None):
    d = copy_distance(args, n) if d is None else d
    block = torch.randint(0, args.vocab, (args.batch, d), generator=generator)
    tokens = block.repeat(1, -(-n // d))[:, :n]
    labels = tokens.clone()
    labels[:, : d + 1] = -100
    return tokens.to(device), labels.to(device)


def make_backend(args):
    if args.backend == "inductor":
        return "inductor"
    w = tuple(args.segment_lengths)
    r = tuple(args.dilation_rates)
    return hilbert_fx.backend(segment_lengths=w, dilation_rates=r, hilbert=bool(getattr(args, "hilbert", False)))


def train(args, device, backend_name, steps):
    args.backend = backend_name
    model = build_model(args, device)
    compiled = torch.compile(model, backend=make_backend(args), dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, grad_norms, times = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warmup = getattr(args, "warmup", 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    full = copy_distance(args, args.seq_len)
    rmax = max(args.dilation_rates)
    d = min(full, getattr(args, "d0", 0) or full)    # curriculum: start at d0, double when learned
    at_d, distances = [], []
    for step in range(steps):
        if d < full and len(at_d) >= 10 and sum(at_d[-10:]) / 10 < getattr(args, "advance", 1.0):
            d, at_d = min(full, 2 * (d // rmax) * rmax + full % rmax), []
        tokens, labels = batch(args, args.seq_len, device, gen, d)
        start = time.perf_counter()
        with autocast:
            loss = compiled(input_ids=tokens, labels=labels).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm before clipping
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        grad_norms.append(grad_norm.item())
        at_d.append(losses[-1])
        distances.append(d)
        if step % args.log_every == 0 or step == steps - 1:
            print(f"  [{backend_name}] step {step:4d}  d {d:6d}  loss {losses[-1]:.3f}  ({times[-1] * 1e3:.0f} ms)", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    steady = sorted(times[min(3, len(times) - 1):])
    result = dict(backend=backend_name, losses=losses, grad_norms=grad_norms, distances=distances, step_ms=1e3 * steady[len(steady) // 2], peak_gib=peak)
    del compiled, model, opt
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def by_distance(result) -> str:
    """'d 33 (steps 0-1392): 1.477; d 65 (...)': under ln(vocab), the copy at d was learned."""
    parts, losses, dists = [], result["losses"], result["distances"]
    start = 0
    for i in range(1, len(dists) + 1):
        if i == len(dists) or dists[i] != dists[start]:
            run = losses[start:i]
            means = [sum(run[j - 10:j]) / 10 for j in range(10, len(run) + 1)] or [sum(run) / len(run)]
            parts.append(f"d {dists[start]} (steps {start}-{i - 1}): {min(means):.3f}")
            start = i
    return "; ".join(parts)


def longest_context(args, device, backend_name):
    """The longest of args.probe lengths that trains one step (forward, backward) without OOM."""
    args.backend = backend_name
    model = build_model(args, device)
    compiled = torch.compile(model, backend=make_backend(args), dynamic=False)
    gen = torch.Generator().manual_seed(2)
    fitted = None
    for n in args.probe:
        try:
            tokens, labels = batch(args, n, device, gen)
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=tokens, labels=labels).loss
            loss.backward()
            torch.cuda.synchronize()
            fitted = (n, torch.cuda.max_memory_allocated() / 2**30)
            print(f"  [{backend_name}] N={n}: fits, peak {fitted[1]:.1f} GiB", flush=True)
        except torch.cuda.OutOfMemoryError:
            print(f"  [{backend_name}] N={n}: out of memory", flush=True)
            break
        finally:
            model.zero_grad(set_to_none=True)
            loss = None
            torch.cuda.empty_cache()
    del compiled, model
    torch._dynamo.reset()
    return fitted


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--steps", type=int, default=1500, help="training steps of the first backend")
    p.add_argument("--compare-steps", type=int, default=40,
                   help="training steps of the other backends (enough for step time and peak memory)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--segment-lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shift", type=int, default=1, help="copy distance d = seq_len / 2 + shift")
    p.add_argument("--d0", type=int, default=33, help="curriculum: first copy distance (0: none, d = N/2 + shift)")
    p.add_argument("--advance", type=float, default=1.5, help="curriculum: double d when the loss falls under this")
    p.add_argument("--warmup", type=int, default=20, help="linear learning-rate warm-up steps")
    p.add_argument("--hilbert", type=int, default=0, help="1: Hilbert-ordered dilation (2-D data)")
    p.add_argument("--backends", nargs="+", default=["hilbert_dilated", "inductor"])
    p.add_argument("--dense-attention", choices=["causal", "model"], default="causal",
                   help="dense baseline: SDPA is_causal (causal) or transformers' own mask (model)")
    p.add_argument("--probe", type=int, nargs="*", default=[], help="lengths to probe for the longest context (GPU)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def main():
    args = parse_args()
    device = torch.device(args.device)
    results = {"args": vars(args).copy(), "train": [], "longest": {}}
    full = copy_distance(args, args.seq_len)
    distance = f"distance {args.d0} doubling up to {full}" if 0 < args.d0 < full else f"distance {full}"
    print(f"copy task, {distance}, vocab {args.vocab}: a model that ignores the context sits at ln(vocab) = "
          f"{math.log(args.vocab):.3f}")
    for i, name in enumerate(args.backends):
        results["train"].append(train(args, device, name, args.steps if i == 0 else args.compare_steps))
    if args.probe and device.type == "cuda":
        for name in args.backends:
            results["longest"][name] = longest_context(args, device, name)
    print("\nbackend           step (ms)  peak (GiB)  loss first -> last (mean of 10)")
    for r in results["train"]:
        first, last = r["losses"][0], sum(r["losses"][-10:]) / len(r["losses"][-10:])
        print(f"{r['backend']:16} {r['step_ms']:10.1f} {r['peak_gib']:11.2f}  {first:.3f} -> {last:.3f}")
    for r in results["train"]:
        print(f"{r['backend']}, lowest mean loss of 10 steps at each copy distance: {by_distance(r)}")
    if len(results["train"]) == 2:
        a, b = results["train"]
        print(f"step time {b['backend']} / {a['backend']}: {b['step_ms'] / a['step_ms']:.2f}x")
    for name, fitted in results["longest"].items():
        print(f"longest context that trains, {name}: {fitted}")
    with open(os.path.join(args.out, "train_long_gpt.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
