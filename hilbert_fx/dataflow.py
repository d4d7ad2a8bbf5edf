"""Facts about where tensors come from, over one FX graph (DataFlow: one per graph, shared by
every finder, holding what is computed once).

- Provenance: which activation inputs of the graph (not parameters, buffers or sizes) each node
  reads, and self-attention: keys and values computed from the same sequence as the queries.
  We prove it from data flow: q, k and v must derive from one latest common activation through
  position-wise ops only (projections, norms, rotary embeddings, reshapes), never through an op
  that mixes positions of two activations (another attention, a product of activations).
- Closed regions: no value of a matched attention, other than its output, is used outside it.
- Compile-time constants (constants.py) and causal triangles over symbolic sizes (triangles.py),
  memoised here, and read through `outer` where a subgraph's input was built by its caller.
"""
from __future__ import annotations

import heapq

import torch
import torch.fx as fx

from . import constants
from .fx_vocab import (ATTENTION_TARGETS, PRODUCTS, example, is_inplace, is_parameter, op_name,
                       target_name)
from .triangles import Tri, Triangles, concrete_triangle, names_nodes


CROSS = "keys/values are not computed from the queries' sequence (cross-attention)"
CROSS_ROWS = ("keys/values are not the queries' sequence: they come from other rows or positions "
              "of the tensor the queries come from (a slice, chunk, flip or roll along its batch "
              "or sequence), cross-attention")


def activation_sources(graph: fx.Graph) -> dict[fx.Node, frozenset]:
    """For every node, the set of activation placeholders it depends on. Parameters, buffers
    and sizes (SymInt placeholders of dynamic shapes) are not activations. An in-place write
    adds what it writes to the tensor it writes into, for the nodes after it: a static KV
    cache made in the graph (zeros, then index_copy_ of this step's keys) holds activations
    once written, and its reads are keys, not constants."""
    sources: dict[fx.Node, frozenset] = {}
    empty = frozenset()
    for node in graph.nodes:
        if node.op == "placeholder":
            ex = example(node)
            # a 0-d tensor holds no positions: a float attribute that Dynamo passes as a tensor
            # under dynamic=True (a norm's eps, attention's scaling), not an activation
            sequence = isinstance(ex, torch.Tensor) and ex.dim() > 0
            sources[node] = frozenset([node]) if sequence and not is_parameter(node) else empty
        elif node.op == "get_attr" or _reads_sizes(node):
            sources[node] = empty  # torch.arange(x.size(0)) does not read x's values
        else:
            acc = empty
            for inp in node.all_input_nodes:
                s = sources.get(inp, empty)
                if s and s is not acc:
                    acc = s if not acc else acc | s
            sources[node] = acc
            target = node.args[0] if node.args else None
            if acc and isinstance(target, fx.Node) and is_inplace(node):
                sources[target] = sources.get(target, empty) | acc
    return sources


_SIZE_READS = {"size", "dim", "numel", "nelement", "stride", "sym_size", "sym_numel",
               "sym_stride", "sym_storage_offset"}


def _reads_sizes(node: fx.Node) -> bool:
    """Does this node read only a tensor's sizes (x.size(0), aten.sym_size), not its values?"""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in ("shape", "ndim")
    return node.op in ("call_method", "call_function") and \
        target_name(node).split(".")[0] in _SIZE_READS


def _reached(start: fx.Node, step) -> set:
    """Every node reached from `start` by repeating `step` (a node -> its neighbours), start
    excluded (a graph has no cycles)."""
    seen, stack = set(), [start]
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


class DataFlow:
    """Ancestry questions over one graph."""

    def __init__(self, graph: fx.Graph, outer: dict | None = None,
                 outer_where: str = "outside this region (a checkpointed body)"):
        """`outer` maps placeholders of a subgraph (the body of a higher-order op, such as a
        checkpointed region; a piece of a DDP model's graph) to (the calling or whole graph's
        DataFlow, the node passed in there), so that a mask built outside the subgraph is still
        read where it was built; `outer_where` says, in words, where that is."""
        self.graph = graph
        self.outer = outer or {}
        self.outer_where = outer_where
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.sources = activation_sources(graph)
        self._constants: dict = {}
        self._lower_triangles: dict = {}  # lower_triangle's answers
        self._rows = None  # row_labels
        self._triangles = None
        # sympy symbols of run-time offsets (triangles.py) -> (the tensor node, how many in-place
        # writes to it come before the read); a region shares its caller's
        self.atoms: dict = {}
        # the tensors of sequence structure made in this graph (structure.insert_recipe)
        self.recipes: dict = {}
        # a region's (caller's GraphModule, caller's DataFlow, the calls of the region) where its
        # inputs are known: structure tensors built there are passed in (backend.caller_inputs)
        self.callers = None

    # -- closed regions ----------------------------------------------------------------------
    def ancestors(self, node: fx.Node) -> set:
        """The nodes `node` is computed from, itself included."""
        return _reached(node, lambda n: n.all_input_nodes) | {node}

    def descendants(self, node: fx.Node) -> set:
        """The nodes computed from `node`, itself excluded."""
        return _reached(node, lambda n: n.users)

    def escapes(self, region: set, output: fx.Node) -> list:
        """The edges by which a value of `region` other than `output` reaches a node outside it:
        empty when the region is closed (its intermediate values die with it). In graph order."""
        inner = sorted(region - {output}, key=self.order.__getitem__)
        return [(u, w) for u in inner for w in u.users if w not in region]

    # -- provenance --------------------------------------------------------------------------
    def is_activation(self, node) -> bool:
        return isinstance(node, fx.Node) and bool(self.sources.get(node))

    def mixes_positions(self, node: fx.Node) -> bool:
        """Does this node combine different positions of a sequence (attention, a product of
        two activations)? Position-wise ops (projections, norms, rotary, reshapes) do not."""
        if node.op == "call_module":
            return False
        if node.op == "call_function" and node.target in ATTENTION_TARGETS:
            return True
        if op_name(node) in PRODUCTS:
            operands = [a for a in node.all_input_nodes if self.is_activation(a)]
            return len(operands) >= 2
        if node.op == "call_function" and getattr(node.target, "_qualname", "").startswith("hilbert_fx::"):
            return True
        return False

    def common_source(self, nodes) -> tuple[fx.Node | None, str]:
        """The latest activation from which every node derives through position-wise ops only.

        Returns (node, "") or (None, reason). Walks up from the nodes in decreasing graph order,
        so it only visits what lies between them and their common source."""
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
            return None, CROSS
        # Which of the popped nodes descend from the source (they lie between it and the nodes)?
        below = {source}
        for n in sorted(popped, key=self.order.__getitem__):
            if any(inp in below for inp in n.all_input_nodes):
                below.add(n)
        for b in below:
            if b is not source and b not in nodes and self.mixes_positions(b):
                return None, CROSS
        if self.row_labels().cut_apart(nodes):
            return None, CROSS_ROWS
        return source, ""

    def row_labels(self):
        """Which dims of each node are an activation's own (rows.py), computed once."""
        if self._rows is None:
            from .rows import RowLabels
            self._rows = RowLabels(self)
        return self._rows

    # -- causal triangles for every size ------------------------------------------------------
    def triangle(self, node):
        """The abstract value (Tri, Sel, ...) of a mask node, or None. A value read in the
        caller that names the caller's nodes (a per-token tensor) is None here unless the region's
        calls are known, through which structure tensors built there are passed in."""
        if node in self.outer:
            flow, outer_node = self.outer[node]
            value = flow.triangle(outer_node)
            return None if names_nodes(value) and self.callers is None else value
        return self._triangles_reader()(node)

    def _triangles_reader(self) -> Triangles:
        if self._triangles is None:
            self._triangles = Triangles(self)
        return self._triangles

    # -- compile-time constants --------------------------------------------------------------
    def lower_triangle(self, node) -> bool:
        """Is `node` a constant square boolean lower triangle of ones: a value computed at
        compile time, or a registered buffer of any size (constants.lower_triangle_buffer)."""
        if not isinstance(node, fx.Node):
            return False
        if node in self.outer:
            flow, outer_node = self.outer[node]
            return flow.lower_triangle(outer_node)
        if node not in self._lower_triangles:
            value = self.constant_value(node)
            if value is not None:  # (a boolean one: a float triangle reads as a Sel)
                found = concrete_triangle(value) == Tri(True, 0)
            else:
                try:
                    found = constants.lower_triangle_buffer(node)
                except Exception:  # noqa: BLE001  (a buffer we cannot compare is no triangle)
                    found = False
            self._lower_triangles[node] = found
        return self._lower_triangles[node]

    def constant_value(self, node):
        """The value of `node` if it is computed from constants, buffers and static sizes only,
        else None. Evaluated once per node (constants.evaluate), and only where every
        intermediate stays under constants.CONSTANT_NUMEL_LIMIT elements."""
        if not isinstance(node, fx.Node):
            return node
        if node in self.outer:
            flow, outer_node = self.outer[node]
            return flow.constant_value(outer_node)
        if node in self._constants:
            return self._constants[node]
        value = None
        try:
            value = constants.evaluate(self, node)
        except Exception:  # noqa: BLE001  (anything we cannot run is simply not a constant)
            value = None
        self._constants[node] = value
        return value
