"""The Triton lowering's launch path without Python per call (lowering/triton_launch.py; the
programs of lowering/triton_lowering.py): programs built once per configuration, launches that
reuse what the first one bound, the Hopper kernels' tensor maps kept by address.

No GPU here: kernels are stand-ins that record what they are launched with. A stand-in's first
launch goes through `kernel[grid](...)` as Triton's JITFunction.run would (arguments bound in
parameter order, then the compiled kernel's launcher called); the tests check that later
launches hand the launcher exactly what that path would have, for the tensors of each call.
scripts/host_profile.py checks the same on a GPU against Triton itself.
"""
import gc
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hilbert_fx.lowering import gluon_forward, triton_launch, triton_lowering, tuning  # noqa: E402
from hilbert_fx.lowering.plans import branch_plans, whole_sets  # noqa: E402
from hilbert_fx.lowering.triton_launch import Q, K, V, OUT, ACC, LSE, NUM_SLOTS  # noqa: E402

# ----------------------------------------------------------------------------- stand-ins

driver = types.ModuleType("stand_in_triton_driver")  # what _tensor_map_launch reads of Triton's
sys.modules[driver.__name__] = driver
driver._BASE_ARGS_FORMAT_LEN = 13
driver.encoded = []


def _make_tensordesc_arg(arg, metadata):
    """A tensor map's stand-in: what it encodes (address, box, metadata), then shape, strides."""
    driver.encoded.append(arg.base.data_ptr())
    return [("map", arg.base.data_ptr(), tuple(arg.block_shape), metadata["id"]),
            *arg.shape, *arg.strides]


driver.make_tensordesc_arg = _make_tensordesc_arg


class Launcher:
    """A compiled kernel's launcher, shaped as Triton 3.6's: __call__(grid, stream, function,
    *rest) passes cooperative/pdl flags and scratch buffers to `launch`, which, for a kernel
    with descriptors, expands each into its tensor map, shape and strides before the raw C
    launcher (here a recorder)."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False
    __module__ = driver.__name__

    def __init__(self, descriptor_positions, metas, calls, wrapped=True):
        def launcher(*args):
            calls.append(list(args))
        tensordesc_indices, tensordesc_meta = set(descriptor_positions), metas

        def inner(*args):
            final = list(args[:13])
            k = 0
            for i, arg in enumerate(args[13:]):
                if i in tensordesc_indices:
                    final.extend(_make_tensordesc_arg(arg, tensordesc_meta[k]))
                    k += 1
                else:
                    final.append(arg)
            return launcher(*final)

        self.launch = inner if wrapped and descriptor_positions else launcher

    def __call__(self, gx, gy, gz, stream, function, *rest):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    None, None, *rest)


Launcher.__module__ = driver.__name__


class Kernel:
    """A jit function whose first launch binds arguments as JITFunction.run does and launches
    through its compiled kernel's launcher; `launches` counts every launch."""

    def __init__(self, arg_names, descriptor_positions=(), wrapped=True):
        self.__name__ = "stand_in"
        self.arg_names, self.pre_run_hooks = list(arg_names), []
        self.calls, self.bound, self.bound_params = [], 0, []
        metas = [{"id": i} for i in range(len(descriptor_positions))]
        self.compiled = types.SimpleNamespace(
            run=Launcher(descriptor_positions, metas, self.calls, wrapped), function=1234,
            packed_metadata=(4, 1, 0))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.bound += 1
            params = list(args) + [kwargs[n] for n in self.arg_names[len(args):]]
            self.bound_params.append(dict(zip(self.arg_names, params)))
            self.compiled.run(*(tuple(grid) + (1, 1))[:3], 0, self.compiled.function,
                              self.compiled.packed_metadata, None, None, None, *params)
            return self.compiled
        return launch


def _bufs(n=64, d=64, dtype=torch.bfloat16):
    bufs = [None] * NUM_SLOTS
    for slot in (Q, K, V, OUT, ACC):
        bufs[slot.index] = torch.randn(1, 2, n, d).to(dtype)
    bufs[LSE.index] = torch.randn(1, 2, n)
    return bufs


def _descriptor_launch(kernel_wrapped=True):
    """A launch shaped like the Hopper forward's: three descriptors, buffers, scalars, then
    compile-time arguments by name."""
    args = [gluon_forward.Descriptor(s, 2, [32, 64]) for s in (Q, K, V)] + [OUT, ACC, LSE, 0.5, 7]
    names = ["Qx", "Kx", "Vx", "Out", "Acc", "Lse", "scale", "n", "FIRST", "num_warps"]
    kernel = Kernel(names, descriptor_positions=(0, 1, 2), wrapped=kernel_wrapped)
    return kernel, triton_launch.Launch(kernel, args, dict(FIRST=True, num_warps=4), (3, 2, 1))


# ----------------------------------------------------------------------------- launches


@pytest.mark.parametrize("wrapped", [True, False], ids=["tensor-maps", "plain"])
def test_cached_launch_passes_what_binding_would(wrapped):
    """Later launches skip the binding (kernel[grid] runs once) and give the raw launcher what
    the first launch's path gives it, for each call's tensors: tensors in their slots,
    descriptors of the call's tensors (tensor maps at their addresses), the same scalars,
    grid and compile-time arguments."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    kernel, launch = _descriptor_launch(wrapped)
    reference, _ = _descriptor_launch(wrapped)
    first = _bufs()
    launch(first, 0)
    assert kernel.bound == 1 and launch.fast is not None
    for bufs in (first, _bufs(), first):
        launch(bufs, 0)
        triton_launch.Launch(reference, launch.args, launch.kwargs, launch.grid)(bufs, 0)
        got, want = kernel.calls[-1], reference.calls[-1]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            if isinstance(b, torch.Tensor):  # passed by address, which the launcher accepts
                assert a == b.data_ptr()
            elif type(b).__name__ == "TensorDescriptor":  # the plain launcher: rebased
                assert a.base.data_ptr() == b.base.data_ptr()
                assert (a.shape, a.strides, a.block_shape, a.layout) == \
                    (b.shape, b.strides, b.block_shape, b.layout)
            else:
                assert a == b
    assert kernel.bound == 1


def test_tensor_maps_encoded_once_per_address():
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    kernel, launch = _descriptor_launch()
    a, b = _bufs(), _bufs()
    launch(a, 0)  # through the binding path: three maps
    driver.encoded.clear()
    launch(a, 0)
    launch(b, 0)
    launch(a, 0)
    launch(b, 0)
    assert sorted(driver.encoded) == sorted(b[s.index].data_ptr() for s in (Q, K, V))


def test_no_cached_launch_without_a_stream():
    """A stream of None (launch hooks, another current device, HILBERT_FX_FAST_LAUNCH=0) sends
    every launch through the binding path; so does the interpreter, which returns no compiled
    kernel."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    kernel, launch = _descriptor_launch()
    bufs = _bufs()
    for _ in range(3):
        launch(bufs, None)
    assert kernel.bound == 3 and launch.fast is None
    assert triton_launch._fast_launch(kernel, None, launch.args, launch.kwargs, (1,),
                                      bufs) is None


def test_stream_refuses_hooks_and_the_knob():
    import triton
    knobs = tuning.tuning()
    assert triton_launch.launch_stream(torch.device("cpu"), knobs) == 0
    off = tuning.Tuning(**{**knobs.__dict__, "fast_launch": False})
    assert triton_launch.launch_stream(torch.device("cpu"), off) is None
    hooks = triton.knobs.runtime.launch_enter_hook  # a chain of hooks (Triton 3.6 on)

    def noop(*args):
        return None
    hooks.add(noop)
    try:
        assert triton_launch.launch_stream(torch.device("cpu"), knobs) is None
    finally:
        hooks.remove(noop)
    assert triton_launch.launch_stream(torch.device("cpu"), knobs) == 0


# ----------------------------------------------------------------------------- programs


POINTERS = {"Out", "Acc", "Lse", "Q", "K", "V", "DO", "Pos", "Cnt", "Mask", "Seed", "Rows", "DQ",
            "DK", "DV", "DQO", "DKO", "DVO", "Seen", "Lse2", "Delta"}


class _Recorder:
    """lowering/triton_kernels.py's kernels, as stand-ins: each records the data pointers of the
    tensors it is launched with (by parameter name)."""

    def __init__(self):
        real = triton_lowering._kernels()
        self.kernels = {}
        self.log = []
        for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_preprocess",
                     "_cast_dq"):
            fn = getattr(real, name)
            while hasattr(fn, "fn"):
                fn = fn.fn
            import inspect
            names = list(inspect.signature(fn).parameters)
            kernel = Kernel(names)
            kernel.__name__ = name
            log = self.log

            def run(*args, names=names, name=name):
                params = args[9:]
                log.append((name, {n: p.data_ptr() if isinstance(p, torch.Tensor) else p
                                   for n, p in zip(names, params) if n in POINTERS}))
            kernel.compiled.run = run
            self.kernels[name] = kernel
        self.module = types.SimpleNamespace(**self.kernels)


def _inputs(n=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, 8, generator=g, dtype=dtype) for _ in range(4)]


def test_programs_built_once_and_fed_each_calls_tensors(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(triton_lowering, "_kernels", lambda: rec.module)
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    plans = branch_plans(40, [16, 8], [2, 1], True)
    kw = dict(is_causal=True, attn_mask=None, scale=0.3)
    for step in range(3):
        q, k, v, dout = _inputs()
        rec.log.clear()
        out, lse = triton_lowering.forward(q, k, v, plans, **kw)
        grads = triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
        assert len(triton_lowering._programs) == 2  # one forward, one backward
        names = [name for name, _ in rec.log]
        assert names == ["_fwd_kernel"] * 2 + ["_bwd_preprocess"] + [
            "_bwd_dkdv_kernel", "_bwd_dq_kernel"] * 2
        for name, ptrs in rec.log:
            for param, tensor in (("Q", q), ("K", k), ("V", v), ("DO", dout)):
                if param in ptrs:
                    assert ptrs[param] == tensor.data_ptr(), (name, param)
        fwd_ptrs = rec.log[1][1]
        assert fwd_ptrs["Out"] == out.data_ptr() and fwd_ptrs["Lse"] == lse.data_ptr()
        pre = rec.log[2][1]
        assert pre["Out"] == out.data_ptr() and pre["DO"] == dout.data_ptr()
        last_dq = rec.log[-1][1]
        assert last_dq["DQO"] == grads[0].data_ptr()
    bound = {"_bwd_preprocess": 1, "_cast_dq": 0}  # no dq summed in float32 on this path
    assert all(k.bound == bound.get(n, 2) for n, k in rec.kernels.items())


def test_programs_keyed_by_layout_and_knobs(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(triton_lowering, "_kernels", lambda: rec.module)
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    plans = branch_plans(40, [16, 8], [2, 1], True)
    kw = dict(is_causal=True, attn_mask=None, scale=0.3)
    q, k, v, _ = _inputs()
    triton_lowering.forward(q, k, v, plans, **kw)
    triton_lowering.forward(q.clone(), k.clone(), v.clone(), plans, **kw)
    assert len(triton_lowering._programs) == 1
    triton_lowering.forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, plans, **kw)
    assert len(triton_lowering._programs) == 2  # other strides
    unaligned = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)
    triton_lowering.forward(unaligned, k, v, plans, **kw)
    assert len(triton_lowering._programs) == 3  # another alignment (Triton specialises on it)
    triton_lowering.forward(q, k, v, plans, **dict(kw, scale=0.25))
    assert len(triton_lowering._programs) == 4
    monkeypatch.setattr(tuning, "_current", None)  # the knobs read again: a new Tuning
    triton_lowering.forward(q, k, v, plans, **kw)
    assert len(triton_lowering._programs) == 5


def test_programs_go_with_their_plans(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(triton_lowering, "_kernels", lambda: rec.module)
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    from hilbert_fx.lowering.plans import BranchPlan
    base = branch_plans(40, [16], [2], True)[0]
    plan = BranchPlan(16, 2, 40, base.positions.clone(), base.counts.clone())
    q, k, v, _ = _inputs()
    triton_lowering.forward(q, k, v, [plan], is_causal=False, attn_mask=None, scale=0.3)
    assert len(triton_lowering._programs) == 1
    del plan
    gc.collect()
    assert len(triton_lowering._programs) == 0


def test_mask_and_seed_slots_get_each_calls_tensors(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(triton_lowering, "_kernels", lambda: rec.module)
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    plans = branch_plans(40, [16, 8], [2, 1], True)
    for step in range(3):
        q, k, v, dout = _inputs()
        mask = torch.rand(1, 1, 40, 40) > 0.3
        seed = torch.tensor(step, dtype=torch.int64)
        kw = dict(is_causal=False, attn_mask=mask, scale=0.3, dropout_p=0.2, seed=seed)
        rec.log.clear()
        out, lse = triton_lowering.forward(q, k, v, plans, **kw)
        triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
        for name, ptrs in rec.log:
            if "Mask" in ptrs:
                assert ptrs["Mask"] == mask.data_ptr() and ptrs["Seed"] == seed.data_ptr(), name
    assert len(triton_lowering._programs) == 2


def test_dropout_rows_slot_gets_each_calls_rows(monkeypatch):
    """dropout_rows reaches the kernels' Rows at every call, cached launches included, with ROWS
    on; a call without it is a program of its own whose kernels have ROWS off and q's pointer
    in Rows (never read), as before dropout_rows existed; the rows' dtype is part of the key."""
    rec = _Recorder()
    monkeypatch.setattr(triton_lowering, "_kernels", lambda: rec.module)
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    plans = branch_plans(40, [16, 8], [2, 1], True)
    kw = dict(is_causal=False, attn_mask=None, scale=0.3, dropout_p=0.2,
              seed=torch.tensor(3, dtype=torch.int64))
    q, k, v, dout = _inputs()
    for step in range(3):
        rows = torch.arange(40) + 100 * step
        rec.log.clear()
        out, lse = triton_lowering.forward(q, k, v, plans, dropout_rows=rows, **kw)
        triton_lowering.backward(dout, q, k, v, out, lse, plans, dropout_rows=rows, **kw)
        assert all(ptrs["Rows"] == rows.data_ptr() for _, ptrs in rec.log if "Rows" in ptrs)
    assert len(triton_lowering._programs) == 2
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        assert all(p["ROWS"] for p in rec.kernels[name].bound_params), name
    rec.log.clear()
    triton_lowering.forward(q, k, v, plans, **kw)
    assert len(triton_lowering._programs) == 3
    assert all(ptrs["Rows"] == q.data_ptr() for _, ptrs in rec.log)
    assert not rec.kernels["_fwd_kernel"].bound_params[-1]["ROWS"]
    triton_lowering.forward(q, k, v, plans, dropout_rows=torch.arange(40, dtype=torch.int32),
                            **kw)
    assert len(triton_lowering._programs) == 4


def _hopper_stand_ins(monkeypatch, unsupported):
    """(forward, backward) stand-ins of the Hopper kernels that record their launches, the
    Triton kernels' too (_Recorder), and `unsupported` as gluon_forward._unsupported: the
    branches it passes go through the Hopper kernels' host code, as on an H100."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from hilbert_fx.lowering import gluon_backward, gluon_backward_kernels, gluon_kernels
    rec = _Recorder()
    monkeypatch.setattr(triton_lowering, "_kernels", lambda: rec.module)
    monkeypatch.setattr(triton_lowering, "_programs", triton_lowering._Programs())
    fwd = Kernel(gluon_kernels._fwd_kernel.arg_names)
    bwd = Kernel(gluon_backward_kernels._bwd_kernel.arg_names)
    monkeypatch.setattr(gluon_forward, "_load", lambda: types.SimpleNamespace(_fwd_kernel=fwd))
    monkeypatch.setattr(gluon_backward, "_load", lambda: types.SimpleNamespace(_bwd_kernel=bwd))
    monkeypatch.setattr(gluon_forward, "_unsupported", unsupported)
    return fwd, bwd


@pytest.mark.parametrize("hilbert", [False, True], ids=["identity", "hilbert"])
def test_hopper_launches_read_the_layouts_they_are_given(hilbert, monkeypatch):
    """The Hopper kernels' host side, run on stand-ins (whole sets sent to them as on an H100):
    q, k, v as [B, N, H, D] transposed, and a dO whose last dimension is strided, which the
    backward copies: its coordinates (OA..OD) are those of the copy's layout, and every launch
    after the first passes what the first passed, for each call's tensors."""
    fwd, bwd = _hopper_stand_ins(monkeypatch, lambda q, k, v, plan, *a: None
                                 if whole_sets(plan) else "stand-in: Triton kernels")
    n, d = 256, 64
    plans = branch_plans(n, [128, 256], [1, 2], hilbert)
    kw = dict(is_causal=True, attn_mask=None, scale=0.125)
    for step in range(3):
        q, k, v = (torch.randn(1, n, h, d).to(torch.bfloat16).transpose(1, 2) for h in (4, 2, 2))
        dout = torch.randn(1, 4, n, 2 * d).to(torch.bfloat16)[..., ::2]
        out, lse = triton_lowering.forward(q, k, v, plans, **kw)
        triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
    assert fwd.bound == 2 and bwd.bound == 2  # one binding per launch: the first call's
    assert len(fwd.calls) == len(bwd.calls) == 6
    copy = dout.contiguous()
    for params, plan in zip(bwd.bound_params, [plans[1], plans[0]]):  # r > 1 first
        r = plan.dilation_rate
        coords = [params[c] for c in ("OA", "OB", "OC", "OD")]
        if isinstance(params["DOx"], torch.Tensor):  # gathered through positions
            assert params["DOx"].is_contiguous()
            assert coords == [*copy.stride()[:3], 0]
        else:
            assert coords == list(gluon_forward._view(copy, r)[1:])
            assert params["DOx"].strides == list(gluon_forward._view(copy, r)[0].stride())
        assert [params[c] for c in ("QA", "QB", "QC", "QD")] == (
            list(gluon_forward._view(q, r)[1:]) if not isinstance(params["Qx"], torch.Tensor)
            else [*q.stride()[:3], 0])


def test_hopper_launches_take_each_call_s_mask_and_dropout(monkeypatch):
    """A user's mask and dropout reach the Hopper kernels (stand-ins, as on an H100): their
    kinds and the mask's strides, broadcast to [B, H, N, N], bound once, and every launch of
    every call given that call's own mask and seed."""
    from hilbert_fx.lowering.dropout import keep_threshold
    fwd, bwd = _hopper_stand_ins(monkeypatch, lambda *a: None)
    n, d, p = 256, 128, 0.2
    plans = branch_plans(n, [128, 256], [1, 2], False)

    def holds(call, t):  # a launch's argument: the tensor, or its address (a replay's)
        return any(a.data_ptr() == t.data_ptr() if isinstance(a, torch.Tensor)
                   else type(a) is int and a == t.data_ptr() for a in call)

    for step in range(3):
        q, k, v, dout = (torch.randn(1, 4, n, d).to(torch.bfloat16) for _ in range(4))
        mask = torch.rand(1, 1, n, n) > 0.5
        seed = torch.tensor(step + 5)
        kw = dict(is_causal=False, attn_mask=mask, scale=0.1, dropout_p=p, seed=seed)
        out, lse = triton_lowering.forward(q, k, v, plans, **kw)
        triton_lowering.backward(dout, q, k, v, out, lse, plans, **kw)
        for call in fwd.calls[-2:] + bwd.calls[-2:]:
            assert holds(call, mask) and holds(call, seed), step
    assert fwd.bound == 2 and bwd.bound == 2 and len(fwd.calls) == len(bwd.calls) == 6
    strides = list(mask.expand(1, 4, n, n).stride())
    for params in fwd.bound_params + bwd.bound_params:
        assert (params["MASK_KIND"], params["DROPOUT"], params["ROWS"]) == (1, True, False)
        assert [params[s] for s in ("MB", "MH", "MQ", "MK")] == strides
        assert params["keep_threshold"] == keep_threshold(p)
        assert params["drop_scale"] == pytest.approx(1 / (1 - p))


# ----------------------------------------------------------------------------- decoding


def _decode_kernels(monkeypatch):
    """Stand-ins for the decode kernels (lowering/triton_decode.py), with the real parameter
    names; a fresh set of programs."""
    from hilbert_fx.lowering import triton_decode
    kernels = {name: Kernel(getattr(triton_decode, name).arg_names)
               for name in ("_decode_split_kernel", "_decode_combine_kernel")}
    for name, kernel in kernels.items():
        monkeypatch.setattr(triton_decode, name, kernel)
    monkeypatch.setattr(triton_decode, "_programs", {})
    return triton_decode, kernels


def _step(triton_decode, nk, b=2, hq=4, hkv=2, d=16):
    """A decoding step of one query per row against a cache of nk rows, as a DynamicCache holds
    it (contiguous, grown by a row each step), rows counted without position_ids."""
    from hilbert_fx.lowering import sequences
    g = torch.Generator().manual_seed(nk)
    q = torch.randn(b, hq, 1, d, generator=g)
    k, v = (torch.randn(b, hkv, nk, d, generator=g) for _ in range(2))
    cache = sequences.cache_of(1, nk, b, None, None, q.device)
    args = (q, k, v, cache.key_positions, cache.query_rows, (16, 32), (1, 2), True, 0.25)
    triton_decode.decode_forward(*args, gapless=True)
    return args


def test_decode_programs_pass_each_steps_cache_length(monkeypatch):
    """Steps against a growing cache share a program while the values Triton specialises on
    stay in one class: a later step's launches hand the launcher what binding would for that
    step (its tensors, its cache length and k's and v's strides), and binding runs once."""
    triton_decode, kernels = _decode_kernels(monkeypatch)
    split = kernels["_decode_split_kernel"]
    names = split.arg_names
    for nk in (40, 56, 72):  # nk % 16 == 8 each time, strides multiples of 16 (D = 16)
        args = _step(triton_decode, nk)
        got = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in split.calls[-1][13:]]
        q, k, v, key_positions, query_rows = args[:5]
        want = {"Q": q.data_ptr(), "K": k.data_ptr(), "V": v.data_ptr(),
                "KPos": key_positions.data_ptr(), "QRows": query_rows.data_ptr(), "NK": nk,
                "stride_kb": k.stride(0), "stride_kh": k.stride(1), "stride_vb": v.stride(0),
                "stride_vh": v.stride(1), "stride_pb": key_positions.stride(0)}
        assert {n: got[names.index(n)] for n in want} == want
    assert len(triton_decode._programs) == 1 and split.bound == 1
    # a cache length that is a multiple of 16 is another class (Triton specialises on it)
    _step(triton_decode, 64)
    assert len(triton_decode._programs) == 2 and split.bound == 2
    assert split.calls[-1][13 + names.index("NK")] == 64
    assert kernels["_decode_combine_kernel"].bound == 2


def test_decode_steps_make_no_tensor_for_their_rows():
    """A decoding step against a cache without position_ids or seqused_k gets its key rows and
    query rows as views of one kept arange (no tensor made, no kernel launched for them)."""
    from hilbert_fx.lowering import sequences
    first = sequences.cache_of(1, 40, 2, None, None, torch.device("cpu"))
    second = sequences.cache_of(2, 41, 2, None, None, torch.device("cpu"))
    assert first.gapless and second.gapless
    assert torch.equal(second.key_positions, torch.arange(41).expand(2, 41))
    assert torch.equal(second.query_rows, torch.tensor([[39, 40], [39, 40]]))
    assert first.key_positions.untyped_storage().data_ptr() == \
        second.query_rows.untyped_storage().data_ptr()
