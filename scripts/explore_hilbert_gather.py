"""Time the Hilbert order's Hopper kernels against the identity order's, one process, one GPU.

    PYTHONPATH=. python scripts/explore_hilbert_gather.py [--n 65536]

Variants: the identity order; the Hilbert order with TMA runs (gluon_forward.plan_run) on and
off; cp.async producer configurations (warps, producer registers, consumer registers) of the
backward. Prints forward and forward+backward ms (median of 7 samples of 5 calls), bf16,
B=1, H=16, D=128, branches (2048,1), (4096,2), (8192,4), (16384,8).
"""
import argparse
import statistics

import torch

import lowering
from lowering import gluon_backward, gluon_forward
from lowering.plans import branch_plans

W, R = [2048, 4096, 8192, 16384], [1, 2, 4, 8]


def timed(fn, reps=5, samples=7):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=65536)
    args = p.parse_args()
    n = args.n
    q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)

    def fwd(hilbert):
        return lambda: lowering.dilated_attention(q, k, v, W, R, hilbert=hilbert, lowering="triton")

    def fwdbwd(hilbert):
        def run():
            out = lowering.dilated_attention(q, k, v, W, R, hilbert=hilbert, lowering="triton")
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    plans = branch_plans(n, W, R, True, q.device)
    runs = {id(p): gluon_forward.plan_run(p) for p in plans}
    print("runs per branch:", [runs[id(p)] for p in plans], flush=True)
    default = dict(gluon_backward._GATHER_PRODUCER)
    rows = [("identity", False, None, default), ("hilbert, runs", True, None, default),
            ("hilbert, no runs", True, 0, default)]
    for warps, preg, creg in ((2, 40, 232), (1, 40, 240), (1, 56, 232)):
        cfg = dict(default, PRODUCER_WARPS=warps, PRODUCER_REGS=preg, CONSUMER_REGS=creg)
        rows.append((f"hilbert, runs, bwd cp.async {warps},{preg},{creg}", True, None, cfg))
    for name, hilbert, run, cfg in rows:
        for plan in plans:
            object.__setattr__(plan, "_run", runs[id(plan)] if run is None else run)
        gluon_backward._GATHER_PRODUCER = cfg
        try:
            f = timed(fwd(hilbert))
            fb = timed(fwdbwd(hilbert))
            print(f"{name:45} fwd {f:6.3f} ms  fwdbwd {fb:6.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:45} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    gluon_backward._GATHER_PRODUCER = default


if __name__ == "__main__":
    main()
