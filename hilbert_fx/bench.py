"""The benchmark: python -m hilbert_fx.bench [options]

Times, for sequence lengths growing step by step until the GPU's memory would run out:
  dense     F.scaled_dot_product_attention over the whole sequence
  flex      FlexAttention with the same dilated pattern (block mask + a score_mod adding
            log(number of branches selecting the key), so it computes exactly the op)
  sdpa      the op's SDPA lowering
  triton    the op's Triton lowering
  floor     cuDNN attention on blocks gathered beforehand: the useful work alone
Useful FLOPs = sum over branches of 4*B*H*(N/r)*(w/r)*D (w capped at N), halved for causal;
the backward counts 2.5 times the forward (five products against two).
Prints a table, writes bench.csv, bench.md and bench.png (time and useful TF/s against N).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from .lowering import dilated_attention, gluon_forward
from .lowering.plans import branch_plans, hilbert_order

from .pattern import optional_import, pyplot

METHODS = ("dense", "flex", "sdpa", "triton", "floor")


def useful_flops(n, b, h, d, segment_lengths, dilation_rates, causal):
    total = 0.0
    for w, r in zip(segment_lengths, dilation_rates):
        total += 4.0 * b * h * (n / r) * (min(w, n) / r) * d
    return total / 2 if causal else total


def _flex_fn(n, h, segment_lengths, dilation_rates, hilbert, causal, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ranks = []  # rank of each in-segment position, per branch
    for w in segment_lengths:
        order = hilbert_order(w) if hilbert else torch.arange(w)
        inv = torch.empty(w, dtype=torch.long)
        inv[order] = torch.arange(w)
        ranks.append(inv.to(device))
    branches = list(zip(segment_lengths, dilation_rates, ranks))

    def selected(hd, qi, ki, w, r, rank):
        same = (qi // w) == (ki // w)
        return same & (rank[qi % w] % r == hd % r) & (rank[ki % w] % r == hd % r)

    def count(hd, qi, ki):
        c = qi * 0
        for w, r, rank in branches:
            c = c + selected(hd, qi, ki, w, r, rank).to(torch.int64)
        return c

    def mask_mod(b, hd, qi, ki):
        ok = count(hd, qi, ki) > 0
        return ok & (ki <= qi) if causal else ok

    def score_mod(score, b, hd, qi, ki):
        return score + torch.log(count(hd, qi, ki).clamp(min=1).to(score.dtype))

    # _compile: built block by block, never as an [H, N, N] tensor (32 GB at N = 16K, H = 16)
    block_mask = create_block_mask(mask_mod, None, h, n, n, device=device, _compile=True)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _floor_fn(q, k, v, segment_lengths, dilation_rates, hilbert, causal):
    """cuDNN attention on every branch's selected sets, gathered before the timing starts."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = q.shape
    blocks = []
    for plan in branch_plans(n, segment_lengths, dilation_rates, hilbert, q.device):
        pos = plan.for_heads(h).clamp(max=n - 1)  # [H, S, L]
        heads = torch.arange(h, device=q.device).view(h, 1, 1)
        blocks.append([t[:, heads, pos].reshape(b, -1, pos.shape[-1], d).detach().requires_grad_(t.requires_grad)
                       for t in (q, k, v)])

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return [F.scaled_dot_product_attention(*blk, is_causal=causal) for blk in blocks]
    return run, blocks


def _time(fn, backward, inputs):
    import triton.testing

    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    outs = fn()
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    grads = [torch.randn_like(o) for o in outs]

    def step():
        res = fn()
        res = res if isinstance(res, (list, tuple)) else [res]
        torch.autograd.backward(res, grads)
    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median",
                                   grad_to_none=inputs)


def bytes_needed(n, args, backward):
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    per = args.batch * args.heads * n * args.head_dim * elem
    return per * (12 if backward else 6)  # q, k, v, out (+ grads), gathered floor blocks


def run_one(method, n, args, backward, device):
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, args.heads, n, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
    w, r = args.segment_lengths, args.dilation_rates
    if method == "dense":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)  # noqa: E731
        return _time(fn, backward, [q, k, v])
    if method == "flex":
        flex = _flex_fn(n, args.heads, w, r, args.hilbert, args.causal, device)
        return _time(lambda: flex(q, k, v), backward, [q, k, v])
    if method in ("sdpa", "triton"):
        fn = lambda: dilated_attention(q, k, v, w, r, hilbert=args.hilbert, is_causal=args.causal,  # noqa: E731
                                       lowering=method)
        return _time(fn, backward, [q, k, v])
    if method == "floor":
        fn, blocks = _floor_fn(q, k, v, w, r, args.hilbert, args.causal)
        return _time(fn, backward, [t for blk in blocks for t in blk])
    raise ValueError(f"unknown method {method!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hilbert_fx.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+",
                   default=[2 ** i for i in range(14, 21)], help="lengths to try, in order")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--segment-lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--hilbert", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default="both")
    p.add_argument("--max-len", type=str, nargs="*", default=["dense=131072", "flex=65536", "sdpa=262144"],
                   help="per-method longest length, e.g. dense=131072 (they grow as N^2 or copy a lot)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every method this many times, in turn (A B A B ...), and report the "
                        "median: a GPU at its power limit lowers its clocks for a while")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    return p.parse_args(argv)


def plot(rows, path, title):
    plt = pyplot("the benchmark's plot")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (method, mode) in sorted({(r["method"], r["mode"]) for r in rows}):
        pts = [r for r in rows if r["method"] == method and r["mode"] == mode and r["ms"] is not None]
        if not pts:
            continue
        style = "-" if mode == "fwd" else "--"
        axes[0].plot([p["N"] for p in pts], [p["ms"] for p in pts], style, marker="o", label=f"{method} {mode}")
        axes[1].plot([p["N"] for p in pts], [p["tflops"] for p in pts], style, marker="o", label=f"{method} {mode}")
    for ax, label in zip(axes, ("time (ms)", "useful TF/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def format_table(rows, title, methods, seq_lens, modes, largest, kernels) -> str:
    """The printed table: ms (useful TF/s) per method, the floor's time over each method's when
    the floor ran, the largest N that fitted, and which kernel ran each branch's forward and
    backward."""
    def cell(n, mode, m):
        return next((r for r in rows if r["N"] == n and r["mode"] == mode and r["method"] == m), None)

    def timing(r):
        return f"{r['ms']:8.2f} ({r['tflops']:5.0f})" if r else "-"

    def line(n, mode, texts):
        return f"{n:>8} {mode:7} " + " ".join(f"{t:>16}" for t in texts)

    header = f"{'N':>8} {'mode':7} " + " ".join(f"{m:>16}" for m in methods)
    lines, ratios = [title, "cells: ms (useful TF/s)", header], []
    for n in seq_lens:
        for mode in modes:
            cells = [cell(n, mode, m) for m in methods]
            if any(cells):
                lines.append(line(n, mode, [timing(r) for r in cells]))
            floor = cell(n, mode, "floor")
            if floor:
                ratios.append(line(n, mode, [f"{floor['ms'] / r['ms']:.2f}" if r else "-"
                                             for r in cells]))
    if ratios:
        lines += ["floor ms / method ms (1.00 = the floor's speed):", header] + ratios
    lines.append("largest N that fitted: " + ", ".join(
        f"{m} {md}: {n}" for (m, md), n in sorted(largest.items())))
    if kernels:
        lines.append("kernel per branch: " + "; ".join(kernels))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU")
    tqdm = optional_import("tqdm", "the benchmark").tqdm

    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    limits = dict(item.split("=") for item in args.max_len)
    modes = ["fwd", "fwdbwd"] if args.mode == "both" else [args.mode]
    gpu = torch.cuda.get_device_name(0)
    title = (f"{gpu}, {args.dtype}, B={args.batch} H={args.heads} D={args.head_dim}, branches "
             f"{list(zip(args.segment_lengths, args.dilation_rates))}, hilbert={args.hilbert}, "
             f"causal={args.causal}")
    if args.rounds > 1:
        title += f"; median of {args.rounds} rounds, the methods timed in turn"
    samples, largest, stopped = {}, {}, set()
    jobs = [(n, mode, m) for n in args.seq_lens for mode in modes
            for _ in range(args.rounds) for m in args.methods]
    for n, mode, method in tqdm(jobs, desc="bench", unit="run"):
        key = (method, mode)
        if key in stopped or n > int(limits.get(method, 1 << 62)):
            continue
        backward = mode == "fwdbwd"
        free, _ = torch.cuda.mem_get_info()
        if bytes_needed(n, args, backward) > 0.8 * free:
            stopped.add(key)
            tqdm.write(f"{method} {mode}: N={n} would not fit in {free / 2**30:.1f} GiB free; stopping it")
            continue
        try:
            ms = run_one(method, n, args, backward, device)
        except torch.cuda.OutOfMemoryError:
            stopped.add(key)
            tqdm.write(f"{method} {mode}: out of memory at N={n}; stopping it")
            torch.cuda.empty_cache()
            continue
        samples.setdefault((n, mode, method), []).append(ms)
        largest[key] = n
        torch.cuda.empty_cache()

    rows = []
    for (n, mode, method), times in samples.items():
        ms = statistics.median(times)
        flops = useful_flops(n, args.batch, args.heads, args.head_dim, args.segment_lengths,
                             args.dilation_rates, args.causal) * (3.5 if mode == "fwdbwd" else 1.0)
        rows.append(dict(N=n, mode=mode, method=method, ms=ms, tflops=flops / ms / 1e9,
                         us_per_token=ms * 1e3 / n))

    text = format_table(rows, title, args.methods, args.seq_lens, modes, largest,
                        gluon_forward.kernel_choices() if "triton" in args.methods else [])
    print(text)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write("```\n" + text + "\n```\n")
    with open(os.path.join(args.out, "bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["N", "mode", "method", "ms", "tflops", "us_per_token"])
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.join(args.out, "bench.png"), title)
    return rows


if __name__ == "__main__":
    main()
