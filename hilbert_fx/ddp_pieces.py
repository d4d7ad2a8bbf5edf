"""Attention in a piece of a DistributedDataParallel model's graph.

Under DDP, Dynamo's DDP optimizer (torch/_dynamo/backends/distributed.py) cuts the model's graph
at DDP's gradient buckets and hands the backend each piece alone. Where a cut falls between the
projections of q and of k, v (DDP's 25 MB buckets cut inside a Llama-7B-shaped layer), the
piece holding the attention cannot show that q, k and v come from one sequence: q arrives as an
input of the piece. The optimizer compiles the pieces from an fx Interpreter over the cut graph
(its SubmodCompiler, on the stack while the backend runs), the first while every piece is still
a GraphModule: there the pass reads the whole graph, pieces inlined (each piece node, inputs
included, mapped to its copy: nodes are named afresh in each piece, so names do not tell), and
finds its attention sites. A piece's site then takes the whole graph's proof (`whole_reason`):
self-attention proved there, a cross-attention left dense. Its mask is read in the piece, whose
inputs link to where the whole graph built them (`outer`). A sequence structure (padding,
packed documents) is built from tensors the piece does not receive; where the whole graph reads
causal sequences from an SDPA call's square 4-D mask, the piece reads them from that mask's
rows (structure.mask_positions); elsewhere the mask is passed as it is, and the site's row says
what the whole graph reads (`mask_note`). Anything
unexpected (another torch's optimizer, a piece already compiled, a whole graph the finders
cannot read) leaves the piece's own reading, and a cross-attention reason then says how to keep
the graph whole (DDP_PIECE).
"""
from __future__ import annotations

import operator
import sys
import weakref
from dataclasses import replace
from typing import NamedTuple, Optional

import torch.fx as fx

from .dataflow import CROSS, DataFlow
from .fx_vocab import example
from .structure import Recipe, Sequences, mask_positions

# read by Dynamo when it compiles a DDP model's frame; "python_reducer" is read when DDP is
# constructed and needs compiled autograd
KEEP_WHOLE = ("set torch._dynamo.config.optimize_ddp = False before compiling a "
              "DistributedDataParallel model to keep its graph whole")
DDP_PIECE = ("; or this graph is a piece of the model that Dynamo's DDP optimizer cut at its "
             "gradient buckets, between q's and k, v's projections: " + KEEP_WHOLE)
WHERE = "in another piece of the graph, which Dynamo's DDP optimizer cut at DDP's gradient buckets"


class Whole(NamedTuple):
    """What the pass read of the whole graph a DDP model's pieces were cut from."""
    flow: DataFlow
    copies: dict  # each piece node (inputs included) -> its copy in the whole graph
    matches: dict  # the whole graph's attention matches by their output node
    pieces: list  # the pieces not compiled yet


# the cut graph -> Whole, or None where it could not be read; made at the optimizer's first
# piece, dropped once its last piece is compiled
_whole: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_reading_whole = False  # the whole graph's own sites: nothing to take from it


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


def start_piece(gm: fx.GraphModule) -> None:
    """Before the pass reads a graph: at a cut graph's first piece, read the whole graph while
    all its pieces are still graphs."""
    global _reading_whole
    cut = _cut_graph() if is_piece(gm) else None
    if cut is None or cut in _whole:
        return
    from .find import find_sites  # find asks this module about pieces
    _whole[cut] = None
    try:
        inlined = _inlined(cut)
        if inlined is None:
            return
        graph, copies = inlined
        flow = DataFlow(graph.graph)
        _reading_whole = True
        try:
            matches = {m.output: m for m in find_sites(graph.graph, flow)}
        finally:
            _reading_whole = False
    except Exception:  # noqa: BLE001 - a whole graph the finders cannot read: pieces alone
        return
    pieces = [cut.get_submodule(str(n.target)) for n in cut.graph.nodes if n.op == "call_module"]
    _whole[cut] = Whole(flow, copies, matches, pieces)


def end_piece(gm: fx.GraphModule) -> None:
    """After the pass rewrote a piece: once the last is done, the whole graph is let go."""
    cut = _cut_graph() if is_piece(gm) else None
    whole = _whole.get(cut) if cut is not None else None
    if whole is not None:
        whole.pieces[:] = [p for p in whole.pieces if p is not gm]
        if not whole.pieces:
            del _whole[cut]


def _current() -> Optional[Whole]:
    """The whole graph of the DDP piece being compiled, where it was read."""
    if _reading_whole or not in_piece():
        return None
    cut = _cut_graph()
    return _whole.get(cut) if cut is not None else None


def outer(gm: fx.GraphModule) -> dict:
    """For a piece whose whole graph was read: its inputs -> (the whole graph's DataFlow, the
    node passed in), so that a mask built in another piece is read where it was built
    (DataFlow's `outer`, as for a checkpointed region's inputs); else {}."""
    whole = _current() if is_piece(gm) else None
    if whole is None:
        return {}
    links = {}
    for p in gm.graph.nodes:
        node = _single(whole.copies.get(p)) if p.op == "placeholder" else None
        if isinstance(node, fx.Node):
            links[p] = (whole.flow, node)
    return links


def whole_reason(match, reason: str) -> str:
    """Why `match` is not a self-attention, as the whole graph a DDP piece was cut from says
    ("" where it is one); a graph that is no piece keeps its own reason."""
    if _reading_whole or not in_piece():
        return reason
    cut = _cut_graph()
    other = _other(_whole.get(cut) if cut is not None else None, match)
    if other is None:  # the piece alone: its cross-attention may be the cut's
        return reason + DDP_PIECE if reason == CROSS and cut is not None else reason
    return other.reason if other.reason else ("" if reason == CROSS else reason)


def mask_note(match):
    """A rewritable match of a DDP piece whose mask the whole graph reads otherwise (as a
    sequence structure built from another piece's tensors): causal sequences are read from the
    rows of the 4-D mask the piece receives (structure.mask_positions); otherwise the mask is
    passed as it is and its note says what the whole graph reads."""
    whole = _current()
    other = _other(whole, match)
    if other is None or match.reason or _reading(match) == _reading(other):
        return match
    rows = _rows_of_mask(match, other)
    if rows is not None:
        return rows
    note = (f"the whole graph reads it as {_reading(other)[0]}, from tensors built {WHERE}; "
            + KEEP_WHOLE)
    return replace(match, note=f"{match.note}; {note}" if match.note else note)


def _rows_of_mask(match, other):
    """`match` given the whole graph's causal sequences, their positions computed from the rows
    of the square 4-D mask an SDPA call in the piece receives, or None where that does not
    hold (a cache, documents put in order, another kind of site or mask)."""
    seq, mask = other.sequences, match.attn_mask
    value = example(mask) if isinstance(mask, fx.Node) else None
    if (seq is None or not seq.is_causal or seq.order is not None or seq.first_row is not None
            or match.kind != "sdpa" or match.adapt_inputs is not None or match.is_causal
            or value is None or value.dim() != 4 or value.shape[1] != 1
            or value.shape[-1] != value.shape[-2]):
        return None
    return replace(match, attn_mask=None, is_causal=True, note="", sequences=Sequences(
        f"{seq.what}; in this piece of a DDP model's graph read from the rows of the 4-D mask it "
        "receives", True, position_ids=Recipe(mask_positions, (mask,))))


def _other(whole: Optional[Whole], match):
    if whole is None:
        return None
    return whole.matches.get(_single(whole.copies.get(match.output)))


def _reading(match) -> tuple:
    """What the pass makes of a match's mask: (in words, causal, a mask passed to the op)."""
    passed = match.attn_mask is not None and match.sequences is None
    words = (match.sequences.what if match.sequences is not None
             else "a mask passed as it is" if passed
             else "causal" if match.is_causal else "no mask")
    return words, bool(match.is_causal), passed


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
    """(the cut graph with its pieces inlined, as a GraphModule owning their attributes, each
    piece node's copy there), or None where a piece is not a GraphModule."""
    graph = fx.Graph()
    env: dict = {}
    copies: dict = {}
    for node in cut.graph.nodes:
        if node.op == "call_module":
            name = str(node.target)
            piece = cut.get_submodule(name)
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
                    copy = graph.node_copy(n, lambda x: _single(inner[x]))
                    if n.op in ("get_attr", "call_module"):  # the piece's own attributes
                        copy.target = f"{name}.{n.target}"
                    inner[n] = copy
            copies.update(inner)
        elif node.op == "call_function" and node.target is operator.getitem \
                and isinstance(env.get(node.args[0]), (tuple, list)):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: _single(env[n])))
        else:
            env[node] = graph.node_copy(node, lambda n: _single(env[n]))
    return fx.GraphModule(cut, graph), copies


def _single(value):
    """A piece's output as its users take it: the optimizer wraps a single output in a tuple
    once it compiles the piece."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        return value[0]
    return value
