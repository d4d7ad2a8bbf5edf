"""Masks read symbolically: causal triangles built from sizes, proved for every size (dynamic
shapes), and the sequence structure of masks built from per-token tensors (SPEC section 5).

With static shapes a mask computed from constants alone is simply evaluated (constants.py). With
dynamic sizes that evaluation would only speak for the size at hand, and a mask built from
position ids or a padding mask has no compile-time value at all, so the mask's sub-graph is read
symbolically instead, over a small abstract domain whose values hold for every size and every
value of the tensors it reads (query index i, key index j, batch index b):
  Pos(dim, off)     an integer tensor equal to its index along `dim` (counted from the end)
                    plus `off`, broadcast elsewhere: torch.arange(n), shifted, unsqueezed. `off`
                    is an int or a sympy expression of symbolic sizes and of one-element integer
                    tensors read at run time (a static cache's length counter)
  Tri(lower, k)     a boolean [.., Lq, Lk] tensor: True where j <= i + k (lower) or j >= i + k
                    (upper): comparisons of two such aranges, torch.tril/triu
  Sel(tri, a, b)    a where tri else b, for scalars a and b: float triangles, additive masks
                    (`tri` a Tri or a Conj)
  Full(v)           a tensor whose every element is v, any shape (torch.ones(n, n), full,
                    zeros; a small constant found uniform, and anything indexed out of one)
  Tok(kind, node)   a per-token tensor [B, N] or [N] (token.py's reading: its values, or the
                    run ids of runs of consecutive values, as transformers computes them)
  At(tok, axis, b)  a per-token tensor read at each element's query index (axis -2) or key
                    index (axis -1), and batch index (dim b): x[batch_arange, kv_arange]
  Conj(atoms)       a boolean mask, the AND of its atoms: Tri, and Rel(kind, node, b) over a
                    per-token tensor (Rel's docstring): positions causal, same run, same id,
                    the key not padding, the key at or before the query's cache position
Anything else is None: not provably any of these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import sympy
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

@dataclass(frozen=True)
class Tok:
    """A per-token tensor: "raw" (the values of `node`), or of node's values "diff" (each minus
    the one before), "break" (that difference is not 1) and "runs" (the cumulative sum of the
    breaks: equal exactly within a run of consecutive values, as transformers numbers packed
    documents from position_ids)."""
    kind: str
    node: fx.Node

@dataclass(frozen=True)
class At:
    """`tok` read at each element's query index (axis -2) or key index (axis -1), and at its
    batch index along dim `bdim` (None: the per-token tensor has one row for every batch)."""
    tok: Tok
    axis: int
    bdim: Optional[int]

@dataclass(frozen=True)
class Rel:
    """A boolean mask over (batch b, query i, key j), from the per-token tensor x = `node`:
      "pos_le"    x[b, j] <= x[b, i]          (causal over position ids)
      "same_run"  i and j in one run of consecutive values of x[b]   (packed documents)
      "same_id"   x[b, j] == x[b, i]          (document ids)
      "key"       x[b, j]                     (a padding mask: True on real tokens)
      "key_le"    j <= x[i]                   (x: the cache rows the queries are written to)"""
    kind: str
    node: fx.Node
    bdim: Optional[int] = None

@dataclass(frozen=True)
class Conj:
    """The AND of `atoms` (Tri and Rel)."""
    atoms: frozenset


def norm(e):
    """An offset as an int where it is one, else a sympy expression."""
    if isinstance(e, bool):
        return None
    if isinstance(e, int):
        return e
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else e


def same_offset(a, b) -> bool:
    """Are two offsets (ints or sympy expressions) equal for every size and run-time value?"""
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return norm(sympy.sympify(a) - b) == 0


def _deps(value) -> set:
    """The dims (from the end) along which a value varies: where a broadcast must keep sizes."""
    if isinstance(value, Pos):
        return {value.dim}
    if isinstance(value, Tri):
        return {-1, -2}
    if isinstance(value, Sel):
        return _deps(value.tri)
    if isinstance(value, At):
        return {value.axis} | ({value.bdim} if value.bdim is not None else set())
    if isinstance(value, Rel):
        axes = {-1} if value.kind == "key" else {-1, -2}
        return axes | ({value.bdim} if value.bdim is not None else set())
    if isinstance(value, Conj):
        return set().union(*(_deps(a) for a in value.atoms)) if value.atoms else set()
    return set()


def names_nodes(value) -> bool:
    """Does the value name nodes of its graph (which a subgraph cannot use)?"""
    if isinstance(value, (Tok, At, Rel)):
        return True
    if isinstance(value, Conj):
        return any(names_nodes(a) for a in value.atoms)
    if isinstance(value, Sel):
        return names_nodes(value.tri)
    if isinstance(value, (Pos, Tri)):
        off = value.off if isinstance(value, Pos) else value.k
        return not isinstance(off, int)
    return False

_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}
_AND = {"and", "and_", "bitwise_and", "logical_and"}
_OR = {"or", "or_", "bitwise_or", "logical_or"}
_KEEP = {"to", "type", "long", "int", "contiguous", "clone", "detach", "expand", "expand_as",
         "bool", "float", "half", "bfloat16", "double", "_to_copy"}

class Triangles:
    """The abstract reading of mask sub-graphs (see above), memoised per node.

    `seeds`: abstract values given to placeholders (a FlexAttention mask_mod's b, h, q_idx,
    kv_idx and the tensors it reads). `pointwise`: the graph computes one element at a time
    (a mask_mod, vmapped by FlexAttention), so no shape says which dims a value varies along."""

    def __init__(self, flow: "DataFlow", seeds: Optional[dict] = None, pointwise: bool = False):
        self.flow = flow
        self.seeds = seeds or {}
        self.pointwise = pointwise
        self.memo: dict = {}
        self.tokens: dict = {}

    def __call__(self, node):
        if not isinstance(node, fx.Node):
            return node if isinstance(node, (int, float, bool)) else None
        if node in self.seeds:
            return self.seeds[node]
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

    def _float_activation(self, node: fx.Node) -> bool:
        """Is the node computed from a floating-point activation (hidden states)? Masks are built
        from sizes and from integer or boolean inputs (position ids, padding masks, cache
        positions), never from hidden states."""
        for p in self.flow.sources.get(node, ()):
            ex = example(p)
            if isinstance(ex, torch.Tensor) and (ex.is_floating_point() or ex.is_complex()):
                return True
        return False

    def _read(self, node: fx.Node):
        if node.op not in ("call_function", "call_method") or self._float_activation(node):
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
            other = arg(node, 1, "other")
            a, b = self._value(args[0]), self._value(other)
            if arg(node, 2, "alpha", 1) != 1:
                return None
            sign = -1 if name == "sub" else 1
            if isinstance(a, Pos):
                off = self.offset(other, node)
                return None if off is None else Pos(a.dim, norm(a.off + sign * off))
            if isinstance(b, Pos) and sign == 1:
                off = self.offset(args[0], node)
                return None if off is None else Pos(b.dim, norm(b.off + off))
            return None
        if name in ("getitem", "unsqueeze"):
            return self._index(node)
        if name in _KEEP:
            return self._keep(node)
        if name in ("le", "lt", "ge", "gt"):
            # j <= i + k holds of [Lq, Lk] scores whatever their shape (a query against a cache)
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
            if name == "eq" and isinstance(a, At) and isinstance(c, At) and a.tok == c.tok \
                    and {a.axis, c.axis} == {-1, -2} and a.bdim == c.bdim:
                kind = {"runs": "same_run", "raw": "same_id"}.get(a.tok.kind)
                return None if kind is None else Conj(frozenset({Rel(kind, a.tok.node, a.bdim)}))
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
            cond = self._condition(args[0])
            a, b = self._value(args[1]), self._value(args[2])
            if cond is not None and isinstance(a, (int, float)) and isinstance(b, (int, float)):
                return Sel(cond, a, b)
            return None
        if name == "masked_fill":
            base, cond = self._value(args[0]), self._condition(args[1])
            value = self._scalar(arg(node, 2, "value"))
            if isinstance(base, Full) and cond is not None and value is not None:
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
        """a & b, a | b of boolean masks. With a Full on one side: the other side, or the Full.
        Two masks ANDed: the Conj of their atoms. A value keeps its meaning only if the result
        keeps the sizes of the dims it varies along (a [1, 1] triangle broadcast is no triangle)."""
        nodes = [node.args[0], arg(node, 1, "other")]
        a, b = (Full(x) if isinstance(x, (bool, int, float)) else x
                for x in (self._value(nodes[0]), self._value(nodes[1])))
        ex = example(node)
        if not isinstance(ex, torch.Tensor) or ex.dtype != torch.bool:
            return None
        if isinstance(b, Full) and not isinstance(a, Full):
            a, b, nodes = b, a, nodes[::-1]
        if isinstance(a, Full):
            other_node = nodes[1]
            absorbing = not is_and  # x & False is False, x | True is True
            if bool(a.value) == absorbing:
                return Full(absorbing)
            if isinstance(b, Full):
                return Full(bool(b.value))
            if isinstance(b, Tri):
                src = example(other_node)
                if self.pointwise:
                    return b
                if isinstance(src, torch.Tensor) and src.dtype == torch.bool and src.dim() >= 2 \
                        and same_size(ex.shape[-1], src.shape[-1]) and same_size(ex.shape[-2], src.shape[-2]):
                    return b
                return None
            conj = self._as_conj(b, other_node)
            return conj if conj is not None and self._kept(conj, other_node, node) else None
        if not is_and:
            return None
        ca, cb = self._as_conj(a, nodes[0]), self._as_conj(b, nodes[1])
        if ca is None or cb is None or not (self._kept(ca, nodes[0], node) and self._kept(cb, nodes[1], node)):
            return None
        return Conj(ca.atoms | cb.atoms)

    def _as_conj(self, value, node) -> Optional[Conj]:
        """A boolean mask value as a Conj: a Tri, a Conj, or a boolean per-token tensor read at
        the key index (a padding mask), else None."""
        if isinstance(value, Conj):
            return value
        if isinstance(value, Tri):
            return Conj(frozenset({value}))
        if isinstance(value, At) and value.axis == -1 and value.tok.kind == "raw":
            ex = example(node)
            if isinstance(ex, torch.Tensor) and ex.dtype == torch.bool:
                return Conj(frozenset({Rel("key", value.tok.node, value.bdim)}))
        return None

    def _condition(self, node):
        """The condition of a where / masked_fill: a Tri or a Conj, else None."""
        v = self._value(node)
        if isinstance(v, Tri):
            return v
        return self._as_conj(v, node)

    def _kept(self, value, src_node, out_node) -> bool:
        """Does `out_node` (a broadcast, cast or AND of `src_node`) keep the sizes of the dims
        along which `value` varies?"""
        if self.pointwise:
            return True
        src, out = example(src_node), example(out_node)
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
            return False
        for d in _deps(value):
            if -d > src.dim() or -d > out.dim() or not same_size(src.shape[d], out.shape[d]):
                return False
        return True

    def _compare(self, op: str, a, b):
        """key index j against query index i: j <= i + c and its kin as a Tri; per-token values
        read at the key and at the query: positions causal (x[j] <= x[i]) and the key at or before
        the query's cache row (j <= x[i])."""
        if isinstance(a, Pos) and isinstance(b, Pos) and {a.dim, b.dim} == {-1, -2}:
            if a.dim == -2:  # i + q OP j + p  ==  j FLIP(OP) i + (q - p)
                a, b, op = b, a, _FLIP[op]
            c = norm(b.off - a.off)  # j + p OP i + q  ==  j OP i + (q - p)
            return {"le": Tri(True, c), "lt": Tri(True, norm(c - 1)), "ge": Tri(False, c),
                    "gt": Tri(False, norm(c + 1))}[op]
        if op in ("ge", "gt"):  # x >= y  ==  y <= x
            a, b, op = b, a, _FLIP[op]
        # an index is never negative: c <= i + off holds everywhere where c <= off (transformers'
        # bidirectional mask function, q_idx >= 0)
        if isinstance(b, Pos) and isinstance(b.off, int) and isinstance(a, int) \
                and not isinstance(a, bool) and (a <= b.off if op == "le" else a < b.off):
            return Full(True)
        if op != "le":
            return None
        if isinstance(a, At) and isinstance(b, At) and a.tok == b.tok and a.tok.kind == "raw" \
                and (a.axis, b.axis) == (-1, -2) and a.bdim == b.bdim:
            return Conj(frozenset({Rel("pos_le", a.tok.node, a.bdim)}))
        if isinstance(a, Pos) and a.dim == -1 and a.off == 0 and isinstance(b, At) \
                and b.axis == -2 and b.bdim is None and b.tok.kind == "raw":
            return Conj(frozenset({Rel("key_le", b.tok.node)}))
        return None

    def _keep(self, node: fx.Node):
        """Casts, copies and broadcasts that keep the last two dims as they were."""
        v = self._value(node.args[0])
        ex, src = example(node), example(node.args[0])
        if isinstance(v, (At, Conj)) and isinstance(ex, torch.Tensor) and isinstance(src, torch.Tensor):
            if not self._kept(v, node.args[0], node):
                return None
            if isinstance(v, At):
                return v if ex.dtype == src.dtype else None
            return v if ex.dtype == torch.bool else Sel(v, 1, 0)
        if not isinstance(v, (Pos, Tri, Sel, Full)) or not isinstance(ex, torch.Tensor):
            return None
        if isinstance(v, Pos):
            d = v.dim
            if self.pointwise:
                return v if not ex.dtype.is_floating_point else None
            if not isinstance(src, torch.Tensor) or -d > ex.dim() or not same_size(ex.shape[d], src.shape[d]):
                return None
            return v if not ex.dtype.is_floating_point else None
        if not self.pointwise and (not same_size(ex.shape[-1], src.shape[-1])
                                   or not same_size(ex.shape[-2], src.shape[-2])):
            return None
        if isinstance(v, Full):
            return Full(bool(v.value)) if ex.dtype == torch.bool else v
        if ex.dtype == torch.bool:
            if isinstance(v, Tri):
                return v
            if isinstance(v, Sel) and bool(v.a) != bool(v.b):
                if v.a:
                    return v.tri
                return v.tri.negate() if isinstance(v.tri, Tri) else None
            return None
        if isinstance(v, Tri):
            return Sel(v, 1, 0)
        return v

    # -- offsets and per-token tensors ----------------------------------------------------------
    def offset(self, x, reader: fx.Node):
        """x as an offset (an int, or a sympy expression) when it is a number for every call: an
        int, a symbolic size, or a one-element integer tensor (a symbol named by the tensor and by
        how many in-place writes to it come before `reader`, which reads it), else None."""
        if isinstance(x, bool):
            return None
        if isinstance(x, int):
            return x
        if not isinstance(x, fx.Node):
            return None
        ex = example(x)
        if isinstance(ex, torch.SymInt):
            return norm(ex.node.expr)
        if isinstance(ex, bool) or not isinstance(ex, (int, torch.Tensor)):
            return None
        if isinstance(ex, int):
            return ex
        if ex.numel() != 1 or ex.is_floating_point() or ex.is_complex() or ex.dtype == torch.bool \
                or any(isinstance(s, torch.SymInt) for s in ex.shape):
            return None
        value = self.flow.constant_value(x)
        if isinstance(value, torch.Tensor):
            return int(value.reshape(()).item())
        if self._float_activation(x):
            return None
        base = canonical(x)
        order = self.flow.order
        if base not in order or reader not in order:
            return None
        version = sum(1 for u in base.users if is_inplace(u) and u.args and u.args[0] is base
                      and order[u] < order[reader])
        symbol = sympy.Symbol(f"{base.name}#{id(base)}@{version}", integer=True)
        self.flow.atoms[symbol] = (base, version)
        return symbol

    def token(self, node) -> Optional[Tok]:
        """The reading of a per-token tensor ([B, N] or [N], integer or boolean): its values, or
        the breaks and run ids of runs of consecutive values (transformers' packed documents:
        (torch.diff(p, prepend=...) != 1).cumsum(-1)). None for values that change in place."""
        if not isinstance(node, fx.Node):
            return None
        if node in self.seeds:
            v = self.seeds[node]
            return v if isinstance(v, Tok) else None
        if node in self.flow.outer:
            flow, outer = self.flow.outer[node]
            if self.flow.callers is None or flow.triangle(outer) is not None:
                return None
            return flow._triangles_reader().token(outer)  # a per-token tensor passed in
        if node not in self.tokens:
            self.tokens[node] = None
            try:
                self.tokens[node] = self._token(node)
            except Exception:  # noqa: BLE001  (what we cannot read is no per-token tensor)
                self.tokens[node] = None
        return self.tokens[node]

    def _token(self, node: fx.Node) -> Optional[Tok]:
        ex = example(node)
        if not isinstance(ex, torch.Tensor) or ex.is_floating_point() or ex.is_complex() \
                or ex.dim() not in (1, 2):
            return None
        if any(is_inplace(u) and u.args and u.args[0] is node for u in node.users):
            return None
        if node.op in ("call_function", "call_method"):
            name = bare_name(node)
            src = node.args[0] if node.args else None
            src_ex = example(src)
            same = isinstance(src_ex, torch.Tensor) and src_ex.dtype == ex.dtype
            if name in ("contiguous", "clone", "detach", "to", "_to_copy") and same \
                    and tuple(src_ex.shape) == tuple(ex.shape):
                return self.token(src)
            if name in ("expand", "expand_as") and same and src_ex.dim() == ex.dim() \
                    and same_size(src_ex.shape[-1], ex.shape[-1]):
                return self.token(src)  # rows of one row: the batch broadcast
            if name == "diff":
                x = self.token(src)
                n, dim = arg(node, 1, "n", 1), arg(node, 2, "dim", -1)
                prepend, append = arg(node, 3, "prepend"), arg(node, 4, "append")
                if x is not None and x.kind == "raw" and n == 1 and dim in (-1, ex.dim() - 1) \
                        and prepend is not None and append is None \
                        and same_size(src_ex.shape[-1], ex.shape[-1]):
                    return Tok("diff", x.node)  # the first element's difference is any number
                return Tok("raw", node)
            if name == "ne":
                x = self.token(src)
                if x is not None and x.kind == "diff" and self._scalar(arg(node, 1, "other")) == 1:
                    return Tok("break", x.node)
            if name in ("int", "long", "to", "_to_copy") and tuple(src_ex.shape) == tuple(ex.shape):
                x = self.token(src)
                if x is not None and x.kind == "break":  # 0 / 1 in another dtype
                    return x
            if name == "cumsum":
                x = self.token(src)
                if x is not None and x.kind == "break" and arg(node, 1, "dim") in (-1, ex.dim() - 1):
                    # the first element's break only shifts every id by one: runs are unchanged
                    return Tok("runs", x.node)
        return Tok("raw", canonical(node))

    def _gather(self, node: fx.Node, idx: list, value=None):
        """x[batch_arange, kv_arange] (every dim of a per-token tensor indexed by an arange):
        the tensor read at each element's key (or query) index and batch index. An arange read
        so (`value`, x's reading, a Pos along its last dim) is the index itself, shifted."""
        src_node = node.args[0]
        src = example(src_node)
        if not isinstance(src, torch.Tensor) or len(idx) != src.dim() or src.dim() not in (1, 2) \
                or not all(isinstance(i, fx.Node) for i in idx):
            return None
        pos = [self._value(i) for i in idx]
        if not all(isinstance(p, Pos) for p in pos):
            return None
        *batch, t = pos
        if t.off != 0 or t.dim not in (-1, -2):
            return None
        bdim = None
        if batch:
            b = batch[0]
            if b.off != 0 or b.dim in (-1, -2):
                return None
            if not (isinstance(src.shape[0], int) and src.shape[0] == 1):
                bdim = b.dim
        if not self.pointwise:
            out = example(node)
            if not isinstance(out, torch.Tensor) or -t.dim > out.dim():
                return None
            # the tokens read are a prefix of x (all of it, or a padding mask that is longer
            # than the keys: its length symbolic where the keys' is not)
        if isinstance(value, Pos):
            return Pos(t.dim, value.off) if value.dim == -1 else None
        tok = self.token(src_node)
        return None if tok is None else At(tok, t.dim, bdim)

    def _triangle_rows(self, node: fx.Node, idx: list):
        """tril[None, None, rows]: the rows of a constant lower triangle of booleans [M, M] (a
        causal_mask buffer, as gpt-fast's) read at each query's cache row: key j is allowed
        where j <= rows[i] (Rel "key_le"; a Tri where rows is an arange, shifted)."""
        src_node = node.args[0]
        src = example(src_node)
        tensors = [i for i in idx if isinstance(i, fx.Node)]
        if src.dim() != 2 or len(tensors) != 1 or any(i is not None and i is not tensors[0]
                                                      for i in idx):
            return None
        rows = tensors[0]
        rex = example(rows)
        if not isinstance(rex, torch.Tensor) or rex.dim() != 1 or rex.is_floating_point() \
                or rex.dtype == torch.bool:
            return None
        if not self.flow.lower_triangle(src_node):
            return None
        at = self._value(rows)
        if isinstance(at, Pos) and at.dim == -1:
            return Tri(True, at.off)
        tok = self.token(rows)
        return Conj(frozenset({Rel("key_le", rows)})) if tok is not None and tok.kind == "raw" \
            else None

    def _index(self, node: fx.Node):
        """x[None, :, None], x.unsqueeze(d) of an arange; x[:, :, :n, :n] of a constant triangle;
        a constant triangle's rows read at the queries' cache rows (_triangle_rows)."""
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
        if isinstance(v, Full):  # any element of a uniform tensor is its value
            return v
        if any(isinstance(i, fx.Node) for i in idx):
            rows = self._triangle_rows(node, idx)
            return rows if rows is not None else self._gather(node, idx, v)
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
        return concrete_triangle(value)

def concrete_triangle(value):
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


def canonical(node):
    """The node whose value `node` is: through copies and device moves that keep the dtype (a
    cache length read as `n.to(device)` is `n`)."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.args:
        name = bare_name(node)
        src = node.args[0]
        ex, src_ex = example(node), example(src)
        if name not in ("to", "_to_copy", "contiguous", "clone", "detach") \
                or not isinstance(ex, torch.Tensor) or not isinstance(src_ex, torch.Tensor) \
                or ex.dtype != src_ex.dtype or tuple(ex.shape) != tuple(src_ex.shape):
            break
        node = src
    return node
