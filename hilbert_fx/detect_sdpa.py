"""The SDPA finder (calls of F.scaled_dot_product_attention) and the FlexAttention finder
(rewritten where its mask_mod is read, reported otherwise)."""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx

from .dataflow import DataFlow
from .detect import MaskTerm, resolve_masks
from .fx_vocab import SDPA_TARGETS, arg, example, same_size, unrepeat_pair
from .sites import Match
from .structure import read_site
from .triangles import Full, Pos, Tok, Tri, Triangles, canonical


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
        sequences, note = None, ""
        if not reason:
            k0, v0, rep = unrepeat_pair(k, v)
            if rep > 1:  # repeat_kv before SDPA: hand the op the key/value heads themselves
                k, v, enable_gqa = k0, v0, True
            qex, kex = example(q), example(k)
            if isinstance(qex, torch.Tensor) and isinstance(kex, torch.Tensor) and qex.dim() == 4:
                # the sequence structure the mask and the keys prove (SPEC section 5)
                sequences, note = read_site(flow, q, k, v, attn_mask, is_causal, node)
                if sequences is not None:
                    attn_mask = attn_mask if sequences.keep_mask else None
                    is_causal = sequences.is_causal
                elif note and kex.dim() == 4 and not same_size(qex.shape[2], kex.shape[2]):
                    reason, note = note, ""  # queries against keys the pass cannot place
            if (sequences is None and isinstance(attn_mask, fx.Node) and not is_causal
                    and isinstance(qex, torch.Tensor) and qex.dim() == 4):
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
                             region=frozenset({node}), reason=reason, sequences=sequences,
                             note=note if attn_mask is not None else ""))
    return matches


# ---------------------------------------------------------------------------------------------
# FlexAttention: its mask_mod is a graph of (b, h, q_idx, kv_idx), read by triangles.py one
# element at a time; the masks the op takes (none, causal, same document, padding, and causal with
# one of them) are rewritten, the rest reported
# ---------------------------------------------------------------------------------------------
FLEX_REASON = ("FlexAttention: its mask_mod is not one the pass reads (none, causal, same "
               "document by an ids tensor, a padding mask, or causal with one of them); left as "
               "it is")


def _submodule(graph: fx.Graph, node) -> Optional[fx.GraphModule]:
    """The graph a get_attr node names (a score_mod or mask_mod), or None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or graph.owning_module is None:
        return None
    sub = graph.owning_module
    for part in str(node.target).split("."):
        sub = getattr(sub, part, None)
    return sub if isinstance(sub, fx.GraphModule) else None


def _identity_score_mod(graph: fx.Graph, score_mod) -> bool:
    """Does the score_mod return the score it is given, unchanged?"""
    sub = _submodule(graph, score_mod)
    if sub is None:
        return False
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    (out,) = [n for n in sub.graph.nodes if n.op == "output"]
    result = out.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]


def _mask_mod_atoms(graph: fx.Graph, block_mask, buffers) -> Optional[set]:
    """The atoms of a block mask's mask_mod (all must hold), or None where it is not read."""
    if not isinstance(block_mask, (tuple, list)) or not block_mask:
        return None
    sub = _submodule(graph, block_mask[-1])
    if sub is None:
        return None
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 4 + len(buffers):
        return None
    seeds = {p: Pos(d, 0) for p, d in zip(placeholders, (-4, -3, -2, -1))}
    for p, outer in zip(placeholders[4:], buffers):
        if isinstance(outer, fx.Node):  # a tensor of the calling graph: read by its values
            seeds[p] = Tok("raw", canonical(outer))
    reader = Triangles(DataFlow(sub.graph), seeds, pointwise=True)
    (out,) = [n for n in sub.graph.nodes if n.op == "output"]
    result = out.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    value = reader(result)
    if isinstance(value, Full):
        return set() if value.value is True else None
    conj = reader._as_conj(value, result)
    return None if conj is None else set(conj.atoms)


def _flex_match(graph: fx.Graph, flow: DataFlow, node: fx.Node) -> Match:
    args = list(node.args)
    q, k, v, score_mod, block_mask = args[:5]
    scale = args[5] if len(args) > 5 else None
    buffers = args[8] if len(args) > 8 else ()
    outputs = [u for u in node.users if u.target is operator.getitem]
    used = [u for u in outputs if u.users]
    found = Match(kind="flex", output=node, q=q, k=k, v=v, region=frozenset({node}))
    if len(outputs) != len(node.users) or any(u.args[1] != 0 for u in used) or len(used) != 1:
        return replace(found, reason="FlexAttention: its logsumexp is used, which the op does not "
                                     "return as FlexAttention does; left as it is")
    (out,) = used
    found = replace(found, output=out, region=frozenset({node, out}))
    if not _identity_score_mod(graph, score_mod):
        return replace(found, reason="FlexAttention: its score_mod changes the scores, which the "
                                     "op does not; left as it is")
    if isinstance(scale, fx.Node):
        return replace(found, reason="FlexAttention: scale is computed at run time; it must be a "
                                     "constant")
    atoms = _mask_mod_atoms(graph, block_mask, buffers)
    if atoms is None:
        return replace(found, reason=FLEX_REASON)
    qex, kex = example(q), example(k)
    if not (isinstance(qex, torch.Tensor) and isinstance(kex, torch.Tensor) and qex.dim() == 4
            and kex.dim() == 4):
        return replace(found, reason="FlexAttention: q and k are not [B, H, N, D] tensors the pass "
                                     "can see")
    enable_gqa = qex.shape[1] != kex.shape[1]
    sequences, note = read_site(flow, q, k, v, None, False, node, atoms=atoms)
    if sequences is not None:
        is_causal = sequences.is_causal
    elif not atoms or atoms == {Tri(True, 0)}:
        is_causal = bool(atoms)
    else:
        return replace(found, reason=f"FlexAttention: {note or FLEX_REASON}")
    return replace(found, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                   sequences=sequences)


def find_flex_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Match]:
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    matches = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is flex:
            flow = flow or DataFlow(graph)
            matches.append(_flex_match(graph, flow, node))
    return matches
