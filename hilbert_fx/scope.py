"""`dilate`: opt a module class or instance in to the rewrite, with its own configuration.

If any module of a compiled graph carries `dilate`, only attention computed inside such a module
is rewritten, with the configuration of the innermost one (SPEC section 1). The configuration is
kept as a class attribute: decorating an instance gives it a subclass of its own class that
carries it, so that Dynamo's record of the module stack (the class of each module) shows it.
Such an instance pickles as its own class plus the configuration (torch.save works), and
`undilate` gives it its class back.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch.nn as nn

from .config import DilatedConfig

CONFIG_ATTR = "_hilbert_fx_config"
MARKED_ATTR = "_hilbert_fx_marked_instance"  # set on the subclasses made for instances


def _restore_dilated(base: type, state: dict, config: DilatedConfig) -> nn.Module:
    """Unpickling a dilated instance: the object of its own class, marked again."""
    obj = base.__new__(base)
    obj.__setstate__(state)
    return _mark_instance(obj, config)


def _reduce_dilated(self):
    base = type(self).__bases__[0]
    return _restore_dilated, (base, self.__getstate__(), getattr(type(self), CONFIG_ATTR))


def _mark_instance(obj: nn.Module, config: DilatedConfig) -> nn.Module:
    cls = obj.__class__
    if getattr(cls, MARKED_ATTR, False):  # marked before: replace its configuration
        cls = cls.__bases__[0]
    marked = type(cls.__name__, (cls,), {CONFIG_ATTR: config, MARKED_ATTR: True,
                                         "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__,
                                         "__reduce__": _reduce_dilated})
    obj.__class__ = marked
    return obj


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
            return _mark_instance(obj, config)
        raise ValueError(f"dilate expects an nn.Module subclass or instance, got {type(obj).__name__}")

    return mark if target is None else mark(target)


def undilate(target):
    """Undo `dilate` on a module class or instance (returns it); a no-op on unmarked ones."""
    if isinstance(target, type):
        if CONFIG_ATTR in vars(target):
            delattr(target, CONFIG_ATTR)
        return target
    if isinstance(target, nn.Module):
        if getattr(type(target), MARKED_ATTR, False):
            target.__class__ = type(target).__bases__[0]
        return target
    raise ValueError(f"undilate expects an nn.Module subclass or instance, got {type(target).__name__}")


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
    roots = [v for v in getattr(tx, "f_locals", {}).values() if isinstance(v, nn.Module)]
    for root in roots:
        _seen_roots.add(root)
    _remember_callers()
    return roots


def _remember_callers() -> None:
    """The modules whose forward is running further up the Python stack: after a graph break
    in an outer module's forward that left no graph of its own, Dynamo compiles the inner
    module's frame alone, and only the stack still knows the outer module."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(owner, nn.Module):
            _seen_roots.add(owner)
        frame = frame.f_back


# Modules seen as compiled roots. After a graph break Dynamo compiles an inner frame (say a
# transformers LlamaModel inside LlamaForCausalLM) whose module names start there; naming a
# module from the outermost root seen gives the name the user knows (model.layers.0.self_attn).
_seen_roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def module_names(extra_roots=()) -> dict[int, str]:
    """id(module) -> qualified name in the outermost known root that holds it."""
    roots = sorted(set(_seen_roots) | set(extra_roots), key=lambda r: sum(1 for _ in r.modules()))
    names: dict[int, str] = {}
    for root in roots:  # smaller roots first: the outermost one's names win
        names.update({id(m): n for n, m in root.named_modules()})
    return names
