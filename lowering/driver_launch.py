"""Kernel launches handed straight to the CUDA driver (cuLaunchKernelEx through ctypes), each
launch's parameters packed once.

Why: a cached launch (lowering/triton_launch.py) still hands Triton 3.6's C launcher a Python
tuple of every argument, which it parses (PyArg_ParseTuple over the Hopper backward's 124
arguments) and copies into C variables before it calls the driver: about 14 us of host time per
Hopper launch on an H100's host, for a launch whose arguments differ from the last one's only in
its tensors' addresses and the stream. At N = 8K a forward+backward makes ten such launches,
and the backward's run on autograd's device thread, where Python runs about half as fast
(BENCHMARKS.md, "Host cost per call").

`build` packs a compiled kernel's parameters as the C launcher would (triton/backends/nvidia/
driver.py, make_launcher): each parameter of the kernel's signature that is not a compile-time
constant, in order, in its C type; a TMA descriptor as its 128-byte CUtensorMap (the one Triton
encoded, read where its PyCUtensorMap object keeps it) followed by its shape (int32) and strides
(int64); then the two scratch pointers. A call writes its tensors' addresses into that block,
points the descriptors' parameters at their tensor maps (kept by address, as the C launcher's
path keeps them) and calls the driver, with the launch configuration the C launcher gives:
grid, 32 * num_warps threads, the kernel's shared memory, the stream.

`build` returns None, and the launch keeps Triton's C launcher, unless everything it relies on
holds: a signature of scalar, pointer and descriptor types; one CTA per cluster, no cooperative
or programmatic-dependent launch, no scratch memory; and the kernel's parameters, as the driver
reports them (cuFuncGetParamInfo), exactly the packed ones in number and size. A launch the
driver refuses (no current context on the calling thread, say) goes through the C launcher,
which makes the context current or raises Triton's error.
"""
from __future__ import annotations

import ctypes
import struct
import sys
import threading

__all__ = ["build", "available"]

# the C type of each scalar in the launcher's signature (driver.py, ty_to_cpp), as struct codes;
# floats in 16 bits are left to the C launcher
_INTEGERS = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32,
             "u64": ctypes.c_uint64}  # the integers a call may pass (triton_launch.Value)
_SCALARS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B",
            "u16": "H", "u32": "I", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}
_MAP_BYTES = 128  # sizeof(CUtensorMap)
# PyCUtensorMapObject (driver.c): PyObject_HEAD, then the map aligned to 128 bytes
_MAP_OFFSET, _MAP_OBJECT_SIZE = 128, 256
MAPS = 256  # tensor maps kept per descriptor parameter, as gluon_forward.Descriptor.MAPS


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


_driver = None


def _functions():
    """(cuLaunchKernelEx, cuFuncGetParamInfo) of libcuda, or None where either is missing."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            launch, info = lib.cuLaunchKernelEx, lib.cuFuncGetParamInfo
        except (OSError, AttributeError):
            _driver = False
        else:
            launch.argtypes = [ctypes.c_void_p] * 4
            launch.restype = ctypes.c_int
            info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                             ctypes.POINTER(ctypes.c_size_t)]
            info.restype = ctypes.c_int
            _driver = (launch, info)
    return _driver or None


def available() -> bool:
    return sys.platform.startswith("linux") and _functions() is not None


def expanded_signature(signature, tensordesc_meta) -> list | None:
    """The launcher's parameter types (driver.py, make_launcher's _expand_signature), a
    descriptor with its metadata as 'nvTmaDesc', then its shape and strides; None for what the
    driver launch leaves to the C launcher (tuples, descriptors Triton passes as pointers)."""
    out, k = [], 0
    for sig in signature:
        if not isinstance(sig, str):
            return None
        if sig.startswith("tensordesc"):
            meta = tensordesc_meta[k] if tensordesc_meta and k < len(tensordesc_meta) else None
            k += 1
            if meta is None or "[" not in sig:
                return None
            ndim = sig[sig.index("[") + 1:].split("]")[0].count(",") + 1
            out += ["nvTmaDesc"] + ["i32"] * ndim + ["i64"] * ndim
        else:
            out.append(sig)
    return out


def _param_size(ty: str) -> int | None:
    if ty.startswith("*"):
        return 8
    if ty == "nvTmaDesc":
        return _MAP_BYTES
    code = _SCALARS.get(ty)
    return None if code is None else struct.calcsize(code)


class DriverLaunch:
    """One launch's parameter block and configuration; calling it launches with a call's
    tensors (`bufs`, by slot) on `stream`. `fallback(bufs, stream)`: the same launch through
    Triton's C launcher."""
    __slots__ = ("_block", "_params", "_config", "_config_ref", "_function", "_pointers",
                 "_values", "_maps", "_lock", "fallback", "_launch")

    def __call__(self, bufs: list, stream) -> None:
        params = self._params
        with self._lock:
            for cell, slot in self._pointers:
                cell.value = bufs[slot].data_ptr()
            for cell, slot in self._values:
                cell.value = bufs[slot]
            for index, slot, maps in self._maps:
                params[index] = maps.address(bufs[slot])
            self._config.hStream = stream
            failed = self._launch(self._config_ref, self._function, params, None)
        if failed:
            self.fallback(bufs, stream)


class _TensorMaps:
    """A descriptor parameter's tensor maps by the tensor's data pointer: the address of the
    128-byte CUtensorMap inside the PyCUtensorMap object that `expand(x)` (Triton's encoding,
    gluon_forward.Descriptor.expanded) returns first, the object kept alive here."""
    __slots__ = ("expand", "by_pointer")

    def __init__(self, expand):
        self.expand, self.by_pointer = expand, {}

    def address(self, x) -> int:
        ptr = x.data_ptr()
        hit = self.by_pointer.get(ptr)
        if hit is None:
            tensor_map = self.expand(x)[0]
            if len(self.by_pointer) >= MAPS:
                self.by_pointer.clear()
            self.by_pointer[ptr] = hit = (map_address(tensor_map), tensor_map)
        return hit[0]


def is_tensor_map(obj) -> bool:
    """Whether obj is Triton 3.6's PyCUtensorMap (driver.c), whose map `map_address` finds."""
    return (type(obj).__name__ == "PyCUtensorMap"
            and sys.getsizeof(obj) >= _MAP_OBJECT_SIZE)


def map_address(obj) -> int:
    """The address of the CUtensorMap a PyCUtensorMap object holds (CPython's id is the
    object's address)."""
    return id(obj) + _MAP_OFFSET


def build(compiled, values: list, pointer_slots, map_slots, grid, fallback, value_slots=()):
    """A DriverLaunch of `compiled` (a Triton CompiledKernel whose launcher has run), or None
    where the launch must keep Triton's C launcher (module docstring).

    values: the launcher's arguments after its 13 leading ones, as the C launcher receives them
    (descriptors expanded into tensor map, shape and strides), with the call's tensors' places
    holding anything; pointer_slots: (position in values, slot) of those tensors;
    map_slots: (position of a tensor map in values, slot, expand) where expand(x) gives the
    expansion of the descriptor of tensor x; grid: three ints; value_slots: (position in values,
    slot) of the integers each call passes (bufs[slot] an int of the class the kernel was
    compiled for: triton_launch.Value)."""
    functions = _functions() if sys.platform.startswith("linux") else None
    try:
        run, src, metadata = compiled.run, compiled.src, compiled.metadata
        num_warps, num_ctas, shared = compiled.packed_metadata
        signature = expanded_signature(list(src.signature.values()),
                                       getattr(metadata, "tensordesc_meta", None))
        plain = (num_ctas == 1 and not run.launch_cooperative_grid and not run.launch_pdl
                 and not run.global_scratch_size and not run.profile_scratch_size)
        function = int(compiled.function)
    except Exception:  # noqa: BLE001 - another Triton: its own launcher
        return None
    if (functions is None or signature is None or not plain or len(signature) != len(values)
            or min(grid) <= 0):  # the C launcher launches nothing for an empty grid
        return None
    launch_kernel, param_info = functions
    pointer_at, map_at = dict(pointer_slots), {i: (slot, expand) for i, slot, expand in map_slots}
    value_at = dict(value_slots)
    kept = [(i, ty) for i, ty in enumerate(signature) if ty != "constexpr"]
    sizes = [_param_size(ty) for _, ty in kept] + [8, 8]  # the two scratch pointers
    if None in sizes or not _params_match(param_info, function, sizes):
        return None
    # every parameter but the tensor maps in an 8-byte cell of one block (the driver reads each
    # parameter's own size from its pointer, little-endian)
    block = ctypes.create_string_buffer(8 * len(sizes))
    base = ctypes.addressof(block)
    params = (ctypes.c_void_p * len(sizes))()
    pointers, maps, integers = [], [], []
    for n, (i, ty) in enumerate(kept):
        params[n] = base + 8 * n
        value = values[i]
        if ty == "nvTmaDesc":
            if i not in map_at or not is_tensor_map(value):
                return None
            slot, expand = map_at[i]
            maps.append((n, slot, _TensorMaps(expand)))
            params[n] = None
        elif i in pointer_at:
            if not ty.startswith("*"):
                return None
            pointers.append((ctypes.c_uint64.from_address(base + 8 * n), pointer_at[i]))
        elif i in value_at:
            if ty not in _INTEGERS:
                return None
            integers.append((_INTEGERS[ty].from_address(base + 8 * n), value_at[i]))
        elif ty.startswith("*"):
            if value is not None and not isinstance(value, int):
                return None
            struct.pack_into("Q", block, 8 * n, value or 0)
        else:
            if not isinstance(value, (int, float)):
                return None
            struct.pack_into(_SCALARS[ty], block, 8 * n, value)
    for n in range(len(kept), len(sizes)):  # the scratch pointers: null
        params[n] = base + 8 * n
    config = _LaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = 32 * num_warps, 1, 1
    config.sharedMemBytes = shared
    config.attrs, config.numAttrs = None, 0
    out = DriverLaunch()
    out._block, out._params, out._config = block, params, config
    out._config_ref, out._function = ctypes.byref(config), ctypes.c_void_p(function)
    out._pointers, out._values, out._maps = tuple(pointers), tuple(integers), tuple(maps)
    out._lock, out.fallback, out._launch = threading.Lock(), fallback, launch_kernel
    return out


def _params_match(param_info, function: int, sizes: list) -> bool:
    """Whether the kernel takes exactly these parameters' sizes, as the driver reports them."""
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    for index, want in enumerate(sizes):
        if param_info(function, index, ctypes.byref(offset), ctypes.byref(size)) != 0 \
                or size.value != want:
            return False
    return param_info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)) != 0
