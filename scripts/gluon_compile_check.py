"""Compile the Hopper (Gluon) kernels for sm_90a without a GPU and print, per configuration,
ptxas's registers, spills and whether it serialised the wgmma instructions (too few registers
to keep them asynchronous), and the shared memory a CTA takes (an SM has 232,448 bytes), so
that a kernel change can be checked for compile errors, spilled registers, serialised products
and shared memory on the whole-set, partial-set, mask and dropout paths before device time is
spent.

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python scripts/gluon_compile_check.py --torch-site /path/to/venv/lib/python3.11/site-packages [--repo DIR] [--only NAME ...]

The kernels are written for Triton 3.6's Gluon, hence a Python whose own Triton is 3.6; torch is
taken from --torch-site, appended to sys.path after that Triton. A stand-in driver names an sm_90
target; each configuration's kernels are built by the lowering's own `prepare` (forward and
backward) and compiled by `warmup`, and the PTX goes through the bundled ptxas. --repo runs
another checkout's lowering/ (e.g. `git archive REV lowering | tar -x -C DIR`) to compare.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-site", required=True, help="site-packages holding torch")
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), os.pardir))
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only the configurations whose names contain one of these")
    args = ap.parse_args()
    sys.path.append(args.torch_site)
    import triton
    if not triton.__version__.startswith("3.6."):
        sys.exit(f"needs Triton 3.6 first on sys.path, found {triton.__version__}")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class SM90:
        """Names an sm_90 target; nothing is launched (warmup only compiles)."""
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def is_active(self):
            return True
    driver.set_active(SM90())
    sys.path.insert(0, os.path.abspath(args.repo))
    import torch
    from lowering import gluon_backward, gluon_forward
    from lowering.plans import branch_plan
    from lowering.sequences import sequence_plans
    from lowering.triton_plans import plan_tensors
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")

    def stats(ptx: str) -> str:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
        os.unlink(f.name)
        if run.returncode:
            return "ptxas failed: " + run.stderr[-300:]
        regs = re.findall(r"Used (\d+) registers", run.stderr + run.stdout)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                            run.stderr + run.stdout)
        # PTX less line information: equal digests mean equal code
        body = "\n".join(line for line in ptx.split(".section")[0].splitlines()
                         if ".loc" not in line and ".file" not in line)
        # C7511: ptxas found too few registers to keep wgmma asynchronous, and waits after each
        serialized = ", wgmma SERIALIZED" if "C7511" in run.stderr + run.stdout else ""
        return (f"registers {','.join(regs)}, spill stores/loads "
                f"{', '.join('/'.join(s) for s in spills)}{serialized}, "
                f"code {hashlib.md5(body.encode()).hexdigest()[:10]}")

    def case(name, n, w, r, hilbert, causal, d, packed=None, first=True, last=False, mask=None,
             dropout=False):
        if args.only and not any(word in name for word in args.only):
            return
        dt = torch.bfloat16
        q = torch.randn(1, 4, n, d, dtype=dt)
        k, v = torch.randn(1, 2, n, d, dtype=dt), torch.randn(1, 2, n, d, dtype=dt)
        plan = (branch_plan(n, w, r, hilbert) if packed is None
                else sequence_plans(packed, (w,), (r,), hilbert)[0])
        pos = plan_tensors(plan, "cpu")[0]
        out, acc, lse = torch.empty_like(q), torch.empty(q.shape), torch.empty(q.shape[:3])
        seed = torch.zeros((), dtype=torch.int64) if dropout else None

        def user(unused):  # a boolean (uint8) or float mask and dropout, as the lowering passes
            return gluon_forward.user_arguments(unused, mask, seed, None, 1 << 20, 1.1)
        fwd = gluon_forward.prepare(q, k, v, plan, pos, is_causal=causal, scale=0.1,
                                    first=first, last=last, refs=(q, k, v, out, acc, lse),
                                    user=user(lse))
        dq, dk, dv = torch.zeros(q.shape), torch.empty(k.shape), torch.empty(v.shape)
        seen = torch.zeros(2, n, dtype=torch.uint8)
        bwd = gluon_backward.prepare(
            q, k, v, q.clone(), plan, pos, is_causal=causal, scale=0.1, first=first, last=last,
            refs=(q, k, v, q.clone(), dq, dk, dv, k.clone(), v.clone(), seen, lse.clone(),
                  lse.clone()), user=user(lse))
        for what, (kernel, grid, kargs, kwargs) in (("forward", fwd), ("backward", bwd)):
            kargs = [a.make(a.source) if isinstance(a, gluon_forward.Descriptor) else a
                     for a in kargs]
            compiled = kernel.warmup(*kargs, grid=grid, **kwargs)
            print(f"{what:8s} {name:32s} {stats(compiled.asm['ptx'])}, shared memory "
                  f"{compiled.metadata.shared} B", flush=True)

    packed = torch.cat([torch.arange(n) for n in (3000, 1000, 4192)]).view(1, -1)
    case("whole, strided r=2 D=128", 8192, 4096, 2, False, False, 128)
    case("whole, Hilbert runs r=2 D=128 causal", 8192, 4096, 2, True, True, 128)
    case("whole, gathered r=4 D=128", 8192, 4096, 4, True, False, 128, first=False, last=True)
    case("whole, gathered r=4 D=64 causal", 8192, 4096, 4, True, True, 64)
    case("whole, gathered r=4 D=128 causal", 8192, 4096, 4, True, True, 128, first=False)
    # a branch between the first and the last (merging into Acc, writing Acc): the Llama step's
    case("whole, strided r=2 D=64 causal, middle", 32768, 4096, 2, False, True, 64, first=False)
    # launches of more items than SMs: the persistent loops (round-robin; the causal table)
    case("persistent, strided r=2 D=128", 65536, 4096, 2, False, False, 128)
    case("persistent, strided r=1 D=64 causal", 32768, 2048, 1, False, True, 64)
    # N % w != 0: partial last sets, gathered in the identity order too
    case("partial, N % w identity r=2 D=128 causal", 8000, 4096, 2, False, True, 128)
    case("partial, N % w r=1 D=64", 8000, 4096, 1, True, False, 64)
    # a user's mask and dropout (their addresses and keep bits take registers)
    bool_mask = torch.zeros(1, 1, 8192, 8192, dtype=torch.uint8)
    case("bool mask, strided r=1 D=128", 8192, 2048, 1, False, False, 128, mask=bool_mask)
    case("bool mask, Hilbert r=4 D=64", 8192, 8192, 4, True, False, 64, mask=bool_mask)
    # the other branches of the benchmark's boolean mask row at D = 64 (TMA copies)
    case("bool mask, Hilbert runs r=2 D=64", 8192, 4096, 2, True, False, 64, mask=bool_mask)
    case("bool mask, strided r=1 D=64", 8192, 2048, 1, True, False, 64, mask=bool_mask)
    case("float mask, Hilbert runs r=2 D=128", 8192, 4096, 2, True, False, 128,
         mask=torch.zeros(1, 1, 8192, 8192, dtype=torch.bfloat16))
    case("dropout, strided r=1 D=128", 8192, 2048, 1, False, False, 128, dropout=True)
    case("dropout, gathered r=4 D=128", 8192, 8192, 4, True, False, 128, dropout=True)
    case("dropout, identity r=2 D=64 causal", 8192, 4096, 2, False, True, 64, dropout=True)
    if gluon_forward.partial_sets(sequence_plans(packed, (4096,), (2,), True)[0]):
        case("partial, packed r=2 D=128", 8192, 4096, 2, True, False, 128, packed=packed)
        case("partial, packed r=4 D=64 causal", 8192, 4096, 4, True, True, 64, packed=packed,
             first=False, last=True)


if __name__ == "__main__":
    main()
