"""The torch.compile backend: find attention, rewrite it, hand the graph on to Inductor."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.fx as fx

from . import ddp_pieces
from .config import DEFAULT_DILATION_RATES, DEFAULT_SEGMENT_LENGTHS, DilatedConfig
from .dataflow import DataFlow
from .find import find_sites
from .rewrite import graph_is_scoped, remove_dead, rewrite
from .scope import compiled_roots, module_names
from .sites import Site, qualified_name
from .structure import prune_passed


@dataclass
class GraphRecord:
    """What the pass did to one compiled graph (its subgraphs' code follows the graph's own)."""
    sites: list[Site]
    graph_before: str
    graph_after: str


def called_graph(gm: fx.GraphModule, node: fx.Node) -> Optional[fx.GraphModule]:
    """The GraphModule a get_attr node reads (the body a higher-order op runs), or None."""
    if node.op != "get_attr":
        return None
    sub = gm
    for part in str(node.target).split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, fx.GraphModule) else None


def subgraphs(gm: fx.GraphModule, prefix: str = "") -> list[tuple[str, fx.GraphModule]]:
    """The graphs that higher-order ops of `gm` run, depth first: checkpointed regions
    (torch.utils.checkpoint puts each in one), autocast and no_grad regions, cond branches,
    nested compile regions. Attention inside them is attention of the model."""
    found = []
    for node in gm.graph.nodes:
        sub = called_graph(gm, node)
        if sub is not None and all(sub is not g for _, g in found):
            name = prefix + str(node.target)
            found.append((name, sub))
            found.extend(subgraphs(sub, name + "."))
    return found


def caller_inputs(gm: fx.GraphModule, flows: dict) -> dict:
    """For each subgraph that higher-order ops of `gm` call with their operands in order after
    the body (torch.utils.checkpoint's regions, nested compile regions), its placeholders ->
    (gm's DataFlow, the operand passed in), where every call passes the same node."""
    flow = flows.setdefault(gm, DataFlow(gm.graph))
    for node in gm.graph.nodes:
        sub = called_graph(gm, node)
        if sub is None or sub in flows:
            continue
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        passed = []  # per call, the operands in the placeholders' order
        for call in node.users:
            operands = list(call.args[call.args.index(node) + 1:]) if node in call.args else []
            passed.append(operands if len(operands) == len(placeholders) else None)
        outer = {}
        if passed and None not in passed:  # a placeholder is known where every call agrees
            for i, p in enumerate(placeholders):
                first = passed[0][i]
                if isinstance(first, fx.Node) and all(ops[i] is first for ops in passed):
                    outer[p] = (flow, first)
        flows[sub] = DataFlow(sub.graph, outer)
        if outer:  # structure tensors built here can be passed in (structure.insert_recipe)
            flows[sub].callers = (gm, flow, list(node.users))
            flows[sub].atoms = flow.atoms
        caller_inputs(sub, flows)
    return flows


def graph_code(gm: fx.GraphModule) -> str:
    parts = [gm.code]
    for name, sub in subgraphs(gm):
        parts.append(f"\n# subgraph {name}\n{sub.code}")
    return "".join(parts)


def inductor(mode: Optional[str] = None, options: Optional[dict] = None):
    """Inductor with torch.compile's `mode` and `options`, set up exactly as
    torch.compile(backend="inductor", mode=..., options=...) sets it up."""
    return torch._TorchCompileInductorWrapper(mode, options, None)


@dataclass
class HilbertBackend:
    """A torch.compile backend with one configuration (SPEC section 1b). torch.compile hands it
    `mode` and `options`, which go on to Inductor."""
    config: DilatedConfig = field(default_factory=DilatedConfig)
    compile_with_inductor: bool = True
    records: list = field(default_factory=list, repr=False)
    keep_records: bool = False

    def transform(self, gm: fx.GraphModule) -> GraphRecord:
        before = graph_code(gm)
        # a piece of a DDP model's graph: the whole graph it was cut from is read at the first
        ddp_pieces.start_piece(gm)
        graphs = [gm] + [sub for _, sub in subgraphs(gm)]
        roots = compiled_roots()
        scoped = any(graph_is_scoped(g.graph, roots) for g in graphs)
        names = module_names()
        # a DDP model's piece reads what other pieces pass it where they built it
        flows = caller_inputs(gm, {gm: DataFlow(gm.graph, ddp_pieces.outer(gm),
                                                outer_where=ddp_pieces.WHERE)})
        # find in every graph before rewriting any: a subgraph's masks are read in its caller
        found = [(g, find_sites(g.graph, flows.get(g))) for g in graphs]
        used = {g: {n for n in g.graph.nodes if n.op == "placeholder" and n.users} for g in graphs}
        sites = []
        for g, matches in found:
            matches = [replace(m, module=qualified_name(m.output, names) or m.module)
                       for m in matches]
            sites.extend(rewrite(g, matches, self.config, scoped=scoped, roots=roots,
                                 flow=flows.get(g)))
        # a region whose mask was replaced by its structure no longer receives the mask; where
        # nothing else reads it, the caller no longer builds it
        changed = set()
        for g in reversed(graphs):
            flow = flows.get(g)
            freed = prune_passed(flow, used[g]) if flow is not None else []
            if freed:
                caller = flow.callers[0]
                remove_dead(caller.graph, freed, set())
                changed |= {g, caller}
            if flow is not None and flow.recipes and flow.callers is not None:
                changed |= {g, flow.callers[0]}
        for g in changed:
            g.graph.lint()
            g.recompile()
        ddp_pieces.end_piece(gm)
        record = GraphRecord(sites, before, graph_code(gm))
        if self.keep_records:
            self.records.append(record)
        return record

    def __call__(self, gm: fx.GraphModule, example_inputs, *, mode: Optional[str] = None,
                 options: Optional[dict] = None):
        compile_fx = inductor(mode, options)  # bad mode or options fail before any work
        record = self.transform(gm)
        if not self.compile_with_inductor:
            return gm.forward
        if any(site.decision.action == "rewritten" for site in record.sites):
            tag_inductor_caches()
        return compile_fx(gm, example_inputs)


def tag_inductor_caches() -> None:
    """Adds a digest of the op's definition (lowering/op.py and lowering/ring.py, where its fake
    implementations give the outputs' shapes and strides) to torch.compiler.config.cache_key_tag,
    which Inductor's and AOTAutograd's caches hash. Their keys do not cover a custom op's fake:
    a graph compiled against an earlier version of the op would be loaded from the cache with
    that version's strides, and fail its stride checks. Set for the process, not around one
    compile, since AOTAutograd compiles a backward when it first runs."""
    tag = f"hilbert_fx-op-{_op_digest()}"
    current = torch.compiler.config.cache_key_tag
    if tag not in current:
        torch.compiler.config.cache_key_tag = f"{current} {tag}".strip()


@functools.cache
def _op_digest() -> str:
    from .lowering import op, ring
    digest = hashlib.sha256()
    for module in (op, ring):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def backend(segment_lengths=None, dilation_rates=None, *, hilbert: bool = True,
            lowering: str = "auto", mesh=None) -> HilbertBackend:
    """A configured backend: torch.compile(model, backend=hilbert_fx.backend(...))."""
    if (segment_lengths is None) != (dilation_rates is None):
        given, default_name, default = (
            ("segment_lengths", "dilation_rates", DEFAULT_DILATION_RATES)
            if dilation_rates is None else
            ("dilation_rates", "segment_lengths", DEFAULT_SEGMENT_LENGTHS))
        values = segment_lengths if dilation_rates is None else dilation_rates
        try:
            count = len(values)
        except TypeError:
            count = None
        if count is not None and count != len(default):
            raise ValueError(
                f"{given} has {count} entries but {default_name} was not given, and its default "
                f"{default} has {len(default)}: pass {default_name} too, one per segment length")
    config = DilatedConfig(
        tuple(segment_lengths) if segment_lengths is not None else DEFAULT_SEGMENT_LENGTHS,
        tuple(dilation_rates) if dilation_rates is not None else DEFAULT_DILATION_RATES,
        hilbert, lowering, mesh)
    return HilbertBackend(config)


def hilbert_dilated(gm: fx.GraphModule, example_inputs, **kwargs):
    """The registered backend "hilbert_dilated", with the default configuration."""
    return HilbertBackend()(gm, example_inputs, **kwargs)
