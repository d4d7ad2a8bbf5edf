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
from .sites import Match


def find_sdpa_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Match]:
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        flow = flow or DataFlow(graph)
        q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
        attn_mask, dropout_p = arg(node, 3, "attn_mask"), arg(node, 4, "dropout_p", 0.0)
        is_causal, scale = arg(node, 5, "is_causal", False), arg(node, 6, "scale")
        enable_gqa = arg(node, 7, "enable_gqa", False)
        runtime_scale = None
        if isinstance(scale, fx.Node) and isinstance(example(scale), (float, torch.SymFloat)):
            # a float attribute made dynamic (dynamic=True): scale q by it, the op by 1
            runtime_scale, scale = scale, 1.0
        reason = ""
        for name, value in (("dropout_p", dropout_p), ("is_causal", is_causal), ("scale", scale),
                            ("enable_gqa", enable_gqa)):
            if isinstance(value, fx.Node):
                reason = f"{name} is computed at run time; it must be a constant"
        if not reason:
            k0, v0, rep = unrepeat_pair(k, v)
            if rep > 1:  # repeat_kv before SDPA: hand the op the key/value heads themselves
                k, v, enable_gqa = k0, v0, True
            qex = example(q)
            if (isinstance(attn_mask, fx.Node) and not is_causal and isinstance(qex, torch.Tensor)
                    and qex.dim() == 4):
                ex = example(attn_mask)
                kind = "allow" if getattr(ex, "dtype", None) == torch.bool else "add"
                causal, kept = resolve_masks(flow, [MaskTerm(attn_mask, kind)], qex.shape[2])
                if not kept:
                    attn_mask, is_causal = None, causal
        adapt_inputs = None
        if runtime_scale is not None and not reason:
            def adapt_inputs(graph, q=q, k=k, v=v, attn_mask=attn_mask, scale=runtime_scale):
                return graph.call_function(operator.mul, (q, scale)), k, v, attn_mask
        matches.append(Match(kind="sdpa", output=node, q=q, k=k, v=v, attn_mask=attn_mask,
                             is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             enable_gqa=enable_gqa, adapt_inputs=adapt_inputs,
                             region=frozenset({node}), reason=reason))
    return matches


# ---------------------------------------------------------------------------------------------
# FlexAttention: reported, not rewritten (its score_mod and mask_mod are graphs the pass does not
# read, so it cannot prove what the call attends to)
# ---------------------------------------------------------------------------------------------
FLEX_REASON = ("FlexAttention: the pass does not read its score_mod / mask_mod, so it cannot "
               "prove the pattern; left as it is")


def find_flex_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Match]:
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return [Match(kind="flex", output=node, q=node.args[0], k=node.args[1], v=node.args[2],
                  reason=FLEX_REASON, region=frozenset({node}))
            for node in graph.nodes if node.op == "call_function" and node.target is flex]
