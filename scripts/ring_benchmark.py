"""Dilated attention over a device mesh on GPUs: correctness against one GPU, and weak scaling.

    torchrun --nproc-per-node P scripts/ring_benchmark.py --out results/ring
    python scripts/ring_benchmark.py --nproc P --out results/ring        # same, via spawn

The ring op runs with --ring-lowering ("auto" by default: the Triton kernels, for the rank's own
sets and those with peers' rows alike, on GPUs of compute capability 8.0 or more, lowering/ring.py;
"sdpa" for the SDPA lowering).

1. Correctness (--check, on by default): small problems (n_check tokens per GPU), the ring op on P
   GPUs against the single-device op on one GPU over the whole sequence with the ring's lowering,
   forward and backward (out, dq, dk, dv), in bfloat16 and float32; both are also compared with the
   single-device op (--lowering) in float32, so that the ring's error can be read next to the
   single GPU's own rounding.
2. Weak scaling: --tokens-per-gpu tokens on each GPU (65536 by default), with a branch set whose
   largest segment spans every GPU (P_max * tokens). For each P in 1, 2, 4, ... up to the GPUs
   launched: the time of the single-device op on one GPU over --tokens-per-gpu tokens (P = 1) and
   of the ring op on P GPUs over P times the tokens. Efficiency = T(1) / T(P); against the best
   single-GPU op read the column of the extra baseline ("auto": Triton on the GPU). Also printed: the
   work ratio (attention pairs per GPU at P = 1 over those at P; the branch whose segments grow
   with the sequence makes each GPU's work grow, so this bounds the efficiency from above), the
   bytes each rank sent (measured) and what a dense ring would send.

Results go to OUT/ring_benchmark.json and OUT/ring_benchmark.md (rewritten after every row, so
that a run cut short still leaves what it measured), and the tables are printed. The run keeps to
--budget-s seconds: weak-scaling rows that would start later are skipped (and listed). A
collective that waits longer than --collective-timeout-s raises instead of hanging.

The runs BENCHMARKS.md gives (4 GPUs; --nproc 2 on 2): calls back to back as in a training
step, then each call timed alone:

    python scripts/ring_benchmark.py --nproc 4 --out $OUT --timing pipelined --budget-s 280
    python scripts/ring_benchmark.py --nproc 4 --out $OUT --timing sync --no-check --budget-s 240

A smoke test of this script on CPU (gloo; the Triton kernels interpreted):

    TRITON_INTERPRET=1 python scripts/ring_benchmark.py --cpu --nproc 2 --out /tmp/rb \
        --ring-lowering triton --tokens-per-gpu 64 --heads 2 --head-dim 16 --n-check 48 \
        --warmup 1 --iters 1 --modes fwd,fwd+bwd --causal both --extra-baseline ""
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEV = "cuda"  # "cpu" with --cpu (a smoke test of this script with gloo)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for ring_benchmark.json / .md")
    p.add_argument("--nproc", type=int, default=None, help="spawn this many processes (no torchrun)")
    p.add_argument("--tokens-per-gpu", type=int, default=65536)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--segments", type=str, default=None,
                   help="comma-separated segment lengths (default: 2048 ... 65536 doubling, then "
                        "P_max * tokens-per-gpu)")
    p.add_argument("--rates", type=str, default=None,
                   help="comma-separated dilation rates (default: 1, 2, 4, ... doubling)")
    p.add_argument("--no-hilbert", action="store_true")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--modes", type=str, default="fwd,fwd+bwd")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--lowering", default="sdpa",
                   help="lowering of the single-device op in the P = 1 baseline and of the "
                        "float32 truth in the check")
    p.add_argument("--ring-lowering", default="auto", choices=["auto", "triton", "sdpa"],
                   help="lowering of the ring op (auto: triton on GPUs of compute capability "
                        ">= 8.0, else sdpa); the check's single-device op in bf16/fp32 uses it too")
    p.add_argument("--extra-baseline", default="auto",
                   help="also time the single-device op with this lowering at P = 1 ('' for none)")
    p.add_argument("--budget-s", type=float, default=250.0,
                   help="skip weak-scaling rows that would start after this many seconds")
    p.add_argument("--collective-timeout-s", type=float, default=240.0,
                   help="a collective (or an idle rank's barrier) waiting longer raises")
    p.add_argument("--timing", choices=["sync", "pipelined"], default="sync",
                   help="each call alone (sync) or calls back to back (pipelined); see timed()")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--n-check", type=int, default=4096, help="tokens per GPU in the check")
    p.add_argument("--cpu", action="store_true", help="smoke test on CPU with gloo (tiny sizes)")
    p.add_argument("--sizes", type=str, default=None,
                   help="comma-separated P values to time (default 1, 2, 4, ... up to world)")
    return p.parse_args(argv)


def default_branches(tokens: int, p_max: int):
    segs, rates = [], []
    w, r = 2048, 1
    while w < tokens:
        segs.append(w)
        rates.append(r)
        w, r = w * 2, r * 2
    segs.append(tokens)
    rates.append(r)
    if p_max > 1:
        segs.append(tokens * p_max)
        rates.append(r * p_max)
    return segs, rates


# ---------------------------------------------------------------------------------------------

def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


PIPELINED = False  # --timing pipelined


def timed(fn, warmup: int, iters: int, group=None) -> float:
    """Median milliseconds per call on this rank, after a barrier; max over the group's ranks.

    --timing sync (default): each call timed alone, the GPU idle and the ranks lined up (a
    barrier) before it, so the host's work per call (Python, the ranks' agreement through the
    store) counts in full, and a rank that finished its previous call first does not count the
    others' lag as its own call's time. --timing
    pipelined: the mean over `iters` calls issued back to back, as in a training step, where
    the host runs ahead of the GPU and its work per call hides behind the kernels."""
    for _ in range(warmup):
        fn()
    sync()
    if group is not None:
        dist.barrier(group=group)
    if PIPELINED and DEV == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor(start.elapsed_time(end) / iters, device=DEV)
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)
    times = []
    for _ in range(iters):
        if group is not None:
            sync()
            dist.barrier(group=group)
            sync()
        if DEV == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    t = torch.tensor(statistics.median(times), device=DEV)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def pairs_per_gpu(n_total: int, world: int, segs, rates, hilbert: bool, causal: bool,
                  heads: int) -> float:
    """Query-key pairs each GPU computes, averaged over GPUs (from the index plans)."""
    from hilbert_fx.lowering.plans import branch_plan
    total = 0
    for w, r in zip(segs, rates):
        plan = branch_plan(n_total, w, r, hilbert, "cpu")
        counts = plan.counts.index_select(0, torch.arange(heads) % r).double()
        total += float((counts * (counts + 1) / 2).sum() if causal else (counts ** 2).sum())
    return total / world


def make_inputs(n_total, args, dtype, seed, device, requires_grad=False):
    g = torch.Generator(device=device).manual_seed(seed)
    hkv = args.kv_heads or args.heads
    shape_q = (args.batch, args.heads, n_total, args.head_dim)
    shape_k = (args.batch, hkv, n_total, args.head_dim)
    q = torch.randn(shape_q, generator=g, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(shape_k, generator=g, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(shape_k, generator=g, device=device, dtype=torch.float32).to(dtype)
    do = torch.randn(shape_q, generator=g, device=device, dtype=torch.float32).to(dtype)
    return q, k, v, do


def ring_lowering(args) -> str:
    """--ring-lowering resolved for this process's device, as the op resolves it."""
    from hilbert_fx.lowering.arguments import resolve_lowering
    return resolve_lowering(args.ring_lowering, torch.device(DEV))


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------

def check(args, mesh, rank, world):
    """Ring on `world` GPUs against the single-device op on one GPU, forward and backward."""
    import hilbert_fx.lowering as lowering
    from hilbert_fx.lowering.ring import ring_dilated_attention
    n = args.n_check
    n_total = n * world
    rows = []
    lowering_ring = ring_lowering(args)
    configs = [
        dict(name="hilbert", segs=[256, 1024, n_total], rates=[1, 2, 8], hilbert=True,
             causal=False, hkv=None),
        dict(name="hilbert causal", segs=[256, 1024, n_total], rates=[1, 2, 8], hilbert=True,
             causal=True, hkv=None),
        dict(name="ragged gqa causal", segs=[300, 1200, 3 * n_total // 2], rates=[1, 4, 12],
             hilbert=True, causal=True, hkv=2),
        dict(name="two shards", segs=[512, 2 * n], rates=[1, 4], hilbert=False, causal=False,
             hkv=None),
        # the keep bits hash global positions: the ring drops what one GPU drops (same seed)
        dict(name="dropout causal gqa", segs=[256, 1024, n_total], rates=[1, 2, 8],
             hilbert=True, causal=True, hkv=2, dropout_p=0.1),
    ]
    sl = slice(rank * n, (rank + 1) * n)
    for cfg in configs:
        for dname in ("bf16", "fp32"):
            dtype = DTYPES[dname]
            sub = argparse.Namespace(**vars(args))
            sub.heads, sub.head_dim, sub.batch = 8, 64, 2
            sub.kv_heads = cfg["hkv"]
            q, k, v, do = make_inputs(n_total, sub, torch.float32, 7, DEV)
            # the ring: this rank's shard
            ql, kl, vl = (x[:, :, sl].to(dtype).clone().requires_grad_(True) for x in (q, k, v))
            drop = cfg.get("dropout_p", 0.0)
            torch.manual_seed(1234)  # the seed of a call with dropout: rank 0's is used
            out = ring_dilated_attention(ql, kl, vl, cfg["segs"], cfg["rates"],
                                         hilbert=cfg["hilbert"], is_causal=cfg["causal"],
                                         dropout_p=drop, lowering=lowering_ring, mesh=mesh)
            out.backward(do[:, :, sl].to(dtype))
            mine = [out.detach(), ql.grad, kl.grad, vl.grad]
            gathered = []
            for t in mine:
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t.contiguous(), group=mesh.get_group())
                gathered.append(torch.cat(parts, dim=2))
            if rank == 0:
                def single(dt, low):
                    qf, kf, vf = (x.to(dt).clone().requires_grad_(True) for x in (q, k, v))
                    torch.manual_seed(1234)
                    o = lowering.dilated_attention(qf, kf, vf, cfg["segs"], cfg["rates"],
                                                   hilbert=cfg["hilbert"],
                                                   is_causal=cfg["causal"],
                                                   dropout_p=drop,
                                                   enable_gqa=cfg["hkv"] is not None,
                                                   lowering=low)
                    o.backward(do.to(dt))
                    return [o.detach(), qf.grad, kf.grad, vf.grad]
                one = single(dtype, lowering_ring)
                truth = single(torch.float32, args.lowering)
                for name, a, b, t in zip(("out", "dq", "dk", "dv"), gathered, one, truth):
                    r_ring, r_one = rel_err(a, t), rel_err(b, t)
                    # the ring is as close to float32 truth as the single GPU's own op is
                    floor = 1e-4 if dtype == torch.float32 else 1e-2
                    rows.append(dict(config=cfg["name"], dtype=dname, tensor=name,
                                     ring_lowering=lowering_ring,
                                     max_abs_ring_vs_1gpu=float((a.float() - b.float()).abs().max()),
                                     rel_ring_vs_1gpu=rel_err(a, b),
                                     rel_ring_vs_fp32=r_ring, rel_1gpu_vs_fp32=r_one,
                                     ok=bool(r_ring <= max(2 * r_one, floor))))
            dist.barrier()
    return rows


def _agree_flag(flag: bool) -> bool:
    """Rank 0's flag, on every rank (so that every rank takes the same branch)."""
    t = torch.tensor([1.0 if flag else 0.0], device=DEV)
    dist.broadcast(t, 0)
    return bool(t.item())


def weak_scaling(args, rank, world, t_start, on_row):
    import hilbert_fx.lowering as lowering
    from hilbert_fx.lowering import ring
    from hilbert_fx.lowering.ring import ring_dilated_attention
    from hilbert_fx.lowering.ring_plan import plan_bytes
    dtype = DTYPES[args.dtype]
    n = args.tokens_per_gpu
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else \
        [p for p in (1, 2, 4, 8, 16) if p <= world]
    p_max = max(sizes)
    if args.segments:
        segs = [int(x) for x in args.segments.split(",")]
        rates = [int(x) for x in args.rates.split(",")]
    else:
        segs, rates = default_branches(n, p_max)
    hilbert = not args.no_hilbert
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    modes = args.modes.split(",")
    hkv = args.kv_heads or args.heads
    lowering_ring = ring_lowering(args)
    # bytes per element on the wire: the ring sends in its lowering's compute dtype (float32 for
    # half types on CPU with the SDPA lowering, which computes in float32 there)
    elem = 4 if DEV == "cpu" and dtype in (torch.float16, torch.bfloat16) \
        and lowering_ring == "sdpa" else torch.finfo(dtype).bits // 8
    log(f"branches: segment_lengths={segs} dilation_rates={rates} hilbert={hilbert}; "
        f"ring lowering {lowering_ring}")
    res = dict(segment_lengths=segs, dilation_rates=rates, hilbert=hilbert, results=[],
               skipped=[], ring_lowering=lowering_ring, lowering=args.lowering)
    groups = {p: (dist.new_group(list(range(p))) if p > 1 else None) for p in sizes}
    one_group = dist.new_group([0])  # P = 1: the ring op on a group of one GPU
    for p, g in list(groups.items()) + [(1, one_group)]:  # connect every group before timing
        if rank < p:
            t = torch.ones(1, device=DEV)
            dist.all_reduce(t, group=g if g is not None else one_group)
    sync()
    dist.barrier()
    for causal in causals:
        for mode in modes:
            base_op = base_ring = None
            for p in sizes:
                if _agree_flag(time.time() - t_start > args.budget_s):
                    res["skipped"].append(dict(causal=causal, mode=mode, gpus=p))
                    log(f"  causal={causal!s:5} {mode:8} P={p}: skipped (over --budget-s)")
                    continue
                group = groups[p]
                n_total = n * p
                ms = op_ms = extra_ms = float("nan")
                extra_error = ""
                sent = {}
                if rank < p:
                    sub_rank = dist.get_rank(group) if group is not None else 0
                    q, k, v, do = make_inputs(n, args, dtype, 100 + sub_rank, DEV)

                    def call(fn, **kw):
                        if mode == "fwd":
                            with torch.no_grad():
                                fn(q, k, v, segs, rates, hilbert=hilbert, is_causal=causal, **kw)
                        else:
                            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
                            fn(qq, kk, vv, segs, rates, hilbert=hilbert, is_causal=causal,
                               **kw).backward(do)
                    ring_group = group if group is not None else one_group

                    def run():
                        call(ring_dilated_attention, lowering=lowering_ring, mesh=ring_group)
                    if p == 1:  # the single-device op too
                        op_ms = timed(lambda: call(lowering.dilated_attention,
                                                   enable_gqa=hkv != args.heads,
                                                   lowering=args.lowering),
                                      args.warmup, args.iters)
                        if args.extra_baseline:
                            try:
                                extra_ms = timed(lambda: call(lowering.dilated_attention,
                                                              enable_gqa=hkv != args.heads,
                                                              lowering=args.extra_baseline),
                                                 args.warmup, args.iters)
                            except Exception as e:  # reported, not fatal (rank 0 alone)
                                extra_error = f"{type(e).__name__}: {e}"[:300]
                                log(f"  extra baseline {args.extra_baseline!r} failed: "
                                    f"{extra_error}")
                    run()  # plans built, connections made
                    sync()
                    ring.reset_comm_stats()
                    run()
                    sync()
                    sent = ring.comm_stats()
                    ms = timed(run, args.warmup, args.iters, group)
                    del q, k, v, do
                    if DEV == "cuda":
                        torch.cuda.empty_cache()
                dist.barrier()
                t = torch.tensor([ms, op_ms, extra_ms] if rank == 0 else [0.0, 0.0, 0.0],
                                 device=DEV, dtype=torch.float64)
                dist.broadcast(t, 0)
                ms, op_ms, extra_ms = t.tolist()
                if p == 1:
                    base_ring, base_op, base_extra = ms, op_ms, extra_ms
                # the bytes of every rank, gathered
                b = torch.tensor([float(sent.get("forward_bytes", 0)),
                                  float(sent.get("backward_bytes", 0))], device=DEV,
                                 dtype=torch.float64)
                parts = [torch.empty_like(b) for _ in range(world)]
                dist.all_gather(parts, b)
                if rank == 0:
                    if base_ring is None:  # P = 1 not timed: efficiencies are not defined
                        base_ring = base_op = base_extra = float("nan")
                    pb = plan_bytes(n, p, segs, rates, hilbert=hilbert, is_causal=causal,
                                    batch=args.batch, num_heads=args.heads, num_kv_heads=hkv,
                                    head_dim=args.head_dim, element_size=elem)
                    measured = [parts[r].tolist() for r in range(p)]
                    if mode == "fwd":
                        sent_max = max(m[0] for m in measured)
                        dense = max(x["dense_forward_bytes"] for x in pb)
                        planned = max(x["forward_bytes"] for x in pb)
                    else:
                        sent_max = max(m[0] + m[1] for m in measured)
                        dense = max(x["dense_forward_bytes"] + x["dense_backward_bytes"] for x in pb)
                        planned = max(x["forward_bytes"] + x["backward_bytes"] for x in pb)
                    work = pairs_per_gpu(n, 1, segs, rates, hilbert, causal, args.heads) / \
                        pairs_per_gpu(n_total, p, segs, rates, hilbert, causal, args.heads)
                    res["results"].append(dict(
                        causal=causal, mode=mode, gpus=p, tokens=n_total, ms=ms,
                        ring_lowering=lowering_ring,
                        single_device_op_ms=op_ms if p == 1 else None,
                        extra_baseline=args.extra_baseline or None,
                        extra_baseline_ms=extra_ms if p == 1 else None,
                        extra_baseline_error=extra_error or None,
                        efficiency=base_ring / ms, efficiency_vs_single_device_op=base_op / ms,
                        efficiency_vs_extra_baseline=base_extra / ms,
                        work_ratio=work, efficiency_per_work=(base_ring / ms) / work,
                        bytes_sent_per_rank=sent_max, bytes_planned_per_rank=planned,
                        bytes_sent_equals_plan=bool(sent_max == planned),
                        dense_ring_bytes_per_rank=dense,
                        fraction_of_dense=(sent_max / dense) if dense else 0.0))
                    r = res["results"][-1]
                    log(f"  causal={causal!s:5} {mode:8} P={p} tokens={n_total:7d} "
                        f"{ms:9.2f} ms  eff={r['efficiency']:.3f} "
                        f"eff_vs_op={r['efficiency_vs_single_device_op']:.3f} "
                        f"eff_vs_{args.extra_baseline or '-'}="
                        f"{r['efficiency_vs_extra_baseline']:.3f} work={work:.3f} "
                        f"sent={sent_max / 2**20:8.2f} MiB (plan {planned / 2**20:.2f}) "
                        f"dense={dense / 2**20:9.2f} MiB  [{time.time() - t_start:.0f} s]")
                    on_row(res)
    return res


def table_md(res, check_rows, meta) -> str:
    lines = [f"# Ring dilated attention: {meta['device']} x {meta['world']}", "",
             f"torch {meta['torch']}, NCCL {meta['nccl']}, {meta['date']}, "
             f"{meta.get('elapsed_s', '?')} s; args: {' '.join(meta.get('argv', []))}", ""]
    for e in meta.get("errors", []):
        lines += [f"**ERROR** {e}", ""]
    if meta.get("kernels"):
        lines += ["Kernels that ran on rank 0 (per branch, pass and reason):", "",
                  *[f"- {k}" for k in meta["kernels"]], ""]
    if check_rows:
        lines += ["## Correctness: ring on P GPUs vs the single-device op on one GPU", "",
                  f"ring and single-device op with lowering "
                  f"{check_rows[0].get('ring_lowering', 'sdpa')}; fp32 truth: the single-device "
                  f"op with --lowering in float32", "",
                  "| config | dtype | tensor | max abs ring-1gpu | rel ring-1gpu | rel ring-fp32 | rel 1gpu-fp32 | ok |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in check_rows:
            lines.append(f"| {r['config']} | {r['dtype']} | {r['tensor']} | "
                         f"{r['max_abs_ring_vs_1gpu']:.2e} | {r['rel_ring_vs_1gpu']:.2e} | "
                         f"{r['rel_ring_vs_fp32']:.2e} | {r['rel_1gpu_vs_fp32']:.2e} | "
                         f"{'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if res:
        extra = next((r["extra_baseline"] for r in res["results"] if r.get("extra_baseline")),
                     None)
        lines += [f"## Weak scaling: {meta['tokens_per_gpu']} tokens per GPU", "",
                  f"segment_lengths={res['segment_lengths']} dilation_rates={res['dilation_rates']} "
                  f"hilbert={res['hilbert']}; B={meta['batch']} H={meta['heads']} "
                  f"Hkv={meta['kv_heads']} D={meta['head_dim']} {meta['dtype']}; ring op "
                  f"lowering: {res.get('ring_lowering', 'sdpa')}", "",
                  "efficiency = T(ring op, 1 GPU, n tokens) / T(ring op, P GPUs, P n tokens); "
                  "work ratio = attention pairs per GPU at P = 1 over those at P (an upper bound "
                  "of the efficiency); the single-device op columns use it for T(1) instead.", "",
                  "| causal | pass | GPUs | tokens | ms | efficiency | work ratio "
                  f"| eff. vs single-device op ({res.get('lowering', 'sdpa')}) "
                  + (f"| eff. vs single-device op ({extra}) " if extra else "")
                  + "| MiB sent per rank (measured) | planned | dense ring MiB | sent / dense |",
                  "|---|---|---|---|---|---|---|---|" + ("---|" if extra else "")
                  + "---|---|---|---|"]

        def fmt_ms(x):
            return f" ({x:.2f} ms)" if x is not None and x == x else ""
        for r in res["results"]:
            lines.append(
                f"| {r['causal']} | {r['mode']} | {r['gpus']} | {r['tokens']} | {r['ms']:.2f} | "
                f"{r['efficiency']:.3f} | {r['work_ratio']:.3f} | "
                f"{r['efficiency_vs_single_device_op']:.3f}{fmt_ms(r['single_device_op_ms'])} | "
                + (f"{r['efficiency_vs_extra_baseline']:.3f}{fmt_ms(r['extra_baseline_ms'])} | "
                   if extra else "")
                + f"{r['bytes_sent_per_rank'] / 2**20:.2f} | "
                f"{r['bytes_planned_per_rank'] / 2**20:.2f} | "
                f"{r['dense_ring_bytes_per_rank'] / 2**20:.2f} | {r['fraction_of_dense']:.4f} |")
        for r in res["results"]:
            if r.get("extra_baseline_error"):
                lines += ["", f"extra baseline failed: {r['extra_baseline_error']}"]
                break
        if res.get("skipped"):
            lines += ["", "skipped (over --budget-s): " + ", ".join(
                f"causal={x['causal']} {x['mode']} P={x['gpus']}" for x in res["skipped"])]
    return "\n".join(lines) + "\n"


def main(args):
    t_start = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(DEV, (world,))
    t = torch.ones(1, device=DEV)
    dist.all_reduce(t, group=mesh.get_group())  # every rank connected before the first P2P
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if DEV == "cuda" else "-"
    except Exception:
        nccl = "?"
    meta = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", world=world,
                torch=torch.__version__, nccl=nccl,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                tokens_per_gpu=args.tokens_per_gpu, batch=args.batch, heads=args.heads,
                kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, dtype=args.dtype,
                argv=sys.argv[1:], errors=[])
    state = dict(check=[], weak=None)

    def write():
        if rank != 0:
            return
        meta["elapsed_s"] = round(time.time() - t_start, 1)
        if DEV == "cuda":
            from hilbert_fx.lowering import gluon_forward
            meta["kernels"] = gluon_forward.kernel_choices()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ring_benchmark.md"), "w") as f:
            f.write(table_md(state["weak"], state["check"], meta))
        with open(os.path.join(args.out, "ring_benchmark.json"), "w") as f:
            json.dump(dict(meta=meta, check=state["check"], weak_scaling=state["weak"]), f,
                      indent=1)

    if not args.no_check:
        try:
            state["check"] = check(args, mesh, rank, world)
        except Exception as e:  # every rank runs the same code: they fail together
            meta["errors"].append(f"check: {type(e).__name__}: {e}"[:2000])
            print(f"rank {rank}: check failed: {traceback.format_exc()}", flush=True)
        dist.barrier()
        log(f"check done in {time.time() - t_start:.1f} s")
        if rank == 0 and state["check"]:
            worst = max(r["rel_ring_vs_1gpu"] for r in state["check"])
            bad = [r for r in state["check"] if not r["ok"]]
            print(f"worst relative error ring vs 1 GPU: {worst:.2e}; rows not ok: {len(bad)}",
                  flush=True)
            print(table_md(None, state["check"], meta), flush=True)
        write()

    def on_row(res):
        state["weak"] = res
        write()
    try:
        state["weak"] = weak_scaling(args, rank, world, t_start, on_row)
    except Exception as e:
        meta["errors"].append(f"weak scaling: {type(e).__name__}: {e}"[:2000])
        print(f"rank {rank}: weak scaling failed: {traceback.format_exc()}", flush=True)
    write()
    if rank == 0:
        print(table_md(state["weak"], state["check"], meta), flush=True)
        print(f"total {time.time() - t_start:.1f} s; results in {args.out}", flush=True)
    failed = meta["errors"] or any(not r["ok"] for r in state["check"])
    if failed:  # a check that failed fails the run, on every rank
        raise SystemExit(f"rank {rank}: ring check failed ({len(meta['errors'])} errors)")


def _init_and_run(local_rank, world, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    _entry(parse_args(argv))


def _entry(args):
    global DEV, PIPELINED
    PIPELINED = args.timing == "pipelined"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        DEV = "cpu"
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                                timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    try:
        main(args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(run, nproc: int, *args) -> None:
    """run(rank, nproc, port, *args) in nproc processes, port a free one for their rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(run, args=(nproc, port, *args), nprocs=nproc)


if __name__ == "__main__":
    args = parse_args()
    if args.nproc and "RANK" not in os.environ:
        spawn_ranks(_init_and_run, args.nproc, sys.argv[1:])
    else:
        _entry(args)
