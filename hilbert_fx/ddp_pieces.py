"""Attention in a piece of a DistributedDataParallel model's graph.

Under DDP, Dynamo's DDP optimizer (torch/_dynamo/backends/distributed.py) cuts the model's graph
at DDP's gradient buckets and hands the backend each piece alone. Where a cut falls between the
projections of q and of k, v (DDP's 25 MB buckets cut inside a Llama-7B-shaped layer), the
piece holding the attention cannot show that q, k and v come from one sequence: q arrives as an
input of the piece. The optimizer compiles the pieces from an fx Interpreter over the cut graph
(its SubmodCompiler, on the stack while the backend runs), the first while every piece is still
a GraphModule: there the pass reads the whole graph, pieces inlined (each piece node, inputs
included, mapped to its copy: nodes are named afresh in each piece, so names do not tell), and
finds its attention sites. A piece's site then takes the whole graph's reading (`reconcile`):
self-attention proved there, a cross-attention left dense; where the whole graph shows a
sequence structure (padding, packed documents) that the piece does not, its tensors being built
in another piece, the site is skipped with the reason rather than given another attention than
the model compiled whole. Anything unexpected (another torch's optimizer, a piece already
compiled) leaves the piece's own reading, and a cross-attention reason says how to keep the
graph whole (DDP_PIECE).
"""
from __future__ import annotations

import operator
import sys
import weakref
from dataclasses import replace
from typing import Optional

import torch.fx as fx

from .dataflow import CROSS, DataFlow

KEEP_WHOLE = ("set torch._dynamo.config.optimize_ddp = 'python_reducer' (or False) before "
              "compiling a DistributedDataParallel model")
DDP_PIECE = ("; or this graph is a piece of the model that Dynamo's DDP optimizer cut at its "
             "gradient buckets, between q's and k, v's projections: " + KEEP_WHOLE)

# the cut graph -> (the whole graph's DataFlow, each piece node's copy there, the whole graph's
# matches by output node), or None where it could not be read; made at the optimizer's first
# piece and kept while the cut graph lives
_whole: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def in_piece() -> bool:
    """Whether the graph being compiled may be a piece of a DDP model's graph (the condition
    under which Dynamo cuts: torch/_dynamo/convert_frame.py)."""
    try:
        from torch._dynamo.utils import get_optimize_ddp_mode
        from torch.nn.parallel import DistributedDataParallel
        return (get_optimize_ddp_mode() == "ddp_optimizer"
                and DistributedDataParallel._get_active_ddp_module() is not None)
    except (ImportError, AttributeError):
        return False


def is_piece(gm) -> bool:
    """Whether `gm` is a piece the DDP optimizer cut (it marks each piece's compile reason)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return "DDPOptimizer" in str(getattr(reason, "reason", ""))


def note_piece(gm: fx.GraphModule) -> None:
    """Called for every graph the backend compiles: at a cut graph's first piece, read the whole
    graph while all its pieces are still graphs."""
    if not is_piece(gm):
        return
    cut = _cut_graph()
    if cut is not None and cut not in _whole:
        from .find import find_sites  # find reconciles its matches here
        inlined = _inlined(cut)
        if inlined is None:
            _whole[cut] = None
            return
        graph, copies = inlined
        flow = DataFlow(graph)
        _reading[0] = True
        try:
            matches = {m.output: m for m in find_sites(graph, flow)}
        finally:
            _reading[0] = False
        _whole[cut] = (flow, copies, matches)


def outer(gm: fx.GraphModule) -> dict:
    """For a piece whose whole graph was read: its placeholders -> (the whole graph's DataFlow,
    the node passed in), so that a mask built in another piece is read where it was built
    (DataFlow's `outer`, as for a checkpointed region's inputs); else {}."""
    cut = _cut_graph() if is_piece(gm) else None
    whole = _whole.get(cut) if cut is not None else None
    if whole is None:
        return {}
    flow, copies, _ = whole
    found = {}
    for p in gm.graph.nodes:
        node = _single(copies.get(p)) if p.op == "placeholder" else None
        if isinstance(node, fx.Node):
            found[p] = (flow, node)
    return found


def reconcile(match):
    """A match of the graph being compiled, as the whole graph reads it where the graph is a
    piece of a DDP model's (`note_piece`); other graphs' matches as they are."""
    if _reading[0] or not in_piece():
        return match
    cut = _cut_graph()
    whole = _whole.get(cut) if cut is not None else None
    other = whole[2].get(_single(whole[1].get(match.output))) if whole is not None else None
    if other is None:  # the piece alone: its cross-attention may be the cut's
        return replace(match, reason=match.reason + DDP_PIECE) if match.reason == CROSS \
            else match
    if other.reason:
        return replace(match, reason=other.reason)
    reason = "" if match.reason == CROSS else match.reason
    if not reason and _mask_reading(match) != _mask_reading(other):
        reason = (f"the whole graph reads this attention's mask as {_mask_reading(other)[0]}, "
                  "from tensors built in another piece of the graph, which Dynamo's DDP "
                  "optimizer cut at its gradient buckets: " + KEEP_WHOLE)
    return replace(match, reason=reason)


def _mask_reading(match) -> tuple:
    """What the pass makes of a match's mask: (in words, causal, a mask passed to the op)."""
    passed = match.attn_mask is not None and match.sequences is None
    words = (match.sequences.what if match.sequences is not None
             else "a mask passed as it is" if passed
             else "causal" if match.is_causal else "no mask")
    return words, bool(match.is_causal), passed


_reading = [False]  # finding the whole graph's sites: nothing to reconcile them with


def _cut_graph() -> Optional[fx.GraphModule]:
    """The cut GraphModule of the DDP optimizer's SubmodCompiler on the stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        me = frame.f_locals.get("self")
        if type(me).__name__ == "SubmodCompiler" and isinstance(getattr(me, "module", None),
                                                                 fx.GraphModule):
            return me.module
        frame = frame.f_back
    return None


def _inlined(cut: fx.GraphModule) -> Optional[tuple]:
    """(the cut graph with its pieces inlined, each piece node's copy there), or None where a
    piece is not a GraphModule. For reading only: get_attr nodes keep their pieces' targets."""
    graph = fx.Graph()
    env: dict = {}
    copies: dict = {}
    for node in cut.graph.nodes:
        if node.op == "call_module":
            piece = cut.get_submodule(str(node.target))
            if not isinstance(piece, fx.GraphModule):
                return None
            inputs = [n for n in piece.graph.nodes if n.op == "placeholder"]
            if len(inputs) != len(node.args) or node.kwargs:
                return None
            inner = {p: env[a] for p, a in zip(inputs, node.args)}
            for n in piece.graph.nodes:
                if n.op == "output":
                    env[node] = fx.map_arg(n.args[0], lambda x: _single(inner[x]))
                elif n.op != "placeholder":
                    inner[n] = graph.node_copy(n, lambda x: _single(inner[x]))
            copies.update(inner)
        elif node.op == "call_function" and node.target is operator.getitem \
                and isinstance(env.get(node.args[0]), (tuple, list)):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op != "output":
            env[node] = graph.node_copy(node, lambda n: _single(env[n]))
    return graph, copies


def _single(value):
    """A piece's output as its users take it: the optimizer wraps a single output in a tuple
    once it compiles the piece."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        return value[0]
    return value
