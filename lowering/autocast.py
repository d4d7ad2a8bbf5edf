"""The ops under torch.autocast behave as F.scaled_dot_product_attention does there: every
floating-point tensor argument (q, k, v, a float attn_mask) is cast to the autocast dtype, and
the op runs with autocast off.

Why it matters: in Hugging Face Llama under autocast, RoPE multiplies the bfloat16 q and k by
float32 cos/sin, so SDPA receives float32 q, k and a bfloat16 v and autocast casts them back. A
rewritten site must do the same, or it runs its kernels in float32.

torch.library.register_autocast takes one fixed dtype; here the dtype is read from the autocast
state at each call (bfloat16 or float16, whatever the user asked for).

The op's eager path (lowering/op.py), which does not go through the dispatcher, applies the same
rule with `autocast_dtype`, `cast_args` and `autocast_off`.
"""
from __future__ import annotations

from typing import Optional

import torch

_LIB = torch.library.Library("hilbert_fx", "FRAGMENT")

# The dispatch key of autocast for each device type that has one (the types the ops register
# an autocast kernel for).
_KEYS = {device_type: getattr(torch._C.DispatchKey,
                              "Autocast" + torch._C._dispatch_key_for_device(device_type))
         for device_type in ("cpu", "cuda") if torch._C._is_autocast_available(device_type)}


def _cast(x, device_type: str, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device_type:
        return x.to(dtype)
    return x


def cast_args(args, device_type: str, dtype: torch.dtype) -> tuple:
    """The arguments as the ops' autocast kernel hands them on: floating-point tensors on
    `device_type` in `dtype`, everything else as it is."""
    return tuple(_cast(a, device_type, dtype) for a in args)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype the ops' autocast kernel casts to for tensors on `device_type`; None where it
    does not run (autocast off there, or a device type without one)."""
    if device_type not in _KEYS or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str):
    """A guard under which the ops' inner operations run with autocast off, as inside their
    autocast kernel."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEYS[device_type]))


def register_autocast(qualname: str) -> None:
    """Autocast kernels of op `qualname` ("hilbert_fx::name") for every device type with autocast."""
    op = torch._library.utils.lookup_op(qualname)
    name = qualname.split("::")[1]
    for device_type, key in _KEYS.items():
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)

        def run(*args, device_type=device_type, key=key):
            dtype = torch.get_autocast_dtype(device_type)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
                return op(*cast_args(args, device_type, dtype))

        if op.has_kernel_for_dispatch_key(key):
            op.py_kernels.pop(key, None)
        op.py_impl(key)(run)  # used when tracing with the Python dispatcher (torch.compile)
        _LIB.impl(name, lambda _keys, *args, run=run: run(*args), key_name, with_keyset=True)
