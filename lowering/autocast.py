"""The ops under torch.autocast behave as F.scaled_dot_product_attention does there: every
floating-point tensor argument (q, k, v, a float attn_mask) is cast to the autocast dtype, and
the op runs with autocast off.

Why it matters: in Hugging Face Llama under autocast, RoPE multiplies the bfloat16 q and k by
float32 cos/sin, so SDPA receives float32 q, k and a bfloat16 v and autocast casts them back. A
rewritten site must do the same, or it runs its kernels in float32.

torch.library.register_autocast takes one fixed dtype; here the dtype is read from the autocast
state at each call (bfloat16 or float16, whatever the user asked for).
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("hilbert_fx", "FRAGMENT")


def _cast(x, device_type: str, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device_type:
        return x.to(dtype)
    return x


def register_autocast(qualname: str) -> None:
    """Autocast kernels of op `qualname` ("hilbert_fx::name") for every device type with autocast."""
    op = torch._library.utils.lookup_op(qualname)
    name = qualname.split("::")[1]
    for device_type in ("cpu", "cuda"):
        if not torch._C._is_autocast_available(device_type):
            continue
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def run(*args, device_type=device_type, key=key):
            dtype = torch.get_autocast_dtype(device_type)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
                return op(*(_cast(a, device_type, dtype) for a in args))

        if op.has_kernel_for_dispatch_key(key):
            op.py_kernels.pop(key, None)
        op.py_impl(key)(run)  # used when tracing with the Python dispatcher (torch.compile)
        _LIB.impl(name, lambda _keys, *args, run=run: run(*args), key_name, with_keyset=True)
