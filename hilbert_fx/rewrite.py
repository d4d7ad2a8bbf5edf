"""Rewriting found sites into torch.ops.hilbert_fx.dilated_attention.

Which sites (SPEC section 1): if any module in the graph carries `dilate`, only sites inside such
a module, with the innermost one's configuration; otherwise every rewritable site, with the
backend's. The lowering is resolved here, at compile time, so the rewritten graph shows it.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from .lowering import resolve_lowering
from .lowering.dropout import new_seed

from .config import DilatedConfig
from .dataflow import DataFlow
from .fx_vocab import example, is_inplace
from .logs import log, log_site
from .scope import compiled_roots, config_of
from .sites import Decision, Match, Site
from .structure import (Recipe, cache_lengths, first_keys, insert_recipe, rows_back,
                        rows_in_order)

OP = torch.ops.hilbert_fx.dilated_attention.default


def graph_is_scoped(graph: fx.Graph, roots) -> bool:
    """Does any module of the compiled model (or, failing that, of this graph) carry `dilate`?"""
    if any(config_of(type(m)) is not None for root in roots for m in root.modules()):
        return True
    for node in graph.nodes:
        for _, module_type in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(module_type, type) and config_of(module_type) is not None:
                return True
    return False


def site_config(module_types, default: DilatedConfig, scoped: bool) -> Optional[DilatedConfig]:
    """The configuration of a site inside `module_types` (outermost first), None if none."""
    if not scoped:
        return default
    for module_type in reversed(module_types):
        config = config_of(module_type)
        if config is not None:
            return config
    return None


def mesh_reason(match: Match, config: DilatedConfig) -> str:
    """Why a site cannot take the ring op of config's mesh ("" when it can): the ring op takes
    no attn_mask (a mask over the whole sequence cannot be sharded along it)."""
    if config.mesh is None:
        return ""
    if match.attn_mask is not None or (match.shapes is not None and match.shapes.mask is not None):
        return "attn_mask with mesh=: the ring op over a device mesh takes no mask"
    if match.sequences is not None:
        return (f"{match.sequences.what} with mesh=: the ring op over a device mesh takes no "
                f"sequence structure (position_ids, seqused_k)")
    return ""


def rewrite_site(graph: fx.Graph, match: Match, config: DilatedConfig,
                 flow: Optional[DataFlow] = None) -> Decision:
    """Replace the match's output by the op (or the ring op of config's mesh). `flow`: the
    graph's DataFlow, which holds the structure tensors already made (structure.insert_recipe)."""
    seq = match.sequences
    structure = [None, None, None]  # position_ids, the first query's cache row, order
    if seq is not None:
        flow = flow if flow is not None else DataFlow(graph)
        structure = [insert_recipe(flow, r) if isinstance(r, Recipe) else r
                     for r in (seq.position_ids, seq.first_row, seq.order)]
    position_ids, first_row, order = structure
    q = example(match.q)
    lowering = resolve_lowering(config.lowering, q.device)
    scale = match.scale if match.scale is not None else 1.0 / math.sqrt(max(q.shape[-1], 1))
    with graph.inserting_before(match.output):
        if match.adapt_inputs is not None:  # canonical q, k, v, mask of mha / manual sites
            inputs = match.adapt_inputs(graph)
        else:
            inputs = (match.q, match.k, match.v, match.attn_mask)
        seed = None
        if match.dropout_p > 0.0:
            seed = graph.call_function(new_seed, (q.device,))
        q_node, k_node, v_node, mask_node = inputs
        seqused_k = None
        if seq is not None and seq.trim and position_ids is not None:
            position_ids = graph.call_function(first_keys, (position_ids, k_node))
        if first_row is not None:
            seqused_k = graph.call_function(cache_lengths, (first_row, q_node))
        if order is not None:  # each row's documents made consecutive, undone on the output
            q_node, k_node, v_node = (graph.call_function(rows_in_order, (x, order))
                                      for x in (q_node, k_node, v_node))
        args = (q_node, k_node, v_node, list(config.segment_lengths), list(config.dilation_rates),
                config.hilbert, bool(match.is_causal), mask_node, float(match.dropout_p), seed,
                float(scale), lowering)
        if config.mesh is None:
            if seq is not None:
                args = args + (position_ids, seqused_k)
            call = graph.call_function(OP, args)
        else:  # the ring op: its collectives run over the mesh's process group
            from .lowering import ring  # noqa: F401  (registers the op)
            group_name = config.mesh.get_group().group_name
            call = graph.call_function(torch.ops.hilbert_fx.ring_dilated_attention.default,
                                       args + (group_name,))
        out = graph.call_function(operator.getitem, (call, 0))
        if order is not None:
            out = graph.call_function(rows_back, (out, order))
        if match.adapt_output is not None:
            out = match.adapt_output(graph, out)
    match.output.replace_all_uses_with(out)
    graph.erase_node(match.output)
    return Decision("rewritten", "", lowering, config, inputs)


def remove_dead(graph: fx.Graph, freed: list, regions: set) -> None:
    """Erase what the rewrite left without users, starting from the nodes it freed: the rest of
    the graph stays exactly as Dynamo made it (nodes kept only for their effects, such as vmap's
    nesting levels, have no users either). In-place ops die only inside rewritten attentions."""
    def removable(node):
        if getattr(node, "_erased", False) or node.users or node.op in ("placeholder", "output"):
            return False
        return not node.is_impure() and not (is_inplace(node) and node not in regions)

    work = list(freed)
    while work:
        node = work.pop()
        if getattr(node, "_erased", False):
            continue
        for user in list(node.users):  # x.mul_(s) whose x is otherwise dead
            if is_inplace(user) and removable(user):
                work.extend(n for n in user.all_input_nodes if n is not node)
                graph.erase_node(user)
        if removable(node):
            inputs = node.all_input_nodes
            graph.erase_node(node)
            work.extend(inputs)


def rewrite(gm: fx.GraphModule, matches: list[Match], default: DilatedConfig, *,
            scoped: Optional[bool] = None, roots=None, flow: Optional[DataFlow] = None) -> list[Site]:
    """Rewrite what may be rewritten, skip the rest; returns each match with its decision.
    `scoped`: does any module of the compiled model carry `dilate` (decided once for a graph and
    its subgraphs). `flow`: the graph's DataFlow, where the finders used one."""
    roots = compiled_roots() if roots is None else roots
    scoped = graph_is_scoped(gm.graph, roots) if scoped is None else scoped
    freed = []
    flow = flow if flow is not None else DataFlow(gm.graph)
    decisions: dict[int, Decision] = {}
    # Last site first: a site's inputs may be an earlier site's output, which that site's rewrite
    # then replaces everywhere, in the nodes inserted for the later site included.
    for i in reversed(range(len(matches))):
        match = matches[i]
        reason = match.reason
        if not reason:
            config = site_config([type(m) for m in roots] + list(match.module_types), default, scoped)
            if config is None:
                reason = "outside every module marked with hilbert_fx.dilate"
            else:
                reason = mesh_reason(match, config)
            if not reason:
                freed.extend(match.output.all_input_nodes)
                decisions[i] = rewrite_site(gm.graph, match, config, flow)
                continue
        decisions[i] = Decision("skipped", reason)
    sites = [Site(match, decisions[i]) for i, match in enumerate(matches)]
    if any(s.action == "rewritten" for s in sites):
        remove_dead(gm.graph, freed, set().union(*(s.region for s in sites if s.action == "rewritten")))
        gm.graph.lint()
        gm.recompile()
    for site in sites:
        log_site(site)
    if sites:
        log.debug("rewritten graph:\n%s", gm.code)
    return sites
