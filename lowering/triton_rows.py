"""Two Triton kernels for the ring (lowering/ring.py) that work on scattered rows of a shard's
results: the merge of the cross call's (out, lse) into the local call's, and the addition of
gradients. Each is one launch where the same work in torch ops is some twenty small launches,
whose host time (about 30 us each) set the pace of a ring call on a GPU.

Both take x viewed [B, R, D] (R = heads * local rows, rows contiguous) and a row index [T] of
distinct rows; the values for those rows come as [B, T, D] with any strides. On CPU tensors, and
for float64, the ring keeps its torch ops (block_attention.merge), which these kernels follow.
"""
from __future__ import annotations

import torch
from torch import Tensor

_BLOCK_ROWS = 16


def usable(*tensors: Tensor) -> bool:
    """Whether the ring uses the kernels for these tensors: CUDA, no float64, each row's last
    dimension contiguous. (Tests run them on CPU tensors under the Triton interpreter.)"""
    if not tensors[0].is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return all(x.dtype != torch.float64 and x.stride(-1) == 1 for x in tensors)


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(Out, Lse, Index, O, LseO, T, D,
                     so_b, so_r, sl_b, sl_r, sx_b, sx_r, sy_b, sy_r,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)  # b * the batch stride passes 2**31 at B * H * n * D
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        live = i < T
        row = tl.load(Index + i, mask=live, other=0).to(tl.int64)
        i = i.to(tl.int64)
        cols = live[:, None] & (d[None, :] < D)
        l1 = tl.load(Lse + b * sl_b + row * sl_r, mask=live, other=float("-inf")).to(tl.float32)
        l2 = tl.load(LseO + b * sy_b + i * sy_r, mask=live, other=float("-inf")).to(tl.float32)
        o1 = tl.load(Out + b * so_b + row[:, None] * so_r + d[None, :], mask=cols,
                     other=0.0).to(tl.float32)
        o2 = tl.load(O + b * sx_b + i[:, None] * sx_r + d[None, :], mask=cols,
                     other=0.0).to(tl.float32)
        # a row with no key on one side carries lse -inf and any out: its weight is 0
        top = tl.maximum(l1, l2)
        top = tl.where(top == float("-inf"), 0.0, top)
        w1 = tl.exp(l1 - top)
        w2 = tl.exp(l2 - top)
        total = w1 + w2
        empty = total == 0.0
        total = tl.where(empty, 1.0, total)
        o1 = tl.where(w1[:, None] > 0.0, o1, 0.0)
        o2 = tl.where(w2[:, None] > 0.0, o2, 0.0)
        merged = o1 * (w1 / total)[:, None] + o2 * (w2 / total)[:, None]
        lse = tl.where(empty, float("-inf"), top + tl.log(total))
        tl.store(Out + b * so_b + row[:, None] * so_r + d[None, :],
                 merged.to(Out.dtype.element_ty), mask=cols)
        tl.store(Lse + b * sl_b + row * sl_r, lse.to(Lse.dtype.element_ty), mask=live)

    @triton.jit
    def add_kernel(X, Index, Delta, T, D, sx_b, sx_r, sd_b, sd_r,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)  # b * the batch stride passes 2**31 at B * H * n * D
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        live = i < T
        row = tl.load(Index + i, mask=live, other=0).to(tl.int64)
        i = i.to(tl.int64)
        cols = live[:, None] & (d[None, :] < D)
        x = tl.load(X + b * sx_b + row[:, None] * sx_r + d[None, :], mask=cols, other=0.0)
        y = tl.load(Delta + b * sd_b + i[:, None] * sd_r + d[None, :], mask=cols, other=0.0)
        total = x.to(tl.float32) + y.to(tl.float32)
        tl.store(X + b * sx_b + row[:, None] * sx_r + d[None, :],
                 total.to(X.dtype.element_ty), mask=cols)

    return merge_kernel, add_kernel


_loaded: list = []


def _get():
    if not _loaded:
        _loaded.extend(_kernels())
    return _loaded


def _grid(index: Tensor, batch: int):
    return (-(-index.numel() // _BLOCK_ROWS), batch)


def merge_rows_(out: Tensor, lse: Tensor, index: Tensor, o: Tensor, lse_o: Tensor) -> None:
    """out [B, R, D], lse [B, R] (float32) at rows `index` [T] become the log-sum-exp merge of
    themselves and (o [B, T, D], lse_o [B, T]), in place."""
    merge_kernel, _ = _get()
    t, d = index.numel(), out.shape[-1]
    if t == 0:
        return
    block_d = max(16, 1 << (d - 1).bit_length())
    merge_kernel[_grid(index, out.shape[0])](
        out, lse, index, o, lse_o, t, d, out.stride(0), out.stride(1), lse.stride(0),
        lse.stride(1), o.stride(0), o.stride(1), lse_o.stride(0), lse_o.stride(1),
        BLOCK_R=_BLOCK_ROWS, BLOCK_D=block_d)


def add_rows_(x: Tensor, index: Tensor, delta: Tensor) -> None:
    """x [B, R, D] at rows `index` [T] (distinct) += delta [B, T, D], added in float32."""
    _, add_kernel = _get()
    t, d = index.numel(), x.shape[-1]
    if t == 0:
        return
    block_d = max(16, 1 << (d - 1).bit_length())
    add_kernel[_grid(index, x.shape[0])](
        x, index, delta, t, d, x.stride(0), x.stride(1), delta.stride(0), delta.stride(1),
        BLOCK_R=_BLOCK_ROWS, BLOCK_D=block_d)
