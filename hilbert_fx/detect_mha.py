"""nn.MultiheadAttention sites, and the fused eval fast paths of the torch.nn transformer modules.

Dynamo keeps nn.MultiheadAttention as one call of F.multi_head_attention_forward (sequence
first, [N, B, E]); in eval under no_grad, nn.TransformerEncoderLayer runs as one call of
torch._transformer_encoder_layer_fwd (the whole layer: attention, residuals, norms, feed-forward)
and nn.MultiheadAttention may run as torch._native_multi_head_attention (both batch first). Each
becomes a site whose q, k, v are the in-projections of the call's inputs (Match.adapt_inputs) and
whose output is rebuilt around the op (out-projection, and for the fused layer the rest of the
layer: Match.adapt_output), all with the call's own weights. Masks follow nn.MultiheadAttention's
conventions: a boolean mask is True where attention is NOT allowed, a float mask is added;
key_padding_mask [B, N] masks keys per batch.
"""
from __future__ import annotations

import inspect
import math
import operator
from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .dataflow import DataFlow
from .detect import MaskTerm, build_mask, mask_shape, resolve_masks
from .fx_vocab import example, shape_of
from .sites import Match, Shapes

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_ENCODER_LAYER = getattr(torch, "_transformer_encoder_layer_fwd", None)
_NATIVE_MHA = getattr(torch, "_native_multi_head_attention", None)
_ENCODER_ARGS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight",
                 "proj_bias", "use_gelu", "norm_first", "eps", "norm_weight_1", "norm_bias_1",
                 "norm_weight_2", "norm_bias_2", "ffn_weight_1", "ffn_bias_1", "ffn_weight_2",
                 "ffn_bias_2", "mask", "mask_type")
_NATIVE_ARGS = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias",
                "proj_weight", "proj_bias", "mask", "need_weights", "average_attn_weights",
                "mask_type")


# ---------------------------------------------------------------------------------------------
# Run time: what the rewritten graph calls around the op (traced through by AOTAutograd)
# ---------------------------------------------------------------------------------------------
def _split_heads(x, num_heads: int, batch_first: bool):
    """[N, B, E] (or [B, N, E] when batch_first) -> [B, H, N, E / H]."""
    if batch_first:
        b, n, e = x.shape
        return x.reshape(b, n, num_heads, e // num_heads).transpose(1, 2)
    n, b, e = x.shape
    return x.reshape(n, b, num_heads, e // num_heads).permute(1, 2, 0, 3)


def mha_in_projection(query, key, value, num_heads: int, batch_first: bool, in_proj_weight,
                      in_proj_bias, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None):
    """q, k, v of nn.MultiheadAttention in [B, H, N, D], packed or separate in-projections."""
    if q_proj_weight is None:
        if query is key and key is value:
            q, k, v = F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
        else:
            w = in_proj_weight.chunk(3)
            b = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
            q, k, v = (F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), w, b))
    else:
        b = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
        q, k, v = (F.linear(x, wi, bi) for x, wi, bi in
                   zip((query, key, value), (q_proj_weight, k_proj_weight, v_proj_weight), b))
    return tuple(_split_heads(x, num_heads, batch_first) for x in (q, k, v))


def mha_out_projection(out, weight, bias, batch_first: bool):
    """The op's [B, H, N, D] -> nn.MultiheadAttention's output [N, B, E] ([B, N, E])."""
    b, h, n, d = out.shape
    if batch_first:
        merged = out.transpose(1, 2).reshape(b, n, h * d)
    else:
        merged = out.permute(2, 0, 1, 3).reshape(n, b, h * d)
    return F.linear(merged, weight, bias)


def encoder_layer_qkv(src, num_heads: int, qkv_weight, qkv_bias, norm_first: bool, eps: float,
                      norm_weight_1, norm_bias_1):
    x = F.layer_norm(src, (src.shape[-1],), norm_weight_1, norm_bias_1, eps) if norm_first else src
    return mha_in_projection(x, x, x, num_heads, True, qkv_weight, qkv_bias)


def encoder_layer_rest(out, src, proj_weight, proj_bias, use_gelu: bool, norm_first: bool,
                       eps: float, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                       ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2):
    """The rest of nn.TransformerEncoderLayer's fused eval layer after the attention."""
    e = src.shape[-1]
    x = src + mha_out_projection(out, proj_weight, proj_bias, True)
    if not norm_first:
        x = F.layer_norm(x, (e,), norm_weight_1, norm_bias_1, eps)
    h = F.layer_norm(x, (e,), norm_weight_2, norm_bias_2, eps) if norm_first else x
    h = F.linear(h, ffn_weight_1, ffn_bias_1)
    h = F.gelu(h) if use_gelu else F.relu(h)
    x = x + F.linear(h, ffn_weight_2, ffn_bias_2)
    if not norm_first:
        x = F.layer_norm(x, (e,), norm_weight_2, norm_bias_2, eps)
    return x


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------
def _mask_term(node) -> Optional[MaskTerm]:
    if not isinstance(node, fx.Node):
        return None
    ex = example(node)
    return MaskTerm(node, "forbid" if getattr(ex, "dtype", None) == torch.bool else "add")


def _padding_term(graph: fx.Graph, kpm: fx.Node) -> MaskTerm:
    """key_padding_mask [B, N] as a [B, 1, 1, N] term (inserted at rewrite time)."""
    ex = example(kpm)
    node = graph.call_method("unsqueeze", (graph.call_method("unsqueeze", (kpm, 1)), 1))
    node.meta["example_value"] = ex[:, None, None, :] if isinstance(ex, torch.Tensor) else None
    return MaskTerm(node, "forbid" if getattr(ex, "dtype", None) == torch.bool else "add")


def _padding_shape(kpm) -> Optional[tuple]:
    ex = example(kpm)
    if not isinstance(ex, torch.Tensor):
        return None
    return (tuple(ex.shape[:1]) + (1, 1) + tuple(ex.shape[1:]), ex.dtype, bool(ex.requires_grad))


def _merge_mask_shapes(a, b):
    if a is None or b is None:
        return a or b
    try:
        shape = tuple(torch.broadcast_shapes(a[0], b[0]))
    except RuntimeError:
        shape = a[0]
    dtype = a[1] if a[1] is not None and a[1] != torch.bool else b[1]
    return shape, dtype, a[2] or b[2]


def _masks(flow: DataFlow, attn_mask, kpm, n: int, heads: int, is_causal_hint: bool):
    """(is_causal, attn_mask terms to carry, key_padding_mask or None, the op's mask shape)."""
    terms = [t for t in [_mask_term(attn_mask)] if t is not None]
    if is_causal_hint and kpm is None:
        return True, [], None, None  # nn.MultiheadAttention's is_causal: attn_mask is the causal mask
    is_causal, kept = resolve_masks(flow, terms, n)
    if is_causal and kpm is not None:
        is_causal, kept = False, terms  # the op takes is_causal or a mask, not both: keep the triangle
    mask = _merge_mask_shapes(mask_shape(kept, heads), _padding_shape(kpm) if kpm is not None else None)
    return is_causal, kept, kpm, mask


def _adapt_inputs(kept, kpm, heads, inputs_fn):
    """Match.adapt_inputs: the in-projections (inputs_fn) and the one mask the terms make."""
    def adapt_inputs(graph: fx.Graph):
        q, k, v = inputs_fn(graph)
        terms = list(kept)
        if kpm is not None:
            terms.append(_padding_term(graph, kpm))
        return q, k, v, build_mask(graph, terms, heads)
    return adapt_inputs


def _qkv_nodes(graph: fx.Graph, fn, args) -> tuple:
    call = graph.call_function(fn, args)
    return tuple(graph.call_function(operator.getitem, (call, i)) for i in range(3))


def _outputs(node: fx.Node) -> tuple[Optional[fx.Node], bool]:
    """(the getitem of the attention output, whether the weights are used)."""
    out, weights_used = None, False
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0:
            out = u
        elif u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1:
            weights_used = weights_used or bool(u.users)
        else:
            weights_used = True
    return out, weights_used


def _mha_forward(node: fx.Node, flow: DataFlow) -> Optional[Match]:
    try:
        bound = _MHA_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    out, weights_used = _outputs(node)
    if out is None:
        return None
    found = Match(kind="mha", output=out, q=a["query"], k=a["key"], v=a["value"],
                  region=frozenset({node, out}))
    for name in ("num_heads", "add_zero_attn", "dropout_p", "training", "need_weights",
                 "use_separate_proj_weight", "is_causal"):
        if isinstance(a[name], fx.Node):
            return replace(found, reason=f"{name} is computed at run time; it must be a constant")
    reason = ""
    if weights_used:
        reason = "attention weights are used outside the attention (need_weights=True)"
    elif a["bias_k"] is not None or a["bias_v"] is not None:
        reason = "bias_k/bias_v add a learned key and value that no position of the sequence has"
    elif a["add_zero_attn"]:
        reason = "add_zero_attn adds a zero key and value that no position of the sequence has"
    elif a["static_k"] is not None or a["static_v"] is not None:
        reason = "static_k/static_v: keys and values are given from outside"
    if reason:
        return replace(found, reason=reason)
    qs, ks, vs = shape_of(a["query"]), shape_of(a["key"]), shape_of(a["value"])
    if qs is None or len(qs) != 3 or ks is None or len(ks) != 3 or vs is None or len(vs) != 3:
        return replace(found, reason="unbatched input to nn.MultiheadAttention")
    heads, e = a["num_heads"], qs[2]
    d = e // heads
    n, b = qs[0], qs[1]
    is_causal, kept, kpm, mask = _masks(flow, a["attn_mask"], a["key_padding_mask"], n, heads,
                                        a["is_causal"])
    args = (a["query"], a["key"], a["value"], heads, False, a["in_proj_weight"], a["in_proj_bias"])
    if a["use_separate_proj_weight"]:
        args += (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
    weight, bias = a["out_proj_weight"], a["out_proj_bias"]
    return replace(
        found, is_causal=is_causal, scale=1.0 / math.sqrt(d),
        dropout_p=float(a["dropout_p"]) if a["training"] else 0.0,
        shapes=Shapes((b, heads, n, d), (ks[1], heads, ks[0], d), (vs[1], heads, vs[0], d), mask),
        adapt_inputs=_adapt_inputs(kept, kpm, heads,
                                   lambda graph: _qkv_nodes(graph, mha_in_projection, args)),
        adapt_output=lambda graph, o: graph.call_function(mha_out_projection, (o, weight, bias, False)))


def _mask_by_type(mask, mask_type, heads):
    """(attn_mask, key_padding_mask) of the native ops' (mask, mask_type)."""
    if mask is None:
        return None, None
    if mask_type == 1:
        return None, mask
    return mask, None


def _encoder_layer(node: fx.Node, flow: DataFlow) -> Optional[Match]:
    a = dict(zip(_ENCODER_ARGS, node.args))
    a.update(node.kwargs)
    a.setdefault("mask", None)
    a.setdefault("mask_type", None)
    src = a["src"]
    found = Match(kind="mha", output=node, q=src, k=src, v=src, region=frozenset({node}))
    for name in ("num_heads", "use_gelu", "norm_first", "eps", "mask_type"):
        if isinstance(a[name], fx.Node):
            return replace(found, reason=f"{name} is computed at run time; it must be a constant")
    shape = shape_of(src)
    if shape is None or len(shape) != 3:
        return replace(found, reason="the fused encoder layer's input is not [B, N, E]")
    b, n, e = shape
    heads = a["num_heads"]
    d = e // heads
    attn_mask, kpm = _mask_by_type(a["mask"], a["mask_type"], heads)
    is_causal, kept, kpm, mask = _masks(flow, attn_mask, kpm, n, heads, False)
    qkv = (src, heads, a["qkv_weight"], a["qkv_bias"], a["norm_first"], a["eps"],
           a["norm_weight_1"], a["norm_bias_1"])
    rest = (src, a["proj_weight"], a["proj_bias"], a["use_gelu"], a["norm_first"], a["eps"],
            a["norm_weight_1"], a["norm_bias_1"], a["norm_weight_2"], a["norm_bias_2"],
            a["ffn_weight_1"], a["ffn_bias_1"], a["ffn_weight_2"], a["ffn_bias_2"])
    return replace(
        found, is_causal=is_causal, scale=1.0 / math.sqrt(d),
        shapes=Shapes((b, heads, n, d), (b, heads, n, d), (b, heads, n, d), mask),
        adapt_inputs=_adapt_inputs(kept, kpm, heads,
                                   lambda graph: _qkv_nodes(graph, encoder_layer_qkv, qkv)),
        adapt_output=lambda graph, o: graph.call_function(encoder_layer_rest, (o,) + rest))


def _native_mha(node: fx.Node, flow: DataFlow) -> Optional[Match]:
    a = dict(zip(_NATIVE_ARGS, node.args))
    a.update(node.kwargs)
    for key, default in (("mask", None), ("need_weights", True), ("mask_type", None)):
        a.setdefault(key, default)
    out, weights_used = _outputs(node)
    if out is None:
        return None
    found = Match(kind="mha", output=out, q=a["query"], k=a["key"], v=a["value"],
                  region=frozenset({node, out}))
    if weights_used:
        return replace(found, reason="attention weights are used outside the attention (need_weights=True)")
    qs, ks, vs = shape_of(a["query"]), shape_of(a["key"]), shape_of(a["value"])
    if qs is None or len(qs) != 3 or ks is None or len(ks) != 3 or vs is None or len(vs) != 3:
        return replace(found, reason="unbatched input to nn.MultiheadAttention")
    heads = a["num_head"]
    b, n, e = qs
    d = e // heads
    attn_mask, kpm = _mask_by_type(a["mask"], a["mask_type"], heads)
    is_causal, kept, kpm, mask = _masks(flow, attn_mask, kpm, n, heads, False)
    args = (a["query"], a["key"], a["value"], heads, True, a["qkv_weight"], a["qkv_bias"])
    weight, bias = a["proj_weight"], a["proj_bias"]
    return replace(
        found, is_causal=is_causal, scale=1.0 / math.sqrt(d),
        shapes=Shapes((b, heads, n, d), (ks[0], heads, ks[1], d), (vs[0], heads, vs[1], d), mask),
        adapt_inputs=_adapt_inputs(kept, kpm, heads,
                                   lambda graph: _qkv_nodes(graph, mha_in_projection, args)),
        adapt_output=lambda graph, o: graph.call_function(mha_out_projection, (o, weight, bias, True)))


def find_mha_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Match]:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is F.multi_head_attention_forward:
            finder = _mha_forward
        elif _ENCODER_LAYER is not None and node.target is _ENCODER_LAYER:
            finder = _encoder_layer
        elif _NATIVE_MHA is not None and node.target is _NATIVE_MHA:
            finder = _native_mha
        else:
            continue
        flow = flow or DataFlow(graph)
        site = finder(node, flow)
        if site is not None:
            sites.append(site)
    return sites
