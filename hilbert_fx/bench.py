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
--mask bool|float and --dropout P time every method but flex with a user's mask ([1, 1, N, N],
`user_mask`) or attention dropout; the floor then gathers the mask's blocks too (`_floor_fn`).
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


def _floor_fn(q, k, v, segment_lengths, dilation_rates, hilbert, causal, mask=None,
              dropout_p=0.0):
    """cuDNN attention on every branch's selected sets, gathered before the timing starts.

    With a mask ([1, 1, N, N]) each set's block of it is gathered too, as an additive float
    mask (0 or the dtype's lowest where a boolean one forbids: SDPA would convert a boolean
    mask on every call), one call per offset class, whose heads share their sets and so the
    mask's block (broadcast over them, as the op reads one mask for every head). cuDNN where
    it takes the mask or dropout, else the next of FlashAttention and the memory-efficient
    kernel that does: `floor_backend` says which ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = q.shape
    blocks, masks = [], []
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, torch.finfo(q.dtype).min)

    def gathered(t, heads, pos):  # [b, heads, S, L, d] -> [b * S, heads, L, d]
        x = t[:, heads][:, :, pos].transpose(1, 2)
        return x.reshape(-1, *x.shape[2:]).detach().requires_grad_(t.requires_grad)

    for plan in branch_plans(n, segment_lengths, dilation_rates, hilbert, q.device):
        pos = plan.for_heads(h).clamp(max=n - 1)  # [H, S, L]
        if mask is None:
            heads = torch.arange(h, device=q.device).view(h, 1, 1)
            blocks.append([t[:, heads, pos].reshape(b, -1, pos.shape[-1], d).detach()
                           .requires_grad_(t.requires_grad) for t in (q, k, v)])
            masks.append(None)
            continue
        r = plan.dilation_rate
        for o in range(min(r, h)):  # query head x selects offset x % r (SPEC)
            heads = torch.arange(o, h, r, device=q.device)
            p = pos[o]  # [S, L]
            blocks.append([gathered(t, heads, p) for t in (q, k, v)])
            m = mask[0, 0][p[:, :, None], p[:, None, :]]  # [S, L, L]
            masks.append(m.unsqueeze(0).expand(b, *m.shape).reshape(-1, 1, *m.shape[1:]))

    def run_on(backends):
        def run():
            with sdpa_kernel(backends):
                return [F.scaled_dot_product_attention(*blk, attn_mask=m, dropout_p=dropout_p,
                                                       is_causal=causal)
                        for blk, m in zip(blocks, masks)]
        return run

    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("FlashAttention", SDPBackend.FLASH_ATTENTION),
                          ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        run = run_on([backend])
        try:
            with torch.no_grad():
                run()
        except RuntimeError:  # this kernel does not take the mask or dropout
            continue
        floor_backend[0] = name
        return run, blocks
    raise RuntimeError("no SDPA kernel runs the floor's blocks")


floor_backend = ["cuDNN"]  # the kernel the last floor ran on (_floor_fn)


def user_mask(kind: str, n: int, dtype, device):
    """The benchmark's mask for --mask: [1, 1, N, N], broadcast over batch and heads, as the
    padding and bias masks of models are. bool: 10% of entries forbidden at random; float: a
    bias drawn from N(0, 1/4), in the inputs' dtype."""
    if kind == "none":
        return None
    gen = torch.Generator(device).manual_seed(0)
    if kind == "bool":
        return torch.rand(1, 1, n, n, device=device, generator=gen) > 0.1
    return (torch.randn(1, 1, n, n, device=device, generator=gen) * 0.5).to(dtype)


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
    mask, p = user_mask(args.mask, n, dtype, device), args.dropout
    if method == "dense":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,  # noqa: E731
                                                    is_causal=args.causal)
        return _time(fn, backward, [q, k, v])
    if method == "flex":
        flex = _flex_fn(n, args.heads, w, r, args.hilbert, args.causal, device)
        return _time(lambda: flex(q, k, v), backward, [q, k, v])
    if method in ("sdpa", "triton"):
        fn = lambda: dilated_attention(q, k, v, w, r, hilbert=args.hilbert, is_causal=args.causal,  # noqa: E731
                                       attn_mask=mask, dropout_p=p, lowering=method)
        return _time(fn, backward, [q, k, v])
    if method == "floor":
        fn, blocks = _floor_fn(q, k, v, w, r, args.hilbert, args.causal, mask, p)
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
    p.add_argument("--mask", choices=["none", "bool", "float"], default="none",
                   help="a user's mask of [1, 1, N, N] (user_mask) for every method but flex")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="attention dropout for every method but flex")
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
    if args.mask != "none" or args.dropout:
        title += f", mask={args.mask}, dropout={args.dropout}"
        if "flex" in args.methods:  # its score_mod and block mask carry the pattern alone
            args.methods = [m for m in args.methods if m != "flex"]
            print("flex left out: it is timed without a user's mask or dropout")
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

    if "floor" in args.methods:
        title += f"; floor on {floor_backend[0]}"
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
