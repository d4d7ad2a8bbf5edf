"""A/B of the Hopper forward's ring depth at D = 128, alternating, calls back to back.

    PYTHONPATH=. python scripts/ab_forward.py [--alternations 8]

Single timings of the forward move by 5 to 8% on an H200 (BENCHMARKS.md, eighth session), more
than most changes worth testing. This alternates the two configurations many times in one
process and times each by 20 calls back to back (no cache flush between calls, the GPU never
waiting for the host), then compares the medians per order (Hilbert and identity).
"""
import argparse
import statistics
import time

import torch

from lowering import dilated_attention, gluon_forward

W, R = [2048, 4096, 8192, 16384], [1, 2, 4, 8]


def back_to_back(fn, calls=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--alternations", type=int, default=8)
    p.add_argument("--n", type=int, default=65536)
    args = p.parse_args()
    q, k, v = (torch.randn(1, 16, args.n, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    base = dict(gluon_forward._TILES[128])
    configs = {"2 stages": dict(base, STAGES=2), "3 stages": dict(base, STAGES=3)}
    with torch.no_grad():
        for hilbert in (True, False):
            times = {name: [] for name in configs}
            for _ in range(args.alternations):
                for name, cfg in configs.items():
                    gluon_forward._TILES[128] = cfg
                    times[name].append(back_to_back(
                        lambda: dilated_attention(q, k, v, W, R, hilbert=hilbert, lowering="triton")))
            for name, ts in times.items():
                print(f"hilbert={hilbert} {name}: median {statistics.median(ts):.3f} ms "
                      f"(min {min(ts):.3f}, max {max(ts):.3f})", flush=True)
    gluon_forward._TILES[128] = base


if __name__ == "__main__":
    main()
