"""Facts about where tensors come from: which graph inputs (not parameters) each node reads.

Self-attention means keys and values computed from the same sequence as the queries. We prove
it from data flow: q, k and v must depend on exactly the same activation inputs of the graph
(parameters and buffers do not count), and have the same length.
"""
from __future__ import annotations

import torch
import torch.fx as fx


def _is_parameter(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.nn.Parameter):
        return True
    grapharg = node.meta.get("grapharg")
    if isinstance(getattr(grapharg, "example", None), torch.nn.Parameter):
        return True
    name = getattr(getattr(grapharg, "source", None), "name", "")
    name = str(name() if callable(name) else name)
    return any(part in name or part in node.name for part in ("_parameters", "_buffers"))


def activation_sources(graph: fx.Graph) -> dict[fx.Node, frozenset]:
    """For every node, the set of activation placeholders it depends on."""
    sources: dict[fx.Node, frozenset] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            sources[node] = frozenset() if _is_parameter(node) else frozenset([node])
        elif node.op == "get_attr":
            sources[node] = frozenset()
        else:
            acc = frozenset()
            for inp in node.all_input_nodes:
                acc = acc | sources.get(inp, frozenset())
            sources[node] = acc
    return sources


_MATMULS = {torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.Tensor.matmul,
            torch.Tensor.bmm, torch.Tensor.__matmul__, torch.mm, torch.Tensor.baddbmm,
            torch.ops.aten.bmm.default, torch.ops.aten.mm.default}
import operator  # noqa: E402

_MATMULS.add(operator.matmul)
_ATTENTION = {torch.nn.functional.scaled_dot_product_attention,
              torch._C._nn.scaled_dot_product_attention,
              torch.nn.functional.multi_head_attention_forward}


class DataFlow:
    """Ancestry questions over one graph, answered from a networkx view of it built once."""

    def __init__(self, graph: fx.Graph):
        import networkx as nx
        self.nx = nx
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.sources = activation_sources(graph)
        self.dag = nx.DiGraph()
        for n in graph.nodes:
            self.dag.add_node(n)
            for inp in n.all_input_nodes:
                self.dag.add_edge(inp, n)

    def ancestors(self, node: fx.Node) -> set:
        return self.nx.ancestors(self.dag, node) | {node}

    def is_activation(self, node) -> bool:
        return isinstance(node, fx.Node) and bool(self.sources.get(node))

    def mixes_positions(self, node: fx.Node) -> bool:
        """Does this node combine different positions of a sequence (attention, a product of
        two activations)? Position-wise ops (projections, norms, rotary, reshapes) do not."""
        if node.op == "call_module":
            return False
        target = node.target
        if target in _ATTENTION:
            return True
        if target in _MATMULS or (node.op == "call_method" and target in ("matmul", "bmm", "baddbmm")):
            operands = [a for a in node.all_input_nodes if self.is_activation(a)]
            return len(operands) >= 2
        return False

    def common_source(self, nodes) -> tuple[fx.Node | None, str]:
        """The latest activation from which every node derives through position-wise ops only.

        Returns (node, "") or (None, reason)."""
        common = None
        for n in nodes:
            anc = {a for a in self.ancestors(n) if self.is_activation(a)}
            common = anc if common is None else common & anc
        if not common:
            return None, "keys/values are not computed from the queries' sequence (cross-attention)"
        source = max(common, key=self.order.__getitem__)
        for n in nodes:
            between = (self.nx.descendants(self.dag, source) & self.ancestors(n)) - {source}
            if any(self.mixes_positions(b) for b in between if b is not n):
                return None, ("keys/values are not computed from the queries' sequence "
                              "(cross-attention)")
        return source, ""
