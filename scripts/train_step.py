"""The training step of a transformers Llama under torch.compile: the dilated backend against
dense (backend="inductor", SDPA is_causal), with torch.compile's modes, and with activation
checkpointing on and off. GPU; prints a table and writes JSON to --out.

    python scripts/train_step.py --seq-len 8192 --modes default reduce-overhead --check-capture
    python scripts/train_step.py --seq-len 32768 --backends hilbert_dilated --checkpointing off on

--check-capture: for each backend, the loss and gradients of one step of the model compiled
with mode="reduce-overhead" (a CUDA graph, replayed) against the same step compiled without it,
from the same weights and inputs, beside the difference between two runs of the plain step (the
backward adds some gradients by atomics, so two runs of one step differ by that much).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import hilbert_fx  # noqa: E402
from hilbert_fx.host_bench import llama  # noqa: E402


def build_model(args, backend: str):
    return llama(vocab=args.vocab, width=args.width, layers=args.layers, heads=args.heads,
                 seq_len=args.seq_len, dense=backend == "inductor", device="cuda",
                 dtype=torch.bfloat16)


def compiled(model, backend: str, mode: str):
    be = hilbert_fx.backend() if backend == "hilbert_dilated" else "inductor"
    return torch.compile(model, backend=be, mode=None if mode == "default" else mode)


def loss_and_grads(step_model, model, ids):
    model.zero_grad(set_to_none=True)
    torch.compiler.cudagraph_mark_step_begin()
    loss = step_model(input_ids=ids, labels=ids).loss
    loss.backward()
    # copies: a CUDA graph's outputs are overwritten by its next replay
    return loss.detach().float().clone(), [p.grad.float().clone() for p in model.parameters()]


def max_rel_diff(a, b, names):
    """(largest relative difference of the loss or of one parameter's gradient, its name)."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    worst = ((loss_a - loss_b).abs().item() / loss_b.abs().item(), "loss")
    for name, x, y in zip(names, grads_a, grads_b):
        worst = max(worst, (((x - y).norm() / y.norm().clamp_min(1e-30)).item(), name))
    return worst


def time_steps(step_model, model, ids, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier outputs may be reused
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3, torch.cuda.max_memory_allocated() / 2**30


def run(args):
    ids = torch.randint(1, args.vocab, (1, args.seq_len), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    rows = []
    for backend in args.backends:
        base = build_model(args, backend)
        for ckpt in args.checkpointing:
            model = copy.deepcopy(base)
            if ckpt == "on":
                model.gradient_checkpointing_enable()
            model.train()
            if backend == "hilbert_dilated":
                report = hilbert_fx.explain(model, input_ids=ids[:, :args.explain_len],
                                            labels=ids[:, :args.explain_len],
                                            backend=hilbert_fx.backend())
                print(f"explain ({backend}, checkpointing {ckpt}, N={args.explain_len}):\n{report}",
                      flush=True)
            torch._dynamo.reset()
            steps = {mode: compiled(model, backend, mode) for mode in args.modes}
            if args.check_capture:  # before any optimizer step: both from the same weights
                rows.append(check_capture(model, backend, steps["default"],
                                          steps["reduce-overhead"], ids))
            for mode, step_model in steps.items():
                torch.cuda.empty_cache()
                start = time.perf_counter()
                ms, peak = time_steps(step_model, model, ids, args.steps)
                row = dict(backend=backend, checkpointing=ckpt, mode=mode, N=args.seq_len,
                           step_ms=round(ms, 2), peak_gib=round(peak, 2),
                           wall_s=round(time.perf_counter() - start, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.profile:
                    profile_step(step_model, model, ids)
            del model, steps
        del base
    return rows


def profile_step(step_model, model, ids, rows: int = 25):
    """One more step under torch.profiler: where its GPU and host time go."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows), flush=True)


def check_capture(model, backend, plain, graphed, ids):
    """One step of the CUDA-graph model against the plain compiled one, same weights, same ids."""
    names = [n for n, _ in model.named_parameters()]
    first = loss_and_grads(plain, model, ids)
    second = loss_and_grads(plain, model, ids)
    for _ in range(3):  # warm-up, record, then a replay
        captured = loss_and_grads(graphed, model, ids)
    replayed = loss_and_grads(graphed, model, ids)
    row = dict(backend=backend, check="reduce-overhead against default",
               deterministic=torch.are_deterministic_algorithms_enabled(),
               loss_plain=first[0].item(), loss_captured=captured[0].item(),
               captured_vs_plain=max_rel_diff(captured, first, names),
               plain_vs_plain=max_rel_diff(second, first, names),
               replay_vs_replay=max_rel_diff(replayed, captured, names))
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--backends", nargs="+", default=["hilbert_dilated", "inductor"])
    p.add_argument("--modes", nargs="+", default=["default"])
    p.add_argument("--checkpointing", nargs="+", default=["off"], choices=["off", "on"])
    p.add_argument("--check-capture", action="store_true")
    p.add_argument("--profile", action="store_true", help="profile one step of each")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): no gradient added by atomics, "
                        "so two runs of one step agree bit for bit")
    p.add_argument("--explain-len", type=int, default=4096,
                   help="length of the explain run (the pass alone, without Inductor)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.check_capture and not {"default", "reduce-overhead"} <= set(args.modes):
        p.error("--check-capture needs --modes default reduce-overhead")
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"train_step_{args.seq_len}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
