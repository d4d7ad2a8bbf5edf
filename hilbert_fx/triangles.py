"""Causal triangles built from sizes, proved for every size (dynamic shapes).

With static shapes a mask computed from constants alone is simply evaluated (constants.py). With
dynamic sizes that evaluation would only speak for the size at hand, so the mask's sub-graph is
read symbolically instead, over a small abstract domain whose values hold for every size:
  Pos(dim, off)     an integer tensor equal to its index along `dim` (counted from the end)
                    plus `off`, broadcast elsewhere: torch.arange(n), shifted, unsqueezed
  Tri(lower, k)     a boolean [.., L, L] tensor: key j, query i, True where j <= i + k (lower)
                    or j >= i + k (upper): comparisons of two such aranges, torch.tril/triu
  Sel(tri, a, b)    a where tri else b, for scalars a and b: float triangles, additive masks
  Full(v)           a tensor whose every element is v, any shape (torch.ones(n, n), full,
                    zeros; a small constant found uniform, and anything indexed out of one)
Anything else is None: not provably a triangle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from .fx_vocab import arg, bare_name, example, is_inplace, same_size

if TYPE_CHECKING:
    from .dataflow import DataFlow

@dataclass(frozen=True)
class Pos:
    dim: int
    off: int

@dataclass(frozen=True)
class Tri:
    lower: bool
    k: int

    def negate(self) -> "Tri":  # not (j <= i + k) == j >= i + k + 1, and back
        return Tri(False, self.k + 1) if self.lower else Tri(True, self.k - 1)

@dataclass(frozen=True)
class Sel:
    tri: Tri
    a: float
    b: float

@dataclass(frozen=True)
class Full:
    value: float

_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}
_AND = {"and", "and_", "bitwise_and", "logical_and"}
_OR = {"or", "or_", "bitwise_or", "logical_or"}
_KEEP = {"to", "type", "long", "int", "contiguous", "clone", "detach", "expand", "expand_as",
         "bool", "float", "half", "bfloat16", "double", "_to_copy"}

class Triangles:
    """The abstract reading of size-only mask sub-graphs (see above), memoised per node."""

    def __init__(self, flow: "DataFlow"):
        self.flow = flow
        self.memo: dict = {}

    def __call__(self, node):
        if not isinstance(node, fx.Node):
            return node if isinstance(node, (int, float, bool)) else None
        if node in self.flow.outer:
            return self.flow.triangle(node)
        if node not in self.memo:
            self.memo[node] = None  # cycles cannot occur, but depth can: bound it by memo
            try:
                self.memo[node] = self._read(node)
            except Exception:  # noqa: BLE001  (what we cannot read is simply not a triangle)
                self.memo[node] = None
        return self.memo[node]

    def _scalar(self, x):
        if isinstance(x, bool):
            return x
        if isinstance(x, (int, float)):
            return x
        if not isinstance(x, fx.Node):
            return None
        ex = example(x)
        if isinstance(ex, torch.Tensor) and ex.numel() == 1 and not any(
                isinstance(s, torch.SymInt) for s in ex.shape):
            v = self.flow.constant_value(x)
            if isinstance(v, torch.Tensor):
                return v.reshape(()).item()
        if isinstance(ex, (int, float)) and not isinstance(ex, bool):
            return ex
        return None

    def _value(self, x):
        """An abstract value or a Python scalar (a one-element Full is its value)."""
        v = self(x)
        if isinstance(v, Full):
            ex = example(x)
            if isinstance(ex, torch.Tensor) and ex.numel() == 1:
                return v.value
        if v is not None:
            return v
        s = self._scalar(x)
        return None if s is None else s

    def _square(self, node) -> bool:
        ex = example(node)
        return isinstance(ex, torch.Tensor) and ex.dim() >= 2 and same_size(ex.shape[-1], ex.shape[-2])

    def _read(self, node: fx.Node):
        if node.op not in ("call_function", "call_method") or self.flow.sources.get(node):
            return None
        if is_inplace(node) or any(is_inplace(u) and u.args and u.args[0] is node for u in node.users):
            return None
        name = bare_name(node)
        args = node.args
        ex = example(node)
        if name == "arange":
            start, end = (0, args[0]) if len(args) == 1 else (args[0], args[1])
            step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
            if "start" in node.kwargs or "end" in node.kwargs:
                start, end = node.kwargs.get("start", start), node.kwargs.get("end", end)
            return Pos(-1, start) if isinstance(start, int) and step == 1 else None
        if name in ("add", "sub", "iadd"):
            a, b = self._value(args[0]), self._value(arg(node, 1, "other"))
            if arg(node, 2, "alpha", 1) != 1:
                return None
            sign = -1 if name == "sub" else 1
            if isinstance(a, Pos) and isinstance(b, int) and not isinstance(b, bool):
                return Pos(a.dim, a.off + sign * b)
            if isinstance(b, Pos) and isinstance(a, int) and not isinstance(a, bool) and sign == 1:
                return Pos(b.dim, b.off + a)
            return None
        if name in ("getitem", "unsqueeze"):
            return self._index(node)
        if name in _KEEP:
            return self._keep(node)
        if name in ("le", "lt", "ge", "gt"):
            if not self._square(node):
                return None
            return self._compare(name, self._value(args[0]), self._value(arg(node, 1, "other")))
        if name in ("eq", "ne"):
            a, c = self._value(args[0]), self._value(arg(node, 1, "other"))
            if isinstance(c, Sel) and not isinstance(a, Sel):
                a, c = c, a
            if isinstance(a, Sel) and isinstance(c, (int, float)):
                hit_a, hit_b = a.a == c, a.b == c
                if hit_a == hit_b:
                    return None
                tri = a.tri if hit_a else a.tri.negate()
                return tri if name == "eq" else tri.negate()
            values = [x.value if isinstance(x, Full) else x for x in (a, c)]
            if all(isinstance(x, (bool, int, float)) for x in values) and Full in (type(a), type(c)):
                return Full((values[0] == values[1]) == (name == "eq"))
            return None
        if name in _AND or name in _OR:
            return self._logical(node, name in _AND)
        if name in ("logical_not", "invert", "bitwise_not", "__invert__"):
            v = self._value(args[0])
            return v.negate() if isinstance(v, Tri) else None
        if name in ("ones", "zeros", "full", "ones_like", "zeros_like", "full_like", "new_ones",
                    "new_zeros", "new_full"):
            if name.endswith("ones"):
                value = 1
            elif name.endswith("zeros"):
                value = 0
            else:
                value = self._scalar(arg(node, 2 if name == "new_full" else 1, "fill_value"))
            if value is None:
                return None
            return Full(True if value and ex.dtype == torch.bool else value)
        if name in ("tril", "triu"):
            base = self._value(args[0])
            k = arg(node, 1, "diagonal", 0)
            if not isinstance(base, Full) or not isinstance(k, int) or not self._square(node):
                return None
            tri = Tri(name == "tril", k)
            return tri if base.value is True else Sel(tri, base.value, 0)
        if name == "where":
            cond = self._value(args[0])
            a, b = self._value(args[1]), self._value(args[2])
            if isinstance(cond, Tri) and isinstance(a, (int, float)) and isinstance(b, (int, float)):
                return Sel(cond, a, b)
            return None
        if name == "masked_fill":
            base, cond = self._value(args[0]), self._value(args[1])
            value = self._scalar(arg(node, 2, "value"))
            if isinstance(base, Full) and isinstance(cond, Tri) and value is not None:
                return Sel(cond, value, base.value)
            return None
        if name == "mul":
            a, c = self._value(args[0]), self._value(arg(node, 1, "other"))
            if isinstance(c, Sel):
                a, c = c, a
            if isinstance(a, Sel) and isinstance(c, (int, float)) and not isinstance(c, bool):
                return Sel(a.tri, a.a * c, a.b * c)
            return None
        return self._uniform_constant(node)

    def _uniform_constant(self, node: fx.Node):
        """Full(v) for a small compile-time constant whose elements all equal v: transformers'
        document ids of one unpacked sequence (position ids 0..N-1 give a single document)."""
        value = self.flow.constant_value(node)
        if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.is_complex():
            return None
        first = value.flatten()[0]
        if not bool((value == first).all()):
            return None
        return Full(first.item())

    def _logical(self, node: fx.Node, is_and: bool):
        """a & b, a | b of boolean masks where one side is a Full: the other side, or the Full.
        A Tri keeps its meaning only if the result has the Tri's last two dims."""
        nodes = [node.args[0], arg(node, 1, "other")]
        a, b = (Full(x) if isinstance(x, (bool, int, float)) else x
                for x in (self._value(nodes[0]), self._value(nodes[1])))
        ex = example(node)
        if not isinstance(ex, torch.Tensor) or ex.dtype != torch.bool:
            return None
        if isinstance(b, Full) and not isinstance(a, Full):
            a, b, nodes = b, a, nodes[::-1]
        if not isinstance(a, Full):
            return None
        other_node = nodes[1]
        absorbing = not is_and  # x & False is False, x | True is True
        if bool(a.value) == absorbing:
            return Full(absorbing)
        if isinstance(b, Full):
            return Full(bool(b.value))
        if isinstance(b, Tri):
            src = example(other_node)
            if isinstance(src, torch.Tensor) and src.dtype == torch.bool and src.dim() >= 2 \
                    and same_size(ex.shape[-1], src.shape[-1]) and same_size(ex.shape[-2], src.shape[-2]):
                return b
        return None

    @staticmethod
    def _compare(op: str, a, b):
        """key index j against query index i: j <= i + c and its kin as a Tri."""
        if not (isinstance(a, Pos) and isinstance(b, Pos)) or {a.dim, b.dim} != {-1, -2}:
            return None
        if a.dim == -2:  # i + q OP j + p  ==  j FLIP(OP) i + (q - p)
            a, b, op = b, a, _FLIP[op]
        c = b.off - a.off  # j + p OP i + q  ==  j OP i + (q - p)
        return {"le": Tri(True, c), "lt": Tri(True, c - 1), "ge": Tri(False, c),
                "gt": Tri(False, c + 1)}[op]

    def _keep(self, node: fx.Node):
        """Casts, copies and broadcasts that keep the last two dims as they were."""
        v = self._value(node.args[0])
        ex, src = example(node), example(node.args[0])
        if not isinstance(v, (Pos, Tri, Sel, Full)) or not isinstance(ex, torch.Tensor):
            return None
        if isinstance(v, Pos):
            d = v.dim
            if not isinstance(src, torch.Tensor) or -d > ex.dim() or not same_size(ex.shape[d], src.shape[d]):
                return None
            return v if not ex.dtype.is_floating_point else None
        if not same_size(ex.shape[-1], src.shape[-1]) or not same_size(ex.shape[-2], src.shape[-2]):
            return None
        if isinstance(v, Full):
            return Full(bool(v.value)) if ex.dtype == torch.bool else v
        if ex.dtype == torch.bool:
            if isinstance(v, Tri):
                return v
            if isinstance(v, Sel) and bool(v.a) != bool(v.b):
                return v.tri if v.a else v.tri.negate()
            return None
        if isinstance(v, Tri):
            return Sel(v, 1, 0)
        return v

    def _index(self, node: fx.Node):
        """x[None, :, None], x.unsqueeze(d) of an arange; x[:, :, :n, :n] of a constant triangle."""
        src, ex = example(node.args[0]), example(node)
        if not isinstance(src, torch.Tensor) or not isinstance(ex, torch.Tensor):
            return None
        if bare_name(node) == "unsqueeze":
            d = arg(node, 1, "dim")
            idx = [slice(None)] * src.dim()
            idx.insert(d % ex.dim(), None)
        else:
            idx = node.args[1]
            idx = list(idx) if isinstance(idx, tuple) else [idx]
        v = self(node.args[0])
        if isinstance(v, Pos):
            src_dim = src.dim() + v.dim
            if Ellipsis in idx:
                e = idx.index(Ellipsis)
                fill = src.dim() - sum(1 for i in idx if i is not None and i is not Ellipsis)
                idx = idx[:e] + [slice(None)] * fill + idx[e + 1:]
            consumed, out = 0, 0
            for i in idx:
                if i is None:
                    out += 1
                elif i == slice(None):
                    if consumed == src_dim:
                        return Pos(out - ex.dim(), v.off)
                    consumed += 1
                    out += 1
                else:
                    return None
            if consumed <= src_dim:  # trailing dims not named: kept in place
                return Pos(out + (src_dim - consumed) - ex.dim(), v.off)
            return None
        if isinstance(v, Full):  # any element of a uniform tensor is its value
            return v
        if isinstance(v, (Tri, Sel)):  # new leading dims only: the triangle is kept
            plain = all(i is None or i is Ellipsis or i == slice(None) for i in idx)
            if plain and ex.dim() >= 2 and same_size(ex.shape[-1], src.shape[-1]) and same_size(
                    ex.shape[-2], src.shape[-2]) and (idx[-1] is Ellipsis or idx[-1] == slice(None)
                                                      or len([i for i in idx if i is not None]) < src.dim() - 1):
                return v
            return None
        # a constant triangle (a registered buffer) sliced from 0 to the same stop on both dims
        if len(idx) < 2 or Ellipsis in idx or None in idx or len(idx) > src.dim():
            return None
        last = [i for i in idx[-2:]]
        if len(idx) != src.dim() or not all(isinstance(i, slice) and i.start in (None, 0)
                                            and i.step in (None, 1) for i in last):
            return None
        if not all(i == slice(None) for i in idx[:-2]):
            return None
        stop_a, stop_b = last[0].stop, last[1].stop
        if not (stop_a is stop_b or (isinstance(stop_a, int) and stop_a == stop_b)):
            return None
        value = self.flow.constant_value(node.args[0])
        return _concrete_triangle(value)

def _concrete_triangle(value):
    """Tri / Sel when a concrete [.., M, M] tensor is tril (k=0) or triu (k=1) of one value."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return None
    m = value.shape[-1]
    lower = torch.ones(m, m, dtype=torch.bool, device=value.device).tril()
    for tri, pattern in ((Tri(True, 0), lower), (Tri(False, 1), ~lower)):
        if value.dtype == torch.bool:
            if bool((value == pattern).all()):
                return tri
            continue
        inside, outside = value[..., pattern], value[..., ~pattern]
        if inside.numel() and outside.numel() and bool((inside == inside.flatten()[0]).all()) \
                and bool((outside == outside.flatten()[0]).all()) and bool((outside == 0).all()):
            return Sel(tri, inside.flatten()[0].item(), 0)
    return None
