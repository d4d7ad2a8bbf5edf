"""Check the op's lowerings on a GPU against the float64 reference, forward and backward.

    PYTHONPATH=.:tests python scripts/gpu_check.py --lowerings sdpa triton --out $OUT

Fresh random inputs per call, --calls calls per case (the first of a configuration launches
through Triton, the later ones replay its cached launches); relative error ||x - ref|| / ||ref|| of out, dq, dk, dv against
the float64 reference. float32 passes under 2e-3. bfloat16 and float16 are held to
FlashAttention's own test criterion: each error (relative norm, and largest absolute difference)
is at most twice that of the same attention computed by plain PyTorch ops in that dtype (scores,
softmax, products, autograd's backward; `attention_in_dtype`), so that no tolerance hides a real
loss of precision. The table prints our errors and, for 16-bit types, the largest ratio of ours
to PyTorch's. Writes the table to OUT/gpu_check.txt and exits non-zero when any case fails.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import reference  # noqa: E402
from reference import reference_dilated_attention  # noqa: E402

import hilbert_fx.lowering as lowering  # noqa: E402
from hilbert_fx.lowering import block_attention  # noqa: E402
from hilbert_fx.lowering.dropout import keep_mask  # noqa: E402

CASES = [
    # name, B, Hq, Hkv, N, D, branches, hilbert, causal, mask
    ("two-branch", 2, 4, 4, 300, 64, ((64, 1), (128, 4)), False, False, None),
    ("full segments", 2, 4, 4, 256, 64, ((64, 1), (128, 4)), True, False, None),
    ("hilbert causal", 1, 4, 4, 333, 64, ((48, 1), (96, 2), (200, 4)), True, True, None),
    ("N < w, GQA", 2, 8, 2, 150, 128, ((256, 2), (512, 8)), True, False, None),
    ("bool mask", 1, 4, 4, 257, 64, ((64, 2), (256, 4)), True, False, "bool"),
    ("float mask", 1, 2, 2, 200, 32, ((50, 1), (100, 5)), False, False, "float"),
    ("D=256 causal", 1, 2, 2, 190, 256, ((64, 1), (128, 2)), True, True, None),
    ("dropout", 1, 2, 2, 130, 64, ((32, 1), (64, 2)), True, True, "dropout"),
    # whole sets of multiples of 128 rows: the Hopper forward (lowering/gluon_kernels.py) on sm_90
    ("hopper 3 branches", 1, 4, 4, 2048, 128, ((256, 1), (512, 2), (1024, 4)), False, False, None),
    ("hopper hilbert GQA", 2, 8, 2, 1024, 64, ((256, 1), (512, 2)), True, False, None),
    ("hopper transposed", 1, 4, 2, 1024, 128, ((512, 4), (1024, 8)), False, False, None),
    ("hopper transposed hilbert", 2, 8, 4, 1024, 64, ((256, 1), (512, 4), (1024, 8)), True, False, None),
    ("hopper one branch", 1, 2, 2, 512, 64, ((512, 1),), True, False, None),
    ("hopper causal", 1, 4, 2, 2048, 128, ((512, 1), (1024, 2), (2048, 4)), True, True, None),
    ("hopper causal id", 2, 4, 4, 1024, 64, ((256, 1), (1024, 8)), False, True, None),
    # (512, 8) has sets of 64: the Triton kernels run it, the Hopper ones the others, in one call
    ("hopper mixed kernels", 1, 4, 2, 1024, 128, ((256, 1), (512, 2), (512, 8)), True, False, None),
    # a user's mask and dropout on the Hopper kernels (a query with no key among the bool mask's)
    ("hopper bool mask", 1, 4, 2, 1024, 64, ((256, 1), (512, 2), (1024, 4)), True, False, "bool"),
    ("hopper float mask", 2, 4, 4, 1024, 128, ((256, 1), (1024, 4)), False, False, "float"),
    ("hopper dropout", 1, 4, 4, 1024, 64, ((256, 1), (512, 2)), True, False, "dropout"),
    ("hopper dropout causal", 1, 4, 2, 2048, 128, ((512, 1), (1024, 2), (2048, 4)), False, True,
     "dropout"),
    # every copy path of the forward with dropout (D = 128): TMA boxes, runs, cp.async gathers
    ("hopper dropout hilbert", 1, 4, 4, 1024, 128, ((256, 1), (512, 2), (1024, 4)), True, False,
     "dropout"),
    # N % w != 0 in the Hilbert order (r = 1: the identity's sets): partial last sets,
    # gathered, with a mask and with dropout
    ("hopper bool mask partial", 1, 4, 2, 1000, 64, ((256, 1), (512, 2)), True, False, "bool"),
    ("hopper dropout partial", 2, 4, 4, 1000, 128, ((256, 1), (512, 4)), True, True, "dropout"),
    # N % w != 0 in the identity order: its partial sets gathered through padded positions
    ("hopper identity partial", 1, 4, 2, 1000, 128, ((256, 1), (512, 2)), False, True, None),
    # more work items than an H100's or H200's SMs (branch (256, 1): 2 tiles * 4 segments * 32
    # batch-heads = 256): the persistent loops, round-robin, and under causal masks the host's
    # table (the backward persistent at D = 64 too)
    ("hopper persistent", 4, 8, 8, 1024, 128, ((256, 1), (1024, 4)), True, False, None),
    ("hopper persistent causal", 4, 8, 8, 1024, 64, ((256, 1), (512, 2)), False, True, None),
]


# the reference and attention_in_dtype both need a case's counts: built once (plain Python loops)
_counts = functools.lru_cache(maxsize=None)(
    lambda n, hq, w, r, hilbert, build=reference.count_matrix: build(n, hq, list(w), list(r),
                                                                     hilbert))
reference.count_matrix = lambda n, hq, w, r, hilbert: _counts(n, hq, tuple(w), tuple(r), hilbert)


def rel(x, ref):
    return ((x.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def max_abs(x, ref):
    return (x.double().cpu() - ref).abs().max().item()


def attention_in_dtype(q, k, v, w, r, hilbert, causal, mask, enable_gqa, dropout_p, keep):
    """What plain PyTorch computes in q's dtype, on q's device: the reference's formula (count
    of branches selecting each key, dense scores, softmax, product) with every tensor in that
    dtype; FlashAttention's tests compare a kernel's error with this one's."""
    b, hq, n, d = q.shape
    dt, dev = q.dtype, q.device
    if enable_gqa:
        k, v = (t.repeat_interleave(hq // k.shape[1], dim=1) for t in (k, v))
    counts = reference.count_matrix(n, hq, w, r, hilbert).to(dev, dt).expand(b, hq, n, n)
    if causal:
        counts = counts * torch.ones(n, n, device=dev, dtype=dt).tril()
    s = (q @ k.transpose(-1, -2)) * (d ** -0.5)
    if mask is not None and mask.dtype == torch.bool:
        counts = counts * mask.to(dt)
    elif mask is not None:
        s = s + mask
    ok = counts > 0
    s = s.masked_fill(~ok, float("-inf"))
    rowmax = s.amax(-1, keepdim=True).detach()
    rowmax = rowmax.masked_fill(torch.isinf(rowmax), 0)
    weights = counts * torch.exp(s - rowmax)
    denom = weights.sum(-1, keepdim=True)
    probs = weights / denom.masked_fill(denom == 0, 1)
    if keep is not None:
        probs = probs * keep.to(dev, dt) / (1.0 - dropout_p)
    return probs @ v


def run_case(case, lowering_name, dtype, device, calls: int = 2):
    """The worst errors over `calls` calls of the op on fresh inputs: the first call of a
    configuration launches through Triton's own path, later ones replay its cached launches
    (lowering/triton_launch.py, lowering/driver_launch.py) on tensors at other addresses."""
    results = [_one_call(case, lowering_name, dtype, device) for _ in range(calls)]
    errs = [max(r[0][i] for r in results) for i in range(4)]
    ratios = [r[2] for r in results]
    return (errs, all(r[1] for r in results),
            None if ratios[0] is None else max(ratios))


def _one_call(case, lowering_name, dtype, device):
    name, b, hq, hkv, n, d, branches, hilbert, causal, mask_kind = case
    w = [x[0] for x in branches]
    r = [x[1] for x in branches]
    if "transposed" in name:  # [B, N, H, D] seen as [B, H, N, D], as models hand them over
        q, k, v = (torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)
                   for h in (hq, hkv, hkv))
    else:
        q = torch.randn(b, hq, n, d, device=device, dtype=dtype)
        k = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
        v = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, n, n, device=device) > 0.3
        mask[0, 0, 5] = False  # a query with no key
    elif mask_kind == "float":
        mask = torch.randn(n, n, device=device, dtype=dtype)
    dropout_p = 0.3 if mask_kind == "dropout" else 0.0
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))  # keeps the layout
    torch.manual_seed(7)
    out = lowering.dilated_attention(qs, ks, vs, w, r, hilbert=hilbert, is_causal=causal,
                                     attn_mask=mask if mask_kind in ("bool", "float") else None,
                                     dropout_p=dropout_p, enable_gqa=hkv != hq, lowering=lowering_name)
    dout = torch.randn_like(out)
    out.backward(dout)
    keep = None
    if dropout_p:
        torch.manual_seed(7)
        seed = lowering.dropout.new_seed(out.device).cpu()  # the op's draw, repeated
        ar = torch.arange(n)
        keep = keep_mask(seed, torch.arange(b).view(b, 1, 1, 1), torch.arange(hq).view(1, hq, 1, 1),
                         ar.view(1, 1, n, 1), ar.view(1, 1, 1, n), dropout_p)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_dilated_attention(
        qr, kr, vr, w, r, hilbert=hilbert, is_causal=causal,
        attn_mask=mask.cpu() if mask is not None and mask_kind != "float" else
        (mask.double().cpu() if mask is not None else None),
        enable_gqa=hkv != hq, dropout_p=dropout_p, dropout_keep=keep)
    ref.backward(dout.double().cpu())
    refs = (ref.detach(), qr.grad, kr.grad, vr.grad)
    ours = (out.detach(), qs.grad, ks.grad, vs.grad)
    errs = [rel(x, y) for x, y in zip(ours, refs)]
    finite = all(torch.isfinite(t).all().item() for t in ours)
    if dtype == torch.float32:
        return errs, finite, None
    qp, kp, vp = (t.detach().requires_grad_() for t in (q, k, v))
    pt = attention_in_dtype(qp, kp, vp, w, r, hilbert, causal, mask, hkv != hq, dropout_p, keep)
    pt.backward(dout)
    # FlashAttention's criterion, in relative norm and in the largest absolute difference; the
    # slack is float64's own rounding of the reference, as in FlashAttention's fwd_atol
    ratio = 0.0
    for x, p_, y in zip(ours, (pt.detach(), qp.grad, kp.grad, vp.grad), refs):
        for err in (rel, max_abs):
            ratio = max(ratio, err(x, y) / (err(p_, y) + 1e-12))
    return errs, finite, ratio


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lowerings", nargs="+", default=["sdpa", "triton"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=2,
                   help="calls of the op per case, each on fresh inputs (run_case)")
    p.add_argument("--cases", nargs="*", default=None,
                   help="only the cases whose names contain one of these")
    args = p.parse_args()
    cases = [c for c in CASES if args.cases is None or any(x in c[0] for x in args.cases)]
    device = args.device
    # which kernel ran each branch's forward and backward (lowering/gluon_forward.py logs it once per reason)
    kernel_log = logging.getLogger("hilbert_fx.lowering")
    kernel_log.setLevel(logging.DEBUG)
    kernel_log.addHandler(logging.StreamHandler(sys.stdout))
    torch.manual_seed(0)
    name = torch.cuda.get_device_properties(0).name if device == "cuda" else "cpu"
    lines = [f"device: {name}, torch {torch.__version__}",
             f"block kernels of the sdpa lowering: fp32 -> "
             f"{block_attention.kernel_for(torch.device('cuda'), torch.float32, 64, False, False)}, "
             f"bf16 -> {block_attention.kernel_for(torch.device('cuda'), torch.bfloat16, 64, False, False)}, "
             f"bf16+mask -> {block_attention.kernel_for(torch.device('cuda'), torch.bfloat16, 64, True, False)}",
             f"{'lowering':8} {'dtype':9} {'case':16} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9} "
             f"{'/pytorch':>8}  ok"]
    worst = {}
    failed = []
    print("\n".join(lines), flush=True)
    for lw, dt, case in itertools.product(args.lowerings, args.dtypes, cases):
        dtype = getattr(torch, dt)
        try:
            errs, finite, ratio = run_case(case, lw, dtype, device, args.calls)
        except Exception as e:  # noqa: BLE001 - report and go on to the next case
            lines.append(f"{lw:8} {dt:9} {case[0]:16} ERROR {type(e).__name__}: {str(e)[:200]}")
            print(lines[-1], flush=True)
            failed.append((lw, dt, case[0]))
            continue
        ok = finite and (max(errs) < 2e-3 if ratio is None else ratio <= 2.0)
        if not ok:
            failed.append((lw, dt, case[0]))
        worst[(lw, dt)] = max(worst.get((lw, dt), 0.0), max(errs))
        lines.append(f"{lw:8} {dt:9} {case[0]:16} " + " ".join(f"{e:9.2e}" for e in errs)
                     + (f" {'':>8}" if ratio is None else f" {ratio:8.2f}")
                     + f"  {'PASS' if ok else 'FAIL'}")
        print(lines[-1], flush=True)
    lines.append("worst relative error: " + ", ".join(f"{k[0]}/{k[1]} {v:.2e}" for k, v in worst.items()))
    lines.append(f"{len(failed)} of {len(args.lowerings) * len(args.dtypes) * len(cases)} cases "
                 f"failed" + (": " + ", ".join("/".join(f) for f in failed) if failed else ""))
    text = "\n".join(lines)
    print("\n".join(lines[-2:]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
        f.write(text + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
