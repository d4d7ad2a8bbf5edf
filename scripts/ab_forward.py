"""A/B of the Hopper forward's schedule options, alternating, calls back to back, beside the floor.

    PYTHONPATH=. python scripts/ab_forward.py [--alternations 10] [--variants base pingpong ...]

Single timings of the forward move by 5 to 8% on an H200 (BENCHMARKS.md, eighth session), more
than most changes worth testing. This alternates the configurations (and the floor: cuDNN on the
sets gathered beforehand) many times in one process and times each by 20 calls back to back (no
cache flush between calls, the GPU never waiting for the host), then compares medians per order
(Hilbert and identity), with the floor's median over each.

Variants set gluon_forward's producer configurations (lowering/gluon_kernels.py's options, warps
and registers), on both producers or on the one a key names.
"""
import argparse
import statistics
import time

import torch

from hilbert_fx.bench import _floor_fn
from lowering import dilated_attention, gluon_forward

W, R = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
VARIANTS = {  # "base": gluon_forward's configurations as they are
    "base": {},
    "stages3": dict(STAGES=3),
    "gather 2 warps 56/224": dict(
        _GATHER_PRODUCER=dict(PRODUCER_WARPS=2, PRODUCER_REGS=56, CONSUMER_REGS=224)),
    "gather 4 warps 56/224": dict(
        _GATHER_PRODUCER=dict(PRODUCER_WARPS=4, PRODUCER_REGS=56, CONSUMER_REGS=224)),
    "tma producer 56 regs": dict(_TMA_PRODUCER=dict(PRODUCER_REGS=56)),
}


def configure(saved, over):
    """gluon_forward's producer configurations: saved ones with `over` applied (to both, or to
    the one a key names)."""
    for name, cfg in saved.items():
        mine = {k: v for k, v in over.items() if not k.startswith("_")}
        setattr(gluon_forward, name, dict(cfg, **mine, **over.get(name, {})))


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
    p.add_argument("--alternations", type=int, default=10)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = p.parse_args()
    d = args.head_dim
    q, k, v = (torch.randn(1, 16, args.n, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    saved = {name: dict(getattr(gluon_forward, name)) for name in ("_TMA_PRODUCER", "_GATHER_PRODUCER")}
    tiles = dict(gluon_forward._TILES[d])

    def apply(over):
        over = dict(over)
        gluon_forward._TILES[d] = dict(tiles, STAGES=over.pop("STAGES", tiles["STAGES"]))
        configure(saved, over)

    with torch.no_grad():
        for hilbert in (True, False):
            floor, _ = _floor_fn(q, k, v, W, R, hilbert, False)
            times = {name: [] for name in ["floor", *args.variants]}
            for _ in range(args.alternations):
                times["floor"].append(back_to_back(floor))
                for name in args.variants:
                    apply(VARIANTS[name])
                    times[name].append(back_to_back(
                        lambda: dilated_attention(q, k, v, W, R, hilbert=hilbert, lowering="triton")))
            base = statistics.median(times["floor"])
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"D={d} hilbert={hilbert} {name:28}: median {med:.3f} ms (min {min(ts):.3f}, "
                      f"max {max(ts):.3f}), floor/this {base / med:.3f}", flush=True)
    apply({})


if __name__ == "__main__":
    main()
