"""Cached launches through the CUDA driver (lowering/driver_launch.py) against Triton's C
launcher (HILBERT_FX_DRIVER_LAUNCH=0) and Triton's own launch path (HILBERT_FX_FAST_LAUNCH=0):
do they compute the same, and what does each cost the host?

    PYTHONPATH=. python scripts/launch_ab.py

One GPU; bf16, B = 1, H = 16, D = 128, causal, branches (2048, 1) ... (16384, 8).
1. Agreement: the Triton lowering's forward and backward at N = 8K (Hilbert and identity order)
   and 4K, four calls on inputs at changing addresses, under each launch path: out and lse
   bitwise those of Triton's own path, gradients to rounding (the Hopper backward adds dq by
   atomics). Exits non-zero if any differs.
2. Host time in turns in one process (the host's state drifts between runs by more than the
   difference; the knobs are switched per call, each with its own programs):
   - the lowering's forward and backward called directly at N = 8K, each call after a
     synchronisation (medians of 50 calls, twice per path);
   - the op (hilbert_fx.dilated_attention, eager: autograd's engine runs the backward on its
     device thread), --rounds rounds of 30 calls back to back per path, forward without grad
     and forward+backward, beside SDPA's forward+backward and an autograd.Function that does
     nothing (what autograd's engine costs any op on this host).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hilbert_fx.lowering import dilated_attention, driver_launch, triton_lowering, tuning
from hilbert_fx.lowering.plans import branch_plans

H, D = 16, 128
SEGS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
_base = tuning.Tuning.from_environ()
PATHS = {"driver": dataclasses.replace(_base, driver_launch=True),
         "c-launcher": dataclasses.replace(_base, driver_launch=False),
         "triton": dataclasses.replace(_base, fast_launch=False)}
PLANS: dict = {}  # a program lives while its plans do


def lowering_call(n: int, hilbert: bool, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(1, H, n, D, generator=g).to("cuda", torch.bfloat16)
                     for _ in range(4))
    plans = PLANS.setdefault((n, hilbert), branch_plans(n, SEGS, RATES, hilbert, q.device))
    kw = dict(is_causal=True, attn_mask=None, scale=D ** -0.5)
    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    grads = triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
    torch.cuda.synchronize()
    return out, lse, grads


def agreement() -> bool:
    ok = True
    for n, hilbert in ((8192, True), (8192, False), (4096, True)):
        results = {}
        for name, knobs in PATHS.items():
            tuning._current = knobs
            results[name] = [lowering_call(n, hilbert, s) for s in (1, 2, 3, 2)]
        for name in ("driver", "c-launcher"):
            out_diff = grad_diff = 0.0
            for (o, l, gr), (o2, l2, gr2) in zip(results["triton"], results[name]):
                out_diff = max(out_diff, (o.float() - o2.float()).abs().max().item(),
                               (l - l2).abs().max().item())
                for a, b in zip(gr, gr2):
                    grad_diff = max(grad_diff, ((a.float() - b.float()).abs().max()
                                                / b.float().abs().max()).item())
            good = out_diff == 0.0 and grad_diff < 2e-2
            ok &= good
            print(f"N = {n}, hilbert {hilbert}: {name} against Triton's path: out, lse largest "
                  f"difference {out_diff:.3g}; gradients largest relative {grad_diff:.3g}  "
                  f"{'ok' if good else 'FAIL'}")
    return ok


def lowering_host_time(n: int = 8192, calls: int = 50) -> None:
    print(f"\nthe lowering called directly, N = {n}: host us, median of {calls} calls, each "
          "after a synchronisation")
    plans = PLANS.setdefault((n, True), branch_plans(n, SEGS, RATES, True, torch.device("cuda")))
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, dout = (torch.randn(1, H, n, D, generator=g).to("cuda", torch.bfloat16)
                     for _ in range(4))
    kw = dict(is_causal=True, attn_mask=None, scale=D ** -0.5)
    for name in ("c-launcher", "driver") * 2:
        tuning._current = PATHS[name]
        fwd, bwd = [], []
        for i in range(calls + 10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, lse = triton_lowering.forward(q, k, v, plans, **kw)
            t1 = time.perf_counter()
            triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
            t2 = time.perf_counter()
            if i >= 10:
                fwd.append((t1 - t0) * 1e6)
                bwd.append((t2 - t1) * 1e6)
        torch.cuda.synchronize()
        print(f"  {name:10}  forward {statistics.median(fwd):6.1f}  "
              f"backward {statistics.median(bwd):6.1f}")


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


def op_host_time(n: int, rounds: int, calls: int = 30) -> None:
    q, k, v = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def op():
        return dilated_attention(q, k, v, SEGS, RATES, hilbert=True, is_causal=True)

    fns = {"sdpa fwd+bwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
           .backward(grad),
           "autograd.Function doing nothing, fwd+bwd": lambda: _Nothing.apply(q, k, v)
           .backward(grad)}
    for name in ("driver", "c-launcher"):
        knobs = PATHS[name]

        def fwd(knobs=knobs):
            tuning._current = knobs
            with torch.no_grad():
                op()

        def both(knobs=knobs):
            tuning._current = knobs
            op().backward(grad)
        fns[f"op fwd, {name}"], fns[f"op fwd+bwd, {name}"] = fwd, both
    for fn in fns.values():  # programs built, kernels compiled
        fn()
        fn()
    times: dict = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.setdefault(name, []).append((time.perf_counter() - t0) * 1e6 / calls)
            torch.cuda.synchronize()
    print(f"\nthe op, N = {n}: host us per call, {rounds} rounds of {calls} calls back to back, "
          "in turns: median (min, max)")
    for name, ts in times.items():
        print(f"  {name:42} {statistics.median(ts):7.1f} ({min(ts):6.1f}, {max(ts):6.1f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__,
          "driver launches available:", driver_launch.available())
    ok = agreement()
    lowering_host_time()
    for n in args.seq_lens:
        op_host_time(n, args.rounds)
    tuning._current = None
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
