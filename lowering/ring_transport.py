"""What travels between the ranks of the ring (lowering/ring.py), point to point with
torch.distributed (batch_isend_irecv; NCCL on GPUs, gloo on CPU), laid out by
lowering/ring_plan.py: one message per peer and direction.

Key/value rows go forward (each step's message: the selected rows of k, then those of v, for
every (kv head, row) the step lists), posted all at once before any compute so that they travel
while the local sets are computed. Gradients of received rows go back to their owners in float32
(float64 for float64 inputs), one batch of sends and receives. The bytes this process sends are
counted (`comm_stats`) for benchmarks and tests.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .ring_plan import RingPlan

FORWARD, BACKWARD, GRADIENTS = 1, 2, 3  # message tags

_STATS = {"forward_bytes": 0, "backward_bytes": 0, "forward_calls": 0, "backward_calls": 0}


def comm_stats() -> dict:
    """Bytes this process has sent (point to point; the small agreement through the store aside)."""
    return dict(_STATS)


def reset_comm_stats() -> None:
    for key in _STATS:
        _STATS[key] = 0


def count_call(phase: str) -> None:
    _STATS[f"{phase}_calls"] += 1


_CONNECTED: set = set()


def connect(group, device: torch.device) -> None:
    """Once per NCCL group: one all_reduce over every rank, so that the group's communicator
    exists before the first batch_isend_irecv (which, as a group's first collective, NCCL wants
    every rank to join; later batches may involve only some ranks)."""
    name = group.group_name
    if name in _CONNECTED or dist.get_world_size(group) == 1:
        return
    if "nccl" in str(dist.get_backend(group)).lower() and device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    _CONNECTED.add(name)


def _peer(group, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def wait(works) -> None:
    for w in works:
        w.wait()


def _split(buf: Tensor, batch: int, rows: int, dk: int, dv: int):
    nk = batch * rows * dk
    return buf[:nk].view(batch, rows, dk), buf[nk:].view(batch, rows, dv)


def _payload(step, k: Tensor, v: Tensor) -> Tensor:
    """The rows a step sends: its rows of k, then those of v, gathered straight into one buffer
    where k and v are contiguous (two index_selects; advanced indexing and a cat cost the host
    several times that)."""
    b, dk, dv = k.shape[0], k.shape[-1], v.shape[-1]
    if not (k.is_contiguous() and v.is_contiguous()):
        return torch.cat([k[:, step.send_heads, step.send_rows].reshape(-1),
                          v[:, step.send_heads, step.send_rows].reshape(-1)])
    m = step.send_count
    payload = k.new_empty(b * m * (dk + dv))
    nk = b * m * dk
    torch.index_select(k.view(b, -1, dk), 1, step.send_flat, out=payload[:nk].view(b, m, dk))
    torch.index_select(v.view(b, -1, dv), 1, step.send_flat, out=payload[nk:].view(b, m, dv))
    return payload


def post_rows(plan: RingPlan, group, k: Tensor, v: Tensor, phase: str, tag: int) -> list:
    """Posts every step's send and receive of key/value rows, all in one batch (one NCCL group);
    returns [(works, receive buffer or None)] per step (the works are the batch's, with the
    first step that has any)."""
    b, dk, dv = k.shape[0], k.shape[-1], v.shape[-1]
    ops, recvs = [], []
    for step in plan.steps:
        recv = None
        if step.send_count:
            payload = _payload(step, k, v)
            ops.append(dist.P2POp(dist.isend, payload, _peer(group, step.send_to), group, tag))
            _STATS[f"{phase}_bytes"] += payload.numel() * payload.element_size()
        if step.recv_rows:
            recv = k.new_empty(b * step.recv_rows * (dk + dv))
            ops.append(dist.P2POp(dist.irecv, recv, _peer(group, step.recv_from), group, tag))
        recvs.append(recv)
    works = dist.batch_isend_irecv(ops) if ops else []
    return [(works if i == 0 else [], recv) for i, recv in enumerate(recvs)]


def received_rows(plan: RingPlan, posted, batch: int, dk: int, dv: int):
    """Waits for every step's key/value rows; returns all of them, the steps' in order
    ([B, M, Dk], [B, M, Dv]: what RingPlan.recv_heads / recv_ext describe), or (None, None)."""
    ks, vs = [], []
    for step, (works, buf) in zip(plan.steps, posted):
        wait(works)
        if buf is not None:
            kb, vb = _split(buf, batch, step.recv_rows, dk, dv)
            ks.append(kb)
            vs.append(vb)
    if len(ks) <= 1:
        return (ks[0], vs[0]) if ks else (None, None)
    return torch.cat(ks, 1), torch.cat(vs, 1)


def post_gradients(plan: RingPlan, group, gk: Tensor | None, gv: Tensor | None, *, batch: int,
                   dk: int, dv: int, dtype: torch.dtype, device: torch.device):
    """Sends the gradients of the received rows (gk [B, M, Dk], gv [B, M, Dv] in `dtype`, rows
    as received) back to their owners, and posts the receives of the gradients of the rows this
    rank sent, in one batch. Returns (works, [receive buffer or None per step], payloads)."""
    ops, recvs, payloads = [], [], []
    for step in plan.steps:
        if step.recv_rows:
            rows = slice(step.recv_offset, step.recv_offset + step.recv_rows)
            payload = torch.cat([gk[:, rows].reshape(-1), gv[:, rows].reshape(-1)])
            ops.append(dist.P2POp(dist.isend, payload, _peer(group, step.recv_from), group,
                                  GRADIENTS))
            payloads.append(payload)
            _STATS["backward_bytes"] += payload.numel() * payload.element_size()
    for step in plan.steps:
        recv = None
        if step.send_count:
            recv = torch.empty(batch * step.send_count * (dk + dv), dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, recv, _peer(group, step.send_to), group,
                                  GRADIENTS))
        recvs.append(recv)
    return (dist.batch_isend_irecv(ops) if ops else []), recvs, payloads


def received_gradients(plan: RingPlan, works, recvs, *, batch: int, dk: int, dv: int):
    """Waits for the gradients of the rows this rank sent; returns their sums per row of
    RingPlan.grad_rows ([B, U, Dk], [B, U, Dv]), or None when it sent nothing."""
    wait(works)
    units = plan.grad_rows.numel()
    if not units:
        return None
    gk_acc = gv_acc = None
    for step, recv in zip(plan.steps, recvs):
        if recv is None:
            continue
        gk, gv = _split(recv, batch, step.send_count, dk, dv)
        if gk_acc is None:
            gk_acc = gk.new_zeros(batch, units, dk)
            gv_acc = gv.new_zeros(batch, units, dv)
        gk_acc.index_add_(1, step.grad_slot, gk)
        gv_acc.index_add_(1, step.grad_slot, gv)
    return gk_acc, gv_acc
