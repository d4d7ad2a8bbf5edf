"""Dilated attention over a 1-D device mesh (SPEC section 4): torch.ops.hilbert_fx.ring_dilated_attention.

Each of the P ranks of the mesh's process group holds a contiguous shard [B, H, n, D] of q, k and
v (rank i: global positions [i*n, (i+1)*n)) and gets back its shard of what the single-device op
computes on the whole sequence, forward and backward.

What travels (lowering/ring_plan.py): segments that lie inside one shard need nothing. For a
segment that spans shards, a rank receives from each other rank of that segment only the rows of
the selected sets its own queries attend to, once per (key/value head, offset) pair, and under
is_causal only from lower ranks. Messages go point to point with torch.distributed
(batch_isend_irecv; NCCL on GPUs, gloo on CPU), one message per peer and direction, all posted
before any compute so that they travel while the local segments are computed. The rows that
arrive from every peer are then taken together: each cross segment is one block of this rank's
queries against its keys from all peers (ring_plan.PeerBlock), so the number of small kernels
does not grow with the number of peers. Every block's partial result is merged
into the rows it covers by log-sum-exp in float32 (float64 for float64 inputs).

Backward (FlashAttention-2 style, with the final out and lse): the received rows are fetched
again rather than kept, each block's dq stays local, and the dk/dv of rows that came from a peer
are summed per row and sent back to their owner (in float32), which adds them to its own. About
half the local work runs while the rows travel in, the rest while the gradients travel back.

Every call starts with one small exchange through the process group's store (host only: it
neither waits for the GPU nor needs a process group of its own) in which each rank states its
shard length, a hash of its configuration and any error it found in its arguments; every rank
then reaches the same decision, so shards of unequal length, configurations that differ across
ranks and arguments that one rank rejects raise ValueError on every rank instead of hanging.

Kernels. lowering="sdpa": every block runs on lowering/block_attention.py (the SDPA kernels).
lowering="triton" (CUDA of compute capability 8.0 or more, or CPU tensors under the Triton
interpreter, as for the single-device op): the local part -- every pair of positions that both
lie in this shard, which is most of the work -- is the single-device Triton lowering run on the
shard with the shard plans of ring_plan.shard_branch_plans (the segments cut to the shard, in
local rows): triton_lowering.forward gives (out, lse) of the local part, reading q, k, v by
strides without gathers, and triton_lowering.backward, given the final out and lse, gives the
local part's dq, dk, dv. Only the blocks against rows received from peers (segments that span
shards) run on the SDPA kernels; their results are merged into the local ones by log-sum-exp in
float32 on their rows only (numbered compactly by the plan), so nothing full-size is copied.
Backward on that path: the key/value rows travel while the Triton backward runs; the gradients
sent back travel after it (they are the smaller part of the bytes of cross segments only).
Rounding: the Triton lowering returns out and dq, dk, dv in q's dtype, so in half precision the
rows that also get a peer's share are rounded twice (once by the kernels, once after the merge);
rows of in-shard segments only are exactly the single-device kernels' results.

Cases that stay on the SDPA block path even with lowering="triton":
- dropout_p > 0: the Triton kernels hash the positions they are given, which on a shard are local
  ones, while the keep bits must be those of global positions (SPEC, lowering/dropout.py); the
  kernels take no position offset, so dropout runs on the blocks, which hash global positions.
- dtypes the Triton lowering does not take (float64) and head dims over its limit (256), which the
  ring has always computed on the blocks.

attn_mask is not supported with a mesh (ValueError naming attn_mask); dropout is, since its keep
bits are a hash of global positions (lowering/dropout.py) and rank 0's seed is used everywhere.
The lowering is also carried so that the rewritten graph shows it, as for the single-device op.
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import block_attention
from .autocast import register_autocast
from .arguments import check_branches, check_flags, check_lowering, problem, resolve_lowering
from .dropout import keep_mask, new_seed
from .ring_plan import PeerBlock, RingPlan, plan_bytes, ring_plan, shard_branch_plans

NEG_INF = float("-inf")
POS_INF = float("inf")

__all__ = ["ring_dilated_attention", "dilated_attention_on_mesh", "ring_dilated_attention_op",
           "comm_stats", "reset_comm_stats", "plan_bytes", "group_name_of"]

# ---------------------------------------------------------------------------------------------
# Bytes sent by this process, for benchmarks and tests.

_STATS = {"forward_bytes": 0, "backward_bytes": 0, "forward_calls": 0, "backward_calls": 0}


def comm_stats() -> dict:
    """Bytes this process has sent (point to point; the small agreement through the store aside)."""
    return dict(_STATS)


def reset_comm_stats() -> None:
    for key in _STATS:
        _STATS[key] = 0


# ---------------------------------------------------------------------------------------------
# Process groups and the agreement every call starts with.

def group_name_of(mesh) -> str:
    """The process-group name of a 1-D DeviceMesh (or of a ProcessGroup, or a name)."""
    if isinstance(mesh, str):
        return mesh
    if isinstance(mesh, dist.ProcessGroup):
        return mesh.group_name
    if getattr(mesh, "ndim", 1) != 1:
        raise ValueError(f"mesh must be a one-dimensional DeviceMesh, got {mesh.ndim} dimensions")
    return mesh.get_group().group_name


def _resolve(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


_CALLS: dict = {}  # group name -> number of agreements made on it by this process


def _exchange(group, t: Tensor) -> Tensor:
    """All-gather of a small int64 CPU tensor through the default store: host only (it neither
    waits for the GPU nor makes a process group), raising after the store's timeout.

    Every call of the op is collective over its group, so the k-th agreement of a group is the
    same call on every rank: its keys are named by (group, k). A rank deletes its key of
    agreement k - 2 when it makes agreement k (by then every rank has read it)."""
    store = dist.distributed_c10d._get_default_store()
    name = group.group_name
    k = _CALLS.get(name, 0)
    _CALLS[name] = k + 1
    world, me = dist.get_world_size(group), dist.get_rank(group)
    prefix = f"hilbert_fx/ring/agree/{name}/"
    store.set(f"{prefix}{k}/{me}", t.numpy().tobytes())
    if k >= 2:
        try:
            store.delete_key(f"{prefix}{k - 2}/{me}")
        except Exception:  # a store without delete_key: the keys stay, harmlessly
            pass
    keys = [f"{prefix}{k}/{r}" for r in range(world)]
    store.wait(keys)
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(x) for x in keys]
    return torch.stack([torch.frombuffer(bytearray(v), dtype=torch.int64) for v in values])


_CONNECTED: set = set()


def _connect(group, device: torch.device) -> None:
    """Once per NCCL group: one all_reduce over every rank, so that the group's communicator
    exists before the first batch_isend_irecv (which, as a group's first collective, NCCL wants
    every rank to join; later batches may involve only some ranks)."""
    name = group.group_name
    if name in _CONNECTED or dist.get_world_size(group) == 1:
        return
    if "nccl" in str(dist.get_backend(group)).lower() and device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    _CONNECTED.add(name)


_MSG = 400


def _agree(group, n_local: int, key: str, seed: int, error: Optional[str]) -> int:
    """One exchange of (length, config hash, seed, error): raise on every rank or on none.

    Returns rank 0's seed."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    digest = hashlib.sha256(key.encode()).digest()
    msg = (error or "").encode()[:_MSG]
    t = torch.zeros(5 + _MSG, dtype=torch.int64)
    t[0] = int(n_local)
    t[1] = int.from_bytes(digest[:7], "little")
    t[2] = int.from_bytes(digest[7:14], "little")
    t[3] = int(seed)
    t[4] = 1 if error is not None else 0
    if msg:
        t[5:5 + len(msg)] = torch.tensor(list(msg), dtype=torch.int64)
    rows = t.view(1, -1) if world == 1 else _exchange(group, t)
    failed = [r for r in range(world) if int(rows[r, 4])]
    if failed:
        if error is not None:
            raise ValueError(error)
        text = bytes(int(c) for c in rows[failed[0], 5:].tolist() if c).decode(errors="replace")
        raise ValueError(f"rank {failed[0]} of the mesh rejected its arguments (ranks {failed} "
                         f"did): {text}")
    lengths = rows[:, 0].tolist()
    if len(set(lengths)) > 1:
        raise ValueError(
            f"q, k, v: shards of unequal length across the mesh: ranks hold {lengths} positions; "
            f"every rank must hold N/P positions of the sequence (SPEC section 4)")
    hashes = [tuple(x) for x in rows[:, 1:3].tolist()]
    if len(set(hashes)) > 1:
        differ = [r for r in range(world) if hashes[r] != hashes[0]]
        raise ValueError(
            f"configuration differs across the mesh's ranks: ranks {differ} differ from rank 0 "
            f"(rank {me} has {key})")
    return int(rows[0, 3])


def _config_key(phase, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
                dropout_p, seed, scale, lowering) -> str:
    b, hq, _, d = q.shape
    return (f"{phase} B={b} Hq={hq} Hkv={k.shape[1]} D={d} Dv={v.shape[-1]} dtype={q.dtype}/"
            f"{k.dtype}/{v.dtype} segment_lengths={list(segment_lengths)} "
            f"dilation_rates={list(dilation_rates)} hilbert={bool(hilbert)} "
            f"is_causal={bool(is_causal)} attn_mask={attn_mask is not None} "
            f"dropout_p={float(dropout_p)!r} seed={seed is not None} scale={float(scale)!r} "
            f"lowering={lowering} device={q.device.type}")


def _local_error(q, k, v, segment_lengths, dilation_rates, is_causal, attn_mask, dropout_p, scale,
                 lowering) -> Optional[str]:
    if attn_mask is not None:
        return ("attn_mask is not supported with mesh= (a mask over the whole sequence cannot be "
                "sharded along it); pass attn_mask=None, or use is_causal for causal masking")
    if lowering not in ("sdpa", "triton"):
        return f"lowering must be 'sdpa' or 'triton' once resolved, got {lowering!r}"
    if lowering == "triton" and q.device.type == "cpu":
        try:
            from . import triton_lowering
            interpreted = triton_lowering.interpreter_active()
        except ImportError as e:
            return f"lowering='triton' needs the triton package: {e}"
        if not interpreted:
            return ("lowering='triton' on CPU tensors runs the Triton interpreter, which triton "
                    "chooses when it is first imported: set TRITON_INTERPRET=1 in the environment")
    try:
        check_branches(list(segment_lengths), list(dilation_rates))
    except ValueError as e:
        return str(e)
    # the op's rule book; the ring's op takes no enable_gqa (Hq % Hkv == 0 is its rule), runs
    # after autocast (one dtype) and has its mask refused above
    return problem(q, k, v, None, is_causal=is_causal, dropout_p=dropout_p, enable_gqa=True,
                   scale=scale, same_dtype=True) or None


def _start(phase, group, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
           dropout_p, seed, scale, lowering) -> Optional[Tensor]:
    """Check locally, agree across ranks; returns the seed every rank uses (rank 0's)."""
    error = _local_error(q, k, v, segment_lengths, dilation_rates, is_causal, attn_mask, dropout_p,
                         scale, lowering)
    key = _config_key(phase, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                      attn_mask, dropout_p, seed, scale, lowering)
    local_seed = int(seed.item()) if seed is not None else 0
    seed0 = _agree(group, q.shape[2], key, local_seed, error)
    if seed is None:
        return None
    return torch.tensor(seed0, dtype=torch.int64, device=q.device)


# ---------------------------------------------------------------------------------------------
# Transport.

def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def _kv_payload(kc: Tensor, vc: Tensor, heads: Tensor, rows: Tensor) -> Tensor:
    """The selected rows of k and v, flattened into one buffer: [B, M, Dk] then [B, M, Dv]."""
    kg = kc[:, heads, rows]
    vg = vc[:, heads, rows]
    return torch.cat([kg.reshape(-1), vg.reshape(-1)])


def _split(buf: Tensor, batch: int, rows: int, dk: int, dv: int):
    nk = batch * rows * dk
    return buf[:nk].view(batch, rows, dk), buf[nk:].view(batch, rows, dv)


def _post_kv(plan: RingPlan, group, kc: Tensor, vc: Tensor, stat: str, tag: int):
    """Post every step's send and receive of key/value rows; returns [(works, recv_buf)]."""
    b, dk, dv = kc.shape[0], kc.shape[-1], vc.shape[-1]
    posted = []
    for step in plan.steps:
        ops, recv = [], None
        if step.send_count:
            payload = _kv_payload(kc, vc, step.send_heads, step.send_rows)
            ops.append(dist.P2POp(dist.isend, payload, _global(group, step.send_to), group, tag))
            _STATS[stat] += payload.numel() * payload.element_size()
        if step.recv_rows:
            recv = kc.new_empty(b * step.recv_rows * (dk + dv))
            ops.append(dist.P2POp(dist.irecv, recv, _global(group, step.recv_from), group, tag))
        posted.append((dist.batch_isend_irecv(ops) if ops else [], recv, ops))
    return posted


def _wait(works) -> None:
    for w in works:
        w.wait()


def _received_kv(plan: RingPlan, posted, batch: int, dk: int, dv: int):
    """Waits for every step's key/value rows; returns all of them, the steps' in order
    ([B, M, Dk], [B, M, Dv]: what PeerBlock.k_idx indexes), or (None, None) if none came."""
    ks, vs = [], []
    for step, (works, buf, _) in zip(plan.steps, posted):
        _wait(works)
        if buf is not None:
            kb, vb = _split(buf, batch, step.recv_rows, dk, dv)
            ks.append(kb)
            vs.append(vb)
    if len(ks) <= 1:
        return (ks[0], vs[0]) if ks else (None, None)
    return torch.cat(ks, 1), torch.cat(vs, 1)


# ---------------------------------------------------------------------------------------------
# Blocks.

def _key_bias(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """[1, G, 1, L]: 0 where the key is real, -inf where it is padding."""
    g = valid.shape[0] * valid.shape[1]
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return bias.masked_fill(~valid, NEG_INF).view(1, g, 1, valid.shape[-1])


def _keep(seed, batch: int, heads: Tensor, q_pos: Tensor, k_pos: Tensor, dropout_p: float):
    h, s, lq = q_pos.shape
    lk = k_pos.shape[-1]
    keep = keep_mask(seed, torch.arange(batch, device=q_pos.device).view(batch, 1, 1, 1, 1),
                     heads.view(1, h, 1, 1, 1), q_pos.view(1, h, s, lq, 1),
                     k_pos.view(1, h, s, 1, lk), dropout_p)
    return keep.reshape(batch, h * s, lq, lk)


def _rows(x: Tensor, heads: Tensor, rows: Tensor) -> Tensor:
    """x [B, Hx, n, D] -> [B, H * S, L, D]: rows[h] (padding n read as row n - 1) of heads[h]."""
    h, s, length = rows.shape
    g = x[:, heads.view(h, 1, 1), rows.clamp(max=x.shape[2] - 1)]
    return g.reshape(x.shape[0], h * s, length, x.shape[-1])


def _peer_keys(buf: Tensor, idx: Tensor) -> Tensor:
    """buf [B, M, D] -> [B, H, L, D] at idx [H, 1, L] (padding M read as row M - 1)."""
    h, _, length = idx.shape
    g = buf[:, idx.view(h, length).clamp(max=buf.shape[1] - 1)]
    return g


def _block_forward(qg, kg, vg, *, bias, causal, scale, keep, dropout_p, has_key):
    o, lse = block_attention.forward(qg, kg, vg, bias=bias, is_causal=causal, scale=scale,
                                     keep=keep, dropout_p=dropout_p)
    wide = torch.promote_types(qg.dtype, torch.float32)
    o, lse = o.to(wide), lse.to(wide)
    if has_key is not None:  # heads with no key from this peer: nothing to merge
        ok = has_key.view(1, -1, 1)
        lse = lse.masked_fill(~ok, NEG_INF)
        o = o.masked_fill(~ok.unsqueeze(-1), 0.0)
    return o, lse


def _merge(acc: Tensor, run_lse: Tensor, heads: Tensor, rows: Tensor, o: Tensor, lse: Tensor):
    """Merge a block's (o, lse) into the rows it covers, by log-sum-exp."""
    h, s, length = rows.shape
    b = acc.shape[0]
    index = (slice(None), heads.view(h, 1, 1), rows)
    o = o.view(b, h, s, length, -1)
    lse = lse.view(b, h, s, length)
    acc[index], run_lse[index] = _lse_merge(acc[index], run_lse[index], o, lse)


def _lse_merge(cur_o: Tensor, cur_l: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two normalised partial results (o [.., Dv], lse [..]) of the same rows as one, weighed by
    their log-sum-exps, normalised by the weights' sum (block_attention.merge says why); rows
    with no key in either stay at lse -inf."""
    return block_attention.merge(cur_o, cur_l, o, lse)


def _add_rows(buf: Tensor, heads: Tensor, rows: Tensor, values: Tensor) -> None:
    """buf [B, Hx, n + 1, D] += values [B, H * S, L, D] at (heads[h], rows[h])."""
    h, s, length = rows.shape
    b = buf.shape[0]
    bidx = torch.arange(b, device=buf.device).view(b, 1, 1, 1)
    buf.index_put_((bidx, heads.view(1, h, 1, 1), rows.view(1, h, s, length)),
                   values.reshape(b, h, s, length, -1).to(buf.dtype), accumulate=True)


def _merge_at(acc: Tensor, run_lse: Tensor, slots: Tensor, o: Tensor, lse: Tensor) -> None:
    """Merge a block's (o [B, H, 1, L, Dv] or [B, H, L, Dv], lse) into the compact buffers
    acc [B, T + 1, Dv], run_lse [B, T + 1] at slots [H, 1, L] (T: padding), by log-sum-exp."""
    b = acc.shape[0]
    h, s, length = slots.shape
    o = o.reshape(b, h, s, length, -1)
    lse = lse.reshape(b, h, s, length)
    index = (slice(None), slots)
    acc[index], run_lse[index] = _lse_merge(acc[index], run_lse[index], o, lse)


# ---------------------------------------------------------------------------------------------
# Forward and backward on one rank.

def _triton_path(q: Tensor, lowering: str, dropout_p: float) -> bool:
    """Whether the local part runs on the Triton lowering (see the module docstring)."""
    if lowering != "triton" or dropout_p > 0.0:
        return False
    from . import triton_lowering
    return (q.dtype in triton_lowering.SUPPORTED_DTYPES
            and q.shape[-1] <= triton_lowering.MAX_HEAD_DIM)


def _shard_plans(q, plan: RingPlan, segment_lengths, dilation_rates, hilbert):
    return shard_branch_plans(plan.n, plan.world, plan.rank, segment_lengths, dilation_rates,
                              hilbert, q.device)


def _triton_forward(q, k, v, plan: RingPlan, group, *, segment_lengths, dilation_rates,
                    hilbert, is_causal, scale):
    """The local part on the Triton kernels (while the key/value rows travel), then the peer
    blocks on the SDPA kernels into compact float32 buffers, merged into the rows they cover."""
    from . import triton_lowering
    b, hq, n, _ = q.shape
    block_dtype = _compute_dtype(q)  # the blocks' (float32 for half types on CPU)
    # the kernels read q, k, v by strides, and the blocks gather their rows: no copies needed
    qc, kc, vc = (x.to(block_dtype) for x in (q, k, v))
    heads = torch.arange(hq, device=q.device)
    dk, dv = k.shape[-1], v.shape[-1]

    posted = _post_kv(plan, group, kc, vc, "forward_bytes", tag=1)

    out, lse = triton_lowering.forward(
        q, k, v, _shard_plans(q, plan, segment_lengths, dilation_rates, hilbert),
        is_causal=is_causal, attn_mask=None, scale=scale, dropout_p=0.0, seed=None)
    kbuf, vbuf = _received_kv(plan, posted, b, dk, dv)
    total = plan.peer_rows.numel()
    if total:
        acc = torch.zeros(b, total + 1, dv, dtype=torch.float32, device=q.device)
        run_lse = torch.full((b, total + 1), NEG_INF, dtype=torch.float32, device=q.device)
    for pb in plan.peer_blocks:
        bias = _key_bias(pb.k_valid, block_dtype) if pb.key_padded else None
        o, blse = _block_forward(_rows(qc, heads, pb.q_rows), _peer_keys(kbuf, pb.k_idx),
                                 _peer_keys(vbuf, pb.k_idx), bias=bias, causal=False,
                                 scale=scale, keep=None, dropout_p=0.0, has_key=pb.has_key)
        if len(plan.peer_blocks) == 1:  # its rows' only peer share: placed, nothing to merge
            h, _, length = pb.q_slot.shape
            acc[:, pb.q_slot] = o.float().view(b, h, 1, length, dv)
            run_lse[:, pb.q_slot] = blse.float().view(b, h, 1, length)
        else:
            _merge_at(acc, run_lse, pb.q_slot, o.float(), blse.float())
    if total:  # the peers' share into the rows it covers: once, in float32
        ph, pr = plan.peer_heads, plan.peer_rows
        merged, lse[:, ph, pr] = _lse_merge(out[:, ph, pr].float(), lse[:, ph, pr],
                                            acc[:, :total], run_lse[:, :total])
        out[:, ph, pr] = merged.to(out.dtype)
    return out, lse


def _peer_backward(plan: RingPlan, kbuf, vbuf, group, qc, dout_c, out_c, lse_pad, heads,
                   add_dq, *, dtype, wide, scale, seed, dropout_p):
    """The backward of every PeerBlock against all the received key/value rows (kbuf, vbuf):
    the blocks' dq goes to add_dq(block, dq), their dk, dv (in `wide`) go back to the peers that
    own those rows, one message each, posted in one batch with the receives of the gradients of
    the rows this rank sent. Returns (works, [receive buffer or None per step], payloads)."""
    b, device = qc.shape[0], qc.device
    dk_dim, dv_dim = qc.shape[-1], out_c.shape[-1]
    ops, recvs, payloads = [], [], []
    if kbuf is not None:
        m = plan.recv_total
        gk_buf = torch.zeros(b, m + 1, dk_dim, dtype=wide, device=device)
        gv_buf = torch.zeros(b, m + 1, dv_dim, dtype=wide, device=device)
        bidx = torch.arange(b, device=device).view(b, 1, 1)
        for pb in plan.peer_blocks:
            bias = _key_bias(pb.k_valid, dtype) if pb.key_padded else None
            keep = _keep(seed, b, heads, pb.q_pos, pb.k_pos, dropout_p) if dropout_p > 0 else None
            dog, og, lg = _query_side(dout_c, out_c, lse_pad, heads, pb.q_rows, pb.q_valid)
            gq, gk, gv = block_attention.backward(
                dog, _rows(qc, heads, pb.q_rows), _peer_keys(kbuf, pb.k_idx),
                _peer_keys(vbuf, pb.k_idx), og, lg, bias=bias, is_causal=False, scale=scale,
                keep=keep, dropout_p=dropout_p)
            add_dq(pb, gq)
            h, _, length = pb.k_idx.shape
            idx = pb.k_idx.view(1, h, length)
            gk_buf.index_put_((bidx, idx), gk.reshape(b, h, length, -1).to(wide), accumulate=True)
            gv_buf.index_put_((bidx, idx), gv.reshape(b, h, length, -1).to(wide), accumulate=True)
        for step in plan.steps:
            if not step.recv_rows:
                continue
            rows = slice(step.recv_offset, step.recv_offset + step.recv_rows)
            payload = torch.cat([gk_buf[:, rows].reshape(-1), gv_buf[:, rows].reshape(-1)])
            ops.append(dist.P2POp(dist.isend, payload, _global(group, step.recv_from), group, 3))
            payloads.append(payload)
            _STATS["backward_bytes"] += payload.numel() * payload.element_size()
    for step in plan.steps:
        recv = None
        if step.send_count:
            recv = torch.empty(b * step.send_count * (dk_dim + dv_dim), dtype=wide, device=device)
            ops.append(dist.P2POp(dist.irecv, recv, _global(group, step.send_to), group, 3))
        recvs.append(recv)
    return (dist.batch_isend_irecv(ops) if ops else []), recvs, payloads


def _triton_backward(dout, q, k, v, out, lse, plan: RingPlan, group, *, segment_lengths,
                     dilation_rates, hilbert, is_causal, scale):
    """The local part's dq, dk, dv on the Triton kernels (given the final out and lse) while
    the key/value rows travel, then the peer blocks; the peers' dq share and the gradients that
    come back are added to the kernels' results on their rows only, in float32."""
    from . import triton_lowering
    b, hq, n, d = q.shape
    block_dtype = _compute_dtype(q)
    qc, kc, vc, out_c, dout_c = (x.to(block_dtype) for x in (q, k, v, out, dout))
    heads = torch.arange(hq, device=q.device)
    dk_dim, dv_dim = k.shape[-1], v.shape[-1]

    posted = _post_kv(plan, group, kc, vc, "backward_bytes", tag=2)

    dq, dk, dv = triton_lowering.backward(
        dout, q, k, v, out, lse.float(),
        _shard_plans(q, plan, segment_lengths, dilation_rates, hilbert),
        is_causal=is_causal, attn_mask=None, scale=scale, dropout_p=0.0, seed=None)
    if not plan.has_peers:
        return dq, dk, dv

    # A row with no key anywhere has lse = -inf; +inf makes every probability of it 0.
    lse_pad = torch.nn.functional.pad(lse.float().masked_fill(lse == NEG_INF, POS_INF), (0, 1),
                                      value=POS_INF).to(torch.promote_types(block_dtype,
                                                                            torch.float32))
    total = plan.peer_rows.numel()
    pdq = torch.zeros(b, total + 1, d, dtype=torch.float32, device=q.device)
    bidx = torch.arange(b, device=q.device).view(b, 1, 1)

    def add_dq(pb, gq):  # into the compact buffer of the rows peers reach
        h = pb.k_idx.shape[0]
        pdq.index_put_((bidx, pb.q_slot.view(1, h, -1)), gq.reshape(b, h, -1, d).float(),
                       accumulate=True)

    kbuf, vbuf = _received_kv(plan, posted, b, dk_dim, dv_dim)
    works, recvs, _payloads = _peer_backward(
        plan, kbuf, vbuf, group, qc, dout_c, out_c, lse_pad, heads, add_dq, dtype=block_dtype,
        wide=torch.float32, scale=scale, seed=None, dropout_p=0.0)

    if total:
        ph, pr = plan.peer_heads, plan.peer_rows
        dq[:, ph, pr] = (dq[:, ph, pr].float() + pdq[:, :total]).to(dq.dtype)
    units = plan.grad_rows.numel()
    if units:
        gk_acc = torch.zeros(b, units, dk_dim, dtype=torch.float32, device=q.device)
        gv_acc = torch.zeros(b, units, dv_dim, dtype=torch.float32, device=q.device)
    _wait(works)
    for step, recv in zip(plan.steps, recvs):
        if recv is None:
            continue
        gk, gv = _split(recv, b, step.send_count, dk_dim, dv_dim)
        gk_acc.index_add_(1, step.grad_slot, gk)
        gv_acc.index_add_(1, step.grad_slot, gv)
    if units:
        gh, gr = plan.grad_heads, plan.grad_rows
        dk[:, gh, gr] = (dk[:, gh, gr].float() + gk_acc).to(dk.dtype)
        dv[:, gh, gr] = (dv[:, gh, gr].float() + gv_acc).to(dv.dtype)
    return dq, dk, dv


def _compute_dtype(q: Tensor) -> torch.dtype:
    if q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cpu":
        return torch.float32
    return q.dtype


def _ring_forward(q, k, v, plan: RingPlan, group, *, is_causal, scale, dropout_p, seed):
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    dtype = _compute_dtype(q)
    qc, kc, vc = (x.to(dtype).contiguous() for x in (q, k, v))
    wide = torch.promote_types(dtype, torch.float32)
    heads = torch.arange(hq, device=q.device)
    kv_heads = heads // (hq // hkv)
    dk, dv = k.shape[-1], v.shape[-1]

    posted = _post_kv(plan, group, kc, vc, "forward_bytes", tag=1)

    acc = torch.zeros(b, hq, n + 1, dv, dtype=wide, device=q.device)
    run_lse = torch.full((b, hq, n + 1), NEG_INF, dtype=wide, device=q.device)
    for blk in plan.local_blocks:
        bias = _key_bias(blk.valid, dtype) if blk.padded and not is_causal else None
        keep = _keep(seed, b, heads, blk.pos, blk.pos, dropout_p) if dropout_p > 0 else None
        o, lse = _block_forward(_rows(qc, heads, blk.rows), _rows(kc, kv_heads, blk.rows),
                                _rows(vc, kv_heads, blk.rows), bias=bias, causal=is_causal,
                                scale=scale, keep=keep, dropout_p=dropout_p, has_key=None)
        _merge(acc, run_lse, heads, blk.rows, o, lse)
    kbuf, vbuf = _received_kv(plan, posted, b, dk, dv)
    for pb in plan.peer_blocks:
        _peer_block_forward(qc, kbuf, vbuf, pb, heads, acc, run_lse, scale=scale,
                            dropout_p=dropout_p, seed=seed)
    return acc[:, :, :n].to(q.dtype), run_lse[:, :, :n].contiguous()


def _peer_block_forward(qc, kbuf, vbuf, pb: PeerBlock, heads, acc, run_lse, *, scale, dropout_p,
                        seed):
    b = qc.shape[0]
    bias = _key_bias(pb.k_valid, qc.dtype) if pb.key_padded else None
    keep = _keep(seed, b, heads, pb.q_pos, pb.k_pos, dropout_p) if dropout_p > 0 else None
    o, lse = _block_forward(_rows(qc, heads, pb.q_rows), _peer_keys(kbuf, pb.k_idx),
                            _peer_keys(vbuf, pb.k_idx), bias=bias, causal=False, scale=scale,
                            keep=keep, dropout_p=dropout_p, has_key=pb.has_key)
    _merge(acc, run_lse, heads, pb.q_rows, o, lse)


def _query_side(dout_c, out_c, lse_pad, heads, rows, valid):
    """dout, out and lse rows of a block; padding rows get dout 0 and lse +inf (no share)."""
    h, s, length = rows.shape
    b = dout_c.shape[0]
    dog = _rows(dout_c, heads, rows)
    og = _rows(out_c, heads, rows)
    lg = lse_pad[:, heads.view(h, 1, 1), rows].reshape(b, h * s, length)
    v = valid.reshape(1, h * s, length)
    dog = dog.masked_fill(~v.unsqueeze(-1), 0.0)
    return dog, og, lg


def _work_split(blocks) -> int:
    """The index that cuts the blocks into two runs of about equal work (G x L x L each)."""
    work = [b.rows.shape[0] * b.rows.shape[1] * b.rows.shape[2] ** 2 for b in blocks]
    half, acc = sum(work) / 2, 0
    for i, w in enumerate(work):
        if acc + w >= half:
            return i + 1 if acc + w - half < half - acc else i
        acc += w
    return len(blocks)


def _ring_backward(dout, q, k, v, out, lse, plan: RingPlan, group, *, is_causal, scale,
                   dropout_p, seed):
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    dtype = _compute_dtype(q)
    qc, kc, vc, out_c, dout_c = (x.to(dtype).contiguous() for x in (q, k, v, out, dout))
    wide = torch.promote_types(dtype, torch.float32)
    heads = torch.arange(hq, device=q.device)
    kv_heads = heads // (hq // hkv)
    dk_dim, dv_dim = k.shape[-1], v.shape[-1]

    posted = _post_kv(plan, group, kc, vc, "backward_bytes", tag=2)

    # A row with no key anywhere has lse = -inf; +inf makes every probability of it 0.
    lse_pad = torch.nn.functional.pad(lse.masked_fill(lse == NEG_INF, POS_INF), (0, 1),
                                      value=POS_INF)
    dq = torch.zeros(b, hq, n + 1, d, dtype=wide, device=q.device)
    dk = torch.zeros(b, hkv, n + 1, dk_dim, dtype=wide, device=q.device)
    dv = torch.zeros(b, hkv, n + 1, dv_dim, dtype=wide, device=q.device)

    def local_block(blk):
        bias = _key_bias(blk.valid, dtype) if blk.padded and not is_causal else None
        keep = _keep(seed, b, heads, blk.pos, blk.pos, dropout_p) if dropout_p > 0 else None
        dog, og, lg = _query_side(dout_c, out_c, lse_pad, heads, blk.rows, blk.valid)
        gq, gk, gv = block_attention.backward(
            dog, _rows(qc, heads, blk.rows), _rows(kc, kv_heads, blk.rows),
            _rows(vc, kv_heads, blk.rows), og, lg, bias=bias, is_causal=is_causal, scale=scale,
            keep=keep, dropout_p=dropout_p)
        _add_rows(dq, heads, blk.rows, gq)
        _add_rows(dk, kv_heads, blk.rows, gk)
        _add_rows(dv, kv_heads, blk.rows, gv)

    # About half the local work runs while the key/value rows travel, the other half while the
    # gradients of the peers' rows travel back.
    split = _work_split(plan.local_blocks) if any(s.recv_rows or s.send_count
                                                  for s in plan.steps) \
        else len(plan.local_blocks)
    for blk in plan.local_blocks[:split]:
        local_block(blk)

    kbuf, vbuf = _received_kv(plan, posted, b, dk_dim, dv_dim)
    works, recvs, _payloads = _peer_backward(
        plan, kbuf, vbuf, group, qc, dout_c, out_c, lse_pad, heads,
        lambda pb, gq: _add_rows(dq, heads, pb.q_rows, gq), dtype=dtype, wide=wide,
        scale=scale, seed=seed, dropout_p=dropout_p)

    for blk in plan.local_blocks[split:]:
        local_block(blk)

    _wait(works)
    for step, recv in zip(plan.steps, recvs):
        if recv is None:
            continue
        gk, gv = _split(recv, b, step.send_count, dk_dim, dv_dim)
        bidx = torch.arange(b, device=q.device).view(b, 1)
        dk.index_put_((bidx, step.send_heads.view(1, -1), step.send_rows.view(1, -1)), gk,
                      accumulate=True)
        dv.index_put_((bidx, step.send_heads.view(1, -1), step.send_rows.view(1, -1)), gv,
                      accumulate=True)
    return (dq[:, :, :n].to(q.dtype).contiguous(), dk[:, :, :n].to(k.dtype).contiguous(),
            dv[:, :, :n].to(v.dtype).contiguous())


def _plan_for(q, k, group, segment_lengths, dilation_rates, hilbert, is_causal) -> RingPlan:
    return ring_plan(q.shape[2], dist.get_world_size(group), dist.get_rank(group),
                     segment_lengths, dilation_rates, hilbert, is_causal, q.shape[1], k.shape[1],
                     q.device)


# ---------------------------------------------------------------------------------------------
# The custom ops.

@torch.library.custom_op("hilbert_fx::ring_dilated_attention", mutates_args=())
def ring_dilated_attention_op(q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int],
                              dilation_rates: list[int], hilbert: bool, is_causal: bool,
                              attn_mask: Optional[Tensor], dropout_p: float,
                              seed: Optional[Tensor], scale: float, lowering: str,
                              group_name: str) -> tuple[Tensor, Tensor]:
    """Local shards in, local shards out: (out [B, Hq, n, Dv], lse [B, Hq, n] float32+)."""
    group = _resolve(group_name)
    seed = _start("forward", group, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                  attn_mask, dropout_p, seed, scale, lowering)
    _STATS["forward_calls"] += 1
    _connect(group, q.device)
    plan = _plan_for(q, k, group, segment_lengths, dilation_rates, hilbert, is_causal)
    if _triton_path(q, lowering, dropout_p):
        out, lse = _triton_forward(q, k, v, plan, group, segment_lengths=segment_lengths,
                                   dilation_rates=dilation_rates, hilbert=hilbert,
                                   is_causal=is_causal, scale=scale)
    else:
        out, lse = _ring_forward(q, k, v, plan, group, is_causal=is_causal, scale=scale,
                                 dropout_p=dropout_p, seed=seed)
    return out.contiguous(), lse


@ring_dilated_attention_op.register_fake
def _(q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed,
      scale, lowering, group_name):
    b, h, n, _ = q.shape
    out = q.new_empty(b, h, n, v.shape[-1])
    lse = q.new_empty(b, h, n, dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


@torch.library.custom_op("hilbert_fx::ring_dilated_attention_backward", mutates_args=())
def ring_dilated_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                       lse: Tensor, segment_lengths: list[int],
                                       dilation_rates: list[int], hilbert: bool, is_causal: bool,
                                       attn_mask: Optional[Tensor], dropout_p: float,
                                       seed: Optional[Tensor], scale: float, lowering: str,
                                       group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    group = _resolve(group_name)
    seed = _start("backward", group, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                  attn_mask, dropout_p, seed, scale, lowering)
    _STATS["backward_calls"] += 1
    plan = _plan_for(q, k, group, segment_lengths, dilation_rates, hilbert, is_causal)
    if _triton_path(q, lowering, dropout_p):
        dq, dk, dv = _triton_backward(dout, q, k, v, out, lse, plan, group,
                                      segment_lengths=segment_lengths,
                                      dilation_rates=dilation_rates, hilbert=hilbert,
                                      is_causal=is_causal, scale=scale)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    return _ring_backward(dout, q, k, v, out, lse, plan, group, is_causal=is_causal, scale=scale,
                          dropout_p=dropout_p, seed=seed)


@ring_dilated_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
      dropout_p, seed, scale, lowering, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask, dropout_p, seed, \
        scale, lowering, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, seed)
    ctx.config = (segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale, lowering,
                  group_name)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, seed = ctx.saved_tensors
    segment_lengths, dilation_rates, hilbert, is_causal, dropout_p, scale, lowering, group_name = \
        ctx.config
    dq, dk, dv = ring_dilated_attention_backward_op(
        dout.contiguous(), q, k, v, out, lse, segment_lengths, dilation_rates, hilbert, is_causal,
        attn_mask, dropout_p, seed, scale, lowering, group_name)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


ring_dilated_attention_op.register_autograd(_backward, setup_context=_setup_context)
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
        _agree(_resolve(name), 0, "invalid", 0, str(e))
        raise  # not reached: _agree raises on every rank
    return ring_dilated_attention(q, k, v, segment_lengths, dilation_rates, hilbert=hilbert,
                                  is_causal=is_causal, attn_mask=attn_mask, dropout_p=dropout_p,
                                  scale=scale, lowering=resolve_lowering(lowering, q.device),
                                  mesh=mesh)
