"""Launches handed straight to the CUDA driver (lowering/driver_launch.py): the parameter block
holds what Triton 3.6's C launcher would pass the kernel, for each call's tensors.

No GPU here: the driver's two functions are stand-ins. The launch stand-in reads every
parameter through the pointers it is given, as cuLaunchKernelEx does, with the sizes the
parameter-info stand-in reports; the expected values are written out from the C launcher's rules
(triton/backends/nvidia/driver.py, make_launcher): compile-time constants dropped, each other
parameter in its C type, a descriptor as its tensor map then its shape (int32) and strides
(int64), two null scratch pointers last, 32 * num_warps threads. scripts/host_profile.py checks
the same launches against Triton's own path on a GPU.
"""
import ctypes
import os
import struct
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hilbert_fx.lowering import driver_launch  # noqa: E402

SIZES = {"*": 8, "i1": 1, "i32": 4, "i64": 8, "fp32": 4, "nvTmaDesc": 128}


def _size(ty):
    return SIZES["*"] if ty.startswith("*") else SIZES[ty]


class Driver:
    """cuLaunchKernelEx and cuFuncGetParamInfo for a kernel of the given parameter types."""

    def __init__(self, kernel_params, result=0):
        self.kernel_params, self.result, self.launches = kernel_params, result, []

    def param_info(self, function, index, offset, size):
        if index >= len(self.kernel_params):
            return 1  # CUDA_ERROR_INVALID_VALUE
        size._obj.value = _size(self.kernel_params[index])
        return 0

    def launch(self, config_ref, function, params, extra):
        config = config_ref._obj
        read = [ctypes.string_at(params[i], _size(ty)) for i, ty in enumerate(self.kernel_params)]
        self.launches.append(dict(
            grid=(config.gridDimX, config.gridDimY, config.gridDimZ),
            block=(config.blockDimX, config.blockDimY, config.blockDimZ),
            shared=config.sharedMemBytes, stream=config.hStream, attrs=config.numAttrs,
            function=function.value, extra=extra, params=read))
        return self.result


def _compiled(signature, meta=None, num_warps=4, shared=1024, **run):
    run = types.SimpleNamespace(**{**dict(launch_cooperative_grid=False, launch_pdl=False,
                                          global_scratch_size=0, profile_scratch_size=0), **run})
    return types.SimpleNamespace(
        run=run, src=types.SimpleNamespace(signature=signature), function=0xF00,
        metadata=types.SimpleNamespace(tensordesc_meta=meta),
        packed_metadata=(num_warps, 1, shared))


class Map:
    """A tensor map's stand-in: 128 bytes at a fixed address."""

    def __init__(self, tag: int):
        self.buffer = ctypes.create_string_buffer(bytes([tag]) * 128)


@pytest.fixture
def driver(monkeypatch):
    def install(kernel_params, result=0):
        d = Driver(kernel_params, result)
        monkeypatch.setattr(driver_launch, "_functions", lambda: (d.launch, d.param_info))
        monkeypatch.setattr(driver_launch.sys, "platform", "linux")
        monkeypatch.setattr(driver_launch, "is_tensor_map", lambda obj: isinstance(obj, Map))
        monkeypatch.setattr(driver_launch, "map_address",
                            lambda obj: ctypes.addressof(obj.buffer))
        return d
    return install


SIGNATURE = {"x": "*bf16", "desc": "tensordesc<bf16[64, 128]>", "n": "i32", "scale": "fp32",
             "BLOCK": "constexpr", "stride": "i64", "flag": "i1", "y": "*fp32"}
KERNEL = ["*bf16", "nvTmaDesc", "i32", "i32", "i64", "i64", "i32", "fp32", "i64", "i1", "*fp32",
          "*i8", "*i8"]  # the expanded parameters, then the two scratch pointers


def _build(driver_stub, fallback=None):
    x_slot, y_slot, desc_slot = 0, 1, 2
    maps = {}

    def expand(t):  # what gluon_forward.Descriptor.expanded gives: map, shape, strides
        maps.setdefault(t.data_ptr(), Map(len(maps) + 1))
        return [maps[t.data_ptr()], 4096, 128, 128, 1]

    first = [torch.zeros(4), torch.zeros(4), torch.zeros(8)]
    # the launcher's arguments after its leading 13: x, the descriptor's expansion, n, scale,
    # BLOCK (a compile-time constant the launcher skips), stride, flag, y
    values = [None, *expand(first[desc_slot]), 4097, 0.125, 64, 1 << 40, True, None]
    launch = driver_launch.build(
        _compiled(SIGNATURE, meta=[{"swizzle": 128}]), values, [(0, x_slot), (11, y_slot)],
        [(1, desc_slot, expand)], (3, 2, 1), fallback or (lambda bufs, stream: None))
    return launch, maps, first


def test_the_parameter_block_is_what_the_c_launcher_passes(driver):
    d = driver(KERNEL)
    launch, maps, first = _build(d)
    assert launch is not None
    second = [torch.zeros(4), torch.zeros(4), torch.zeros(8)]
    for bufs, stream in ((first, 7), (second, 9), (first, 11)):
        launch(bufs, stream)
        got = d.launches[-1]
        assert got["grid"] == (3, 2, 1) and got["block"] == (128, 1, 1)
        assert got["shared"] == 1024 and got["stream"] == stream and got["attrs"] == 0
        assert got["function"] == 0xF00 and got["extra"] is None
        want = [struct.pack("Q", bufs[0].data_ptr()),
                bytes([list(maps).index(bufs[2].data_ptr()) + 1]) * 128,
                struct.pack("i", 4096), struct.pack("i", 128), struct.pack("q", 128),
                struct.pack("q", 1), struct.pack("i", 4097), struct.pack("f", 0.125),
                struct.pack("q", 1 << 40), struct.pack("b", 1),
                struct.pack("Q", bufs[1].data_ptr()), bytes(8), bytes(8)]
        assert got["params"] == want
    assert len(maps) == 2  # a tensor map per address, made once


def test_a_refused_launch_goes_through_the_c_launcher(driver):
    d = driver(KERNEL, result=201)  # CUDA_ERROR_INVALID_CONTEXT
    calls = []
    launch, _, first = _build(d, fallback=lambda bufs, stream: calls.append((bufs, stream)))
    launch(first, 5)
    assert len(d.launches) == 1 and calls == [(first, 5)]


@pytest.mark.parametrize("kernel_params", [KERNEL[:-1], KERNEL + ["i32"],
                                           KERNEL[:2] + ["i64"] + KERNEL[3:]],
                         ids=["fewer", "more", "other-size"])
def test_a_kernel_whose_parameters_differ_keeps_the_c_launcher(driver, kernel_params):
    driver(kernel_params)
    assert _build(None)[0] is None


@pytest.mark.parametrize("change", [
    dict(run=dict(launch_pdl=True)), dict(run=dict(launch_cooperative_grid=True)),
    dict(run=dict(global_scratch_size=64)), dict(signature={"h": "fp16"}),
    dict(signature={"t": ("i32", "i32")}), dict(meta=None)],
    ids=["pdl", "cooperative", "scratch", "fp16-scalar", "tuple", "descriptor-as-pointer"])
def test_what_the_driver_launch_does_not_pack_keeps_the_c_launcher(driver, change):
    driver(KERNEL)
    signature = {**SIGNATURE, **change.get("signature", {})}
    compiled = _compiled(signature, meta=change.get("meta", [{"swizzle": 128}]),
                         **change.get("run", {}))
    values = [None] * len(driver_launch.expanded_signature(
        list(signature.values()), [{"swizzle": 128}]) or [])
    assert driver_launch.build(compiled, values, [], [], (1, 1, 1), None) is None


def test_without_a_driver_nothing_is_built():
    """On this CPU machine there is no libcuda: every launch keeps Triton's path."""
    if driver_launch.available():
        pytest.skip("a CUDA driver is installed here")
    assert driver_launch.build(_compiled(SIGNATURE), [], [], [], (1, 1, 1), None) is None


def test_integers_of_each_call_are_written_in_their_c_types(driver):
    """triton_launch.Value: an integer each call passes (a decoding step's cache length, the
    strides that follow from it) goes into its parameter in the kernel's C type at each call."""
    d = driver(KERNEL)
    maps = {}

    def expand(t):
        maps.setdefault(t.data_ptr(), Map(len(maps) + 1))
        return [maps[t.data_ptr()], 4096, 128, 128, 1]

    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(8)]
    values = [None, *expand(tensors[2]), 4097, 0.125, 64, 1 << 40, True, None]
    launch = driver_launch.build(
        _compiled(SIGNATURE, meta=[{"swizzle": 128}]), values, [(0, 0), (11, 1)],
        [(1, 2, expand)], (3, 2, 1), lambda bufs, stream: None, [(6, 3), (9, 4)])
    assert launch is not None
    for n, stride in ((4097, 1 << 40), (4113, (1 << 40) + 16), (-3, 7)):
        launch(tensors + [n, stride], 0)
        params = d.launches[-1]["params"]
        assert params[6] == struct.pack("i", n) and params[8] == struct.pack("q", stride)
        assert params[0] == struct.pack("Q", tensors[0].data_ptr())
    # an integer of the call where the kernel takes no integer: the C launcher
    assert driver_launch.build(
        _compiled(SIGNATURE, meta=[{"swizzle": 128}]), values, [(11, 1)], [(1, 2, expand)],
        (3, 2, 1), None, [(0, 3)]) is None
