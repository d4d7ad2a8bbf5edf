"""Dilated attention over a 1-D device mesh (SPEC section 4): torch.ops.hilbert_fx.ring_dilated_attention.

Each of the P ranks of the mesh's process group holds a contiguous shard [B, H, n, D] of q, k and
v (rank i: global positions [i*n, (i+1)*n)) and gets back its shard of what the single-device op
computes on the whole sequence, forward and backward.

The ring is a composition of four parts, each in a file of its own:
- agreement (lowering/ring_agree.py): one small exchange through the process group's store
  before the ranks do anything together, so that a rank that rejects its arguments, or shards and
  configurations that differ across ranks, make every rank raise instead of hanging;
- plan (lowering/ring_plan.py): which rows travel, and the branch plans of the two calls below;
- transport (lowering/ring_transport.py): the key/value rows and the gradients, point to point;
- the computation here: two calls of one lowering's `forward` (or `backward`), the interface
  every lowering implements (lowering/op.py calls it on one device):

      forward(q, k, v, plans, *, is_causal, attn_mask, scale, dropout_p, seed) -> (out, lse)
      backward(dout, q, k, v, out, lse, plans, *, same keywords) -> (dq, dk, dv)

  over BranchPlans whose sets may be partial or empty and may leave rows out
  (plan.complete False: such rows get out 0, lse -inf, gradients 0).

Forward: the local call runs on the shard itself (every set none of whose members comes from a
peer, `RingPlan.local_plans`) while the key/value rows travel; then, once they arrived, the
*cross* call runs the sets with peers' rows, each such set whole, its members in global order.
Its rows are (query head, position) pairs, the heads folded into the row (`RingPlan.folded`:
one head, each query head carrying only its own members); with dropout, whose keep bits hash the
head and the positions, they are the extended row of every head (the local rows of those sets,
followed by the rows received). Its results on the local rows are merged into the local call's
by log-sum-exp in float32 (float64 for float64 inputs), on those rows only. The received rows are
no queries: a lowering that takes `query_rows` (the SDPA lowering) skips them, another computes
them too and their results are dropped (ring_plan.py says what that costs).

On CUDA without dropout the local call is launched before the agreement, so that the
agreement's round trips through the store overlap the GPU's work, and the rows are posted from
a stream of their own (`_posting`); elsewhere the rows are posted first and the local call runs
while they travel.

Backward (FlashAttention-2 style, with the final out and lse, so that each call's gradients are
its exact share and add up): the rows travel again while the local call's backward runs; the
cross call's backward gives the local rows' share and the received rows' key/value gradients,
which go back to their owners (in float32), which add them to their own. On the SDPA lowering
(many small kernels) the local call is cut in two runs of about equal work, the second computed
while the gradients travel back.

Dropout: the keep bits are a hash of global positions (lowering/dropout.py), and rank 0's seed is
used everywhere. A lowering whose forward and backward take `dropout_rows` (the global position
of each row of the call) runs dropout in the ring; the SDPA and the Triton lowerings both do.
lowering="triton" runs both calls on the SDPA lowering only for dtypes and head dims the Triton
lowering does not take (float64, D > 256).

attn_mask is not supported with a mesh (ValueError naming attn_mask), nor are op.py's sequence
arguments (position_ids, seqused_k; op.dilated_attention refuses them with mesh=). The lowering
is carried so that the rewritten graph shows it, as for the single-device op.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Optional

import torch
from torch import Tensor

from . import block_attention, ring_agree, ring_transport, sdpa_lowering, triton_rows
from .arguments import check_branches, check_flags, check_lowering, problem, resolve_lowering
from .autocast import register_autocast
from .dropout import new_seed
from .op import _bnhd, _compute_dtype, _like, _op_backward_fake, _op_fake
from .ring_agree import group_name_of
from .ring_plan import RingPlan, plan_bytes, ring_plan
from .ring_transport import comm_stats, reset_comm_stats

NEG_INF = float("-inf")

__all__ = ["ring_dilated_attention", "dilated_attention_on_mesh", "ring_dilated_attention_op",
           "comm_stats", "reset_comm_stats", "plan_bytes", "group_name_of"]


# ---------------------------------------------------------------------------------------------
# Which lowering the two calls run on.

_TAKES: dict = {}


def _takes(module, keyword: str) -> bool:
    """Whether a lowering's forward and backward take an optional keyword of the interface
    (read once per pair of functions: signatures cost more than a small kernel's launch)."""
    key = (module.forward, module.backward, keyword)
    if key not in _TAKES:
        _TAKES[key] = all(keyword in inspect.signature(f).parameters for f in key[:2])
    return _TAKES[key]


def _lowering(q: Tensor, lowering: str, dropout_p: float):
    """(module, name): the Triton lowering where it was asked for and takes the call (see the
    module docstring), else the SDPA lowering."""
    if lowering == "triton":
        from . import triton_lowering
        if (q.dtype in triton_lowering.SUPPORTED_DTYPES
                and q.shape[-1] <= triton_lowering.MAX_HEAD_DIM
                and (dropout_p == 0.0 or _takes(triton_lowering, "dropout_rows"))):
            return triton_lowering, "triton"
    return sdpa_lowering, "sdpa"


def _rows(dropout_p: float, positions: Tensor) -> dict:
    """The keyword that makes a call's dropout hash global positions (only a call with dropout
    passes it: a lowering without dropout need not take it)."""
    return {"dropout_rows": positions} if dropout_p > 0.0 else {}


# ---------------------------------------------------------------------------------------------
# The cross call's rows. Two layouts with one set of methods:
# - _Folded (RingPlan.folded): the query heads folded into the row, one head whose rows are
#   (head, position) pairs, so each head carries only its own members;
# - _Extended: the extended row of every head (ring_plan.py), kept for dropout, whose keep bits
#   hash the head index and the global positions of a call's rows (`dropout_rows` is per row).
# Both take the shard's tensors viewed [B, H*n, ...] (rows h * n + i) and give the call's.

def _flat(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


class _Folded:
    def __init__(self, plan: RingPlan):
        f = plan.folded
        self.plans, self.t, self.length = list(f.plans), f.queries, f.length
        self.q_index, self.kv_unique, self.kv_inverse = f.q_index, f.kv_unique, f.kv_inverse
        self.recv_index, self.kv_index = f.recv_index, f.kv_index

    def queries(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """[B, 1, R, ...]: x's (head, row) pairs, then `fill` for the received rows."""
        out = x.new_full((x.shape[0], 1, self.length, *x.shape[3:]), fill)
        out[:, 0, :self.t] = _flat(x)[:, self.q_index]
        return out

    def keys(self, x: Tensor, received: Optional[Tensor]) -> Tensor:
        out = x.new_empty((x.shape[0], 1, self.length, *x.shape[3:]))
        out[:, 0, :self.t] = _flat(x)[:, self.kv_index]
        if received is not None:
            out[:, 0, self.t:] = received[:, self.recv_index]
        return out

    def query_part(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """(index into the shard's [B, Hq*n] rows, the call's results on them [B, R_loc, ...])."""
        return self.q_index, y[:, 0, :self.t]

    def key_part(self, g: Tensor, wide) -> tuple[Tensor, Tensor]:
        """(index into [B, Hkv*n], the call's key/value gradients summed onto it, in wide)."""
        delta = g.new_zeros((g.shape[0], self.kv_unique.numel(), g.shape[-1]), dtype=wide)
        return self.kv_unique, delta.index_add_(1, self.kv_inverse, g[:, 0, :self.t].to(wide))

    def received(self, g: Tensor, rows: int, wide) -> Tensor:
        """[B, M, D] in wide: each received row's gradient, on its first arrival (a row that
        arrived twice carries its total once; the others 0)."""
        out = g.new_zeros((g.shape[0], rows, g.shape[-1]), dtype=wide)
        return out.index_add_(1, self.recv_index, g[:, 0, self.t:].to(wide))


class _Extended:
    def __init__(self, plan: RingPlan, num_heads: int, num_kv_heads: int):
        self.plan, self.plans, self.t = plan, list(plan.cross_plans), plan.cross_rows.numel()
        rows = plan.cross_rows
        self.q_index = (torch.arange(num_heads, device=rows.device)[:, None] * plan.n
                        + rows).reshape(-1)
        self.kv_index = (torch.arange(num_kv_heads, device=rows.device)[:, None] * plan.n
                         + rows).reshape(-1)

    def queries(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """[B, H, T, ...]: x's rows cross_rows, then `fill` for the received rows."""
        ext = x.new_full((*x.shape[:2], self.plan.ext_len, *x.shape[3:]), fill)
        ext[:, :, :self.t] = x[:, :, self.plan.cross_rows]
        return ext

    def keys(self, x: Tensor, received: Optional[Tensor]) -> Tensor:
        """Each received row at its (kv head, extended row); an extended row that no kv head's
        message brought stays 0 for that head (no query head of it reads the row)."""
        ext = self.queries(x)
        if received is not None:
            ext[:, self.plan.recv_heads, self.plan.recv_ext] = received
        return ext

    def query_part(self, y: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_index, _flat(y[:, :, :self.t])

    def key_part(self, g: Tensor, wide) -> tuple[Tensor, Tensor]:
        return self.kv_index, _flat(g[:, :, :self.t]).to(wide)

    def received(self, g: Tensor, rows: int, wide) -> Tensor:
        first = self.plan.recv_first.view(1, -1, 1)
        return torch.where(first, g[:, self.plan.recv_heads, self.plan.recv_ext].to(wide), 0.0)


def _layout(plan: RingPlan, q: Tensor, k: Tensor, dropout_p: float):
    return (_Folded(plan) if dropout_p == 0.0 and plan.folded is not None
            else _Extended(plan, q.shape[1], k.shape[1]))


def _cross(lower, plan: RingPlan, layout, dropout_p: float) -> dict:
    """The cross call's optional keywords: global positions for dropout (extended row), and
    query_rows (the received rows are no queries) where the lowering takes it; one that does
    not computes those rows' queries too, and their results are dropped."""
    kw = _rows(dropout_p, plan.ext_positions)
    if _takes(lower, "query_rows"):
        kw["query_rows"] = layout.t
    return kw


def _merge_rows(out: Tensor, lse: Tensor, index: Tensor, o: Tensor, lse_o: Tensor) -> None:
    """Merges (o, lse_o) [B, X, ...] into out, lse viewed [B, H*n, ...] at rows `index`, by
    log-sum-exp in lse's dtype (block_attention.merge). Rows with lse -inf have no key: their
    out is taken as 0 (a lowering may leave anything there)."""
    wide = lse.dtype
    out_f, lse_f = _flat(out), _flat(lse)
    if triton_rows.usable(out_f, lse_f, o, lse_o):  # one launch instead of some twenty
        triton_rows.merge_rows_(out_f, lse_f, index, o, lse_o)
        return
    l1 = lse_f[:, index]
    o1 = out_f[:, index].to(wide).masked_fill((l1 == NEG_INF).unsqueeze(-1), 0.0)
    lse_o = lse_o.to(wide)
    o2 = o.to(wide).masked_fill((lse_o == NEG_INF).unsqueeze(-1), 0.0)
    merged, lse_f[:, index] = block_attention.merge(o1, l1, o2, lse_o)
    out_f[:, index] = merged.to(out.dtype)


def _accumulate(x: Tensor, index: Tensor, delta: Tensor, wide: torch.dtype) -> None:
    """x viewed [B, H*n, ...] += delta at rows `index` (distinct), added in wide."""
    x_f = _flat(x)
    if wide == torch.float32 and triton_rows.usable(x_f, delta):
        triton_rows.add_rows_(x_f, index, delta)
        return
    x_f[:, index] = (x_f[:, index].to(wide) + delta.to(wide)).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Forward and backward on one rank.

def _forward(q, k, v, call: _Call, *, is_causal, scale, dropout_p):
    plan, group, lower = call.plan, call.group, call.lower
    b, dk, dv = q.shape[0], k.shape[-1], v.shape[-1]
    common = dict(is_causal=is_causal, attn_mask=None, scale=scale, dropout_p=dropout_p)
    local = lambda seed: lower.forward(q, k, v, list(plan.local_plans), **common, seed=seed,
                                       **_rows(dropout_p, plan.local_positions))
    inputs = _mark(q.device)
    result = call.early(lambda: local(None)) if _early(inputs, dropout_p) else None
    seed = call.agree()
    posted = _post_rows(call, k, v, inputs, "forward", ring_transport.FORWARD)
    out, lse = (x.contiguous() for x in (result or local(seed)))
    if plan.cross_plans:
        with _beside(inputs):
            kbuf, vbuf = ring_transport.received_rows(plan, posted, b, dk, dv)
            lay = _layout(plan, q, k, dropout_p)
            ox, lx = lower.forward(lay.queries(q), lay.keys(k, kbuf), lay.keys(v, vbuf),
                                   lay.plans, **common, seed=seed,
                                   **_cross(lower, plan, lay, dropout_p))
        _join(inputs, ox, lx)
        index, o = lay.query_part(ox)
        _merge_rows(out, lse, index, o, lay.query_part(lx)[1])
    else:
        ring_transport.received_rows(plan, posted, b, dk, dv)  # the sends completed
    return out, lse


def _backward(dout, q, k, v, out, lse, call: _Call, *, is_causal, scale, dropout_p):
    plan, group, lower = call.plan, call.group, call.lower
    b, dk_dim, dv_dim = q.shape[0], k.shape[-1], v.shape[-1]
    wide = torch.promote_types(q.dtype, torch.float32)
    local = _rows(dropout_p, plan.local_positions)
    # many small kernels (the SDPA lowering): half of the local sets while the gradients travel
    split = call.name == "sdpa"
    first, second = plan.local_halves if split and plan.talks else (plan.local_plans, ())
    grads = lambda plans, seed: lower.backward(
        dout, q, k, v, out, lse, list(plans), is_causal=is_causal, attn_mask=None, scale=scale,
        dropout_p=dropout_p, seed=seed, **local)
    inputs = _mark(q.device)
    result = call.early(lambda: grads(first, None)) if _early(inputs, dropout_p) else None
    seed = call.agree()
    common = dict(is_causal=is_causal, attn_mask=None, scale=scale, dropout_p=dropout_p,
                  seed=seed)
    posted = _post_rows(call, k, v, inputs, "backward", ring_transport.BACKWARD)
    dq, dk, dv = (x.contiguous() for x in (result or grads(first, seed)))

    gk = gv = cross = lay = None
    with _beside(inputs):
        kbuf, vbuf = ring_transport.received_rows(plan, posted, b, dk_dim, dv_dim)
        if plan.cross_plans:
            lay = _layout(plan, q, k, dropout_p)
            # received rows are no queries: dout 0 (and lse -inf) gives them no share of anything
            cross = lower.backward(
                lay.queries(dout), lay.queries(q), lay.keys(k, kbuf), lay.keys(v, vbuf),
                lay.queries(out), lay.queries(lse, NEG_INF), lay.plans, **common,
                **_cross(lower, plan, lay, dropout_p))
            if plan.recv_total:
                gk, gv = (lay.received(g, plan.recv_total, wide) for g in cross[1:])
        works, recvs, payloads = ring_transport.post_gradients(
            plan, group, gk, gv, batch=b, dk=dk_dim, dv=dv_dim, dtype=wide, device=q.device)
    _join(inputs, *(cross or ()), *recvs)

    if second:  # while the gradients travel
        more = grads(second, seed)
        dq, dk, dv = (x.to(wide) + y.to(wide) for x, y in zip((dq, dk, dv), more))
    if cross is not None:
        _accumulate(dq, *lay.query_part(cross[0]), wide)
        for x, g in zip((dk, dv), cross[1:]):
            _accumulate(x, *lay.key_part(g, wide), wide)
    back = ring_transport.received_gradients(plan, works, recvs, batch=b, dk=dk_dim, dv=dv_dim)
    del payloads  # kept alive until received_gradients waited for every send of the batch
    if back is not None:
        index = plan.grad_heads * plan.n + plan.grad_rows
        _accumulate(dk, index, back[0], wide)
        _accumulate(dv, index, back[1], wide)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_POSTING: dict = {}  # device -> the stream messages are posted from


def _mark(device: torch.device):
    """An event after everything enqueued so far on the current stream (CUDA), else None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _posting(device: torch.device, after):
    """Where the key/value rows are posted from. NCCL starts a message only after the work
    enqueued before it on the posting stream; posted from the current stream after the local
    sets, the rows would travel only once those are done. A stream of its own that waits for
    `after` (the inputs ready) lets them travel while the local sets run."""
    if after is None:
        return contextlib.nullcontext()
    stream = _POSTING.get(device)
    if stream is None:
        stream = _POSTING[device] = torch.cuda.Stream(device)
    stream.wait_event(after)
    return torch.cuda.stream(stream)


def _early(inputs, dropout_p: float) -> bool:
    """Whether the local sets run before the agreement, hiding its round trips behind the GPU's
    work: on CUDA (where the rows are posted from a stream of their own, so they still travel
    while those sets run) and without dropout (whose seed is agreed on). Elsewhere the rows are
    posted first (gloo sends from threads of its own) and the sets computed while they travel."""
    return inputs is not None and dropout_p == 0.0


def _post_rows(call: "_Call", k: Tensor, v: Tensor, after, phase: str, tag: int):
    with _posting(k.device, after):
        return ring_transport.post_rows(call.plan, call.group, k, v, phase, tag)


def _beside(after):
    """Where the cross call runs: on CUDA, on the posting stream (which already waited for the
    inputs, `after`), beside the local call, so that it starts as soon as the rows arrived and
    its gradients travel back while the local call's backward still runs."""
    if after is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(_POSTING[torch.cuda.current_stream().device])


def _join(after, *tensors) -> None:
    """The current stream waits for the cross call's stream; `tensors` made there are read on
    the current stream from now on (the allocator must not reuse them before)."""
    if after is None:
        return
    current = torch.cuda.current_stream()
    current.wait_stream(_POSTING[current.device])
    for t in tensors:
        if t is not None:
            t.record_stream(current)


class _Call:
    """One call's group, plan and lowering, and its agreement (ring_agree), made once and before
    anything the ranks do together. The rank's own checks come first: a rank that rejects its
    arguments makes every rank raise before any plan is built. The local sets need no peer, so
    a call may compute them (`early`) while the ranks agree, which hides the agreement's round
    trips through the store behind the GPU's work."""

    def __init__(self, phase, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                 attn_mask, dropout_p, seed, scale, lowering, group_name):
        self.group, self.phase, self.device = ring_agree.resolve(group_name), phase, q.device
        args = (q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
                dropout_p, seed, scale, lowering)
        self._start = lambda error: ring_agree.start(phase, self.group, *args, error=error)
        self.agreed, self.seed = False, None
        error = ring_agree.local_error(q, k, v, segment_lengths, dilation_rates, is_causal,
                                       attn_mask, dropout_p, scale, lowering)
        if error is not None:
            self._start(error)  # raises on every rank
        self.lower, self.name = _lowering(q, lowering, dropout_p)
        self.plan = ring_plan(q.shape[2], torch.distributed.get_world_size(self.group),
                              torch.distributed.get_rank(self.group), segment_lengths,
                              dilation_rates, hilbert, is_causal, q.shape[1], k.shape[1],
                              q.device)
        self.dtype = _compute_dtype(q, self.name)

    def early(self, compute):
        """compute() before the agreement; a rank whose compute raises makes every rank raise."""
        try:
            return compute()
        except Exception as e:
            if not self.agreed:
                self._start(f"{type(e).__name__} in the sets of rank "
                            f"{torch.distributed.get_rank(self.group)} alone: {e}")
            raise

    def agree(self) -> Optional[Tensor]:
        """The agreement (once); returns the seed every rank uses."""
        if not self.agreed:
            self.seed, self.agreed = self._start(None), True
            ring_transport.count_call(self.phase)
            ring_transport.connect(self.group, self.device)
        return self.seed


# ---------------------------------------------------------------------------------------------
# The custom ops: the single-device op's fake implementations (lowering/op.py), and an autograd
# formula that passes every argument after q, k, v on to the backward op.

@torch.library.custom_op("hilbert_fx::ring_dilated_attention", mutates_args=())
def ring_dilated_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int],
                              dilation_rates: list[int], hilbert: bool, is_causal: bool,
                              attn_mask: Optional[Tensor], dropout_p: float,
                              seed: Optional[Tensor], scale: float, lowering: str,
                              group_name: str) -> tuple[Tensor, Tensor]:
    """Local shards in, local shards out: (out [B, Hq, n, Dv], lse [B, Hq, n] float32+)."""
    call = _Call("forward", q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                 attn_mask, dropout_p, seed, scale, lowering, group_name)
    out, lse = _forward(*(x.to(call.dtype) for x in (q, k, v)), call, is_causal=is_causal,
                        scale=scale, dropout_p=dropout_p)
    return _bnhd(out.to(q.dtype)), lse.contiguous()  # the single-device op's layout


@ring_dilated_attention_op.register_fake
def _(*args):
    return _op_fake(*args[:-1])  # the single-device op's, group_name aside


@torch.library.custom_op("hilbert_fx::ring_dilated_attention_backward", mutates_args=())
def ring_dilated_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                       lse: Tensor, segment_lengths: list[int],
                                       dilation_rates: list[int], hilbert: bool, is_causal: bool,
                                       attn_mask: Optional[Tensor], dropout_p: float,
                                       seed: Optional[Tensor], scale: float, lowering: str,
                                       group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    call = _Call("backward", q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                 attn_mask, dropout_p, seed, scale, lowering, group_name)
    dq, dk, dv = _backward(*(x.to(call.dtype) for x in (dout, q, k, v, out)), lse, call,
                           is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    return _like(dq, q), _like(dk, k), _like(dv, v)  # the single-device op's layouts


@ring_dilated_attention_backward_op.register_fake
def _(*args):
    return _op_backward_fake(*args[:-1])


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse and every tensor argument; the others ride on ctx."""
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(x if isinstance(x, Tensor) else None for x in rest))
    ctx.rest = [None if isinstance(x, Tensor) else x for x in rest]
    ctx.mark_non_differentiable(lse)


def _backward_formula(ctx, dout, _dlse):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    rest = [t if t is not None else x for t, x in zip(tensors, ctx.rest)]
    dq, dk, dv = ring_dilated_attention_backward_op(dout.contiguous(), q, k, v, out, lse, *rest)
    return (dq, dk, dv) + (None,) * len(rest)


ring_dilated_attention_op.register_autograd(_backward_formula, setup_context=_setup_context)
register_autocast("hilbert_fx::ring_dilated_attention")  # as SDPA under torch.autocast


# ---------------------------------------------------------------------------------------------
# Python fronts.

def ring_dilated_attention(q: Tensor, k: Tensor, v: Tensor, segment_lengths, dilation_rates, *,
                           hilbert: bool = False, is_causal: bool = False,
                           attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                           seed: Optional[Tensor] = None, scale: Optional[float] = None,
                           lowering: str = "sdpa", mesh) -> Tensor:
    """The op on this rank's shards, arguments already checked (as lowering/op.py calls it)."""
    name = group_name_of(mesh)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if lowering == "auto":
        lowering = resolve_lowering(lowering, q.device)
    if dropout_p > 0.0 and seed is None:
        seed = new_seed(q.device)
    out, _ = torch.ops.hilbert_fx.ring_dilated_attention(
        q, k, v, list(segment_lengths), list(dilation_rates), bool(hilbert), bool(is_causal),
        attn_mask, float(dropout_p), seed, scale, lowering, name)
    return out


def dilated_attention_on_mesh(q: Tensor, k: Tensor, v: Tensor, segment_lengths, dilation_rates, *,
                              hilbert: bool = False, is_causal: bool = False,
                              attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                              scale: Optional[float] = None, enable_gqa: bool = False,
                              lowering: str = "auto", mesh) -> Tensor:
    """hilbert_fx.dilated_attention(..., mesh=mesh) with its arguments checked such that a rank
    that rejects its own arguments makes every rank raise (instead of leaving the others waiting
    for it in the first collective)."""
    name = group_name_of(mesh)
    try:
        hilbert, is_causal, enable_gqa = check_flags(hilbert=hilbert, is_causal=is_causal,
                                                     enable_gqa=enable_gqa).values()
        segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
        check_lowering(lowering)
        reason = problem(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                         enable_gqa=enable_gqa, scale=scale)
        if reason:
            raise ValueError(reason)
    except ValueError as e:
        ring_agree.agree(ring_agree.resolve(name), 0, "invalid", 0, str(e))
        raise  # not reached: agree raises on every rank
    return ring_dilated_attention(q, k, v, segment_lengths, dilation_rates, hilbert=hilbert,
                                  is_causal=is_causal, attn_mask=attn_mask, dropout_p=dropout_p,
                                  scale=scale, lowering=resolve_lowering(lowering, q.device),
                                  mesh=mesh)
