"""The SDPA finder (calls of F.scaled_dot_product_attention) and the FlexAttention finder
(reported, never rewritten)."""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .dataflow import DataFlow
from .detect import MaskTerm, resolve_masks
from .fx_vocab import SDPA_TARGETS, arg, example, unrepeat_pair
from .sites import Site


def find_sdpa_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Site]:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        flow = flow or DataFlow(graph)
        site = Site(kind="sdpa", output=node, q=arg(node, 0, "query"), k=arg(node, 1, "key"),
                    v=arg(node, 2, "value"), attn_mask=arg(node, 3, "attn_mask"),
                    dropout_p=arg(node, 4, "dropout_p", 0.0), is_causal=arg(node, 5, "is_causal", False),
                    scale=arg(node, 6, "scale"), enable_gqa=arg(node, 7, "enable_gqa", False))
        site.region = {node}
        runtime_scale = None
        if isinstance(site.scale, fx.Node) and isinstance(example(site.scale), (float, torch.SymFloat)):
            # a float attribute made dynamic (dynamic=True): scale q by it, the op by 1
            runtime_scale, site.scale = site.scale, 1.0
        for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
            if isinstance(getattr(site, name), fx.Node):
                site.reason = f"{name} is computed at run time; it must be a constant"
        if site.reason:
            sites.append(site)
            continue
        k, v, rep = unrepeat_pair(site.k, site.v)
        if rep > 1:  # repeat_kv before SDPA: hand the op the key/value heads themselves
            site.k, site.v, site.enable_gqa = k, v, True
        mask = site.attn_mask
        q = example(site.q)
        if isinstance(mask, fx.Node) and not site.is_causal and isinstance(q, torch.Tensor) and q.dim() == 4:
            ex = example(mask)
            kind = "allow" if getattr(ex, "dtype", None) == torch.bool else "add"
            is_causal, kept = resolve_masks(flow, [MaskTerm(mask, kind)], q.shape[2])
            if not kept:
                site.attn_mask, site.is_causal = None, is_causal
        if runtime_scale is not None:
            def adapt_inputs(graph, site=site, scale=runtime_scale):
                q = graph.call_function(operator.mul, (site.q, scale))
                return q, site.k, site.v, site.attn_mask
            site.adapt_inputs = adapt_inputs
        sites.append(site)
    return sites


# ---------------------------------------------------------------------------------------------
# FlexAttention: reported, not rewritten (its score_mod and mask_mod are graphs the pass does not
# read, so it cannot prove what the call attends to)
# ---------------------------------------------------------------------------------------------
FLEX_REASON = ("FlexAttention: the pass does not read its score_mod / mask_mod, so it cannot "
               "prove the pattern; left as it is")


def find_flex_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Site]:
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return [Site(kind="flex", output=node, q=node.args[0], k=node.args[1], v=node.args[2],
                 reason=FLEX_REASON, region={node})
            for node in graph.nodes if node.op == "call_function" and node.target is flex]
