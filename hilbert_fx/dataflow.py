"""Facts about where tensors come from, over one FX graph.

- Which activation inputs of the graph (not parameters, buffers or sizes) each node reads.
- Self-attention: keys and values computed from the same sequence as the queries. We prove it
  from data flow: q, k and v must derive from one latest common activation through
  position-wise ops only (projections, norms, rotary embeddings, reshapes), never through an
  op that mixes positions of two activations (another attention, a product of activations).
- Closed regions: no value of a matched attention, other than its output, is used outside it
  (proved on a networkx view of the graph).
- Compile-time constants: the value of a node computed only from constants, buffers and sizes
  (causal triangles built from aranges, torch.tril, registered buffers), evaluated once.
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

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.sources = activation_sources(graph)
        self._dag = None
        self._constants: dict = {}

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

    # -- compile-time constants --------------------------------------------------------------
    def constant_value(self, node):
        """The value of `node` if it is computed from constants, buffers and sizes only (sizes
        at their hint when shapes are dynamic), else None. Evaluated once per node, and only
        where every intermediate stays under CONSTANT_NUMEL_LIMIT elements."""
        if not isinstance(node, fx.Node):
            return node
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
            hint = getattr(ex.node, "hint", None)
            return hint
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
