"""The Triton and Hopper lowerings' knobs (lowering/tuning.py), caches and launch arguments: the
environment is read once, into one frozen Tuning; nothing is attached to plans; the three branch
kernels take one shared run of operands; importing the lowering leaves TRITON_INTERPRET alone."""
import dataclasses
import gc
import inspect
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hilbert_fx.lowering import tuning  # noqa: E402
from hilbert_fx.lowering.plans import BranchPlan, branch_plan  # noqa: E402
from hilbert_fx.lowering.tuning import TileConfig, Tuning  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_and_each_variable():
    assert Tuning.from_environ({}) == Tuning()
    t = Tuning.from_environ({
        "HILBERT_FX_TRITON_FWD": "64,32,4,2", "HILBERT_FX_TRITON_DKDV": "16,64,8,1",
        "HILBERT_FX_TRITON_DQ": "128,64,8,3", "HILBERT_FX_TRITON_FP32_PRECISION": "ieee",
        "HILBERT_FX_TRITON_ATOMIC_DQ": "1", "HILBERT_FX_DETERMINISTIC": "1",
        "HILBERT_FX_GLUON": "0", "HILBERT_FX_GLUON_RUNS": "0"})
    assert t == Tuning(TileConfig(64, 32, 4, 2), TileConfig(16, 64, 8, 1), TileConfig(128, 64, 8, 3),
                       "ieee", True, True, False, False)
    assert tuning.tile_config("dq", torch.device("cpu"), torch.float32, 64, True, knobs=t) == \
        TileConfig(128, 64, 8, 3)
    # the environment's deterministic flag turns the atomic dq off
    assert t.deterministic() and not t.use_atomic_dq()
    # "" and "0" are off, anything else on (as the lowerings read them before)
    assert not Tuning.from_environ({"HILBERT_FX_TRITON_ATOMIC_DQ": ""}).atomic_dq
    assert not Tuning.from_environ({"HILBERT_FX_GLUON": ""}).gluon
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.gluon = True


@pytest.mark.parametrize("name,value", [("HILBERT_FX_TRITON_FP32_PRECISION", "fp16"),
                                        ("HILBERT_FX_TRITON_DKDV", "16,16"),
                                        ("HILBERT_FX_TRITON_DQ", "8,16,4,1")])
def test_malformed_values_name_their_variable(name, value):
    with pytest.raises(ValueError, match=name):
        Tuning.from_environ({name: value})


def test_read_once_until_reloaded(monkeypatch):
    monkeypatch.setattr(tuning, "_current", None)
    monkeypatch.delenv("HILBERT_FX_GLUON", raising=False)
    first = tuning.tuning()
    assert first.gluon and tuning.tuning() is first
    monkeypatch.setenv("HILBERT_FX_GLUON", "0")
    assert tuning.tuning() is first  # not read again per call
    assert not tuning.reload().gluon and not tuning.tuning().gluon


def test_deterministic_algorithms_are_read_per_call(monkeypatch):
    monkeypatch.setattr(tuning, "_current", Tuning(atomic_dq=True))
    assert tuning.tuning().use_atomic_dq()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert tuning.tuning().deterministic() and not tuning.tuning().use_atomic_dq()
    finally:
        torch.use_deterministic_algorithms(previous)


class _Recording(dict):
    """os.environ, recording the names asked for."""

    def __init__(self, env):
        super().__init__(env)
        self.asked = set()

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def _inputs(b=1, h=2, n=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g) for _ in range(4)]


def test_calls_read_no_environment(monkeypatch):
    """Forward and backward calls (Triton kernels, the Hopper kernels' eligibility) ask the
    environment for none of the knobs: they were read once."""
    from hilbert_fx.lowering import triton_lowering
    tuning.tuning()
    q, k, v, dout = _inputs()
    plans = [branch_plan(40, 16, 2, True), branch_plan(40, 8, 1, True)]
    kw = dict(is_causal=True, attn_mask=None, scale=0.3)
    recording = _Recording(os.environ)
    monkeypatch.setattr(os, "environ", recording)
    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
    assert not [name for name in recording.asked if name.startswith("HILBERT_FX")]


def test_plans_are_left_alone():
    """The lowering's per-plan tensors live in its own caches: a plan gains no attribute, and an
    entry goes when its plan does."""
    from hilbert_fx.lowering import gluon_forward, triton_lowering, triton_plans
    fields = {f.name for f in dataclasses.fields(BranchPlan)}
    plans = [branch_plan(40, 16, 2, True), branch_plan(40, 8, 1, False)]
    q, k, v, dout = _inputs()
    kw = dict(is_causal=False, attn_mask=None, scale=0.3)
    out, lse = triton_lowering.forward(q, k, v, plans, **kw)
    triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
    gluon_forward.plan_run(plans[0])
    for p in plans:
        assert set(vars(p)) == fields

    fresh = BranchPlan(16, 2, 40, plans[0].positions.clone(), plans[0].counts.clone())
    before = len(triton_plans._plan_cache)
    first = triton_plans.plan_tensors(fresh, torch.device("cpu"))
    assert triton_plans.plan_tensors(fresh, torch.device("cpu")) is first
    assert len(triton_plans._plan_cache) == before + 1
    del fresh, first
    gc.collect()
    assert len(triton_plans._plan_cache) == before


def test_plan_cache_keeps_entries_of_other_plans_at_a_reused_address():
    cache = tuning.PlanCache()
    calls = []
    for i in range(50):  # plans made and dropped: addresses get reused
        p = BranchPlan(4, 1, 4, torch.arange(4).view(1, 1, 4), torch.tensor([[4]]))
        assert cache.get(p, "k", lambda i=i: calls.append(i) or i) == i
        del p
    assert calls == list(range(50)) and len(cache) == 0


def _kernel_params(kernel):
    """(names of the runtime parameters, in order), read from the kernel's Python function."""
    fn = getattr(kernel, "fn", kernel)
    while hasattr(fn, "fn"):
        fn = fn.fn
    names = []
    for name, p in inspect.signature(fn).parameters.items():
        if "constexpr" not in str(p.annotation):
            names.append(name)
    return names


SHARED = ["Q", "K", "V", "DO", "Pos", "Cnt", "Grp", "Mask", "Seed", "Rows",
          "stride_qb", "stride_qh", "stride_qn", "stride_qd",
          "stride_kb", "stride_kh", "stride_kn", "stride_kd",
          "stride_vb", "stride_vh", "stride_vn", "stride_vd",
          "stride_dob", "stride_doh", "stride_don", "stride_dod",
          "stride_mb", "stride_mh", "stride_mq", "stride_mk",
          "stride_po", "stride_ps", "stride_pm", "stride_co", "stride_cs", "stride_pg",
          "H", "HKV", "N", "GROUP", "SEG", "R", "qk_scale", "scale", "keep_threshold", "drop_scale"]


@pytest.mark.parametrize("kernel,own,after,backward", [
    ("_fwd_kernel", ["Out", "Acc", "Lse", "stride_ob", "stride_oh", "stride_on"], [], False),
    ("_bwd_dkdv_kernel", ["DK", "DV", "DQ", "DKO", "DVO", "Seen", "Lse2", "Delta"], ["NUM_CLASSES"],
     True),
    ("_bwd_dq_kernel", ["DQ", "DQO", "Seen", "Lse2", "Delta"], [], True)])
def test_kernels_take_the_shared_operands(kernel, own, after, backward):
    """Each branch kernel's runtime parameters are its own buffers (with the strides of the
    forward's Out), the run Call.operands builds (DO and its strides only in the backward's),
    then its own scalars."""
    from hilbert_fx.lowering import triton_kernels, triton_lowering
    q, k, v, dout = _inputs()
    call = triton_lowering._call(q, k, v, attn_mask=None, dropout_p=0.0, seed=None,
                                 dropout_rows=None, scale=0.3, is_causal=False,
                                 dout=dout if backward else None)
    operands = call.operands(call.branch(branch_plan(40, 16, 2, True)))
    shared = [n for n in SHARED if backward or not (n == "DO" or n.startswith("stride_do"))]
    assert len(operands) == len(shared)
    assert _kernel_params(getattr(triton_kernels, kernel)) == own + shared + after


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    from hilbert_fx.lowering import triton_lowering
    monkeypatch.setattr(triton_lowering, "_interpreted", False)
    q, k, v, _ = _inputs()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_lowering.forward(q, k, v, [branch_plan(40, 8, 1, False)], is_causal=False,
                                attn_mask=None, scale=0.3)


def test_import_leaves_the_environment_alone():
    """Importing the lowering sets no TRITON_INTERPRET (a process that also uses a GPU would be
    switched to the interpreter); CPU tensors then get the RuntimeError that says what to do."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import os, torch\n"
        "import hilbert_fx\n"
        "from hilbert_fx.lowering import triton_lowering\n"
        "assert 'TRITON_INTERPRET' not in os.environ\n"
        "if not torch.cuda.is_available():\n"
        "    x = torch.randn(1, 1, 8, 4)\n"
        "    try:\n"
        "        hilbert_fx.dilated_attention(x, x, x, [4], [1], lowering='triton')\n"
        "    except RuntimeError as e:\n"
        "        assert 'TRITON_INTERPRET=1' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no RuntimeError')\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
