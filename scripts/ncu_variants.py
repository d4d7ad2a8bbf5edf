"""Forward kernels of schedule variants, for Nsight Compute's cycle counts (one process).

    ncu --clock-control none --kernel-name regex:_fwd_kernel --csv --metrics \
        gpc__cycles_elapsed.max,gpu__time_duration.sum python scripts/ncu_variants.py V1 V2 ... \
        > ncu.csv 2> order.txt
    python scripts/ncu_variants.py --table ncu.csv order.txt

Single timings of the whole forward move by 5 to 8% under the GPU's power cap; a kernel's
elapsed cycles under ncu (each launch alone, caches flushed) move far less, so variants are
compared per branch kernel by cycles. Each variant (scripts/ab_forward.py's VARIANTS) runs the
issue-4 forward (head dim $HEAD_D, default 128) once in the Hilbert order and once in the
identity order; stderr names each run in order, and --table splits ncu's launches among them.
"""
import csv
import os
import statistics
import sys
from collections import defaultdict


def run(variants):
    import torch
    from lowering import dilated_attention, gluon_forward
    from lowering.plans import branch_plans
    sys.path.insert(0, "scripts")
    from ab_forward import VARIANTS, W, R, configure

    d = int(os.environ.get("HEAD_D", "128"))
    q, k, v = (torch.randn(1, 16, 65536, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    saved = {name: dict(getattr(gluon_forward, name)) for name in ("_TMA_PRODUCER", "_GATHER_PRODUCER")}
    order = [(p.segment_length, p.dilation_rate) for p in branch_plans(65536, W, R, False, q.device)]
    with torch.no_grad():
        for name in variants:
            configure(saved, VARIANTS[name])
            for hilbert in (True, False):
                dilated_attention(q, k, v, W, R, hilbert=hilbert, lowering="triton")
                torch.cuda.synchronize()
                print(f"{name}|{'hilbert' if hilbert else 'identity'}", file=sys.stderr, flush=True)


def table(csv_path, order_path):
    """Cycles per (variant, order, grid) from ncu's CSV, in launch order."""
    rows = [r for r in csv.DictReader(l for l in open(csv_path) if l.startswith('"'))]
    runs = [l.strip() for l in open(order_path) if "|" in l and not l.startswith("==")]
    by_id = defaultdict(dict)
    for r in rows:
        by_id[int(r["ID"])][r["Metric Name"]] = (r["Grid Size"], float(r["Metric Value"].replace(",", "")))
    ids = sorted(by_id)
    per = len(ids) // len(runs)
    out = defaultdict(list)
    for i, run_name in enumerate(runs):
        total = 0
        for kid in ids[i * per:(i + 1) * per]:
            grid, cycles = by_id[kid]["gpc__cycles_elapsed.max"]
            out[(run_name, grid)].append(cycles)
            total += cycles
        out[(run_name, "total")].append(total)
    for (run_name, grid), vals in sorted(out.items()):
        print(f"{run_name:40} {grid:16} cycles {statistics.median(vals):12,.0f}  (n={len(vals)})")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1:])
