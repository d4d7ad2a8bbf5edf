"""`dilate`: opt a module class or instance in to the rewrite, with its own configuration.

If any module of a compiled graph carries `dilate`, only attention computed inside such a module
is rewritten, with the configuration of the innermost one (SPEC section 1). The configuration is
kept as a class attribute: decorating an instance gives it a subclass of its own class that
carries it, so that Dynamo's record of the module stack (the class of each module) shows it.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from .config import DilatedConfig

CONFIG_ATTR = "_hilbert_fx_config"


def dilate(target=None, *, segment_lengths, dilation_rates, hilbert: bool = True,
           lowering: str = "auto", mesh=None):
    """Mark a module class (as a decorator) or a module instance (returns it)."""
    config = DilatedConfig(tuple(segment_lengths), tuple(dilation_rates), hilbert, lowering, mesh)

    def mark(obj):
        if isinstance(obj, type):
            if not issubclass(obj, nn.Module):
                raise ValueError(f"dilate expects an nn.Module subclass or instance, got class {obj.__name__}")
            setattr(obj, CONFIG_ATTR, config)
            return obj
        if isinstance(obj, nn.Module):
            cls = obj.__class__
            marked = type(cls.__name__, (cls,), {CONFIG_ATTR: config, "__module__": cls.__module__,
                                                 "__qualname__": cls.__qualname__})
            obj.__class__ = marked
            return obj
        raise ValueError(f"dilate expects an nn.Module subclass or instance, got {type(obj).__name__}")

    return mark if target is None else mark(target)


def config_of(module_type: type) -> Optional[DilatedConfig]:
    return getattr(module_type, CONFIG_ATTR, None)


def compiled_roots() -> list[nn.Module]:
    """The modules among the locals of the frame Dynamo is compiling (the compiled model itself).

    Dynamo's record of module stacks leaves out the root module, so `dilate` on the whole model,
    and "does any module of the compiled model carry dilate", need the frame's own locals. They
    are only there while a backend runs inside Dynamo; elsewhere this returns [].
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - outside Dynamo, or another torch version's internals
        return []
    if tx is None:
        return []
    return [v for v in getattr(tx, "f_locals", {}).values() if isinstance(v, nn.Module)]
