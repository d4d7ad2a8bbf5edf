"""GPU check and benchmark of the Gluon FA3-style backward prototype (gluon_bwd.py).

usage (repo root):  PYTHONPATH=. python scripts/prototypes/gluon_backward/run_gpu.py --out DIR [--budget 185] [--d 128,64]

Every case runs in its own subprocess with a timeout (a hang costs one case). Output lines go to stdout and
DIR/bwd.txt; DIR/results.json collects the numbers.

  Variants of the kernel (VARIANTS, --variants) each get their correctness and timing case.
  correct_D : B=1, H=4, N=8192, branches (2048,1), (4096,2): dq, dk, dv against torch autograd in float32 on the
              gathered sets (scattered back), relative Frobenius error, PASS < 2e-2; rows no set selects must be 0.
  ours_D    : B=1, H=16, N=65536, (2048,1), (4096,2): branch_backward (delta, lse2, zeroing, kernel, dq cast),
              median of samples of back-to-back calls; also the kernel's share (prep timed alone).
  cudnn_D   : SDPA cuDNN on pre-gathered sets, (fwd+bwd) - fwd.
  project_D : lowering.dilated_attention(..., lowering="triton") forward + torch.autograd.grad, (fwd+bwd) - fwd.
"""
import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CORR = dict(B=1, H=4, N=8192)
TIME = dict(B=1, H=16, N=65536)
BRANCHES = [(2048, 1), (4096, 2)]
TOL = 2e-2
# kernel variants (gluon_bwd CONFIG overrides): PIPE issues S^T/dP^T of the next query tile before dQ's adds;
# DQW hands dQ to a dedicated writer warp through shared memory (FA3's dQ writer, atomics instead of TMA reduce)
# fused_prep: delta and lse2 by a Triton kernel instead of torch. GPU run 1 measured "base" alone (torch prep).
VARIANTS = {"base": {}, "fprep": dict(fused_prep=True), "dqw": dict(DQW=1, fused_prep=True),
            "pipe": dict(PIPE=1, fused_prep=True), "pipe_dqw": dict(PIPE=1, DQW=1, fused_prep=True)}
DEFAULT_VARIANTS = {128: ["base", "fprep", "dqw", "pipe_dqw"], 64: ["fprep", "pipe"]}
REPS, INNER, WARM = 7, 5, 2


def gather_index(N, H, w, r, device):
    import torch
    rows = []
    for h in range(H):
        o = h % r
        j = torch.arange(N // w).view(-1, 1)
        m = torch.arange(w // r).view(1, -1)
        rows.append((j * w + o + m * r).reshape(-1))
    return torch.stack(rows).to(device)  # [H, N // r], segment-major


def gather_sets(x, w, r):
    """[B, H, N, D] -> [B, H * (N // w), w // r, D]."""
    import torch
    B, H, N, D = x.shape
    idx = gather_index(N, H, w, r, x.device)
    return torch.gather(x, 2, idx.view(1, H, -1, 1).expand(B, H, -1, D)).reshape(B, H * (N // w), w // r, D)


def scatter_sets(g, shape, w, r):
    """inverse of gather_sets: [B, H*S, L, X] -> [B, H, N, X] (zeros off the sets); X may be absent."""
    import torch
    B, H, N = shape[:3]
    idx = gather_index(N, H, w, r, g.device)
    if g.dim() == 3:  # [B, H*S, L]
        full = torch.zeros(B, H, N, dtype=g.dtype, device=g.device)
        return full.scatter_(2, idx.view(1, H, -1).expand(B, H, -1), g.reshape(B, H, -1))
    D = g.shape[-1]
    full = torch.zeros(B, H, N, D, dtype=g.dtype, device=g.device)
    return full.scatter_(2, idx.view(1, H, -1, 1).expand(B, H, -1, D), g.reshape(B, H, -1, D))


def cuda_time(fn, warmup=WARM, reps=REPS, inner=INNER):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    ts.sort()
    return ts[len(ts) // 2]


def rand(shape, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


def emit(key, value):
    print("RESULT " + json.dumps({key: value}), flush=True)


# ----------------------------------------------------------------------------- workers


def worker_correct(d, variant):
    import torch
    sys.path.insert(0, HERE)
    import gluon_bwd as gb
    B, H, N = CORR["B"], CORR["H"], CORR["N"]
    q, k, v, do = (rand((B, H, N, d), s) for s in (1, 2, 3, 4))
    scale = 1.0 / math.sqrt(d)
    res, ok_all = {}, True
    for (w, r) in BRANCHES:
        qg, kg, vg = (gather_sets(x, w, r).float().requires_grad_(True) for x in (q, k, v))
        dog = gather_sets(do, w, r).float()
        s = torch.matmul(qg, kg.transpose(-1, -2)) * scale
        lse_g = torch.logsumexp(s, dim=-1)
        og = torch.matmul(torch.softmax(s, dim=-1), vg)
        gq, gk, gv = torch.autograd.grad(og, (qg, kg, vg), dog)
        ref = [scatter_sets(g, q.shape, w, r) for g in (gq, gk, gv)]
        out = scatter_sets(og.detach(), q.shape, w, r)
        lse = scatter_sets(lse_g.detach(), q.shape, w, r)
        t0 = time.time()
        dq, dk, dv = gb.branch_backward(q, k, v, out, do, lse, w, r, **VARIANTS[variant])
        torch.cuda.synchronize()
        t1 = time.time() - t0
        sel = scatter_sets(torch.ones_like(lse_g), q.shape, w, r) > 0
        entry = {}
        for name, x, y in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
            err = ((x.float() - y).norm() / y.norm()).item()
            zero_off = bool((x[~sel] == 0).all().item())
            entry[name] = err
            entry[name + "_off_zero"] = zero_off
            ok_all &= (err < TOL) and zero_off and math.isfinite(err)
        ok = all(entry[n] < TOL for n in ("dq", "dk", "dv")) and all(entry[n + "_off_zero"] for n in ("dq", "dk", "dv"))
        print(f"  correct {variant} D={d} (w,r)=({w},{r}): rel_fro dq={entry['dq']:.3e} dk={entry['dk']:.3e} "
              f"dv={entry['dv']:.3e} off-set rows zero={entry['dq_off_zero'] and entry['dk_off_zero'] and entry['dv_off_zero']}"
              f" {'PASS' if ok else 'FAIL'} (first call {t1:.1f}s incl. compile)", flush=True)
        res[f"{w},{r}"] = entry
        del qg, kg, vg, gq, gk, gv, ref, s
        torch.cuda.empty_cache()
    res["pass"] = ok_all
    emit(f"correct_{variant}_{d}", res)


def _project_fwd_lse(q, k, v, w, r):
    import torch
    import lowering  # noqa: F401
    return torch.ops.hilbert_fx.dilated_attention(q, k, v, [w], [r], False, False, None, 0.0, None,
                                                  1.0 / math.sqrt(q.shape[-1]), "triton")


def worker_ours(d, variant):
    import torch
    sys.path.insert(0, HERE)
    import gluon_bwd as gb
    B, H, N = TIME["B"], TIME["H"], TIME["N"]
    q, k, v, do = (rand((B, H, N, d), s) for s in (1, 2, 3, 4))
    res = {}
    for (w, r) in BRANCHES:
        with torch.no_grad():
            out, lse = _project_fwd_lse(q, k, v, w, r)
        out, lse = out.contiguous(), lse.float().contiguous()
        ms = cuda_time(lambda: gb.branch_backward(q, k, v, out, do, lse, w, r, **VARIANTS[variant]))

        def prep():  # what branch_backward does besides the Gluon kernel
            if VARIANTS[variant].get("fused_prep"):
                gb.prep(out, do, lse)
            else:
                gb.torch_prep(out, do, lse)
            torch.zeros(B, H, N, d, device="cuda", dtype=torch.float32).to(q.dtype)
            if r > 1:
                torch.zeros(B, H, N, d, device="cuda", dtype=q.dtype)
                torch.zeros(B, H, N, d, device="cuda", dtype=q.dtype)
        prep_ms = cuda_time(prep)
        fl = 5 * 2.0 * B * H * (N // w) * (w // r) ** 2 * d  # 5 products
        print(f"  ours {variant} D={d} (w,r)=({w},{r}): backward {ms:.3f} ms (of which torch prep ~{prep_ms:.3f} ms; "
              f"kernel ~{ms - prep_ms:.3f} ms = {fl / (ms - prep_ms) / 1e9:.0f} TFLOP/s over 5 products)", flush=True)
        res[f"{w},{r}"] = dict(bwd_ms=ms, prep_ms=prep_ms)
    emit(f"ours_{variant}_{d}", res)


def worker_cudnn(d, variant=None):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    B, H, N = TIME["B"], TIME["H"], TIME["N"]
    q, k, v, do = (rand((B, H, N, d), s) for s in (1, 2, 3, 4))
    res = {}
    for (w, r) in BRANCHES:
        qg, kg, vg = (gather_sets(x, w, r).contiguous().requires_grad_(True) for x in (q, k, v))
        dog = gather_sets(do, w, r).contiguous()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(qg, kg, vg)

            def full():
                o = F.scaled_dot_product_attention(qg, kg, vg)
                torch.autograd.grad(o, (qg, kg, vg), dog)
            f_ms = cuda_time(fwd)
            t_ms = cuda_time(full)
        print(f"  cudnn D={d} (w,r)=({w},{r}): fwd {f_ms:.3f} ms, fwd+bwd {t_ms:.3f} ms, bwd {t_ms - f_ms:.3f} ms",
              flush=True)
        res[f"{w},{r}"] = dict(fwd_ms=f_ms, full_ms=t_ms, bwd_ms=t_ms - f_ms)
        del qg, kg, vg, dog
    emit(f"cudnn_{d}", res)


def worker_project(d, variant=None):
    import torch
    from lowering import dilated_attention
    B, H, N = TIME["B"], TIME["H"], TIME["N"]
    q, k, v, do = (rand((B, H, N, d), s) for s in (1, 2, 3, 4))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    res = {}
    for (w, r) in BRANCHES:
        def fwd():
            with torch.no_grad():
                dilated_attention(q, k, v, [w], [r], hilbert=False, lowering="triton")

        def full():
            o = dilated_attention(q, k, v, [w], [r], hilbert=False, lowering="triton")
            torch.autograd.grad(o, (q, k, v), do)
        f_ms = cuda_time(fwd)
        t_ms = cuda_time(full)
        print(f"  project D={d} (w,r)=({w},{r}): fwd {f_ms:.3f} ms, fwd+bwd {t_ms:.3f} ms, bwd {t_ms - f_ms:.3f} ms",
              flush=True)
        res[f"{w},{r}"] = dict(fwd_ms=f_ms, full_ms=t_ms, bwd_ms=t_ms - f_ms)
    emit(f"project_{d}", res)


WORKERS = dict(correct=worker_correct, ours=worker_ours, cudnn=worker_cudnn, project=worker_project)


# ----------------------------------------------------------------------------- driver


def run_case(args, timeout, log):
    cmd = [sys.executable, os.path.abspath(__file__)] + args
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         start_new_session=True)
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    results, timed_out = {}, False
    while True:
        if time.time() - t0 > timeout:
            timed_out = True
            break
        if not sel.select(timeout=0.5):
            if p.poll() is not None:
                break
            continue
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                break
            continue
        line = line.rstrip("\n")
        if line.startswith("RESULT "):
            results.update(json.loads(line[7:]))
        else:
            log(line if line.startswith("  ") else "    " + line)
    if timed_out:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log(f"  TIMEOUT after {timeout:.0f}s (hang?): {' '.join(args)}")
    rc = p.wait()
    if not timed_out:
        for line in p.stdout.read().splitlines():
            if line.startswith("RESULT "):
                results.update(json.loads(line[7:]))
            else:
                log("    " + line)
    if rc and not timed_out:
        log(f"  FAILED rc={rc}: {' '.join(args)}")
    return results, timed_out, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--budget", type=float, default=185.0)
    ap.add_argument("--cases", default="correct,ours,cudnn,project")
    ap.add_argument("--variants", default=None, help="comma list of VARIANTS names (default per D)")
    ap.add_argument("--variant", default="base")
    a = ap.parse_args()
    if a.worker:
        WORKERS[a.worker](int(a.d), a.variant)
        return
    if not a.out:
        ap.error("--out DIR is required")
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "bwd.txt"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    t_start = time.time()
    import torch
    import triton
    log(f"== gluon FA3-style backward prototype: torch {torch.__version__}, triton {triton.__version__}, "
        f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    timeouts = dict(correct=45, ours=40, cudnn=35, project=60)
    allres = {}
    for d in map(int, a.d.split(",")):
        variants = a.variants.split(",") if a.variants else DEFAULT_VARIANTS[d]
        jobs = []
        for v in variants:
            jobs += [(c, v) for c in ("correct", "ours") if c in a.cases.split(",")]
        if d == 128:  # baselines at D=128 only (the brief's timing shape)
            jobs += [(c, None) for c in ("cudnn", "project") if c in a.cases.split(",")]
        hung = set()
        for case, v in jobs:
            if case == "ours" and v in hung:
                log(f"-- skip ours {v} D={d}: its correctness case hung or failed")
                continue
            left = a.budget - (time.time() - t_start)
            if left < 15:
                log(f"-- skip {case} {v or ''} D={d}: budget ({left:.0f}s left)")
                continue
            log(f"-- {case} {v or ''} D={d}")
            res, to, el = run_case(["--worker", case, "--d", str(d), "--variant", v or "base"],
                                   min(timeouts[case], left - 5), log)
            allres.update(res)
            if case == "correct" and (to or f"correct_{v}_{d}" not in res):
                hung.add(v)
            log(f"   ({el:.1f}s)")
    # summary
    for d in map(int, a.d.split(",")):
        for (w, r) in BRANCHES:
            key = f"{w},{r}"
            c = allres.get(f"cudnn_{d}", {}).get(key, {}).get("bwd_ms")
            p = allres.get(f"project_{d}", {}).get(key, {}).get("bwd_ms")
            f = lambda x: "n/a" if x is None else f"{x:.3f} ms"  # noqa: E731
            for v in VARIANTS:
                o = allres.get(f"ours_{v}_{d}", {}).get(key, {}).get("bwd_ms")
                if o is None:
                    continue
                ok = allres.get(f"correct_{v}_{d}", {}).get("pass")
                line = (f"SUMMARY D={d} (w,r)=({w},{r}) backward: ours[{v}]={f(o)} (correct={ok}) "
                        f"project={f(p)} cudnn={f(c)}")
                if p:
                    line += f" project/ours={p / o:.2f}"
                if c:
                    line += f" cudnn/ours={c / o:.2f}"
                log(line)
    json.dump(allres, open(os.path.join(a.out, "results.json"), "w"), indent=1)
    log(f"== done in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
