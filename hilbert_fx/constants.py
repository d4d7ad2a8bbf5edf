"""Compile-time constants: the value of a node computed only from constants, buffers and static
sizes (causal triangles built from aranges, torch.tril, registered buffers), evaluated once per
node by DataFlow.constant_value. Symbolic sizes and dynamic floats are not constants (a hint
speaks for one call alone); triangles over symbolic sizes are read by triangles.py instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from .fx_vocab import example, grapharg_example, is_buffer, is_inplace, target_name

if TYPE_CHECKING:
    from .dataflow import DataFlow

CONSTANT_NUMEL_LIMIT = 1 << 24  # largest intermediate evaluated at compile time (elements)

# Ops whose value is not a function of their inputs: never treated as compile-time constants.
_NONDETERMINISTIC = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "empty",
                     "poisson", "exponential", "geometric", "cauchy", "log_normal", "seed",
                     "record", "manual")
_NOT_CONSTANT = {"print", "item", "tolist", "numpy", "data_ptr", "set_", "copy_", "storage",
                 "untyped_storage", "_local_scalar_dense"}


def evaluate(flow: DataFlow, node: fx.Node):
    """The value of `node` from its operands' constant values (flow.constant_value), or None.
    Raises whatever running the op raises; the caller treats that as not a constant."""
    ex = example(node)
    if isinstance(ex, (bool, int, float)):
        return ex
    if isinstance(ex, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return None  # known only at run time: its hint speaks for this call alone
    if isinstance(ex, torch.Tensor) and ex.numel() > CONSTANT_NUMEL_LIMIT:
        return None
    if node.op == "placeholder":
        real = grapharg_example(node)
        if (isinstance(real, torch.Tensor) and not isinstance(real, torch.nn.Parameter)
                and not real.requires_grad and is_buffer(node)
                and real.numel() <= CONSTANT_NUMEL_LIMIT):
            return real.detach().clone()
        return None
    if node.op == "get_attr":
        obj = flow.graph.owning_module
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return obj.detach().clone() if isinstance(obj, torch.Tensor) else obj
    if node.op not in ("call_function", "call_method"):
        return None
    if is_inplace(node) or any(is_inplace(u) and u.args and u.args[0] is node for u in node.users):
        return None  # a value that changes over time is no constant
    name = target_name(node)
    if name in _NOT_CONSTANT or any(word in str(name).lower() for word in _NONDETERMINISTIC):
        return None
    if flow.sources.get(node):
        return None  # depends on an activation's value
    failed = []

    def load(a):
        if isinstance(a, fx.Node):
            v = flow.constant_value(a)
            if v is None:
                failed.append(a)
            return v
        return a
    args = fx.node.map_aggregate(node.args, load)
    kwargs = fx.node.map_aggregate(node.kwargs, load)
    if failed:
        return None
    if node.op == "call_method":
        self_arg, *rest = args
        return getattr(self_arg, node.target)(*rest, **kwargs)
    return node.target(*args, **kwargs)


def lower_triangle_buffer(node: fx.Node) -> bool:
    """Is `node` a registered buffer holding a square boolean lower triangle of ones (j <= i),
    however large? gpt-fast's causal_mask spans max_seq_length squared (1G elements at 32K,
    past CONSTANT_NUMEL_LIMIT), so it is compared with the triangle a block of rows at a time,
    no block larger than that limit."""
    real = grapharg_example(node) if node.op == "placeholder" and is_buffer(node) else None
    if not (isinstance(real, torch.Tensor) and not real.requires_grad
            and real.dtype == torch.bool and real.dim() == 2 and real.shape[0] == real.shape[1]):
        return False
    m = real.shape[0]
    cols = torch.arange(m, device=real.device)
    step = max(1, CONSTANT_NUMEL_LIMIT // max(m, 1))
    for start in range(0, m, step):
        rows = torch.arange(start, min(start + step, m), device=real.device)
        if not torch.equal(real[start:start + step], cols[None, :] <= rows[:, None]):
            return False
    return True

