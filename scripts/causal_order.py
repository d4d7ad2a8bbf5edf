"""The kernels' order under causal masks: the longest tiles of a chunk of sets first
(lowering/gluon_kernels.py's `_work`, lowering/triton_kernels.py's `_scheduled`) against grid
order, checked and timed in one process on one GPU.

    PYTHONPATH=.:tests python scripts/causal_order.py [--triton-only]

Checks first, against tests/reference.py (float64), out and gradients, in both orders: shapes
whose number of sets makes chunks of 16, 4 and 1, the Hilbert and the identity order, D = 64
and 128; a case fails over 2e-2 (bf16) and the run exits non-zero. Then, per configuration
(bf16, H = 16, branches (2048,1) ... (16384,8), Hilbert on, causal: D = 64 at 32K, the
transformers Llama's layer, and D = 128 at 16K and 64K), the lowering's forward and backward
(CUDA events, medians of 20 calls) with chunks of up to 16 sets (CHUNK_SETS, the default) and
of 1 (grid order), beside the floor (cuDNN on pre-gathered blocks, hilbert_fx.bench).
--triton-only: the same with HILBERT_FX_GLUON=0 (the Triton kernels).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

from reference import reference_dilated_attention  # noqa: E402

from hilbert_fx import bench  # noqa: E402
from hilbert_fx.lowering import dilated_attention, gluon_forward, tuning  # noqa: E402
from hilbert_fx.lowering import op as op_module  # noqa: E402
from hilbert_fx.lowering import triton_lowering  # noqa: E402

SEGS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
CHUNKS = (gluon_forward.CHUNK_SETS, 1)  # the default order, then grid order
# (B, H, N, D, segment lengths, dilation rates, hilbert): 32, 9 and 12 sets in a launch
CHECKS = [(1, 4, 4096, 64, [512, 1024, 2048], [1, 2, 4], True),
          (1, 3, 1536, 128, [512, 1536], [1, 2], False),
          (2, 3, 2048, 64, [1024, 2048], [1, 2], True),
          (1, 4, 4096, 128, [512, 1024, 2048], [1, 2, 4], True)]


def in_order(chunk: int) -> None:
    gluon_forward.CHUNK_SETS = chunk
    triton_lowering._programs.clear()  # the chunk is a kernel constant fixed when a program is built


def median_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(b, h, n, d, w, r, hilbert) -> list[float]:
    torch.manual_seed(n + d + h)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = dilated_attention(q, k, v, w, r, hilbert=hilbert, is_causal=True, lowering="triton")
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_dilated_attention(qr, kr, vr, w, r, hilbert=hilbert, is_causal=True)
    ref.backward(dout.double().cpu())
    return [((x.double().cpu() - y).norm() / y.norm()).item()
            for x, y in ((out.detach(), ref.detach()), (q.grad, qr.grad), (k.grad, kr.grad),
                         (v.grad, vr.grad))]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton-only", action="store_true")
    args = p.parse_args()
    if args.triton_only:
        os.environ["HILBERT_FX_GLUON"] = "0"
        tuning._current = None  # the knobs are read once: read them again
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{'Triton kernels only' if args.triton_only else 'Hopper kernels where they apply'}")
    failed = 0
    for chunk in CHUNKS:
        in_order(chunk)
        for case in CHECKS:
            errors = check(*case)
            ok = max(errors) < 2e-2
            failed += not ok
            print(f"chunks of {chunk:2d}: B, H, N, D {case[:4]} branches {list(zip(case[4], case[5]))} "
                  f"hilbert={case[6]}: out, dq, dk, dv " + " ".join(f"{e:.2e}" for e in errors)
                  + ("  ok" if ok else "  FAIL"), flush=True)
    print("| D | N | floor fwd / bwd ms | chunks: fwd / bwd ms | grid order: fwd / bwd ms | "
          "floor / chunks: fwd, bwd |")
    print("|---|---|---|---|---|---|")
    for d, n in ((64, 32768), (128, 16384), (128, 65536)):
        q, k, v = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        floor, blocks = bench._floor_fn(q, k, v, SEGS, RATES, True, True)
        floor_fwd = bench._time(floor, False, None)
        floor_bwd = bench._time(floor, True, [t for blk in blocks for t in blk]) - floor_fwd
        del q, k, v, blocks, floor
        q, k, v, dout = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        plans = op_module._plain_plans(n, SEGS, RATES, True, q.device)
        kw = dict(is_causal=True, attn_mask=None, scale=d ** -0.5)
        cells = []
        for chunk in CHUNKS:
            in_order(chunk)
            out, lse = triton_lowering.forward(q, k, v, plans, **kw)
            cells.append((median_ms(lambda: triton_lowering.forward(q, k, v, plans, **kw)),
                          median_ms(lambda: triton_lowering.backward(dout, q, k, v, out, lse,
                                                                     plans, **kw))))
        print(f"| {d} | {n} | {floor_fwd:.3f} / {floor_bwd:.3f} | {cells[0][0]:.3f} / "
              f"{cells[0][1]:.3f} | {cells[1][0]:.3f} / {cells[1][1]:.3f} | "
              f"{floor_fwd / cells[0][0]:.2f}x, {floor_bwd / cells[0][1]:.2f}x |", flush=True)
    print(f"{failed} checks failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
