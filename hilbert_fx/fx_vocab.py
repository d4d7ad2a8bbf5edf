"""The FX vocabulary that every finder reads graphs with: a node's recorded value and shape, its
arguments, the name of what it calls, the canonical step it performs (one table for functions,
methods and aten overloads, products included), in-place writes, and repeat_kv undone.

The SDPA, MHA and hand-written finders (detect_*.py) and the data-flow facts (dataflow.py,
constants.py, triangles.py) import these from here, so that they agree on what a node is.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------
# Values, shapes, arguments, names
# ---------------------------------------------------------------------------------------------
def example(node) -> Optional[object]:
    """The fake tensor (or value) recorded for a node, if any; a non-node is its own value."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node) -> Optional[tuple]:
    """The recorded shape of a tensor node, or None."""
    ex = example(node)
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else None


def is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(example(node), torch.Tensor)


def same_size(a, b) -> bool:
    """Are two (possibly symbolic) sizes the same expression? Never installs a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return not isinstance(a, int) and not isinstance(b, int) and str(a) == str(b)


def arg(node: fx.Node, index: int, name: str, default=None):
    """An argument given by position `index` or by keyword `name` (a method's self is 0)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def target_name(node: fx.Node) -> str:
    """The name of what a node calls: a method's name, a function's __name__, "" otherwise."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return ""


def bare_name(node: fx.Node) -> str:
    """target_name with operators' dunders stripped (x.__eq__(y) is "eq")."""
    name = target_name(node)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


# ---------------------------------------------------------------------------------------------
# In-place writes
# ---------------------------------------------------------------------------------------------
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift}


def is_inplace(node: fx.Node) -> bool:
    """Does this node write into its first argument (x.mul_(s), x += m, masked_fill_)?"""
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        if node.target is operator.setitem:
            return True
        if node.target in _INPLACE_OPERATORS:
            first = node.args[0] if node.args else None
            return isinstance(first, fx.Node) and isinstance(example(first), torch.Tensor)
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_") and name not in ("and_", "or_", "not_")
    return False


# ---------------------------------------------------------------------------------------------
# Canonical steps: one name for every spelling of an op
# ---------------------------------------------------------------------------------------------
def _targets(*names):
    out = set()
    for name in names:
        obj = torch
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        out.add(obj)
    return out


_FUNCTIONS = {}
for _name, _targets_of in {
    "matmul": _targets("matmul", "Tensor.matmul", "Tensor.__matmul__", "ops.aten.matmul.default") | {operator.matmul},
    "mm": _targets("mm", "Tensor.mm", "ops.aten.mm.default"),
    "bmm": _targets("bmm", "Tensor.bmm", "ops.aten.bmm.default"),
    "einsum": _targets("einsum", "functional.einsum", "ops.aten.einsum.default"),
    "baddbmm": _targets("baddbmm", "Tensor.baddbmm", "ops.aten.baddbmm.default"),
    "mul": _targets("mul", "multiply", "Tensor.mul", "ops.aten.mul.Tensor", "ops.aten.mul.Scalar") | {operator.mul, operator.imul},
    "div": _targets("div", "divide", "true_divide", "Tensor.div", "ops.aten.div.Tensor", "ops.aten.div.Scalar") | {operator.truediv, operator.itruediv},
    "add": _targets("add", "Tensor.add", "ops.aten.add.Tensor") | {operator.add, operator.iadd},
    "sub": _targets("sub", "subtract", "Tensor.sub", "ops.aten.sub.Tensor") | {operator.sub, operator.isub},
    "where": _targets("where", "ops.aten.where.self"),
    "masked_fill": _targets("masked_fill", "ops.aten.masked_fill.Scalar", "ops.aten.masked_fill.Tensor"),
    "softmax": _targets("softmax", "_softmax", "special.softmax", "ops.aten._softmax.default", "ops.aten.softmax.int") | {F.softmax},
    "dropout": _targets("dropout", "ops.aten.dropout.default") | {F.dropout},
    "transpose": _targets("transpose", "swapaxes", "swapdims", "ops.aten.transpose.int"),
    "permute": _targets("permute", "ops.aten.permute.default"),
    "cast": _targets("clone", "ops.aten.clone.default", "ops.aten._to_copy.default"),
    "reshape": _targets("reshape", "flatten", "unflatten", "ops.aten.view.default",
                        "ops.aten.reshape.default", "ops.aten._unsafe_view.default"),
}.items():
    for _t in _targets_of:
        _FUNCTIONS[_t] = _name

_METHODS = {
    "matmul": "matmul", "__matmul__": "matmul", "mm": "mm", "__rmatmul__": "rmatmul",
    "bmm": "bmm", "baddbmm": "baddbmm",
    "mul": "mul", "mul_": "mul", "multiply": "mul", "div": "div", "div_": "div",
    "true_divide": "div", "divide": "div", "add": "add", "add_": "add", "sub": "sub", "sub_": "sub",
    "masked_fill": "masked_fill", "masked_fill_": "masked_fill", "softmax": "softmax",
    "to": "cast", "float": "cast", "half": "cast", "double": "cast", "bfloat16": "cast",
    "type": "cast", "type_as": "cast", "contiguous": "cast", "clone": "cast",
    "transpose": "transpose", "swapaxes": "swapaxes", "swapdims": "transpose", "permute": "permute",
    "where": "where_method", "view": "reshape", "reshape": "reshape", "flatten": "reshape",
    "unflatten": "reshape", "view_as": "reshape", "reshape_as": "reshape",
}

# Products of two tensors, every spelling ("rmatmul": x.__rmatmul__(y) is y @ x, operands
# swapped). The hand-written finder reads q k^T and p v from matmul, bmm, einsum and baddbmm.
PRODUCTS = frozenset({"matmul", "mm", "bmm", "baddbmm", "einsum", "rmatmul"})


def op_name(node) -> Optional[str]:
    """The canonical step a node performs, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        name = _METHODS.get(node.target)
        return "transpose" if name == "swapaxes" else name
    if node.op == "call_function":
        if node.target is getattr and len(node.args) == 2:
            return {"mT": "mT", "mH": "mT", "T": "T"}.get(node.args[1])
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(node.target) if node.graph.owning_module else None
        if isinstance(module, torch.nn.Softmax):
            return "softmax"
        if isinstance(module, torch.nn.Dropout):
            return "dropout"
    return None


SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                torch.ops.aten.scaled_dot_product_attention.default)

# Calls that attend (they mix positions of the sequence): SDPA, nn.MultiheadAttention's
# functional form and the fused eval paths of nn.TransformerEncoderLayer / nn.MultiheadAttention.
ATTENTION_TARGETS = frozenset(SDPA_TARGETS) | {F.multi_head_attention_forward} | {
    getattr(torch, name) for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")
    if hasattr(torch, name)}


# ---------------------------------------------------------------------------------------------
# GQA: keys and values expanded to the query heads (repeat_kv, repeat_interleave)
# ---------------------------------------------------------------------------------------------
def unrepeat_kv(node) -> tuple[object, int]:
    """(base, rep) when node is base [B, Hkv, N, D] with each head repeated rep times in a row
    (head h reads base head h // rep), as Llama's repeat_kv or repeat_interleave(rep, dim=1) do;
    (node, 1) otherwise."""
    if not isinstance(node, fx.Node):
        return node, 1
    out = shape_of(node)
    if out is None or len(out) != 4:
        return node, 1
    name = target_name(node)
    if name == "repeat_interleave":
        base = node.args[0]
        reps = arg(node, 1, "repeats")
        dim = arg(node, 2, "dim")
        bs = shape_of(base)
        if isinstance(reps, int) and dim in (1, -3) and bs and len(bs) == 4 and bs[1] * reps == out[1]:
            return base, reps
        return node, 1
    if name not in ("reshape", "view"):
        return node, 1
    expanded = node.args[0]
    if not isinstance(expanded, fx.Node):
        return node, 1
    es = shape_of(expanded)
    if target_name(expanded) != "expand" or es is None or len(es) != 5:
        return node, 1
    b, hkv, rep, n, d = es
    if (b, hkv * rep, n, d) != out:
        return node, 1
    unsq = expanded.args[0]
    us = shape_of(unsq)
    if us is None or us[2] != 1 or len(us) != 5:
        return node, 1
    uname = target_name(unsq)
    base = unsq.args[0]
    if shape_of(base) != (b, hkv, n, d):
        return node, 1
    if uname == "unsqueeze" and arg(unsq, 1, "dim") in (2, -3):
        return base, rep
    if uname == "getitem" and isinstance(unsq.args[1], tuple):
        index = [i for i in unsq.args[1] if i is not Ellipsis] if unsq.args[1][-1] is Ellipsis else list(unsq.args[1])
        full = slice(None, None, None)
        if len(index) >= 3 and index[0] == full and index[1] == full and index[2] is None and all(
                i == full for i in index[3:]):
            return base, rep
    return node, 1


def unrepeat_pair(k, v) -> tuple[object, object, int]:
    """(k, v, rep): both un-repeated when they were repeated alike, else as they were."""
    k0, rk = unrepeat_kv(k)
    v0, rv = unrepeat_kv(v)
    if rk > 1 and rk == rv:
        return k0, v0, rk
    return k, v, 1


# ---------------------------------------------------------------------------------------------
# Placeholders: what Dynamo recorded of the value behind a graph input
# ---------------------------------------------------------------------------------------------
def grapharg_example(node: fx.Node):
    """The real value behind a placeholder, when Dynamo still holds it."""
    grapharg = node.meta.get("grapharg")
    if grapharg is None:
        return None
    try:
        return grapharg.example
    except Exception:  # noqa: BLE001  (a dead weak reference)
        return None


def _source_name(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return ""
    name = getattr(source, "name", "")
    try:
        return str(name() if callable(name) else name)
    except Exception:  # noqa: BLE001
        return ""


def is_parameter(node: fx.Node) -> bool:
    """Is this placeholder a parameter or a buffer of the model (not an activation)?"""
    value = example(node)
    if isinstance(value, torch.nn.Parameter):
        return True
    if isinstance(grapharg_example(node), torch.nn.Parameter):
        return True
    name = _source_name(node)
    return any(part in name or part in node.name for part in ("_parameters", "_buffers"))


def is_buffer(node: fx.Node) -> bool:
    name = _source_name(node)
    return "_buffers" in name or ("_buffers_" in node.name and not name)
