"""Finding attention sites in a Dynamo FX graph: `find_sites` runs every finder, then checks the
shapes of what they found and proves, from data flow, which sites are self-attention. Kinds:
- "sdpa":   calls of F.scaled_dot_product_attention                          (detect_sdpa.py)
- "mha":    nn.MultiheadAttention's F.multi_head_attention_forward, and the fused eval fast paths
            of nn.TransformerEncoderLayer / nn.MultiheadAttention              (detect_mha.py)
- "manual": softmax(q @ k^T) @ v however it is spelled                     (detect_manual.py)
- "flex":   FlexAttention, reported and left as it is                        (detect_sdpa.py)

The finders share the FX vocabulary (fx_vocab.py) and the masks (detect.py); a new finder is one
function (graph, flow) -> list of Matches (sites.py), added to FINDERS.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx

from .dataflow import DataFlow
from .detect_manual import find_manual_sites
from .detect_mha import find_mha_sites
from .detect_sdpa import find_flex_sites, find_sdpa_sites
from .fx_vocab import example
from .sites import Match, module_stack

FINDERS = (find_sdpa_sites, find_mha_sites, find_manual_sites, find_flex_sites)


def _check_shapes(site: Match) -> str:
    if site.shapes is not None:
        qs, ks, vs, mask = site.shapes.q, site.shapes.k, site.shapes.v, site.shapes.mask
    else:
        q, k, v = example(site.q), example(site.k), example(site.v)
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return "q, k and v are not tensors the pass can see"
        qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
        m = example(site.attn_mask)
        if site.attn_mask is not None and not isinstance(m, torch.Tensor):
            return "attn_mask is not a tensor the pass can see"
        mask = None if m is None else (tuple(m.shape), m.dtype, bool(m.requires_grad))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_floating_point():
                return f"{name} is not a floating-point tensor ({t.dtype})"
    if not (len(qs) == len(ks) == len(vs) == 4):
        return f"q, k, v are not 4-D [B, H, N, D] (q has shape {qs})"
    if qs[2] != ks[2]:
        return (f"q and k have different lengths ({qs[2]} and {ks[2]}): "
                f"not self-attention over one sequence")
    if ks[2] != vs[2] or ks[1] != vs[1] or not (qs[0] == ks[0] == vs[0]) or qs[3] != ks[3]:
        return f"q, k, v shapes {qs}, {ks}, {vs} do not fit one attention"
    if qs[1] != ks[1] and (qs[1] % ks[1]):
        return f"{qs[1]} query heads do not divide into {ks[1]} key/value heads"
    if mask is not None:
        shape, dtype, requires_grad = mask
        if dtype is not None and dtype != torch.bool and not dtype.is_floating_point:
            return f"attn_mask is neither boolean nor floating point ({dtype})"
        if len(shape) > 4:
            return f"attn_mask has {len(shape)} dimensions"
        target = (qs[0], qs[1], qs[2], qs[2])
        try:  # broadcasts *to* the scores, not merely with them (a larger batch is an error)
            fits = tuple(torch.broadcast_shapes(shape, target)) == target
        except RuntimeError:
            fits = False
        if not fits:
            return f"attn_mask of shape {shape} does not broadcast to [B, Hq, N, N]"
        if requires_grad:
            return ("attn_mask requires grad (a learned bias, such as T5's relative position "
                    "bias, in training): the op does not compute the mask's gradient")
        if site.is_causal:
            return "attn_mask and is_causal both given"
    if not (0.0 <= float(site.dropout_p) < 1.0):
        return f"dropout_p {site.dropout_p} is outside [0, 1)"
    return ""


def _complete(match: Match, flow: DataFlow) -> Match:
    """The finder's match with where it is, and why it is not rewritable if it is not: its
    shapes do not fit one attention, or keys and values are not from the queries' sequence."""
    module, module_types = module_stack(match.output)
    match = replace(match, module=module, module_types=tuple(module_types))
    if match.reason:
        return match
    reason = _check_shapes(match)
    if not reason:
        _, reason = flow.common_source([match.q, match.k, match.v])
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
    matches = [_complete(match, flow) for match in found]
    matches.sort(key=lambda m: flow.order[m.output])
    return matches


