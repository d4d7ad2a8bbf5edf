"""Finding attention sites in a Dynamo FX graph: `find_sites` runs every finder, then checks the
shapes of what they found and proves, from data flow, which sites are self-attention. Kinds:
- "sdpa":   calls of F.scaled_dot_product_attention                          (detect_sdpa.py)
- "mha":    nn.MultiheadAttention's F.multi_head_attention_forward, and the fused eval fast paths
            of nn.TransformerEncoderLayer / nn.MultiheadAttention              (detect_mha.py)
- "manual": softmax(q @ k^T) @ v however it is spelled                     (detect_manual.py)
- "flex":   FlexAttention, rewritten where its mask_mod is read           (detect_sdpa.py)

The finders share the FX vocabulary (fx_vocab.py) and the masks (detect.py); a new finder is one
function (graph, flow) -> list of Matches (sites.py), added to FINDERS.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx

from . import ddp_pieces
from .dataflow import DataFlow
from .detect_manual import find_manual_sites
from .detect_mha import find_mha_sites
from .detect_sdpa import find_flex_sites, find_sdpa_sites
from .fx_vocab import example, same_size
from .lowering.arguments import TensorSpec, problem
from .sites import Match, module_stack
from .structure import structure_specs

FINDERS = (find_sdpa_sites, find_mha_sites, find_manual_sites, find_flex_sites)


def _check_shapes(site: Match) -> str:
    """The op's rule book (lowering.arguments.problem) on what the pass sees of the site: the
    shapes a finder recorded when it rebuilds q, k, v (no dtypes then), or the example tensors."""
    if site.shapes is not None:
        q, k, v = (TensorSpec(tuple(s)) for s in (site.shapes.q, site.shapes.k, site.shapes.v))
        recorded = site.shapes.mask
        mask = None if recorded is None else TensorSpec(
            tuple(recorded[0]), recorded[1], requires_grad=bool(recorded[2]))
    else:
        q, k, v = example(site.q), example(site.k), example(site.v)
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return "q, k and v are not tensors the pass can see"
        mask = example(site.attn_mask)
        if site.attn_mask is not None and not isinstance(mask, torch.Tensor):
            return "attn_mask is not a tensor the pass can see"
    # enable_gqa=True: the pass sets the site's flag once the heads divide; same_dtype=False:
    # the rewritten op is cast as SDPA is under autocast, whose state the pass does not see
    structure = structure_specs(site.sequences, site.q, site.k, site.shapes)
    return problem(q, k, v, mask, is_causal=site.is_causal, dropout_p=site.dropout_p,
                   enable_gqa=True, same_dtype=False, **structure)


def _placed(match: Match) -> str:
    """Why the queries of a self-attention shorter than its keys cannot be placed, or "": the
    op reads them as the last rows of a cached sequence (SPEC section 5), which only a cache
    the pass proved (structure.read_site) says they are."""
    q, k = (match.shapes.q, match.shapes.k) if match.shapes is not None else (
        example(match.q).shape, example(match.k).shape)
    if match.sequences is not None or same_size(q[2], k[2]):
        return ""
    return (f"q and k have different lengths (q has {q[2]} positions, k has {k[2]}), and k and "
            f"v are no cache the pass can see: where the queries stand among the keys is not "
            f"known")


def _complete(match: Match, flow: DataFlow) -> Match:
    """The finder's match with where it is, and why it is not rewritable if it is not: its
    shapes do not fit one attention, or keys and values are not from the queries' sequence."""
    module, module_types = module_stack(match.output)
    match = replace(match, module=module, module_types=tuple(module_types))
    if match.reason:
        return match
    reason = _check_shapes(match)
    if not reason:
        # queries against a cache: the rows this step computed are the queries' sequence (the
        # cached rows are that sequence's, by the cache)
        new_kv = match.sequences.new_kv if match.sequences is not None else None
        _, reason = flow.common_source([match.q, *(new_kv or (match.k, match.v))])
        # in a piece of a DDP model's graph, the whole graph's proof (ddp_pieces.py)
        reason = ddp_pieces.whole_reason(match, reason) or _placed(match)
    if reason:
        return replace(match, reason=reason)
    if match.enable_gqa is False and match.shapes is None:
        qs, ks = example(match.q).shape, example(match.k).shape
        return replace(match, enable_gqa=qs[1] != ks[1])
    return match


def find_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Match]:
    """Every attention site of the graph, with `reason` set for those that are not rewritable.
    `flow`: the graph's DataFlow, when the caller made it (a subgraph's knows its callers)."""
    flow = flow if flow is not None else DataFlow(graph)
    found = [match for finder in FINDERS for match in finder(graph, flow)]
    matches = [ddp_pieces.mask_note(_complete(match, flow)) for match in found]
    matches.sort(key=lambda m: flow.order[m.output])
    return matches


