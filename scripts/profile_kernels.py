"""Per-kernel GPU time of the op's forward+backward on one GPU, beside FlexAttention's, at N = 64K.

    PYTHONPATH=. python scripts/profile_kernels.py --out $OUT [--n 65536]
    PYTHONPATH=. python scripts/profile_kernels.py --out $OUT --per-branch [--n 65536] [--causal]

--per-branch: each launch's time in launch order (medians of 5 forward+backward steps), ours
beside the floor's (cuDNN on the gathered sets, hilbert_fx.bench), and branch by branch our
forward and backward kernel against the floor's: where the gap to the floor lies.

torch.profiler over five steps after warm-up; for each workload a table of the GPU kernels with
their time per step (ms) and launches per step, then the registers and spills of each compiled
kernel of lowering/triton_kernels.py (spills are what to look for after a kernel change).
Workloads: the benchmark's configuration (bf16, H=16, D=128, branches (2048,1), (4096,2),
(8192,4), (16384,8), Hilbert on); the one-branch pattern (2048, 1), plain block-diagonal
attention, for ours and for FlexAttention (Triton-generated too, every block full): on that
pattern the two do the same work, so the comparison shows where Triton's own best stands.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hilbert_fx.lowering import dilated_attention  # noqa: E402

SEGS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]


def _inputs(n: int, d: int = 128):
    return [torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)]


def gpu_events(step, steps: int) -> list:
    """The GPU events of `steps` steps after three of warm-up, in launch order."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernel_table(step, steps: int = 5) -> tuple[list[tuple[str, float, int]], float]:
    """[(kernel name, ms per step, launches per step)], total ms per step."""
    times, calls = defaultdict(float), defaultdict(int)
    for ev in gpu_events(step, steps):
        times[ev.name[:70]] += ev.device_time / 1000.0
        calls[ev.name[:70]] += 1
    rows = sorted(((k, t / steps, calls[k] // steps) for k, t in times.items()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def launch_times(step, steps: int = 5) -> list[tuple[str, float]]:
    """[(kernel name, us)] of one step's GPU launches in launch order, medians over `steps`."""
    events = gpu_events(step, steps)
    per, rest = divmod(len(events), steps)
    if rest:
        raise RuntimeError(f"{len(events)} launches in {steps} steps: the steps differ")
    return [(events[j].name, statistics.median(
        events[i * per + j].time_range.end - events[i * per + j].time_range.start
        for i in range(steps))) for j in range(per)]


def per_branch(ours, floor, order, branches) -> list[tuple] | None:
    """[(branch, our forward us, the floor's, our backward us, the floor's)], each branch's
    kernels picked out of the launch lists: ours run in `order` (triton_plans.forward_order),
    forward and backward alike; the floor's forwards in the branches' order, its backwards the
    other way round (autograd). None where the counts do not match (a branch on other kernels)."""
    ours_fwd = [us for name, us in ours if name == "_fwd_kernel"]
    ours_bwd = [us for name, us in ours if name == "_bwd_kernel"]
    floor_fwd = [us for name, us in floor if "fprop" in name or "flash_fwd" in name]
    floor_bwd = [us for name, us in floor if "bprop" in name or "flash_bwd" in name][::-1]
    if not len(ours_fwd) == len(ours_bwd) == len(floor_fwd) == len(floor_bwd) == len(order):
        return None
    at = {branch: i for i, branch in enumerate(order)}
    return [(b, ours_fwd[at[b]], floor_fwd[i], ours_bwd[at[b]], floor_bwd[i])
            for i, b in enumerate(branches)]


def branch_report(n: int, causal: bool) -> list[str]:
    """The --per-branch tables at the benchmark's configuration (Hilbert order)."""
    from hilbert_fx.bench import _floor_fn
    from hilbert_fx.lowering.plans import branch_plans
    from hilbert_fx.lowering.triton_plans import forward_order
    q, k, v = _inputs(n)
    dout = torch.randn_like(q)

    def ours():
        dilated_attention(q, k, v, SEGS, RATES, hilbert=True, is_causal=causal,
                          lowering="triton").backward(dout)
        for t in (q, k, v):
            t.grad = None
    run, blocks = _floor_fn(q, k, v, SEGS, RATES, True, causal)
    leaves = [t for blk in blocks for t in blk]
    grads = [torch.randn_like(o) for o in run()]

    def floor():
        torch.autograd.backward(run(), grads)
        for t in leaves:
            t.grad = None
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N={n}, bf16, H=16, "
             f"D=128, branches {list(zip(SEGS, RATES))}, hilbert, causal={causal}"]
    launches = {}
    for label, step in (("ours", ours), ("floor", floor)):
        launches[label] = launch_times(step)
        lines.append(f"\n== {label}: each launch of a forward+backward, us")
        lines += [f"  {us:9.1f}  {name[:100]}" for name, us in launches[label]]
    plans = branch_plans(n, SEGS, RATES, True, q.device)
    order = [(p.segment_length, p.dilation_rate) for p in forward_order(plans)[0]]
    rows = per_branch(launches["ours"], launches["floor"], order, list(zip(SEGS, RATES)))
    if rows is None:
        lines.append("\n(launch counts differ from one kernel a branch: no table by branch)")
        return lines
    lines += ["\n| branch | forward ours / floor us | floor / ours | backward ours / floor us "
              "| floor / ours |", "|---|---|---|---|---|"]
    lines += [f"| {b} | {of:.0f} / {ff:.0f} | {ff / of:.2f} | {ob:.0f} / {fb:.0f} | {fb / ob:.2f} |"
              for b, of, ff, ob, fb in rows]
    return lines


def fwd_bwd(fn, inputs):
    def step():
        out = fn()
        out.backward(torch.ones_like(out))  # a fixed dO: the same work every step
        for t in inputs:
            t.grad = None
    return step


def registers() -> list[str]:
    """Registers and spills of each compiled kernel of lowering/triton_kernels.py."""
    from hilbert_fx.lowering import triton_kernels as tk
    lines = []
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_preprocess"):
        fn = getattr(tk, name)
        for caches in fn.device_caches.values():
            for kernel in caches[0].values():
                md = kernel.metadata
                lines.append(f"{name:18s} warps {md.num_warps} stages {md.num_stages} "
                             f"regs {getattr(kernel, 'n_regs', '?')} "
                             f"spills {getattr(kernel, 'n_spills', '?')} shared {md.shared}")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--per-branch", action="store_true")
    p.add_argument("--causal", action="store_true", help="with --per-branch")
    args = p.parse_args()
    n = args.n
    if args.per_branch:
        lines = branch_report(n, args.causal)
        print("\n".join(lines))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "per_branch.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N={n}, bf16, H=16, D=128"]
    q, k, v = _inputs(n)
    mask = create_block_mask(lambda b, h, qi, ki: (qi // 2048) == (ki // 2048), None, None, n, n,
                             device="cuda")
    flex = torch.compile(flex_attention)
    workloads = [
        ("ours, branches (2048,1) ... (16384,8), hilbert",
         lambda: dilated_attention(q, k, v, SEGS, RATES, hilbert=True, lowering="triton")),
        ("ours, one branch (2048,1)",
         lambda: dilated_attention(q, k, v, [2048], [1], lowering="triton")),
        ("flex, one branch (2048,1)", lambda: flex(q, k, v, block_mask=mask)),
    ]
    for label, fn in workloads:
        rows, total = kernel_table(fwd_bwd(fn, [q, k, v]))
        lines.append(f"\n== {label}: {total:.3f} ms of kernels per forward+backward")
        lines += [f"  {ms:8.3f} ms  x{c:<3d} {name}" for name, ms, c in rows]
        print("\n".join(lines[-len(rows) - 1:]), flush=True)
    lines.append("\n== registers")
    lines += registers()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_kernels.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[lines.index("\n== registers"):]))


if __name__ == "__main__":
    main()
