"""Where the ring op's time goes on P GPUs: kernels per call, GPU busy time and host time.

    python scripts/ring_profile.py --nproc 4 --out $OUT

Weak-scaling configuration of scripts/ring_benchmark.py (--tokens-per-gpu per GPU, its default
branches, bf16, H=16, D=128, Hilbert on), non-causal and causal, forward and forward+backward,
calls issued back to back. Each rank writes OUT/ring_profile_rank<i>.txt (rank 0's and the last
rank's are printed): per mode the GPU time per call (events), the host time per call, the time of
a call timed alone (ranks lined up, synchronised before and after; the median), the host time
of the ring's phases (agreement, transport, the lowering's calls, merge), the kernels per call
grouped by name (count and microseconds) and how much of the GPU time no kernel ran on the
compute stream. Under causal masking the ranks' work differs: read the last rank's too. Use it
when the ring's efficiency drops: it separates the kernels' time from the time the GPU waits for
messages or for the host.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tokens-per-gpu", type=int, default=65536)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--trace", action="store_true",
                   help="also write each rank's Chrome trace of one call per mode to OUT")
    return p.parse_args(argv)


def group_of(name: str) -> str:
    for key in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_preprocess", "nccl",
                "flash", "fmha", "cudnn", "index", "cat", "elementwise", "reduce"):
        if key.lower() in name.lower():
            return key
    return name[:60]


def _label_phases():
    """Names the ring's host phases in the traces (agreement, plan, transport, the calls)."""
    import functools
    from torch.profiler import record_function
    from hilbert_fx.lowering import ring, ring_agree, ring_transport

    def label(module, name, tag):
        fn = getattr(module, name)

        @functools.wraps(fn)
        def wrapped(*a, **kw):
            with record_function(tag):
                return fn(*a, **kw)
        setattr(module, name, wrapped)

    label(ring_agree, "start", "ring: agree")
    label(ring, "ring_plan", "ring: plan")
    for name in ("post_rows", "received_rows", "post_gradients", "received_gradients"):
        label(ring_transport, name, f"ring: {name}")
    from hilbert_fx.lowering import sdpa_lowering, triton_lowering
    for module in (sdpa_lowering, triton_lowering):
        for name in ("forward", "backward"):
            label(module, name, f"ring: {module.__name__.rsplit('.', 1)[-1]}.{name}")
    for name in ("_merge_rows", "_accumulate", "_layout"):
        label(ring, name, f"ring: {name}")


def run(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=120))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ring_benchmark import default_branches
    from hilbert_fx.lowering.ring import ring_dilated_attention
    _label_phases()
    n = args.tokens_per_gpu
    segs, rates = default_branches(n, world)
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v, do = (torch.randn(1, 16, n, 128, generator=g, device="cuda").to(torch.bfloat16)
                   for _ in range(4))
    lines = [f"P={world}, {n} tokens per GPU, branches {list(zip(segs, rates))}"]

    def call(causal, backward):
        if not backward:
            with torch.no_grad():
                ring_dilated_attention(q, k, v, segs, rates, hilbert=True, is_causal=causal,
                                       lowering="triton", mesh=dist.group.WORLD)
            return
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        ring_dilated_attention(qq, kk, vv, segs, rates, hilbert=True, is_causal=causal,
                               lowering="triton", mesh=dist.group.WORLD).backward(do)

    for causal in (False, True):
        for backward in (False, True):
            mode = f"causal={causal} {'fwd+bwd' if backward else 'fwd'}"
            for _ in range(3):
                call(causal, backward)
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(args.iters):
                call(causal, backward)
            host_ms = (time.perf_counter() - t0) * 1000 / args.iters
            end.record()
            torch.cuda.synchronize()
            gpu_ms = start.elapsed_time(end) / args.iters
            alone = []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                call(causal, backward)
                torch.cuda.synchronize()
                alone.append((time.perf_counter() - t0) * 1000)
            dist.barrier()
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    call(causal, backward)
                torch.cuda.synchronize()
            dist.barrier()
            if args.trace:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as one:
                    call(causal, backward)
                    torch.cuda.synchronize()
                os.makedirs(args.out, exist_ok=True)
                one.export_chrome_trace(os.path.join(
                    args.out, f"trace_rank{rank}_{'causal' if causal else 'full'}_"
                              f"{'fwdbwd' if backward else 'fwd'}.json"))
                dist.barrier()
            # the phases' labels show on the GPU's timeline too: they are no kernels
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not e.name.startswith("ring: ")]
            count, micros = collections.Counter(), collections.Counter()
            for e in kernels:
                key = group_of(e.name)
                count[key] += 1
                micros[key] += e.device_time
            busy = sum(micros[key] for key in micros if key != "nccl") / args.iters / 1000
            lines.append(f"\n{mode}: GPU {gpu_ms:.3f} ms per call, host {host_ms:.3f} ms per call, "
                         f"compute kernels {busy:.3f} ms per call (GPU idle or waiting "
                         f"{gpu_ms - busy:.3f} ms), {sum(count.values()) / args.iters:.0f} "
                         f"kernels per call; a call timed alone {statistics.median(alone):.3f} "
                         f"ms")
            phases = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("ring: "):
                    phases[e.name] += e.cpu_time_total
            for name, us in sorted(phases.items(), key=lambda x: -x[1]):
                lines.append(f"  host {name:57s} {us / args.iters:9.1f} us")
            for key, us in micros.most_common():
                lines.append(f"  {key:62s} {count[key] / args.iters:6.1f} per call "
                             f"{us / args.iters:9.1f} us")
    text = "\n".join([f"rank {rank}:"] + lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"ring_profile_rank{rank}.txt"), "w") as f:
        f.write(text + "\n")
    for r in sorted({0, world - 1}):
        dist.barrier()
        if rank == r:
            print(text, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse_args()
    from ring_benchmark import spawn_ranks
    spawn_ranks(run, a.nproc, a)
