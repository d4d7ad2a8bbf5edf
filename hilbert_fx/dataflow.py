"""Facts about where tensors come from, over one FX graph.

- Which activation inputs of the graph (not parameters, buffers or sizes) each node reads.
- Self-attention: keys and values computed from the same sequence as the queries. We prove it
  from data flow: q, k and v must derive from one latest common activation through
  position-wise ops only (projections, norms, rotary embeddings, reshapes), never through an
  op that mixes positions of two activations (another attention, a product of activations).
- Closed regions: no value of a matched attention, other than its output, is used outside it
  (proved on a networkx view of the graph).
- Compile-time constants: the value of a node computed only from constants, buffers and static
  sizes (causal triangles built from aranges, torch.tril, registered buffers), evaluated once.
  Symbolic sizes and dynamic floats are not constants; triangles over symbolic sizes are read
  symbolically (Triangles, at the end).
"""
from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx


def _example(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _grapharg_example(node: fx.Node):
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


def _is_parameter(node: fx.Node) -> bool:
    value = _example(node)
    if isinstance(value, torch.nn.Parameter):
        return True
    if isinstance(_grapharg_example(node), torch.nn.Parameter):
        return True
    name = _source_name(node)
    return any(part in name or part in node.name for part in ("_parameters", "_buffers"))


def _is_buffer(node: fx.Node) -> bool:
    name = _source_name(node)
    return "_buffers" in name or ("_buffers_" in node.name and not name)


def activation_sources(graph: fx.Graph) -> dict[fx.Node, frozenset]:
    """For every node, the set of activation placeholders it depends on. Parameters, buffers
    and sizes (SymInt placeholders of dynamic shapes) are not activations."""
    sources: dict[fx.Node, frozenset] = {}
    empty = frozenset()
    for node in graph.nodes:
        if node.op == "placeholder":
            is_tensor = isinstance(_example(node), torch.Tensor)
            sources[node] = frozenset([node]) if is_tensor and not _is_parameter(node) else empty
        elif node.op == "get_attr":
            sources[node] = empty
        else:
            acc = empty
            for inp in node.all_input_nodes:
                s = sources.get(inp, empty)
                if s and s is not acc:
                    acc = s if not acc else acc | s
            sources[node] = acc
    return sources


_MATMULS = {torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.Tensor.matmul,
            torch.Tensor.bmm, torch.Tensor.__matmul__, torch.mm, torch.Tensor.baddbmm,
            torch.ops.aten.bmm.default, torch.ops.aten.mm.default, operator.matmul,
            torch.functional.einsum}
_MATMUL_METHODS = {"matmul", "bmm", "baddbmm", "mm", "__matmul__", "__rmatmul__"}
_ATTENTION = {torch.nn.functional.scaled_dot_product_attention,
              torch._C._nn.scaled_dot_product_attention,
              torch.nn.functional.multi_head_attention_forward}
for _name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
    if hasattr(torch, _name):
        _ATTENTION.add(getattr(torch, _name))

# Ops whose value is not a function of their inputs: never treated as compile-time constants.
_NONDETERMINISTIC = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "empty",
                     "poisson", "exponential", "geometric", "cauchy", "log_normal", "seed",
                     "record", "manual")
_NOT_CONSTANT = {"print", "item", "tolist", "numpy", "data_ptr", "set_", "copy_", "storage",
                 "untyped_storage", "_local_scalar_dense"}

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
            return isinstance(first, fx.Node) and isinstance(_example(first), torch.Tensor)
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_") and name not in ("and_", "or_", "not_")
    return False


CONSTANT_NUMEL_LIMIT = 1 << 24  # largest intermediate evaluated at compile time (elements)


class DataFlow:
    """Ancestry questions over one graph. The networkx view is built on first use."""

    def __init__(self, graph: fx.Graph, outer: dict | None = None):
        """`outer` maps placeholders of a subgraph (the body of a higher-order op, such as a
        checkpointed region) to (the calling graph's DataFlow, the node passed in there), so
        that a mask built outside the region is still read where it was built."""
        self.graph = graph
        self.outer = outer or {}
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.sources = activation_sources(graph)
        self._dag = None
        self._constants: dict = {}
        self._triangles = None

    # -- the networkx view ------------------------------------------------------------------
    @property
    def dag(self):
        if self._dag is None:
            import networkx as nx
            dag = nx.DiGraph()
            dag.add_nodes_from(self.graph.nodes)
            dag.add_edges_from((inp, n) for n in self.graph.nodes for inp in n.all_input_nodes)
            self._dag = dag
        return self._dag

    def ancestors(self, node: fx.Node) -> set:
        import networkx as nx
        return nx.ancestors(self.dag, node) | {node}

    def descendants(self, node: fx.Node) -> set:
        """The nodes computed from `node`, itself excluded."""
        import networkx as nx
        return nx.descendants(self.dag, node)

    def escapes(self, region: set, output: fx.Node) -> list:
        """The edges by which a value of `region` other than `output` reaches a node outside it:
        empty when the region is closed (its intermediate values die with it)."""
        import networkx as nx
        inner = region - {output}
        return [(u, w) for u, w in nx.edge_boundary(self.dag, inner) if w not in region]

    # -- activations -------------------------------------------------------------------------
    def is_activation(self, node) -> bool:
        return isinstance(node, fx.Node) and bool(self.sources.get(node))

    def mixes_positions(self, node: fx.Node) -> bool:
        """Does this node combine different positions of a sequence (attention, a product of
        two activations)? Position-wise ops (projections, norms, rotary, reshapes) do not."""
        if node.op == "call_module":
            return False
        target = node.target
        if node.op == "call_function" and target in _ATTENTION:
            return True
        if (node.op == "call_function" and target in _MATMULS) or (
                node.op == "call_method" and target in _MATMUL_METHODS):
            operands = [a for a in node.all_input_nodes if self.is_activation(a)]
            return len(operands) >= 2
        if node.op == "call_function" and getattr(target, "_qualname", "").startswith("hilbert_fx::"):
            return True
        return False

    def common_source(self, nodes) -> tuple[fx.Node | None, str]:
        """The latest activation from which every node derives through position-wise ops only.

        Returns (node, "") or (None, reason). Walks up from the nodes in decreasing graph order,
        so it only visits what lies between them and their common source."""
        cross = "keys/values are not computed from the queries' sequence (cross-attention)"
        nodes = list(dict.fromkeys(n for n in nodes if isinstance(n, fx.Node)))
        if not nodes:
            return None, "q, k and v are not nodes of the graph"
        full = (1 << len(nodes)) - 1
        reach: dict[fx.Node, int] = {}
        for i, n in enumerate(nodes):
            reach[n] = reach.get(n, 0) | (1 << i)
        heap = [(-self.order[n], id(n), n) for n in nodes]
        heapq.heapify(heap)
        seen = set(nodes)
        popped = []
        source = None
        while heap:
            _, _, n = heapq.heappop(heap)
            if reach[n] == full and self.is_activation(n) and n.op != "get_attr":
                source = n
                break
            popped.append(n)
            for inp in n.all_input_nodes:
                if not self.sources.get(inp):
                    continue  # parameters and constants: no sequence comes through them
                reach[inp] = reach.get(inp, 0) | reach[n]
                if inp not in seen:
                    seen.add(inp)
                    heapq.heappush(heap, (-self.order[inp], id(inp), inp))
        if source is None:
            return None, cross
        # Which of the popped nodes descend from the source (they lie between it and the nodes)?
        below = {source}
        for n in sorted(popped, key=self.order.__getitem__):
            if any(inp in below for inp in n.all_input_nodes):
                below.add(n)
        for b in below:
            if b is not source and b not in nodes and self.mixes_positions(b):
                return None, cross
        return source, ""

    # -- causal triangles for every size ------------------------------------------------------
    def triangle(self, node):
        """The abstract value (Tri, Sel, ...) of a size-only mask node, or None."""
        if node in self.outer:
            flow, outer_node = self.outer[node]
            return flow.triangle(outer_node)
        if self._triangles is None:
            self._triangles = Triangles(self)
        return self._triangles(node)

    # -- compile-time constants --------------------------------------------------------------
    def constant_value(self, node):
        """The value of `node` if it is computed from constants, buffers and static sizes only,
        else None. Evaluated once per node, and only
        where every intermediate stays under CONSTANT_NUMEL_LIMIT elements."""
        if not isinstance(node, fx.Node):
            return node
        if node in self.outer:
            flow, outer_node = self.outer[node]
            return flow.constant_value(outer_node)
        if node in self._constants:
            return self._constants[node]
        value = None
        try:
            value = self._evaluate(node)
        except Exception:  # noqa: BLE001  (anything we cannot run is simply not a constant)
            value = None
        self._constants[node] = value
        return value

    def _evaluate(self, node: fx.Node):
        ex = _example(node)
        if isinstance(ex, (bool, int, float)):
            return ex
        if isinstance(ex, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None  # known only at run time: its hint speaks for this call alone
        if isinstance(ex, torch.Tensor) and ex.numel() > CONSTANT_NUMEL_LIMIT:
            return None
        if node.op == "placeholder":
            real = _grapharg_example(node)
            if (isinstance(real, torch.Tensor) and not isinstance(real, torch.nn.Parameter)
                    and not real.requires_grad and _is_buffer(node)
                    and real.numel() <= CONSTANT_NUMEL_LIMIT):
                return real.detach().clone()
            return None
        if node.op == "get_attr":
            obj = self.graph.owning_module
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            return obj.detach().clone() if isinstance(obj, torch.Tensor) else obj
        if node.op not in ("call_function", "call_method"):
            return None
        if is_inplace(node) or any(is_inplace(u) and u.args and u.args[0] is node for u in node.users):
            return None  # a value that changes over time is no constant
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name in _NOT_CONSTANT or any(word in str(name).lower() for word in _NONDETERMINISTIC):
            return None
        if self.sources.get(node):
            return None  # depends on an activation's value
        failed = []

        def load(a):
            if isinstance(a, fx.Node):
                v = self.constant_value(a)
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


# ---------------------------------------------------------------------------------------------
# Causal triangles built from sizes, proved for every size (dynamic shapes)
# ---------------------------------------------------------------------------------------------
# With static shapes a mask computed from constants alone is simply evaluated (constant_value).
# With dynamic sizes that evaluation would only speak for the size at hand, so the mask's
# sub-graph is read symbolically instead, over a small abstract domain whose values hold for
# every size:
#   Pos(dim, off)     an integer tensor equal to its index along `dim` (counted from the end)
#                     plus `off`, broadcast elsewhere: torch.arange(n), shifted, unsqueezed
#   Tri(lower, k)     a boolean [.., L, L] tensor: key j, query i, True where j <= i + k (lower)
#                     or j >= i + k (upper): comparisons of two such aranges, torch.tril/triu
#   Sel(tri, a, b)    a where tri else b, for scalars a and b: float triangles, additive masks
#   Full(v)           a tensor whose every element is v, any shape (torch.ones(n, n), full,
#                     zeros; a small constant found uniform, and anything indexed out of one)
# Anything else is None: not provably a triangle.
from dataclasses import dataclass as _dataclass


@_dataclass(frozen=True)
class Pos:
    dim: int
    off: int


@_dataclass(frozen=True)
class Tri:
    lower: bool
    k: int

    def negate(self) -> "Tri":  # not (j <= i + k) == j >= i + k + 1, and back
        return Tri(False, self.k + 1) if self.lower else Tri(True, self.k - 1)


@_dataclass(frozen=True)
class Sel:
    tri: Tri
    a: float
    b: float


@_dataclass(frozen=True)
class Full:
    value: float


def _name(node: fx.Node) -> str:
    """The op's name, operators' dunders without their underscores (x.__eq__(y) is "eq")."""
    name = ""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


def _same_size(a, b) -> bool:
    """Are two (possibly symbolic) sizes the same expression? Never installs a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return not isinstance(a, int) and not isinstance(b, int) and str(a) == str(b)


_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}
_AND = {"and", "and_", "bitwise_and", "logical_and"}
_OR = {"or", "or_", "bitwise_or", "logical_or"}
_KEEP = {"to", "type", "long", "int", "contiguous", "clone", "detach", "expand", "expand_as",
         "bool", "float", "half", "bfloat16", "double", "_to_copy"}


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


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
        ex = _example(x)
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
            ex = _example(x)
            if isinstance(ex, torch.Tensor) and ex.numel() == 1:
                return v.value
        if v is not None:
            return v
        s = self._scalar(x)
        return None if s is None else s

    def _square(self, node) -> bool:
        ex = _example(node)
        return isinstance(ex, torch.Tensor) and ex.dim() >= 2 and _same_size(ex.shape[-1], ex.shape[-2])

    def _read(self, node: fx.Node):
        if node.op not in ("call_function", "call_method") or self.flow.sources.get(node):
            return None
        if is_inplace(node) or any(is_inplace(u) and u.args and u.args[0] is node for u in node.users):
            return None
        name = _name(node)
        args = node.args
        ex = _example(node)
        if name == "arange":
            start, end = (0, args[0]) if len(args) == 1 else (args[0], args[1])
            step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
            if "start" in node.kwargs or "end" in node.kwargs:
                start, end = node.kwargs.get("start", start), node.kwargs.get("end", end)
            return Pos(-1, start) if isinstance(start, int) and step == 1 else None
        if name in ("add", "sub", "iadd"):
            a, b = self._value(args[0]), self._value(_arg(node, 1, "other"))
            if _arg(node, 2, "alpha", 1) != 1:
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
            return self._compare(name, self._value(args[0]), self._value(_arg(node, 1, "other")))
        if name in ("eq", "ne"):
            a, c = self._value(args[0]), self._value(_arg(node, 1, "other"))
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
                value = self._scalar(_arg(node, 2 if name == "new_full" else 1, "fill_value"))
            if value is None:
                return None
            return Full(True if value and ex.dtype == torch.bool else value)
        if name in ("tril", "triu"):
            base = self._value(args[0])
            k = _arg(node, 1, "diagonal", 0)
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
            value = self._scalar(_arg(node, 2, "value"))
            if isinstance(base, Full) and isinstance(cond, Tri) and value is not None:
                return Sel(cond, value, base.value)
            return None
        if name == "mul":
            a, c = self._value(args[0]), self._value(_arg(node, 1, "other"))
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
        nodes = [node.args[0], _arg(node, 1, "other")]
        a, b = (Full(x) if isinstance(x, (bool, int, float)) else x
                for x in (self._value(nodes[0]), self._value(nodes[1])))
        ex = _example(node)
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
            src = _example(other_node)
            if isinstance(src, torch.Tensor) and src.dtype == torch.bool and src.dim() >= 2 \
                    and _same_size(ex.shape[-1], src.shape[-1]) and _same_size(ex.shape[-2], src.shape[-2]):
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
        ex, src = _example(node), _example(node.args[0])
        if not isinstance(v, (Pos, Tri, Sel, Full)) or not isinstance(ex, torch.Tensor):
            return None
        if isinstance(v, Pos):
            d = v.dim
            if not isinstance(src, torch.Tensor) or -d > ex.dim() or not _same_size(ex.shape[d], src.shape[d]):
                return None
            return v if not ex.dtype.is_floating_point else None
        if not _same_size(ex.shape[-1], src.shape[-1]) or not _same_size(ex.shape[-2], src.shape[-2]):
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
        src, ex = _example(node.args[0]), _example(node)
        if not isinstance(src, torch.Tensor) or not isinstance(ex, torch.Tensor):
            return None
        if _name(node) == "unsqueeze":
            d = _arg(node, 1, "dim")
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
            if plain and ex.dim() >= 2 and _same_size(ex.shape[-1], src.shape[-1]) and _same_size(
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
