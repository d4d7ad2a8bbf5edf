"""The Triton lowering's kernel launches, planned once per configuration and replayed cheaply.

Why: the host must not set the pace. At N = 8K the GPU work of a forward+backward is about 1.8 ms
on an H100, and Triton's launch path (binding and specialising 35 to 70 arguments a launch, the
Hopper kernels' TMA descriptors built in Python) took 3.7 ms of CPU. So lowering/triton_lowering.py
plans a call's work once per configuration (its programs, `_Forward` and `_Backward`), and a
program's steps are the `Launch`es here:

- a launch names the call's tensors by `Slot` (the slots are filled with each call's tensors,
  `bufs`), and everything else it passes is fixed when the program is built;
- its first run goes through Triton (`kernel[grid](...)`), shrinking tiles the GPU lacks the
  resources for; what that returns, the compiled kernel, is kept, and later runs hand its
  launcher the arguments directly, tensors as addresses (`_fast_launch`: the direct launcher
  path);
- the Hopper kernels' TMA descriptors are rebased onto each call's tensors rather than built
  again, and their tensor maps are encoded only for a data pointer not seen before
  (gluon_forward.Descriptor, `_tensor_map_launch`; TENSOR_MAPS turns that part off);
- where it can, a cached launch skips Triton's C launcher too and calls the CUDA driver with the
  kernel's parameters packed once (lowering/driver_launch.py; HILBERT_FX_DRIVER_LAUNCH=0 keeps
  the C launcher).

`launch_stream` says where a launch may take the direct path; HILBERT_FX_FAST_LAUNCH=0
(lowering/tuning.py) sends every launch through Triton's own path instead, as do launch hooks
and the interpreter. scripts/host_profile.py measures both paths and checks that they agree;
tests/test_triton_launch.py checks what the direct path passes against what binding would.
"""
from __future__ import annotations

import torch

from . import driver_launch, gluon_forward
from .tuning import Tuning
from .tuning import shrunk as _shrunk

__all__ = ["Slot", "Value", "int_class", "Launch", "Emulated", "launch_stream", "NUM_SLOTS",
           "TENSOR_MAPS"]


class Slot:
    """A call's tensor in the arguments of a cached launch: a program (triton_lowering's
    `_Forward`, `_Backward`) is built once per configuration and its launches name a call's
    tensors by slot, filled in at each call (`Launch`)."""
    __slots__ = ("index", "name")

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name

    def __repr__(self) -> str:
        return f"Slot({self.name})"


class Value(Slot):
    """An integer of each call in the arguments of a cached launch (a decoding step's cache
    length and the strides that follow from it: lowering/triton_decode.py), passed as it is
    where a Slot's tensor goes by its address. A program that takes Values is keyed by their
    `int_class`, so that the kernel its first launch compiled serves every later value."""
    __slots__ = ()

    def __repr__(self) -> str:
        return f"Value({self.name})"


def int_class(value: int) -> tuple:
    """What Triton's binder specialises an integer argument on: equal to 1 (then a compile-time
    constant), a multiple of 16, and its C type by range."""
    kind = "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"
    return value == 1, value % 16 == 0, kind


_SLOT_NAMES = ("q", "k", "v", "dout", "mask", "seed", "dropout_rows", "out", "acc", "lse",
               "out_in", "lse_in", "delta", "lse2", "dq", "dk", "dv", "dq_final", "dk_final",
               "dv_final", "dout_g")
(Q, K, V, DOUT, MASK, SEED, DROPOUT_ROWS, OUT, ACC, LSE, OUT_IN, LSE_IN, DELTA, LSE2, DQ, DK, DV,
 DQ_FINAL, DK_FINAL, DV_FINAL, DOUT_G) = (Slot(i, n) for i, n in enumerate(_SLOT_NAMES))
NUM_SLOTS = len(_SLOT_NAMES)

# The tiles that ran, by kernel, first-choice tiles, device, dtype and compile-time arguments:
# a config the GPU had too few resources for is shrunk once, not at every call.
_working_configs: dict = {}


class Launch:
    """One kernel launch of a program: the kernel, its arguments with a call's tensors as `Slot`s
    (and the Hopper kernels' TMA descriptors as gluon_forward.Descriptors of slots), its
    keyword arguments, and its grid (or, for the Triton kernels, the tiles and the grid they
    give, `grid_of(cfg)`; tiles the GPU lacks the resources for are shrunk, tuning.shrunk).

    The first launch goes through Triton's launch path (`kernel[grid](...)`), which binds and
    specialises every argument, finds the compiled kernel and launches it. What it returns, the
    compiled kernel, is kept with the arguments in the kernel's parameter order, so that a later
    launch of the same program hands the launcher the arguments directly: the slots filled with
    the call's tensors, nothing else recomputed. That is what Triton's own path would launch: a
    program's key (triton_lowering._key) fixes every argument other than the data pointers and
    the `Value`s, and the 16-byte alignment of each caller's tensor, which is all that Triton
    specialises pointers on (the buffers the lowering allocates are always aligned), and each
    Value's `int_class`."""
    __slots__ = ("kernel", "args", "kwargs", "grid", "grid_of", "cfg", "m_multiple_of_n",
                 "cfg_key", "fast")

    def __init__(self, kernel, args: list, kwargs: dict, grid=None, *, grid_of=None, cfg=None,
                 m_multiple_of_n: bool = True, cfg_key=None):
        self.kernel, self.args, self.kwargs, self.grid = kernel, args, kwargs, grid
        self.grid_of, self.cfg, self.m_multiple_of_n = grid_of, cfg, m_multiple_of_n
        self.cfg_key = cfg_key
        if cfg_key is not None:
            self.cfg = _working_configs.get(cfg_key, cfg)
        self.fast = None

    def __call__(self, bufs: list, stream) -> None:
        fast = self.fast
        if fast is not None and stream is not None:
            fast(bufs, stream)
        else:
            self._first(bufs, stream)

    def _first(self, bufs: list, stream) -> None:
        """The launch through Triton's own path (the first, or when a cached one cannot be used:
        the interpreter, launch hooks, another current device, HILBERT_FX_FAST_LAUNCH=0)."""
        Descriptor = gluon_forward.Descriptor
        args = [bufs[a.index] if type(a) in (Slot, Value)
                else a.make(bufs[a.source.index]) if type(a) is Descriptor else a
                for a in self.args]
        if self.grid_of is None:
            grid, kwargs = self.grid, self.kwargs
            compiled = self.kernel[grid](*args, **kwargs)
        else:
            from triton.runtime.errors import OutOfResources
            cfg = self.cfg
            while True:
                grid = self.grid_of(cfg)
                kwargs = dict(self.kwargs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                try:
                    compiled = self.kernel[grid](*args, **kwargs)
                    break
                except OutOfResources:
                    smaller = _shrunk(cfg, self.m_multiple_of_n)
                    if smaller is None:
                        raise
                    cfg = smaller
            self.cfg = _working_configs[self.cfg_key] = cfg
        if stream is not None and self.fast is None:
            self.fast = _fast_launch(self.kernel, compiled, self.args, kwargs, grid, bufs)


def _fast_launch(kernel, compiled, args: list, kwargs: dict, grid, bufs: list):
    """A function (bufs, stream) that launches `compiled` again without Triton's binding, or None
    where that cannot be done faithfully. It passes the launcher what
    triton.runtime.jit.JITFunction.run does (Triton 3.6 and later): the grid, the stream, the
    function, its metadata, no launch metadata and no hooks (`launch_stream` sends launches
    through Triton while hooks are installed), then every parameter in order: the positional
    arguments, then the keyword ones by name, compile-time ones included (the launcher skips
    those)."""
    names = getattr(kernel, "arg_names", None)
    if (compiled is None or getattr(kernel, "pre_run_hooks", None)
            or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            or not isinstance(names, (list, tuple)) or len(names) < len(args)
            or not all(name in kwargs for name in names[len(args):])):
        return None
    Descriptor = gluon_forward.Descriptor
    # tensors as their addresses: the launcher takes an int as it is, where for a tensor it calls
    # data_ptr() and asks the driver about the pointer (the tensors stay alive in `args`)
    template = [None if type(a) in (Slot, Value, Descriptor)
                else a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    template += [kwargs[name] for name in names[len(args):]]
    slots = tuple((i, a.index) for i, a in enumerate(args) if type(a) is Slot)
    values = tuple((i, a.index) for i, a in enumerate(args) if type(a) is Value)
    descriptors = tuple((i, a.source.index, a) for i, a in enumerate(args)
                        if type(a) is Descriptor)
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    if descriptors and TENSOR_MAPS and not values:
        with_maps = _tensor_map_launch(compiled, template, slots, descriptors, (g0, g1, g2),
                                       bufs)
        if with_maps is not None:
            return with_maps

    def launch(bufs: list, stream) -> None:
        a = template.copy()
        for i, slot in slots:
            a[i] = bufs[slot].data_ptr()
        for i, slot in values:
            a[i] = bufs[slot]
        for i, slot, desc in descriptors:
            a[i] = desc.rebase(bufs[slot])
        run(g0, g1, g2, stream, function, metadata, None, None, None, *a)

    if descriptors or not _driver_launch_on():
        return launch
    return driver_launch.build(compiled, template, slots, (), (g0, g1, g2), launch,
                               values) or launch


# Whether launches with TMA descriptors keep their tensor maps by address (`_tensor_map_launch`);
# scripts/host_profile.py turns it off to tell a fault there from one in the rest
TENSOR_MAPS = True


def _driver_launch_on() -> bool:
    """Whether cached launches call the CUDA driver themselves (lowering/driver_launch.py) rather
    than Triton's C launcher (HILBERT_FX_DRIVER_LAUNCH; read when a launch is first made)."""
    from .tuning import tuning
    return tuning().driver_launch

# Triton 3.6's C launcher takes, before the kernel's parameters: the grid (3), the stream, the
# function, cooperative launch, programmatic dependent launch, two scratch buffers, the kernel's
# metadata, the launch metadata and the two hooks
_BASE_ARGS = 13


def _tensor_map_launch(compiled, template: list, slots, descriptors, grid, bufs: list):
    """For a kernel that takes TMA descriptors: a function (bufs, stream) that calls Triton's C
    launcher itself, each descriptor's expansion (tensor map, shape, strides) kept by data
    pointer (gluon_forward.Descriptor.expanded), where Triton 3.6's Python wrapper around that
    launcher (triton/backends/nvidia/driver.py: wrap_handle_tensordesc) walks every argument
    and encodes every tensor map again (make_tensordesc_arg) at each launch. None unless `run`
    is that wrapper as 3.6 builds it (a closure over the launcher, the descriptors' positions and
    their metadata; the module's make_tensordesc_arg(arg, metadata)) and the kernel needs no
    scratch memory, which the wrapper's caller would allocate."""
    import inspect
    import sys
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    try:
        closure = inspect.getclosurevars(run.launch).nonlocals
        driver = sys.modules[type(run).__module__]
        expand = driver.make_tensordesc_arg
        usable = (set(closure) == {"launcher", "tensordesc_indices", "tensordesc_meta"}
                  and getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) == _BASE_ARGS
                  and list(inspect.signature(expand).parameters) == ["arg", "metadata"]
                  and not run.global_scratch_size and not run.profile_scratch_size)
        indices, metas = sorted(closure["tensordesc_indices"]), closure["tensordesc_meta"]
        usable = usable and indices == [i for i, _, _ in descriptors] \
            and len(metas) == len(indices) and all(m is not None for m in metas)
        flags = (run.launch_cooperative_grid, run.launch_pdl)
    except Exception:  # noqa: BLE001 - any other launcher: Triton's own path
        return None
    if not usable:
        return None
    raw = closure["launcher"]
    for (_, _, desc), meta in zip(descriptors, metas):
        desc.expand = lambda d, meta=meta: expand(d, meta)
    flat = [*grid, None, function, *flags, None, None, metadata, None, None, None]
    by_index = {i: (slot, desc) for i, slot, desc in descriptors}
    slot_at = dict(slots)
    flat_slots, spans = [], []
    for i, value in enumerate(template):
        if i in by_index:
            slot, desc = by_index[i]
            expansion = desc.expanded(bufs[slot])
            spans.append((len(flat), len(flat) + len(expansion), slot, desc))
            flat.extend(expansion)
        elif i in slot_at:
            flat_slots.append((len(flat), slot_at[i]))
            flat.append(None)
        else:
            flat.append(value)
    flat_slots, spans = tuple(flat_slots), tuple(spans)

    def launch(bufs: list, stream) -> None:
        a = flat.copy()
        a[3] = stream
        for i, slot in flat_slots:
            a[i] = bufs[slot].data_ptr()
        for start, stop, slot, desc in spans:
            a[start:stop] = desc.expanded(bufs[slot])
        raw(*a)

    if not _driver_launch_on():
        return launch
    return driver_launch.build(
        compiled, flat[_BASE_ARGS:], [(i - _BASE_ARGS, slot) for i, slot in flat_slots],
        [(start - _BASE_ARGS, slot, desc.expanded) for start, _, slot, desc in spans], grid,
        launch) or launch


class Emulated:
    """A program step that calls a module's launch function by name at each call, with the
    call's tensors (tests put emulations of the Hopper kernels there)."""
    __slots__ = ("module", "name", "args", "kwargs")

    def __init__(self, module, name: str, args: list, kwargs: dict):
        self.module, self.name, self.args, self.kwargs = module, name, args, kwargs

    def __call__(self, bufs: list, stream) -> None:
        getattr(self.module, self.name)(
            *[bufs[a.index] if type(a) in (Slot, Value) else a for a in self.args],
            **{k: bufs[a.index] if type(a) in (Slot, Value) else a
               for k, a in self.kwargs.items()})


_runtime_knobs = None
_raw_stream = None


def launch_stream(device: torch.device, knobs: Tuning):
    """The stream a cached launch goes on, or None where launches must go through Triton's own
    path: HILBERT_FX_FAST_LAUNCH=0, launch hooks installed (a profiler reads what that path
    passes them), or a current CUDA device other than the tensors' (Triton launches on the
    current device, and a kernel's compiled function belongs to the device it was loaded on).
    CPU tensors: 0 (only launches replaced by stand-ins, scripts/host_profile.py --stub, ever
    reach a cached launch there; the interpreter returns no compiled kernel)."""
    global _runtime_knobs, _raw_stream
    if not knobs.fast_launch:
        return None
    if _runtime_knobs is None:
        import triton
        knobs_module = getattr(triton, "knobs", None)  # Triton 3.4 on
        _runtime_knobs = False if knobs_module is None else knobs_module.runtime
    if _runtime_knobs is False:
        return None
    for hook in (_runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook):
        if getattr(hook, "calls", hook):  # Triton 3.6's hook chains, or a plain hook (or None)
            return None
    if device.type != "cuda":
        return 0
    if _raw_stream is None:
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream)
    index = torch.cuda.current_device()
    if index != device.index:
        return None
    return _raw_stream(index)

