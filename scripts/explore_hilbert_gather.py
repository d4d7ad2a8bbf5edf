"""Time the Hilbert order's Hopper kernels against the identity order's, one process, one GPU.

    PYTHONPATH=. python scripts/explore_hilbert_gather.py [--n 65536]

Variants: the identity order; the Hilbert order with TMA runs (gluon_forward.plan_run) on and
off; the forward's ring depth at D = 128; cp.async producer configurations (warps, producer
registers, consumer registers) of the forward and the backward. Prints forward and forward+backward ms (median of 7 samples of 5 calls), bf16,
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
    bwd_default = dict(gluon_backward._GATHER_PRODUCER)
    fwd_default = dict(gluon_forward._GATHER_PRODUCER)
    tiles_default = dict(gluon_forward._TILES[128])
    # name, hilbert, run (None: the plan's), forward STAGES at D = 128, forward cp.async
    # (warps, producer regs, consumer regs), backward cp.async (the same)
    rows = [("identity", False, None, None, None, None), ("hilbert", True, None, None, None, None),
            ("hilbert, no runs", True, 0, None, None, None),
            ("identity, fwd 3 stages", False, None, 3, None, None),
            ("hilbert, fwd 3 stages", True, None, 3, None, None),
            ("hilbert, fwd cp.async 2,40,232", True, None, None, (2, 40, 232), None),
            ("hilbert, fwd cp.async 4,40,224", True, None, None, (4, 40, 224), None),
            ("hilbert, bwd cp.async 2,56,224", True, None, None, None, (2, 56, 224)),
            ("identity (again)", False, None, None, None, None),
            ("hilbert (again)", True, None, None, None, None)]
    for name, hilbert, run, stages, fwd_cp, bwd_cp in rows:
        for plan in plans:
            object.__setattr__(plan, "_run", runs[id(plan)] if run is None else run)
        gluon_forward._TILES[128] = dict(tiles_default, STAGES=stages or tiles_default["STAGES"])
        gluon_forward._GATHER_PRODUCER = fwd_default if fwd_cp is None else dict(
            fwd_default, PRODUCER_WARPS=fwd_cp[0], PRODUCER_REGS=fwd_cp[1], CONSUMER_REGS=fwd_cp[2])
        gluon_backward._GATHER_PRODUCER = bwd_default if bwd_cp is None else dict(
            bwd_default, PRODUCER_WARPS=bwd_cp[0], PRODUCER_REGS=bwd_cp[1], CONSUMER_REGS=bwd_cp[2])
        try:
            f = timed(fwd(hilbert))
            fb = timed(fwdbwd(hilbert))
            print(f"{name:36} fwd {f:6.3f} ms  fwdbwd {fb:6.3f} ms  bwd {fb - f:6.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:36} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    gluon_forward._TILES[128] = tiles_default
    gluon_forward._GATHER_PRODUCER = fwd_default
    gluon_backward._GATHER_PRODUCER = bwd_default

if __name__ == "__main__":
    main()
