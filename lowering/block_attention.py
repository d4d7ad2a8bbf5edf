"""Attention over dense, already gathered blocks, returning the log-sum-exp: the SDPA kernels.

Every function here takes q, k, v of shape [B, G, L, D] (G = heads x segments), an optional
additive float `bias` broadcastable to [B, G, L, L] (-inf where attention is forbidden) and
returns per-row log-sum-exp in float32, so that the caller can merge several blocks exactly.
Rows with no allowed key come back with an arbitrary lse; the caller knows which they are.

Kernels (chosen by `kernel_for`):
- "flash_cpu":  aten._scaled_dot_product_flash_attention_for_cpu (CPU, any float dtype)
- "flash":      aten._scaled_dot_product_flash_attention (CUDA, fp16/bf16, no bias, D <= 256)
- "efficient":  aten._scaled_dot_product_efficient_attention (CUDA, the rest)
- "math":       float32 matmuls in PyTorch, used when dropout is on: its keep mask is a hash of
                positions (lowering/dropout.py), which no SDPA kernel accepts.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int, has_bias: bool,
               dropout: bool) -> str:
    if dropout:
        return "math"
    if device.type == "cpu":
        return "flash_cpu"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not has_bias \
            and head_dim % 8 == 0 and head_dim <= 256:
        return "flash"
    if device.type == "cuda":
        return "efficient"
    return "math"


def merge(cur_o, cur_lse, o, lse):
    """Two normalised partial results of the same rows, (o [.., Dv], lse [..]), as one.

    The weights are exp(lse - top) over their sum, top the larger lse: a convex combination
    whatever the lse's magnitude (the differences are exact where they matter, close numbers),
    as lowering/triton_kernels.py's _fwd_kernel merges. Weights exp(lse - logaddexp(..))
    instead divide by a number rounded at the lse's magnitude: at |lse| ~ 5e6 in float32 (ulp
    0.5) they sum to anything in e^(+-0.25), an error one softmax does not make (2.3e-2
    relative on logits of that size, where each branch alone was exact). Rows with no key in
    either keep lse -inf and o 0."""
    top = torch.maximum(cur_lse, lse)
    top = top.masked_fill(top == float("-inf"), 0.0)
    w_old, w_new = torch.exp(cur_lse - top), torch.exp(lse - top)
    total = w_old + w_new
    empty = total == 0
    total = total.masked_fill(empty, 1.0)
    new_lse = torch.where(empty, float("-inf"), top + torch.log(total))
    return (cur_o * (w_old / total).unsqueeze(-1) + o * (w_new / total).unsqueeze(-1)), new_lse


def _aligned_bias(bias: torch.Tensor, shape) -> torch.Tensor:
    """Expanded bias whose row stride is a multiple of 16, as the efficient kernel requires."""
    length = bias.shape[-1]
    pad = (-length) % 16
    if pad:
        bias = F.pad(bias.expand(*shape[:-1], length), (0, pad))[..., :length]
    return bias.expand(shape)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _math_scores(q, k, bias, is_causal, scale):
    wide = _wide(q.dtype)
    s = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(wide)
    if is_causal:
        length = s.shape[-1]
        tril = torch.ones(length, length, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tril, float("-inf"))
    return s


def _kernel_scale(kernel: str, q, scale):
    """(q, scale) for the SDPA kernels, giving the same scores exactly: (-q, -scale) when
    scale < 0, (0 * q, 1) when scale == 0. PyTorch's CPU kernel returns NaN for either with
    is_causal (it scales scores already set to -inf: -inf * 0 is NaN)."""
    if kernel == "math":
        return q, scale
    if scale < 0:
        return -q, -scale
    if scale == 0:
        return q * 0.0, 1.0  # not zeros_like: a NaN or inf in q still gives NaN, as in SDPA
    return q, scale


def _same_head_dim(*tensors, width: int):
    """Each tensor zero-padded in its last dim to `width`. The SDPA kernels (flash on CPU and
    CUDA) take one head dim for q, k and v; padding q and k with zeros leaves q . k as it is,
    padding v (and dout, out) with zeros gives out and its gradient zero columns, sliced off."""
    return tuple(t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))
                 for t in tensors)


def forward(q, k, v, *, bias, is_causal, scale, keep=None, dropout_p=0.0):
    d, dv = q.shape[-1], v.shape[-1]
    kernel = kernel_for(q.device, q.dtype, max(d, dv), bias is not None, keep is not None)
    if kernel != "math" and d != dv:  # v with its own head dim: see _same_head_dim
        q, k, v = _same_head_dim(q, k, v, width=max(d, dv))
        out, lse = forward(q, k, v, bias=bias, is_causal=is_causal, scale=scale, keep=keep,
                           dropout_p=dropout_p)
        return out[..., :dv], lse
    q, scale = _kernel_scale(kernel, q, scale)
    if kernel == "flash_cpu":
        mask = None if bias is None else bias.to(q.dtype)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out, lse
    if kernel == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return res[0], res[1]
    if kernel == "efficient":
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        b = None if bias is None else _aligned_bias(bias.to(q.dtype), shape)
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, b, True, 0.0, is_causal, scale=scale)
        return out, lse[..., : q.shape[2]]
    s = _math_scores(q, k, bias, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = torch.matmul(p, v.to(p.dtype)).to(q.dtype)
    return out, lse


def backward(dout, q, k, v, out, lse, *, bias, is_causal, scale, keep=None, dropout_p=0.0):
    """Gradients of the block attention given the FINAL out and lse of each row.

    With out and lse of the whole mixture (not of this block alone), these are exactly this
    block's share of the gradient of the mixture (FlashAttention-2's backward, term by term).
    Rows whose lse is +inf contribute nothing.
    """
    d, d_v = q.shape[-1], v.shape[-1]
    kernel = kernel_for(q.device, q.dtype, max(d, d_v), bias is not None, keep is not None)
    if kernel != "math" and d != d_v:  # v with its own head dim: see _same_head_dim
        q, k, v, dout, out = _same_head_dim(q, k, v, dout, out, width=max(d, d_v))
        dq, dk, dv = backward(dout, q, k, v, out, lse, bias=bias, is_causal=is_causal,
                              scale=scale, keep=keep, dropout_p=dropout_p)
        return dq[..., :d], dk[..., :d], dv[..., :d_v]
    if kernel != "math" and scale <= 0:  # the kernels see _kernel_scale's q and scale
        q_k, scale_k = _kernel_scale(kernel, q, scale)
        dq, dk, dv = backward(dout, q_k, k, v, out, lse, bias=bias, is_causal=is_causal,
                              scale=scale_k, keep=keep, dropout_p=dropout_p)
        # scores = scale * q . k = scale_k * q_k . k, with q_k = (scale / scale_k) * q
        return dq * (scale / scale_k), dk, dv
    lse = lse.contiguous()
    if kernel == "flash_cpu":
        mask = None if bias is None else bias.to(q.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(q.dtype), 0.0, is_causal, attn_mask=mask, scale=scale)
    if kernel == "flash":
        seed = torch.empty((2,), dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float(), None, None, q.shape[2], k.shape[2], 0.0, is_causal,
            seed, offset, scale=scale)
    if kernel == "efficient":
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        b = None if bias is None else _aligned_bias(bias.to(q.dtype), shape)
        padded = math.ceil(q.shape[2] / 32) * 32
        lse = F.pad(lse.float(), (0, padded - q.shape[2]))
        seed = torch.empty((), dtype=torch.long, device=q.device)
        # The kernel that computes rowsum(dO * O) itself assumes the layout its forward writes,
        # [B, L, G, D] contiguous (seen on H100 with bf16: wrong dq, dk otherwise).
        out, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (out, dout))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, b, out, lse, seed, seed, 0.0, [True, True, True, False], is_causal,
            scale=scale)
        return dq, dk, dv
    s = _math_scores(q, k, bias, is_causal, scale)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
    wide = s.dtype
    do = dout.to(wide)
    dp = torch.matmul(do, v.to(wide).transpose(-1, -2))
    pd = p
    if keep is not None:
        factor = keep / (1.0 - dropout_p)
        pd = p * factor
        dp = dp * factor
    delta = (do * out.to(wide)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.to(wide)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(wide)) * scale
    dv = torch.matmul(pd.transpose(-1, -2), do)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
