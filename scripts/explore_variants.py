"""Time variants of lowering/triton_kernels.py against each other, in one process, at N = 64K.

    PYTHONPATH=. python scripts/explore_variants.py --variants DIR --out $OUT

(scripts/variants/ is ignored by git: a place for such copies, carried to the GPU machine by hand.)

Each *.py file in DIR is a whole copy of lowering/triton_kernels.py with one change; the
lowering runs it in place of its own kernels (triton_lowering._kernels_module). Workloads: the
issue-4 configuration (bf16, H=16, D=128 or --head-dim, branches (2048,1) ... (16384,8)) in the Hilbert and
the identity order, and the one-branch pattern (2048, 1), each forward and forward+backward
(--work picks some); each variant twice,
alternated, so that the spread between rounds shows the noise. A variant may be valid only for
these shapes (every set a whole number of tiles): it is a measurement, not a candidate.
First, every variant's output and gradients are compared with the kernels in lowering/, and
the floor (cuDNN on the gathered sets) is timed for each workload.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hilbert_fx.bench import _floor_fn, _time  # noqa: E402
from lowering import dilated_attention, triton_lowering  # noqa: E402

SEGS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]


def load(path: str):
    name = "variant_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--env", nargs="*", default=[""],
                   help="tile settings to cross with the variants, e.g. HILBERT_FX_TRITON_DKDV=64,128,8,3")
    p.add_argument("--work", nargs="*", default=None, help="workload names (default: all)")
    args = p.parse_args()
    n = args.n
    variants = {os.path.basename(f): load(f) for f in sorted(glob.glob(os.path.join(args.variants, "*.py")))}
    q, k, v = [torch.randn(1, 16, n, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    work = {"4 branches fwd": (SEGS, RATES, True, False),
            "4 branches fwd+bwd": (SEGS, RATES, True, True),
            "identity fwd": (SEGS, RATES, False, False),
            "identity fwd+bwd": (SEGS, RATES, False, True),
            "(2048,1) fwd": ([2048], [1], False, False),
            "(2048,1) fwd+bwd": ([2048], [1], False, True)}
    work = {key: work[key] for key in args.work} if args.work else work
    lines = [f"{torch.cuda.get_device_name()}, N={n}, bf16, H=16, D={args.head_dim}; median ms"]
    # every variant against the kernels in lowering/: outputs and gradients, both orders
    gen = torch.Generator(device="cuda").manual_seed(0)
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
    own = triton_lowering._kernels()  # lowering/triton_kernels.py, before any variant is set
    for hilbert in (False, True):
        results = {}
        for name, mod in [("lowering", own)] + list(variants.items()):
            triton_lowering._kernels_module = mod
            triton_lowering._working_configs.clear()
            out = dilated_attention(q, k, v, SEGS, RATES, hilbert=hilbert, lowering="triton")
            grads = torch.autograd.grad(out, (q, k, v), do)
            results[name] = [out.float()] + [g.float() for g in grads]
        ref = results.pop("lowering")
        for name, res in results.items():
            diff = ", ".join(f"{t} {(a - b).abs().max().item():.2e}" for t, a, b in zip("o q k v".split(), res, ref))
            line = f"hilbert={hilbert} {name}: max |variant - lowering/|: {diff}"
            print(line, flush=True)
            lines.append(line)
    for label, (segs, rates, hilbert, backward) in work.items():  # cuDNN on gathered sets
        fn, blocks = _floor_fn(q, k, v, segs, rates, hilbert, False)
        line = f"floor {label}: {_time(fn, backward, [t for blk in blocks for t in blk]):7.3f}"
        print(line, flush=True)
        lines.append(line)
        del fn, blocks
    for rnd in range(args.rounds):
        for env in args.env:
            for name, mod in variants.items():
                key, _, value = env.partition("=")
                if key:
                    os.environ[key] = value
                triton_lowering._kernels_module = mod
                triton_lowering._working_configs.clear()
                cells = []
                for label, (segs, rates, hilbert, backward) in work.items():
                    try:
                        ms = _time(lambda: dilated_attention(q, k, v, segs, rates, hilbert=hilbert,
                                                             lowering="triton"), backward, [q, k, v])
                    except Exception as e:  # reported, not fatal
                        print(f"  {name} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        ms = float("nan")
                    cells.append(f"{label} {ms:7.3f}")
                if key:
                    os.environ.pop(key)
                line = f"#{rnd} {name:16s} {env:32s} " + "  ".join(cells)
                print(line, flush=True)
                lines.append(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "variants.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
