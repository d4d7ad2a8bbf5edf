"""The same sets through each copy path of the Hopper forward, for Nsight Compute's cycle counts.

    ncu --clock-control none --kernel-name regex:_fwd_kernel --csv \
        --metrics gpc__cycles_elapsed.max python scripts/ncu_copy_paths.py > ncu.csv 2> order.txt
    python scripts/ncu_variants.py --table ncu.csv order.txt

The issue-4 forward (N = 64K, D = 128, bf16), its plans given to lowering/triton_lowering.forward
directly: the identity order's plans as they are (strided: one TMA box a tile); the same
positions marked not strided, so that they take the Hilbert order's copy paths (runs of 64 and
of 32 members: TMA boxes a run; run 0: cp.async row by row); and the Hilbert order's plans.
Whatever differs between a path's cycles on identity positions and on Hilbert positions is the
positions' pattern (locality), not the copy path.
"""
import sys

import torch

from lowering import triton_lowering
from lowering.plans import BranchPlan, branch_plans

W, R = [2048, 4096, 8192, 16384], [1, 2, 4, 8]


def unstrided(plan, run):
    """A copy of an identity-order plan that the kernels treat as a gathered one, with `run`
    (r = 1: the plan itself, strided in every order)."""
    if plan.dilation_rate == 1:
        return plan
    copy = BranchPlan(plan.segment_length, plan.dilation_rate, plan.seq_len, plan.positions,
                      plan.counts)
    object.__setattr__(copy, "_strided", False)
    object.__setattr__(copy, "_run", run)
    return copy


def main():
    n = 65536
    q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    identity = branch_plans(n, W, R, False, q.device)
    variants = {"identity strided": identity,
                "identity run 64": [unstrided(p, 64) for p in identity],
                "identity run 32": [unstrided(p, 32) for p in identity],
                "identity gather": [unstrided(p, 0) for p in identity],
                "hilbert": branch_plans(n, W, R, True, q.device)}
    with torch.no_grad():
        for name, plans in variants.items():
            triton_lowering.forward(q, k, v, plans, is_causal=False, attn_mask=None,
                                    scale=128 ** -0.5)
            torch.cuda.synchronize()
            print(f"{name}|hilbert", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
