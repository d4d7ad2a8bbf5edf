"""Host (CPU) time to issue one call of the op, forward and forward+backward: is the host setting
the pace?

    PYTHONPATH=. python scripts/host_profile.py [--n 4096 8192 16384] [--iters 100] [--profile]

On one GPU: bf16, B = 1, H = 16, D = 128, causal, branches (2048, 1), (4096, 2), (8192, 4),
(16384, 8), in the Hilbert and the identity order. For each N and order, the CPU time of one
call (median over --iters calls, each issued on an idle GPU after a synchronisation, none
waited for) of
  - op:       hilbert_fx.dilated_attention (torch.ops.hilbert_fx.dilated_attention and its
              autograd): forward without grad, forward on inputs that require grad (autograd
              records the backward), and forward + out.backward(dO);
  - lowering: lowering/triton_lowering.forward and .backward, called directly;
  - the same two with HILBERT_FX_FAST_LAUNCH=0 ("slow": every launch through Triton's own
    path, as before launches were cached), and SDPA (causal, the whole sequence) for scale;
beside the GPU time of a forward+backward (CUDA events over --iters back-to-back calls): where
the CPU column exceeds the GPU column, the host sets the pace.

Before any timing, a check, in a child process (a fault there must not end this run): the
cached launches compute what Triton's own path computes, on inputs at other addresses than the
first call's and on new inputs at freed addresses (forward bitwise; gradients to rounding, as
the Hopper backward adds dq by atomics). A line per case says "ok" or what differs; if the
check fails, it is run again without the Hopper kernels' kept tensor maps
(triton_launch.TENSOR_MAPS), and the timing runs with what passed, or with
HILBERT_FX_FAST_LAUNCH=0 if nothing did. --check-extra adds a boolean mask with dropout and
transposed GQA inputs with a dO the Hopper backward must copy (more kernels to compile).

--profile: for N = 8192 in the Hilbert order, cProfile of 50 forward+backward calls of the op
(the top host functions by cumulative and by own time), and the kernels one call launches
(torch.profiler).

--stub: on the CPU (run with TRITON_INTERPRET=1), every kernel launch replaced by a stand-in
that binds its arguments as Triton's launch path would (Triton's own binder for the sm_90
backend, and its cache key) and launches nothing, and the lowering's allocations by tensors
made once, so that what remains is the Python of the launch path: the cost this script
measures on the GPU, less the C launcher and the allocator (the op's forward+backward there
also pays for the zero gradient autograd makes for lse, and the Hopper stub for converting dq,
both slow on a CPU). --stub-hopper also sends the branches the Hopper kernels would take
(whole sets) through their host code (descriptors included), with this machine's Triton
building the descriptors. --base DIR:PACKAGE measures
another copy of lowering/ (e.g. `git archive HEAD lowering | tar -x -C /tmp/base` then
mv /tmp/base/lowering /tmp/base/lowering_base; --base /tmp/base:lowering_base) for before/after;
on the GPU too (the lowering's rows only: the registered op runs this tree's lowering).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import importlib
import io
import os
import pstats
import statistics
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEGS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
H, D = 16, 128


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def cpu_us(fn, iters: int, device, before=None) -> float:
    """Median CPU time of one call of fn (us), each issued after a synchronisation."""
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        _sync(device)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    _sync(device)
    return statistics.median(times) * 1e6


def gpu_us(fn, iters: int, before=None) -> float:
    """GPU time of one call (us): CUDA events around iters calls issued back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        if before is not None:
            before()
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


class Case:
    """One configuration's inputs and the calls to time."""

    def __init__(self, lowering_mod, n: int, hilbert: bool, device, dtype=torch.bfloat16):
        from hilbert_fx.lowering.plans import branch_plans
        self.lw, self.n, self.hilbert, self.device = lowering_mod, n, hilbert, device
        g = torch.Generator(device="cpu").manual_seed(n + hilbert)
        self.inputs = [torch.randn(1, H, n, D, generator=g).to(device, dtype) for _ in range(4)]
        self.plans = branch_plans(n, SEGS, RATES, hilbert, device)
        self.kw = dict(is_causal=True, attn_mask=None, scale=D ** -0.5)
        q, k, v, dout = self.inputs
        self.out, self.lse = self.lw.forward(q, k, v, self.plans, **self.kw)
        self.leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd(self):
        q, k, v, _ = self.inputs
        return self.lw.forward(q, k, v, self.plans, **self.kw)

    def bwd(self):
        q, k, v, dout = self.inputs
        return self.lw.backward(dout, q, k, v, self.out, self.lse, self.plans, **self.kw)

    def fwd_bwd(self):
        self.fwd()
        self.bwd()

    def op_fwd(self):
        from hilbert_fx.lowering import dilated_attention
        q, k, v, _ = self.inputs
        with torch.no_grad():
            return dilated_attention(q, k, v, SEGS, RATES, hilbert=self.hilbert, is_causal=True,
                                     lowering="triton")

    def op_fwd_graph(self):
        """The forward of a training step: autograd records the op's backward."""
        from hilbert_fx.lowering import dilated_attention
        q, k, v = self.leaves
        return dilated_attention(q, k, v, SEGS, RATES, hilbert=self.hilbert, is_causal=True,
                                 lowering="triton")

    def op_fwd_bwd(self):
        from hilbert_fx.lowering import dilated_attention
        q, k, v = self.leaves
        out = dilated_attention(q, k, v, SEGS, RATES, hilbert=self.hilbert, is_causal=True,
                                lowering="triton")
        if self.device.type == "cuda":
            out.backward(self.inputs[3])
        else:  # --stub: the gradients are reused tensors, which .grad would copy
            torch.autograd.grad(out, self.leaves, self.inputs[3])

    def clear_grads(self):
        for t in self.leaves:
            t.grad = None

    def sdpa_fwd(self):
        q, k, v, _ = self.inputs
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_fwd_bwd(self):
        q, k, v = self.leaves
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(
            self.inputs[3])


class _Knobs:
    """HILBERT_FX_FAST_LAUNCH off (or on) for the duration of a with-block; one Tuning object per
    setting, so that the lowering's programs (keyed by the knobs' identity) are built once."""
    made: dict = {}

    def __init__(self, tuning_mod, fast: bool):
        self.tuning, self.fast = tuning_mod, fast

    def __enter__(self):
        self.saved = self.tuning.tuning()
        key = (id(self.saved), self.fast)
        if key not in self.made:
            self.made[key] = (self.saved, dataclasses.replace(self.saved, fast_launch=self.fast))
        self.tuning._current = self.made[key][1]

    def __exit__(self, *exc):
        self.tuning._current = self.saved


def has_fast_launch(tuning_mod) -> bool:
    return "fast_launch" in {f.name for f in dataclasses.fields(tuning_mod.Tuning)}


def check(case: Case, tuning_mod) -> str:
    """'ok', or what differs between cached launches and Triton's own path (compare())."""
    return compare(case.lw, tuning_mod, lambda: [torch.randn_like(t) for t in case.inputs],
                   case.plans, case.kw)


def compare(lw, tuning_mod, make, plans, kw) -> str:
    """'ok', or what differs between cached launches and Triton's own path for the lowering's
    forward and backward on inputs (q, k, v, dO) = make(): first on inputs at new addresses, then
    on new inputs at the addresses just freed (the caching allocator hands them back: kept
    tensor maps are found again, for other data). Forward bitwise; gradients to rounding (the
    Hopper backward adds dq by atomics)."""
    q, k, v, dout = make()
    for _ in range(2):  # the programs are built and their launches cached
        lw.backward(dout, q, k, v, *lw.forward(q, k, v, plans, **kw), plans, **kw)
    problems = []
    for _ in range(2):
        q, k, v, dout = make()
        out_f, lse_f = lw.forward(q, k, v, plans, **kw)
        grads_f = lw.backward(dout, q, k, v, out_f, lse_f, plans, **kw)
        with _Knobs(tuning_mod, fast=False):
            out_s, lse_s = lw.forward(q, k, v, plans, **kw)
            grads_s = lw.backward(dout, q, k, v, out_s, lse_s, plans, **kw)
        if not torch.equal(out_f, out_s):
            problems.append(f"out differs (max {(out_f.float() - out_s.float()).abs().max():.3g})")
        if not torch.equal(lse_f, lse_s):
            problems.append("lse differs")
        for name, a, b in zip(("dq", "dk", "dv"), grads_f, grads_s):
            err = (a.float() - b.float()).abs().max().item()
            size = b.float().abs().max().item()
            if not err <= 2e-2 * max(size, 1e-6):
                problems.append(f"{name} differs ({err:.3g} against max |{name}| {size:.3g})")
        del q, k, v, dout, out_f, lse_f, grads_f, out_s, lse_s, grads_s
    return "ok" if not problems else "; ".join(problems)


def extra_checks(lw, tuning_mod, device) -> bool:
    """compare() on layouts the benchmark does not have: a boolean mask with dropout (the Triton
    kernels' mask and seed), q, k, v as [B, N, H, D] transposed with GQA and a dO the Hopper
    backward must copy (its 2-D views cannot read a strided last dimension)."""
    from hilbert_fx.lowering.plans import branch_plans
    n = 1024
    ok = True
    g = torch.Generator(device="cpu").manual_seed(1)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g).to(device, dtype)

    mask = torch.rand(1, 1, n, n, generator=g).to(device) > 0.2
    seed = torch.tensor(7, dtype=torch.int64, device=device)
    cases = [
        ("bool mask, dropout, fp16",
         lambda: [rand(1, 4, n, 64, dtype=torch.float16) for _ in range(4)],
         branch_plans(n, [256, 512], [1, 2], True, device),
         dict(is_causal=False, attn_mask=mask, scale=0.125, dropout_p=0.1, seed=seed)),
        ("[B, N, H, D] transposed, GQA, strided dO, bf16",
         lambda: [rand(2, n, h, 128, dtype=torch.bfloat16).transpose(1, 2) for h in (8, 2, 2)]
         + [rand(2, 8, n, 256, dtype=torch.bfloat16)[..., ::2]],
         branch_plans(n, [256, 512, 1024], [1, 2, 4], True, device),
         dict(is_causal=True, attn_mask=None, scale=128 ** -0.5)),
    ]
    for name, make, plans, kw in cases:
        verdict = compare(lw, tuning_mod, make, plans, kw)
        ok = ok and verdict == "ok"
        print(f"check {name}: cached launches against Triton's own path: {verdict}", flush=True)
    return ok


def checks(args, lw, tuning_mod, device) -> bool:
    """check() for every N and order; prints a line each, returns whether all are ok."""
    ok = True
    for n in args.n:
        for hilbert in (True, False):
            verdict = check(Case(lw, n, hilbert, device), tuning_mod)
            ok = ok and verdict == "ok"
            print(f"check N={n} {'hilbert' if hilbert else 'identity'}: cached launches against "
                  f"Triton's own path: {verdict}", flush=True)
    return ok


def keep_tensor_maps(lw, on: bool) -> None:
    """Whether the Hopper kernels' launches keep their tensor maps by address: TENSOR_MAPS of
    the lowering's triton_launch module (of triton_lowering itself in copies of lowering/ from
    before that module)."""
    package = lw.__name__.rsplit(".", 1)[0]
    try:
        launches = importlib.import_module(package + ".triton_launch")
    except ImportError:
        launches = lw
    launches.TENSOR_MAPS = on


def checked_launches(args, lw, tuning_mod) -> None:
    """Runs the checks in a child process (a fault there, such as an illegal address, must not
    end this one); if they fail with the Hopper kernels' tensor maps kept by address, again
    without; if that fails too, the rest runs with HILBERT_FX_FAST_LAUNCH=0, and says so."""
    import subprocess
    base = [sys.executable, os.path.abspath(__file__), "--check-only", "--n", *map(str, args.n)]
    if args.check_extra:
        base.append("--check-extra")
    for extra, what in (([], "cached launches"),
                        (["--no-tensor-maps"], "cached launches without kept tensor maps")):
        done = subprocess.run(base + extra, capture_output=True, text=True, timeout=900)
        print(done.stdout, end="")
        if done.returncode == 0:
            print(f"checks passed: timing {what}\n", flush=True)
            if extra:
                keep_tensor_maps(lw, False)
            return
        print(f"checks FAILED for {what} (exit {done.returncode}):\n{done.stderr[-3000:]}",
              flush=True)
    print("timing with HILBERT_FX_FAST_LAUNCH=0 only\n", flush=True)
    tuning_mod._current = dataclasses.replace(tuning_mod.tuning(), fast_launch=False)


def table(args, lw, tuning_mod, device):
    knob = has_fast_launch(tuning_mod)  # a copy of lowering/ from before cached launches: none
    op = not args.base  # the registered op runs this tree's lowering
    if knob and device.type == "cuda":
        checked_launches(args, lw, tuning_mod)
    knob = knob and tuning_mod.tuning().fast_launch
    rows = []
    for n in args.n:
        for hilbert in (True, False):
            case = Case(lw, n, hilbert, device)
            order = "hilbert" if hilbert else "identity"
            it = args.iters
            row = dict(N=n, order=order)
            if op:
                row["op fwd"] = cpu_us(case.op_fwd, it, device)
                row["op fwd, grad"] = cpu_us(case.op_fwd_graph, it, device)
                row["op fwd+bwd"] = cpu_us(case.op_fwd_bwd, it, device, case.clear_grads)
            row["lowering fwd"] = cpu_us(case.fwd, it, device)
            row["lowering fwd+bwd"] = cpu_us(case.fwd_bwd, it, device)
            if knob:
                with _Knobs(tuning_mod, fast=False):
                    if op:
                        row["slow op fwd"] = cpu_us(case.op_fwd, it, device)
                        row["slow op fwd+bwd"] = cpu_us(case.op_fwd_bwd, it, device,
                                                        case.clear_grads)
                    row["slow lowering fwd"] = cpu_us(case.fwd, it, device)
                    row["slow lowering fwd+bwd"] = cpu_us(case.fwd_bwd, it, device)
            if device.type == "cuda":
                row["GPU fwd+bwd"] = gpu_us(case.op_fwd_bwd if op else case.fwd_bwd, it,
                                            case.clear_grads)
                if hilbert:
                    row["sdpa fwd"] = cpu_us(case.sdpa_fwd, it, device)
                    row["sdpa fwd+bwd"] = cpu_us(case.sdpa_fwd_bwd, it, device,
                                                 case.clear_grads)
            rows.append(row)
            del case
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    print()
    print("CPU time per call (us, median)" + ("" if args.stub else "; GPU fwd+bwd: GPU time"))
    print(" | ".join(f"{c:>10}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>10.0f}" if isinstance(r.get(c), float)
                         else f"{str(r.get(c, '')):>10}" for c in cols))
    return rows


def profile(args, lw, device):
    case = Case(lw, 8192, True, device)
    step = case.fwd_bwd if args.stub or args.base else case.op_fwd_bwd
    for _ in range(5):
        case.clear_grads()
        step()
    _sync(device)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        case.clear_grads()
        step()
    pr.disable()
    _sync(device)
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        print(f"\n---- cProfile of 50 forward+backward calls at N = 8192, by {key}")
        print(s.getvalue())
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                case.clear_grads()
                step()
            torch.cuda.synchronize()
        counts = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                counts[ev.name[:80]] = counts.get(ev.name[:80], 0) + 1
        print(f"\n---- kernels of one forward+backward ({sum(counts.values()) / 5:.0f} in all)")
        for name, c in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{c / 5:5.1f}  {name}")


# ----------------------------------------------------------------------------- --stub


class _StandInCompiled:
    """What a launch returns in place of a compiled kernel: run() counts launches."""
    launches = 0

    def __init__(self):
        self.function, self.packed_metadata = 0, (4, 1, 0)

    @staticmethod
    def run(*args):
        _StandInCompiled.launches += 1


class _StandInKernel:
    """A kernel whose launch binds its arguments as Triton's launch path does (binder and cache
    key, for the sm_90 backend), then launches nothing."""

    def __init__(self, fn, name: str):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
        python_fn = fn
        while hasattr(python_fn, "fn"):
            python_fn = python_fn.fn
        jit = JITFunction(python_fn)
        self.__name__ = name
        self.arg_names = jit.arg_names
        self.pre_run_hooks = []
        self._binder = create_function_from_signature(
            jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
        self._key_cache = {}

    def __getitem__(self, grid):
        from triton.runtime.jit import compute_cache_key

        def launch(*args, **kwargs):
            kwargs.update(debug=False, instrumentation_mode="")
            bound, specialization, options = self._binder(*args, **kwargs)
            compute_cache_key(self._key_cache, specialization, options)
            _StandInCompiled.launches += 1
            return _StandInCompiled()
        return launch


class _Allocations:
    """torch, with empty/full/zeros/ones answered by tensors made once per (shape, dtype, device),
    16 of each in turn (so that no op call returns one of its inputs): the CPU's allocator is not
    the GPU's caching allocator."""

    def __init__(self):
        self._made, self.count = {}, 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _get(self, kind, shape, kwargs, make):
        self.count += 1
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list,
                                                                              torch.Size)) \
            else tuple(shape)
        key = (kind, shape, kwargs.get("dtype"), str(kwargs.get("device")),
               kwargs.get("fill_value"))
        ring = self._made.get(key)
        if ring is None:
            ring = self._made[key] = [[make() for _ in range(16)], 0]
        ring[1] = (ring[1] + 1) % 16
        return ring[0][ring[1]]

    def empty(self, *shape, **kw):
        return self._get("empty", shape, kw, lambda: torch.empty(*shape, **kw))

    def zeros(self, *shape, **kw):
        return self._get("zeros", shape, kw, lambda: torch.zeros(*shape, **kw))

    def ones(self, *shape, **kw):
        return self._get("ones", shape, kw, lambda: torch.ones(*shape, **kw))

    def full(self, shape, value, **kw):
        return self._get("full", (tuple(shape),), dict(kw, fill_value=value),
                         lambda: torch.full(shape, value, **kw))


def stub(lw, hopper: bool):
    """Replaces the launches of lowering module `lw` (and its Hopper modules) by stand-ins."""
    real = lw._kernels()
    names = ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_preprocess", "_cast_dq")
    kernels = types.SimpleNamespace(**{n: _StandInKernel(getattr(real, n), n) for n in names})
    lw._kernels = lambda: kernels
    lw.torch = allocations = _Allocations()
    package = lw.__name__.rsplit(".", 1)[0]
    gf = importlib.import_module(package + ".gluon_forward")
    gb = importlib.import_module(package + ".gluon_backward")
    whole_sets = importlib.import_module(package + ".plans").whole_sets
    if hopper:
        def unsupported(q, k, v, plan, is_causal, mask_kind, dropout, scale, *rest):
            if (plan.segment_length // plan.dilation_rate) % 128 or not whole_sets(plan):
                return "stub: Triton kernels"
            return None
        gf._unsupported = unsupported
        try:
            gluon_fwd = importlib.import_module(package + ".gluon_kernels")._fwd_kernel
            gluon_bwd = importlib.import_module(package + ".gluon_backward_kernels")._bwd_kernel
            fwd_k, bwd_k = _StandInKernel(gluon_fwd, "_fwd_kernel"), \
                _StandInKernel(gluon_bwd, "_bwd_kernel")
        except Exception as e:  # noqa: BLE001 - this Triton's Gluon may lack 3.6's names
            print(f"(Hopper kernels' binder not emulated: {type(e).__name__}: {e})")
            fwd_k = _NoBinder("_fwd_kernel")
            bwd_k = _NoBinder("_bwd_kernel")
        gf._load = lambda: types.SimpleNamespace(_fwd_kernel=fwd_k)
        gb._load = lambda: types.SimpleNamespace(_bwd_kernel=bwd_k)
    return allocations


class _NoBinder:
    def __init__(self, name):
        self.__name__, self.arg_names, self.pre_run_hooks = name, None, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _StandInCompiled.launches += 1
            return _StandInCompiled()
        return launch


def stub_counts(lw, allocations, n: int = 8192):
    """Launches and allocations per call of the lowering's forward and backward."""
    case = Case(lw, n, True, torch.device("cpu"))
    for name, fn in (("forward", case.fwd), ("backward", case.bwd)):
        fn(), fn()
        _StandInCompiled.launches, allocations.count = 0, 0
        fn()
        print(f"{name} at N = {n}: {_StandInCompiled.launches} kernel launches, "
              f"{allocations.count} allocations")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--stub", action="store_true")
    ap.add_argument("--stub-hopper", action="store_true")
    ap.add_argument("--base", default=None, help="DIR:PACKAGE, another copy of lowering/")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-tensor-maps", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--check-extra", action="store_true",
                    help="also check a mask with dropout and transposed GQA layouts (compiles "
                         "more kernels: a minute or two)")
    args = ap.parse_args()
    if args.check_only:  # the child process of checked_launches
        from hilbert_fx.lowering import triton_lowering, tuning
        keep_tensor_maps(triton_lowering, not args.no_tensor_maps)
        device = torch.device("cuda")
        ok = checks(args, triton_lowering, tuning, device)
        if args.check_extra:
            ok = extra_checks(triton_lowering, tuning, device) and ok
        sys.exit(0 if ok else 1)
    args.stub = args.stub or args.stub_hopper
    if args.base:  # its modules without its package's __init__, which would register the op again
        where, package = args.base.split(":")
        module = types.ModuleType(package)
        module.__path__ = [os.path.join(where, package)]
        sys.modules[package] = module
    else:
        package = "hilbert_fx.lowering"
    lw = importlib.import_module(package + ".triton_lowering")
    tuning_mod = importlib.import_module(package + ".tuning")
    if args.stub:
        device = torch.device("cpu")
        allocations = stub(lw, args.stub_hopper)
        stub_counts(lw, allocations)
    else:
        if not torch.cuda.is_available():
            sys.exit("no GPU: use --stub (with TRITON_INTERPRET=1) to measure on the CPU")
        device = torch.device("cuda")
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {importlib.import_module('triton').__version__}")
    table(args, lw, tuning_mod, device)
    if args.profile:
        profile(args, lw, device)
    if not args.stub:
        from hilbert_fx.lowering import gluon_forward
        print("\nkernels that ran:", *gluon_forward.kernel_choices(), sep="\n  ")


if __name__ == "__main__":
    main()
