"""Does the Triton lowering's forward time follow the inputs' allocation, or the clock?

    PYTHONPATH=. python scripts/forward_spread.py [--hilbert 1] [--rounds 3] [--allocations 4]

At N = 64K (bf16, B=1, H=16, D=128, the issue's branches) the bench's forward moved by 5 to 8%
between runs while the floor's moved by 2% (BENCHMARKS.md, eighth session). This allocates
`--allocations` sets of q, k, v (each its own memory) and times the forward of each, and the
floor on each, round after round (hilbert_fx.bench's timing). If a time follows its allocation
across rounds, the addresses matter (DRAM channels under strided rows); if it drifts with the
round, the clock does. Last, the host's time to enqueue one call, and the time per call back to
back (the GPU never waiting for the host).
"""
import argparse
import time

import torch

from hilbert_fx.bench import _floor_fn, _time
from lowering import dilated_attention

W, R = [2048, 4096, 8192, 16384], [1, 2, 4, 8]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--hilbert", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--allocations", type=int, default=4)
    args = p.parse_args()
    hilbert = bool(args.hilbert)
    inputs = [tuple(torch.randn(1, 16, args.n, 128, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3)) for _ in range(args.allocations)]
    floors = [_floor_fn(q, k, v, W, R, hilbert, False) for q, k, v in inputs]
    print(f"hilbert={hilbert}; ms per call; columns: allocation (q's address mod 2 MiB in KiB)")
    print("round  " + "  ".join(f"{(q.data_ptr() % 2**21) // 1024:>13}" for q, _, _ in inputs))
    for rnd in range(args.rounds):
        ours = [_time(lambda q=q, k=k, v=v: dilated_attention(q, k, v, W, R, hilbert=hilbert,
                                                              lowering="triton"), False, [])
                for q, k, v in inputs]
        floor = [_time(fn, False, []) for fn, _ in floors]
        print(f"{rnd:5}  " + "  ".join(f"{a:5.3f}/{b:5.3f}={b / a:4.2f}"
                                       for a, b in zip(ours, floor)), flush=True)
    # the host's time to enqueue one call (no synchronisation inside): when it exceeds what the
    # GPU still has queued, do_bench's events count the GPU waiting for the host
    q, k, v = inputs[0]
    for name, fn in (("triton", lambda: dilated_attention(q, k, v, W, R, hilbert=hilbert,
                                                         lowering="triton")),
                     ("floor", floors[0][0])):
        with torch.no_grad():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        print(f"{name}: host enqueue {1e3 * (t1 - t0) / 20:.3f} ms a call, "
              f"GPU {1e3 * (t2 - t0) / 20:.3f} ms a call back to back", flush=True)


if __name__ == "__main__":
    main()
