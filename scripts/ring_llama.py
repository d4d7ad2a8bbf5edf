"""A transformers Llama's training step with the sequence sharded over P GPUs
(`hilbert_fx.backend(mesh=...)`, the ring op) against the one-GPU step on one shard's length.

    python scripts/ring_llama.py --nproc 4 --tokens-per-gpu 65536 --out $OUT

Weak scaling: every rank holds tokens-per-gpu tokens of one sequence of P times that length
(its slice of input_ids); the branches
are scripts/ring_benchmark.py's (up to one segment spanning every GPU). The one-GPU step runs
first, on rank 0's GPU, with the same model and the branches of its length. Prints and writes
(OUT/ring_llama.json) the step time (median of --steps timed steps after --warmup) and the peak
memory per GPU. bf16 weights, random init (no download), loss on each rank's own tokens.

No position_ids are passed: transformers then builds a "same run of position ids" mask under
torch.compile, a sequence structure the ring op does not take (the pass leaves such a site as
it is, and says so), so each rank's rotary positions start at 0. That changes no cost.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tokens-per-gpu", type=int, default=65536)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing on every decoder layer")
    p.add_argument("--cpu", action="store_true", help="smoke test: gloo, float32, tiny sizes")
    return p.parse_args(argv)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step_times(model, step_model, ids, positions, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        _sync(ids.device.type)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        _sync(ids.device.type)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    return times


def _measure(args, segs, rates, ids, positions, mesh) -> dict:
    import hilbert_fx
    from hilbert_fx.host_bench import llama
    model = llama(vocab=args.vocab, width=args.width, layers=args.layers, heads=args.heads,
                  seq_len=int(positions.max()) + 1, dense=False, device=ids.device,
                  dtype=torch.float32 if args.cpu else torch.bfloat16)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    be = hilbert_fx.backend(segs, rates, hilbert=True, mesh=mesh)
    step_model = torch.compile(model, backend=be)
    from hilbert_fx.lowering.ring import comm_stats
    if not args.cpu:
        torch.cuda.reset_peak_memory_stats()
    calls = comm_stats()["forward_calls"]
    times = _step_times(model, step_model, ids, positions, args.warmup, args.steps)
    ring_calls = (comm_stats()["forward_calls"] - calls) / (args.warmup + args.steps)
    expected = args.layers * (2 if args.checkpointing else 1)  # every layer on the ring
    if mesh is not None and ring_calls != expected:
        raise SystemExit(f"{ring_calls} ring calls per step, expected {expected}")
    return {"ms": statistics.median(times), "times_ms": times, "ring_calls": ring_calls,
            "peak_gib": 0.0 if args.cpu else torch.cuda.max_memory_allocated() / 2**30}


def run(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=900))
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank),
                                timeout=datetime.timedelta(seconds=900))
    from ring_benchmark import default_branches
    from torch.distributed.device_mesh import init_device_mesh
    n = args.tokens_per_gpu
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, n * world), device=device, generator=g)
    result = {}
    if rank == 0:
        segs, rates = default_branches(n, 1)
        one = _measure(args, segs, rates, ids[:, :n], torch.arange(n, device=device)[None],
                       None)
        result["one_gpu"] = dict(one, tokens=n, branches=list(zip(segs, rates)))
        torch._dynamo.reset()
        if not args.cpu:
            torch.cuda.empty_cache()
    dist.barrier()
    mesh = init_device_mesh(device, (world,))
    segs, rates = default_branches(n, world)
    lo = rank * n
    ring = _measure(args, segs, rates, ids[:, lo:lo + n],
                    torch.arange(lo, lo + n, device=device)[None], mesh)
    gathered = [None] * world
    dist.all_gather_object(gathered, ring)
    if rank == 0:
        result["ring"] = {"gpus": world, "tokens": n * world, "branches": list(zip(segs, rates)),
                          "ms_per_rank": [r["ms"] for r in gathered],
                          "peak_gib_per_rank": [r["peak_gib"] for r in gathered],
                          "times_ms_rank0": gathered[0]["times_ms"]}
        one, ring_ms = result["one_gpu"], max(r["ms"] for r in gathered)
        lines = [
            f"# Llama training step, {args.layers} layers, width {args.width}, {args.heads} heads, "
            f"{'float32, CPU' if args.cpu else 'bf16, ' + torch.cuda.get_device_name()} x {world}"
            f"{', activation checkpointing' if args.checkpointing else ''}",
            "",
            "| | tokens | GPUs | step ms | peak GiB per GPU | efficiency |",
            "|---|---|---|---|---|---|",
            f"| one GPU | {n} | 1 | {one['ms']:.1f} | {one['peak_gib']:.1f} | 1.000 |",
            f"| ring | {n * world} | {world} | {ring_ms:.1f} | "
            f"{max(r['peak_gib'] for r in gathered):.1f} | {one['ms'] / ring_ms:.3f} |",
        ]
        text = "\n".join(lines)
        print(text, flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ring_llama.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "ring_llama.md"), "w") as f:
            f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse_args()
    from ring_benchmark import spawn_ranks
    spawn_ranks(run, a.nproc, a)
