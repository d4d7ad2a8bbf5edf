"""Finding attention sites in a Dynamo FX graph.

Each finder returns Sites in canonical form (sites.py); `find_sites` runs them all and then
proves, from data flow, which sites are self-attention. Kinds:
- "sdpa":   calls of F.scaled_dot_product_attention
- "mha":    nn.MultiheadAttention's F.multi_head_attention_forward, and the fused eval fast paths
            of nn.TransformerEncoderLayer / nn.MultiheadAttention              (detect_mha.py)
- "manual": softmax(q @ k^T) @ v however it is spelled                     (detect_manual.py)

Shared here: masks (a site's mask is a list of MaskTerms; constant causal triangles become
is_causal, constant all-allowed masks vanish, the rest is combined into one attn_mask at rewrite
time), and undoing repeat_kv (GQA keys/values expanded to the query heads).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .dataflow import DataFlow, Sel, Tri, _same_size
from .sites import Site, example, module_stack

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                torch.ops.aten.scaled_dot_product_attention.default)

# A float mask entry at or below this (or -inf) forbids the key: exp() of it is 0 in float32.
FORBIDDEN = -1.0e4


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------
@dataclass
class MaskTerm:
    """One mask applied to the scores. kind: "add" (a float tensor added to the scores, times
    `factor`, the scale applied after the addition), "allow" (bool, True where a query may
    attend) or "forbid" (bool, True where it may not)."""
    node: fx.Node
    kind: str
    factor: float = 1.0


def classify_mask(flow: DataFlow, term: MaskTerm, n) -> str:
    """"all" (a constant that allows everything), "causal" (a constant causal triangle over
    n x n, whatever its leading dims) or "general". With static shapes the mask is evaluated;
    with a symbolic n it must be proved a triangle for every n (DataFlow.triangle)."""
    if not isinstance(n, int):
        return "causal" if _symbolic_causal(flow, term, n) else "general"
    kind = _concrete_kind(flow, term, n)
    if kind == "general" and _symbolic_causal(flow, term, n):
        return "causal"
    return kind


def _symbolic_causal(flow: DataFlow, term: MaskTerm, n) -> bool:
    ex = example(term.node)
    if not isinstance(ex, torch.Tensor) or ex.dim() < 2:
        return False
    if not (_same_size(ex.shape[-1], n) and _same_size(ex.shape[-2], n)):
        return False
    value = flow.triangle(term.node)
    allow_lower, forbid_upper = Tri(True, 0), Tri(False, 1)
    if term.kind == "allow":
        return value == allow_lower
    if term.kind == "forbid":
        return value == forbid_upper
    if isinstance(value, Sel):
        a, b = value.a * term.factor, value.b * term.factor
        if a == 0 and b <= FORBIDDEN:
            return value.tri == allow_lower
        if b == 0 and a <= FORBIDDEN:
            return value.tri == forbid_upper
    return False


def _concrete_kind(flow: DataFlow, term: MaskTerm, n: int) -> str:
    value = flow.constant_value(term.node)
    if not isinstance(value, torch.Tensor):
        return "general"
    try:
        if term.kind == "add":
            if not value.is_floating_point():
                return "general"
            scaled = value.double() * term.factor
            allow, forbid = scaled == 0, scaled <= FORBIDDEN
            if not bool((allow | forbid).all()):
                return "general"
        elif value.dtype != torch.bool:
            return "general"
        else:
            allow = value if term.kind == "allow" else ~value
        while allow.dim() < 2:
            allow = allow.unsqueeze(0)
        allow = allow.expand(*allow.shape[:-2], n, n)
        if bool(allow.all()):
            return "all"
        tri = torch.ones(n, n, dtype=torch.bool, device=allow.device).tril()
        if bool((allow == tri).all()):
            return "causal"
    except RuntimeError:  # does not broadcast to [.., n, n]
        return "general"
    return "general"


def resolve_masks(flow: DataFlow, terms: list, n: int) -> tuple[bool, list]:
    """(is_causal, the terms the op's attn_mask must still carry). Causal triangles alone become
    is_causal with no mask; next to another mask they stay in it (the op takes one or the other),
    which is exact, only slower."""
    general, causal = [], []
    for term in terms:
        kind = classify_mask(flow, term, n)
        if kind == "general":
            general.append(term)
        elif kind == "causal":
            causal.append(term)
    if not general:
        return bool(causal), []
    return False, general + causal


def combine_masks(spec: tuple, heads: Optional[int], *masks):
    """Run time: one attn_mask (True = allowed, or float additive) from the terms of a site.
    `spec` holds (kind, factor) per mask; `heads` unfolds [B*H, ...] masks of folded attention."""
    allowed = additive = None
    for (kind, factor), m in zip(spec, masks):
        if heads is not None and m.dim() == 3:
            m = m.unsqueeze(0) if m.shape[0] == 1 else m.unflatten(0, (-1, heads))
        if kind == "add":
            m = m if factor == 1.0 else m * factor
            additive = m if additive is None else additive + m
        else:
            a = m if kind == "allow" else m.logical_not()
            allowed = a if allowed is None else allowed & a
    if additive is None:
        return allowed
    if allowed is not None:
        additive = torch.where(allowed, additive, float("-inf"))
    return additive


def mask_shape(terms: list, heads: Optional[int], batch_heads: Optional[tuple] = None):
    """(shape, dtype, requires_grad) of what combine_masks returns, or None without terms."""
    if not terms:
        return None
    shapes, dtypes, grad = [], [], False
    for t in terms:
        ex = example(t.node)
        if not isinstance(ex, torch.Tensor):
            return ((), None, False)
        shape = tuple(ex.shape)
        if heads is not None and len(shape) == 3:
            shape = (1,) + shape if shape[0] == 1 else (shape[0] // heads, heads) + shape[1:]
        shapes.append(shape)
        dtypes.append(ex.dtype)
        grad = grad or bool(ex.requires_grad)
    try:
        shape = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        shape = shapes[0]
    floats = [d for d, t in zip(dtypes, terms) if t.kind == "add"]
    dtype = floats[0] if floats else torch.bool
    return shape, dtype, grad


def build_mask(graph: fx.Graph, terms: list, heads: Optional[int] = None) -> Optional[fx.Node]:
    """The node that carries `terms` as one attn_mask (reusing the term's node when it already
    is one), inserted at the graph's insertion point."""
    if not terms:
        return None
    if len(terms) == 1 and heads is None:
        t = terms[0]
        ex = example(t.node)
        if t.kind == "allow" and getattr(ex, "dtype", None) == torch.bool:
            return t.node
        if t.kind == "add" and t.factor == 1.0 and getattr(ex, "is_floating_point", lambda: False)():
            return t.node
    spec = tuple((t.kind, float(t.factor)) for t in terms)
    return graph.call_function(combine_masks, (spec, heads) + tuple(t.node for t in terms))


# ---------------------------------------------------------------------------------------------
# GQA: keys and values expanded to the query heads (repeat_kv, repeat_interleave)
# ---------------------------------------------------------------------------------------------
def _shape(node):
    ex = example(node)
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else None


def unrepeat_kv(node) -> tuple[object, int]:
    """(base, rep) when node is base [B, Hkv, N, D] with each head repeated rep times in a row
    (head h reads base head h // rep), as Llama's repeat_kv or repeat_interleave(rep, dim=1) do;
    (node, 1) otherwise."""
    if not isinstance(node, fx.Node):
        return node, 1
    out = _shape(node)
    if out is None or len(out) != 4:
        return node, 1
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name == "repeat_interleave":
        base = node.args[0]
        reps = _arg(node, 1, "repeats")
        dim = _arg(node, 2, "dim")
        bs = _shape(base)
        if isinstance(reps, int) and dim in (1, -3) and bs and len(bs) == 4 and bs[1] * reps == out[1]:
            return base, reps
        return node, 1
    if name not in ("reshape", "view"):
        return node, 1
    expanded = node.args[0]
    if not isinstance(expanded, fx.Node):
        return node, 1
    es = _shape(expanded)
    ename = expanded.target if expanded.op == "call_method" else getattr(expanded.target, "__name__", "")
    if ename not in ("expand",) or es is None or len(es) != 5:
        return node, 1
    b, hkv, rep, n, d = es
    if (b, hkv * rep, n, d) != out:
        return node, 1
    unsq = expanded.args[0]
    us = _shape(unsq)
    if us is None or us[2] != 1 or len(us) != 5:
        return node, 1
    uname = unsq.target if unsq.op == "call_method" else getattr(unsq.target, "__name__", "")
    base = unsq.args[0]
    bs = _shape(base)
    if bs != (b, hkv, n, d):
        return node, 1
    if uname == "unsqueeze" and _arg(unsq, 1, "dim") in (2, -3):
        return base, rep
    if uname == "getitem" and isinstance(unsq.args[1], tuple):
        index = [i for i in unsq.args[1] if i is not Ellipsis] if unsq.args[1][-1] is Ellipsis else list(unsq.args[1])
        full = slice(None, None, None)
        if len(index) >= 3 and index[0] == full and index[1] == full and index[2] is None and all(
                i == full for i in index[3:]):
            return base, rep
    return node, 1


def unrepeat_pair(k, v) -> tuple[object, object, int]:
    """(k, v, rep): both un-repeated when they were repeated alike, else as they were."""
    k0, rk = unrepeat_kv(k)
    v0, rv = unrepeat_kv(v)
    if rk > 1 and rk == rv:
        return k0, v0, rk
    return k, v, 1


# ---------------------------------------------------------------------------------------------
# SDPA
# ---------------------------------------------------------------------------------------------
def find_sdpa_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Site]:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        flow = flow or DataFlow(graph)
        site = Site(kind="sdpa", output=node, q=_arg(node, 0, "query"), k=_arg(node, 1, "key"),
                    v=_arg(node, 2, "value"), attn_mask=_arg(node, 3, "attn_mask"),
                    dropout_p=_arg(node, 4, "dropout_p", 0.0), is_causal=_arg(node, 5, "is_causal", False),
                    scale=_arg(node, 6, "scale"), enable_gqa=_arg(node, 7, "enable_gqa", False))
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


def _finders():
    from . import detect_manual, detect_mha
    return [find_sdpa_sites, detect_mha.find_mha_sites, detect_manual.find_manual_sites,
            find_flex_sites]


def _check_shapes(site: Site) -> str:
    if site.shapes is not None:
        qs, ks, vs = site.shapes["q"], site.shapes["k"], site.shapes["v"]
        mask = site.shapes.get("mask")
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


def find_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Site]:
    """Every attention site of the graph, with `reason` set for those that are not rewritable.
    `flow`: the graph's DataFlow, when the caller made it (a subgraph's knows its callers)."""
    flow = flow if flow is not None else DataFlow(graph)
    sites: list[Site] = []
    for finder in _finders():
        sites.extend(finder(graph, flow))
    for site in sites:
        site.module, site.module_types = module_stack(site.output)
        if site.reason:
            continue
        site.reason = _check_shapes(site)
        if not site.reason:
            _, site.reason = flow.common_source([site.q, site.k, site.v])
        if not site.reason and site.enable_gqa is False and site.shapes is None:
            qs, ks = example(site.q).shape, example(site.k).shape
            site.enable_gqa = qs[1] != ks[1]
    sites.sort(key=lambda s: flow.order[s.output])
    return sites


__all__ = ["find_sites", "find_sdpa_sites", "MaskTerm", "resolve_masks", "build_mask",
           "combine_masks", "mask_shape", "unrepeat_kv", "unrepeat_pair", "classify_mask"]
