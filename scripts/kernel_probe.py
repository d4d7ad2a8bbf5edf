"""The Triton lowering's forward and backward times, alone, at the configurations BENCHMARKS.md
compares kernel changes by: one line per configuration, medians of CUDA-event timings.

    python scripts/kernel_probe.py TAG [--configs NAME ...] [--calls 30] [--forward-only]

To compare two versions of the code, name the other one's lowering/ with --against DIR:PACKAGE
(`git archive REV lowering | tar -x -C DIR && mv DIR/lowering DIR/lowering_old`, then
`--against DIR:lowering_old`): both lowerings are then called directly (triton_lowering's forward
and backward) in one process, in turns of 10 calls, --rounds turns each, and the lines give the
medians of the turns and their ratio. The GPU's clocks move between processes and machines by
more than most changes (BENCHMARKS.md, "rounds"), and within a process they move for both alike.
Without --against, the backward is timed as autograd's gradient of one forward's output; either
way it includes the preprocessing and dq's conversion. Lines are appended to
$OUT/kernel_probe.txt as well. bf16, B = 1, H = 16; "id" is the identity order, else Hilbert.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from causal_order import median_ms  # noqa: E402  (scripts/, this script's folder)

from hilbert_fx.lowering import dilated_attention  # noqa: E402

BRANCHES = ((2048, 4096, 8192, 16384), (1, 2, 4, 8))
LLAMA_BRANCHES = ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16))  # train_step.py's
# name: (head dim, N, causal, Hilbert order, branches[, dropout_p[, mask: "bool" or "float"]])
CONFIGS = {
    "d128_16k": (128, 16384, False, True, BRANCHES),
    "d128_64k": (128, 65536, False, True, BRANCHES),
    "d128_16k_causal": (128, 16384, True, True, BRANCHES),
    "d128_64k_causal": (128, 65536, True, True, BRANCHES),
    "d64_64k": (64, 65536, False, True, BRANCHES),
    "d64_32k_causal_id": (64, 32768, True, False, LLAMA_BRANCHES),
    # dropout 0.1 (the masks-and-dropout rows of BENCHMARKS.md)
    "d128_16k_dropout": (128, 16384, False, True, BRANCHES, 0.1),
    "d64_32k_causal_id_dropout": (64, 32768, True, False, LLAMA_BRANCHES, 0.1),
    # a user's boolean mask, [1, 1, N, N] (hilbert_fx.bench's --mask bool)
    "d64_16k_bool": (64, 16384, False, True, BRANCHES, 0.0, "bool"),
    "d128_16k_bool": (128, 16384, False, True, BRANCHES, 0.0, "bool"),
}


def _config(name: str):
    """(d, n, causal, hilbert, (w, r), dropout_p, mask kind) of a configuration."""
    d, n, causal, hilbert, branches, *more = CONFIGS[name]
    dropout_p, mask = (list(more) + [0.0, "none"][len(more):])[:2]
    return d, n, causal, hilbert, branches, dropout_p, mask


def _mask(kind: str, n: int):
    from hilbert_fx.bench import user_mask
    return user_mask(kind, n, torch.bfloat16, "cuda")


def probe(name: str, calls: int, forward_only: bool) -> tuple[float, float]:
    d, n, causal, hilbert, (w, r), dropout_p, mask = _config(name)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    attn_mask = _mask(mask, n)

    def forward():
        return dilated_attention(q, k, v, w, r, hilbert=hilbert, is_causal=causal,
                                 attn_mask=attn_mask, dropout_p=dropout_p, lowering="triton")
    with torch.no_grad():
        fwd = median_ms(forward, calls)
    if forward_only:
        return fwd, float("nan")
    out = forward()
    grad = torch.randn_like(out)
    bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), calls)
    return fwd, bwd


def _lowering(package: str):
    """(triton_lowering, plans) of a lowering package: this tree's, or another copy's modules
    loaded without its package's __init__ (which would register the op a second time)."""
    import importlib
    import types
    if ":" in package:
        where, package = package.split(":")
        module = types.ModuleType(package)
        module.__path__ = [os.path.join(os.path.abspath(where), package)]
        sys.modules[package] = module
    return (importlib.import_module(package + ".triton_lowering"),
            importlib.import_module(package + ".plans"))


def against(name: str, other: str, rounds: int, forward_only: bool) -> list[str]:
    """Lines comparing this tree's lowering (new) with `other` (old), timed in turns."""
    d, n, causal, hilbert, (w, r), dropout_p, mask = _config(name)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = dict(is_causal=causal, attn_mask=_mask(mask, n), scale=d ** -0.5)
    if dropout_p:
        kw.update(dropout_p=dropout_p, seed=torch.tensor(1234, device="cuda"))
    calls = {}
    for tag, package in (("old", other), ("new", "hilbert_fx.lowering")):
        lw, plans = _lowering(package)
        branches = plans.branch_plans(n, w, r, hilbert, q.device)
        out, lse = lw.forward(q, k, v, branches, **kw)
        dout = torch.randn_like(out)
        calls[tag] = (
            lambda lw=lw, b=branches: lw.forward(q, k, v, b, **kw),
            lambda lw=lw, b=branches, out=out, lse=lse, dout=dout: lw.backward(
                dout, q, k, v, out, lse, b, **kw))
    lines = []
    for what in (0,) if forward_only else (0, 1):
        turns = {"old": [], "new": []}
        for _ in range(rounds):
            for tag in turns:
                turns[tag].append(median_ms(calls[tag][what], 10))
        old, new = (statistics.median(turns[t]) for t in ("old", "new"))
        lines.append(f"{name:18s} {('forward', 'backward')[what]:8s} old {old:.3f} ms  "
                     f"new {new:.3f} ms  new/old {new / old:.3f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag", help="names this code version in the lines printed")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--against", default=None, help="DIR:PACKAGE, another copy of lowering/")
    ap.add_argument("--rounds", type=int, default=10, help="turns of each, with --against")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    for name in args.configs:
        if args.against:
            lines = against(name, args.against, args.rounds, args.forward_only)
        else:
            fwd, bwd = probe(name, args.calls, args.forward_only)
            lines = [f"{args.tag:10s} {name:18s} forward {fwd:.3f} ms  backward {bwd:.3f} ms"]
        for line in lines:
            print(line, flush=True)
            with open(os.path.join(out_dir, "kernel_probe.txt"), "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
