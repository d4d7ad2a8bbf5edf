"""Masks of attention sites, as every finder reads them (detect_sdpa.py, detect_mha.py,
detect_manual.py).

A site's mask is a list of MaskTerms: constant causal triangles become is_causal, constant
all-allowed masks vanish, the rest is combined into one attn_mask at rewrite time
(combine_masks, which the rewritten graph calls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .dataflow import DataFlow
from .fx_vocab import example, same_size
from .triangles import Sel, Tri

# A float mask entry at or below this (or -inf) forbids the key: exp() of it is 0 in float32.
FORBIDDEN = -1.0e4


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
    if not (same_size(ex.shape[-1], n) and same_size(ex.shape[-2], n)):
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


__all__ = ["FORBIDDEN", "MaskTerm", "classify_mask", "resolve_masks", "combine_masks",
           "mask_shape", "build_mask"]
