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
