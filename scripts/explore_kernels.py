"""Forward/backward variants of the Triton lowering at N = 64K against the floor, in one process.

    PYTHONPATH=. python scripts/explore_kernels.py --out $OUT

The issue-4 configuration (bf16, B=1, H=16, branches (2048,1) ... (16384,8)), D=128 and D=64.
Each variant is an environment setting read by lowering/triton_lowering.py at call time
(tile configs HILBERT_FX_TRITON_{FWD,DKDV,DQ});
times are medians of triton.testing.do_bench, the floor measured in the same process.
Group "ceiling" times the one-branch pattern (2048, 1), plain block-diagonal attention, against
the floor and FlexAttention (Triton kernels too) on the same blocks.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hilbert_fx.bench import _floor_fn, _time  # noqa: E402
from lowering import dilated_attention  # noqa: E402

SEGS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
KNOBS = ("HILBERT_FX_TRITON_FWD", "HILBERT_FX_TRITON_DKDV", "HILBERT_FX_TRITON_DQ")


def _inputs(d: int, n: int, backward: bool):
    return [torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            for _ in range(3)]


def timing(d: int, hilbert: bool, backward: bool, env: dict, n: int, segs=SEGS, rates=RATES) -> float:
    for key in KNOBS:
        os.environ.pop(key, None)
    os.environ.update(env)
    q, k, v = _inputs(d, n, backward)
    try:
        return _time(lambda: dilated_attention(q, k, v, segs, rates, hilbert=hilbert,
                                               lowering="triton"), backward, [q, k, v])
    except Exception as e:  # a config that does not compile or fit: reported, not fatal
        print(f"    failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")
    finally:
        for key in env:
            os.environ.pop(key, None)


def floor(d: int, hilbert: bool, backward: bool, n: int, segs=SEGS, rates=RATES) -> float:
    q, k, v = _inputs(d, n, backward)
    fn, blocks = _floor_fn(q, k, v, segs, rates, hilbert, False)
    return _time(fn, backward, [t for blk in blocks for t in blk])


def flex_block_diagonal(d: int, backward: bool, n: int, w: int) -> float:
    """FlexAttention (Triton kernels) on the one-branch pattern (w, 1): block-diagonal, every
    128-block full, no score_mod: what a tuned Triton FlashAttention reaches on these blocks."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    q, k, v = _inputs(d, n, backward)
    mask = create_block_mask(lambda b, h, qi, ki: (qi // w) == (ki // w), None, None, n, n,
                             device="cuda")
    compiled = torch.compile(flex_attention)
    return _time(lambda: compiled(q, k, v, block_mask=mask), backward, [q, k, v])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--groups", nargs="+", default=["fwd", "hilbert", "d64", "bwd"],
                   help="fwd hilbert d64 bwd bwd2 ceiling")
    args = p.parse_args()
    n = args.n
    lines = [f"{torch.cuda.get_device_name()}, N={n}, bf16, H=16, branches "
             f"{list(zip(SEGS, RATES))}; ms (floor/variant)"]

    def row(label, d, hilbert, backward, env, base):
        from lowering import triton_lowering
        triton_lowering._working_configs.clear()
        ms = timing(d, hilbert, backward, env, n)
        shrunk = [f"{key[0]} {key[1]} ran as {cfg}"
                  for key, cfg in triton_lowering._working_configs.items() if key[1] != cfg]
        line = f"{label:58s} {ms:8.3f} ms  floor/this {base / ms:5.3f}  {'; '.join(shrunk)}"
        print(line, flush=True)
        lines.append(line)

    fl = {}
    for d in (128, 64):
        for backward in (False, True):
            fl[d, backward] = floor(d, True, backward, n)
            line = f"floor D={d} {'fwd+bwd' if backward else 'fwd'}: {fl[d, backward]:.3f} ms"
            print(line, flush=True)
            lines.append(line)
    if "ceiling" in args.groups:  # one branch (2048, 1): plain block-diagonal attention
        for d in (128, 64):
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                base = floor(d, False, backward, n, [2048], [1])
                ours = timing(d, False, backward, {}, n, [2048], [1])
                flex = flex_block_diagonal(d, backward, n, 2048)
                line = (f"one branch (2048,1) D={d} {mode}: floor {base:.3f} ms, triton {ours:.3f} "
                        f"({base / ours:.3f}), flex {flex:.3f} ({base / flex:.3f})")
                if backward:
                    tiles = timing(d, False, backward, {"HILBERT_FX_TRITON_DKDV": "64,128,8,3",
                                                        "HILBERT_FX_TRITON_DQ": "128,64,8,3"},
                                   n, [2048], [1])
                    line += f", triton with flex's tiles {tiles:.3f} ({base / tiles:.3f})"
                print(line, flush=True)
                lines.append(line)
    if "bwd2" in args.groups:  # FlexAttention's sm90 backward tiles: dK/dV (64, 128), dQ (128, 64)
        for rep in range(2):
            for kv, qc in (("", ""), ("64,128,8,3", ""), ("", "128,64,8,3"),
                           ("64,128,8,3", "128,64,8,3"), ("64,128,8,2", "128,64,8,3"),
                           ("64,64,8,3", "128,64,8,3"), ("64,128,4,3", "128,64,4,3")):
                env = {}
                if kv:
                    env["HILBERT_FX_TRITON_DKDV"] = kv
                if qc:
                    env["HILBERT_FX_TRITON_DQ"] = qc
                row(f"D=128 hilbert fwd+bwd dkdv {kv or '-'} dq {qc or '-'} #{rep}", 128, True,
                    True, env, fl[128, True])
    if "fwd" in args.groups:
        for cfg in ("", "128,128,8,3", "128,128,8,2", "128,64,8,2", "128,64,8,4", "64,128,4,3",
                    "64,128,4,2", "128,128,4,2", "64,64,4,4"):
            row(f"D=128 hilbert fwd tiles {cfg or 'default'}", 128, True, False,
                {"HILBERT_FX_TRITON_FWD": cfg} if cfg else {}, fl[128, False])
    if "hilbert" in args.groups:
        for backward in (False, True):
            for hilbert in (True, False):
                row(f"D=128 hilbert={hilbert} {'fwd+bwd' if backward else 'fwd'}", 128, hilbert,
                    backward, {}, fl[128, backward])
    if "d64" in args.groups:
        for cfg in ("", "128,128,8,3", "256,64,8,2", "256,64,8,3", "128,64,8,3", "64,64,4,3",
                    "", "128,128,8,3", "256,64,8,2", "256,64,8,3"):
            row(f"D=64 hilbert fwd tiles {cfg or 'default'}", 64, True, False,
                {"HILBERT_FX_TRITON_FWD": cfg} if cfg else {}, fl[64, False])
    if "bwd" in args.groups:
        row("D=128 hilbert fwd+bwd default", 128, True, True, {}, fl[128, True])
        for cfg in ("32,128,4,3", "32,128,8,2", "64,128,4,2", "32,64,4,4", "64,64,4,2"):
            row(f"D=128 hilbert fwd+bwd dkdv {cfg}", 128, True, True,
                {"HILBERT_FX_TRITON_DKDV": cfg}, fl[128, True])
        for cfg in ("128,64,4,2", "64,64,4,2", "128,32,8,3", "64,32,4,4"):
            row(f"D=128 hilbert fwd+bwd dq {cfg}", 128, True, True,
                {"HILBERT_FX_TRITON_DQ": cfg}, fl[128, True])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "explore.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
