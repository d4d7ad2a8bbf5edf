"""The agreement every call of the ring op starts with (lowering/ring.py, SPEC section 4).

Each rank states its shard length, a hash of its configuration, its dropout seed and any error
it found in its arguments, in one small exchange through the process group's store (host only:
it neither waits for the GPU nor needs a process group of its own). Every rank then reaches the
same decision, so shards of unequal length, configurations that differ across ranks and
arguments that one rank rejects raise ValueError on every rank instead of leaving the others
waiting in a collective; and every rank uses rank 0's seed.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .arguments import check_branches, problem


def group_name_of(mesh) -> str:
    """The process-group name of a 1-D DeviceMesh (or of a ProcessGroup, or a name)."""
    if isinstance(mesh, str):
        return mesh
    if isinstance(mesh, dist.ProcessGroup):
        return mesh.group_name
    if getattr(mesh, "ndim", 1) != 1:
        raise ValueError(f"mesh must be a one-dimensional DeviceMesh, got {mesh.ndim} dimensions")
    return mesh.get_group().group_name


def resolve(group_name: str):
    """The process group of a name (as the op's string argument carries it)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


_CALLS: dict = {}  # group name -> number of agreements made on it by this process


def _exchange(group, value: bytes) -> list[bytes]:
    """All-gather of a few bytes through the default store: host only, raising after the
    store's timeout.

    Every call of the op is collective over its group, so the k-th agreement of a group is the
    same call on every rank: its keys are named by (group, k). Three round trips: set, a
    multi_get that waits for every rank's key, and the deletion of this rank's key of agreement
    k - 2 (by then every rank has read it)."""
    store = dist.distributed_c10d._get_default_store()
    name = group.group_name
    k = _CALLS.get(name, 0)
    _CALLS[name] = k + 1
    world, me = dist.get_world_size(group), dist.get_rank(group)
    prefix = f"hilbert_fx/ring/agree/{name}/"
    store.set(f"{prefix}{k}/{me}", value)
    keys = [f"{prefix}{k}/{r}" for r in range(world)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(x) for x in keys]
    if k >= 2:
        try:
            store.delete_key(f"{prefix}{k - 2}/{me}")
        except Exception:  # a store without delete_key: the keys stay, harmlessly
            pass
    return [bytes(v) for v in values]


_MSG = 400
_FORMAT = "<5q"  # before the error's text: length, config hash (2), seed, error flag
_HEAD = struct.calcsize(_FORMAT)


@functools.lru_cache(maxsize=256)
def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def agree(group, n_local: int, key: str, seed: int, error: Optional[str]) -> int:
    """One exchange of (length, config hash, seed, error): raise on every rank or on none.

    Returns rank 0's seed."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    digest = _digest(key)
    head = struct.pack(_FORMAT, int(n_local), int.from_bytes(digest[:7], "little"),
                       int.from_bytes(digest[7:14], "little"), int(seed),
                       1 if error is not None else 0)
    value = head + (error or "").encode()[:_MSG]
    values = [value] if world == 1 else _exchange(group, value)
    rows = [struct.unpack(_FORMAT, v[:_HEAD]) for v in values]
    failed = [r for r in range(world) if rows[r][4]]
    if failed:
        if error is not None:
            raise ValueError(error)
        text = values[failed[0]][_HEAD:].decode(errors="replace")
        raise ValueError(f"rank {failed[0]} of the mesh rejected its arguments (ranks {failed} "
                         f"did): {text}")
    lengths = [row[0] for row in rows]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"q, k, v: shards of unequal length across the mesh: ranks hold {lengths} positions; "
            f"every rank must hold N/P positions of the sequence (SPEC section 4)")
    hashes = [row[1:3] for row in rows]
    if len(set(hashes)) > 1:
        differ = [r for r in range(world) if hashes[r] != hashes[0]]
        raise ValueError(
            f"configuration differs across the mesh's ranks: ranks {differ} differ from rank 0 "
            f"(rank {me} has {key})")
    return rows[0][3]


def _config_key(phase, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
                dropout_p, seed, scale, lowering) -> str:
    b, hq, _, d = q.shape
    return (f"{phase} B={b} Hq={hq} Hkv={k.shape[1]} D={d} Dv={v.shape[-1]} dtype={q.dtype}/"
            f"{k.dtype}/{v.dtype} segment_lengths={list(segment_lengths)} "
            f"dilation_rates={list(dilation_rates)} hilbert={bool(hilbert)} "
            f"is_causal={bool(is_causal)} attn_mask={attn_mask is not None} "
            f"dropout_p={float(dropout_p)!r} seed={seed is not None} scale={float(scale)!r} "
            f"lowering={lowering} device={q.device.type}")


_ACCEPTED: set = set()  # signatures of calls local_error found nothing wrong with


def local_error(q, k, v, segment_lengths, dilation_rates, is_causal, attn_mask, dropout_p, scale,
                lowering) -> Optional[str]:
    """What this rank finds wrong with its own arguments (None when nothing), before agreeing.
    A signature (layouts of q, k, v and the other arguments) found right once is not checked
    again: the checks cost more host time than a small kernel."""
    signature = (*((t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v)),
                 tuple(segment_lengths), tuple(dilation_rates), bool(is_causal),
                 attn_mask is None, float(dropout_p), float(scale), lowering)
    if signature in _ACCEPTED:
        return None
    error = _local_error(q, k, v, segment_lengths, dilation_rates, is_causal, attn_mask,
                         dropout_p, scale, lowering)
    if error is None:
        if len(_ACCEPTED) > 1024:
            _ACCEPTED.clear()
        _ACCEPTED.add(signature)
    return error


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


def start(phase, group, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal, attn_mask,
          dropout_p, seed, scale, lowering, error: Optional[str]) -> Optional[Tensor]:
    """Agree across ranks on this rank's `error` (local_error's, or one met since) and
    configuration; returns the seed every rank uses (rank 0's)."""
    key = _config_key(phase, q, k, v, segment_lengths, dilation_rates, hilbert, is_causal,
                      attn_mask, dropout_p, seed, scale, lowering)
    local_seed = int(seed.item()) if seed is not None else 0
    seed0 = agree(group, q.shape[2], key, local_seed, error)
    if seed is None:
        return None
    return torch.tensor(seed0, dtype=torch.int64, device=q.device)
