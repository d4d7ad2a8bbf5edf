"""Finding attention sites in a Dynamo FX graph.

Each finder returns Sites in canonical form (sites.py); `find_sites` runs them all and then
proves, from data flow, which sites are self-attention. Kinds:
- "sdpa":   calls of F.scaled_dot_product_attention
- "mha":    nn.MultiheadAttention's F.multi_head_attention_forward   (detect_mha.py)
- "manual": softmax(q @ k^T) @ v however it is spelled               (detect_manual.py)
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .dataflow import DataFlow
from .sites import Site, example, module_stack

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                torch.ops.aten.scaled_dot_product_attention.default)


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def find_sdpa_sites(graph: fx.Graph) -> list[Site]:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        site = Site(kind="sdpa", output=node, q=_arg(node, 0, "query"), k=_arg(node, 1, "key"),
                    v=_arg(node, 2, "value"), attn_mask=_arg(node, 3, "attn_mask"),
                    dropout_p=_arg(node, 4, "dropout_p", 0.0), is_causal=_arg(node, 5, "is_causal", False),
                    scale=node.kwargs.get("scale"), enable_gqa=node.kwargs.get("enable_gqa", False))
        for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
            if isinstance(getattr(site, name), fx.Node):
                site.reason = f"{name} is computed at run time; it must be a constant"
        sites.append(site)
    return sites


def _finders():
    from . import detect_manual, detect_mha
    return [find_sdpa_sites, detect_mha.find_mha_sites, detect_manual.find_manual_sites]


def _check_shapes(site: Site) -> str:
    q, k, v = example(site.q), example(site.k), example(site.v)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k and v are not tensors the pass can see"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v are not 4-D [B, H, N, D] (q has shape {tuple(q.shape)})"
    if q.shape[2] != k.shape[2]:
        return (f"q and k have different lengths ({q.shape[2]} and {k.shape[2]}): "
                f"not self-attention over one sequence")
    if q.shape[1] != k.shape[1] and (not site.enable_gqa or q.shape[1] % k.shape[1]):
        return f"{q.shape[1]} query heads do not divide into {k.shape[1]} key/value heads"
    mask = example(site.attn_mask)
    if mask is not None and not isinstance(mask, torch.Tensor):
        return "attn_mask is not a tensor the pass can see"
    if mask is not None and site.is_causal:
        return "attn_mask and is_causal both given"
    return ""


def find_sites(graph: fx.Graph) -> list[Site]:
    """Every attention site of the graph, with `reason` set for those that are not rewritable."""
    sites: list[Site] = []
    for finder in _finders():
        sites.extend(finder(graph))
    flow = DataFlow(graph) if sites else None
    for site in sites:
        site.module, site.module_types = module_stack(site.output)
        if site.reason:
            continue
        site.reason = _check_shapes(site)
        if site.reason:
            continue
        _, reason = flow.common_source([site.q, site.k, site.v])
        site.reason = reason
    sites.sort(key=lambda s: flow.order[s.output] if flow else 0)
    return sites
