"""Worker processes for tests/test_ring.py: one process per rank of a gloo group on CPU.

`launch(world, cases, timeout)` starts `world` processes with torch.multiprocessing (spawn), runs
every case on every rank in order and returns {case name: {rank: result}}, where a result is a
dict of numpy arrays and numbers, or {"error": "ValueError: ..."}. A launch that does not finish
within `timeout` seconds (a hang) has its processes killed and raises TimeoutError.

Inputs are drawn on the whole sequence from the case's seed (`full_inputs`), so that the test
process can compute the reference on the whole sequence and compare each rank's shard.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # lowering="triton" runs interpreted here (SPEC section 3);
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when first imported

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COLLECTIVE_TIMEOUT_S = 60

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_inputs(case: dict):
    """q, k, v, dout on the whole sequence (N = world * n), in the case's dtype."""
    g = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, d = case["B"], case["Hq"], case["Hkv"], case["D"]
    n = case["world"] * case["n"]
    dtype = DTYPES[case.get("dtype", "float32")]
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, dout))


def _np(t):
    return t.detach().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# What a rank does for each kind of case.

def _run_attention(case, rank, mesh, between=None):
    from hilbert_fx.lowering import ring
    q, k, v, dout = full_inputs(case)
    n = case["n"]
    sl = slice(rank * n, (rank + 1) * n)
    if case.get("layout") == "bnhd":  # [B, N, H, D] storage, as models make them: strided views
        leaves = [x[:, :, sl].transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v)]
        ql, kl, vl = (x.transpose(1, 2) for x in leaves)
    else:
        leaves = [x[:, :, sl].clone().requires_grad_(True) for x in (q, k, v)]
        ql, kl, vl = leaves
    seed = None
    if case.get("dropout_p", 0.0) > 0:
        # every rank passes its own seed on purpose: rank 0's must be used everywhere
        seed = torch.tensor(case["dropout_seed"] + rank, dtype=torch.int64)
    before = ring.comm_stats()
    if case.get("front") == "public":  # hilbert_fx.dilated_attention(..., mesh=mesh)
        import hilbert_fx
        assert seed is None, "the public op draws its own dropout seed"
        out = hilbert_fx.dilated_attention(
            ql, kl, vl, case["segs"], case["rates"], hilbert=case["hilbert"],
            is_causal=case["causal"], scale=case.get("scale"),
            enable_gqa=case["Hq"] != case["Hkv"], lowering=case.get("lowering", "sdpa"),
            mesh=mesh)
    else:
        out = ring.ring_dilated_attention(
            ql, kl, vl, case["segs"], case["rates"], hilbert=case["hilbert"],
            is_causal=case["causal"], dropout_p=case.get("dropout_p", 0.0), seed=seed,
            scale=case.get("scale"), lowering=case.get("lowering", "sdpa"), mesh=mesh)
    mid = ring.comm_stats()
    if between is not None:
        between()
    out.backward(dout[:, :, sl])
    after = ring.comm_stats()
    dq, dk, dv = (x.grad.transpose(1, 2) if case.get("layout") == "bnhd" else x.grad
                  for x in leaves)
    return {"out": _np(out), "dq": _np(dq), "dk": _np(dk), "dv": _np(dv),
            "forward_bytes": mid["forward_bytes"] - before["forward_bytes"],
            "backward_bytes": after["backward_bytes"] - mid["backward_bytes"]}


def _run_error(case, rank, mesh):
    """Each rank calls with its own arguments; every rank must raise, none may hang."""
    from hilbert_fx.lowering import ring
    spec = dict(case["common"])
    spec.update(case["per_rank"].get(rank, {}))
    n = spec["n"]
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 2, n, 4, generator=g)
    mask = torch.ones(n, n, dtype=torch.bool) if spec.get("mask") else None
    # "checked": the public op, hilbert_fx.dilated_attention(mesh=...), which checks arguments
    # first (a rank that rejects its own arguments must still make the others raise); otherwise
    # the unchecked front that the op and the rewritten graph end in
    import hilbert_fx
    fn = hilbert_fx.dilated_attention if spec.get("front") == "checked" else \
        ring.ring_dilated_attention
    out = fn(q, q, q, spec["segs"], spec["rates"], hilbert=spec.get("hilbert", False),
             is_causal=spec.get("causal", False), attn_mask=mask, lowering="sdpa", mesh=mesh)
    return {"out": _np(out)}


def _run_compiled(case, rank, mesh):
    """TinyTransformer compiled with hilbert_fx.backend(mesh=...) on this rank's tokens."""
    import hilbert_fx
    import torch.distributed as dist
    from models import TinyTransformer
    torch.manual_seed(case["seed"])
    model = TinyTransformer(**case["model"])
    tokens, weight = compiled_inputs(case)
    n = case["n"]
    sl = slice(rank * n, (rank + 1) * n)
    be = hilbert_fx.backend(case["segs"], case["rates"], hilbert=case["hilbert"],
                            lowering="sdpa", mesh=mesh)
    be.keep_records = True
    compiled = torch.compile(model, backend=be)
    y = compiled(tokens[:, sl])
    (y * weight[:, sl]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=mesh.get_group())
        grads[name] = _np(g)
    return {"out": _np(y), "grads": grads,
            "graph_after": [r.graph_after for r in be.records],
            "group_name": mesh.get_group().group_name}


def compiled_inputs(case):
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = case["world"] * case["n"]
    tokens = torch.randint(0, case["model"].get("vocab", 50), (case["B"], n), generator=g)
    weight = torch.randn(case["B"], n, case["model"].get("vocab", 50), generator=g)
    return tokens, weight


def _run_overlap(case, rank, mesh):
    """The order in which the op posts messages, waits for them and computes: "post", "wait",
    "compute" (an SDPA kernel call, lowering/block_attention.py) and "triton" (a call of the
    Triton lowering)."""
    from hilbert_fx.lowering import block_attention, ring_transport, triton_lowering
    events = []
    saved = (ring_transport.dist.batch_isend_irecv, ring_transport.wait, block_attention.forward,
             block_attention.backward, triton_lowering.forward, triton_lowering.backward)

    def logged(name, fn):
        def call(*a, **kw):
            events.append(name)
            return fn(*a, **kw)
        return call
    ring_transport.dist.batch_isend_irecv = logged("post", saved[0])
    ring_transport.wait = logged("wait", saved[1])
    block_attention.forward = logged("compute", saved[2])
    block_attention.backward = logged("compute", saved[3])
    triton_lowering.forward = logged("triton", saved[4])
    triton_lowering.backward = logged("triton", saved[5])
    forward = []

    def between():
        forward.extend(events)
        events.clear()
    try:
        res = _run_attention(case, rank, mesh, between)
    finally:
        (ring_transport.dist.batch_isend_irecv, ring_transport.wait, block_attention.forward,
         block_attention.backward, triton_lowering.forward, triton_lowering.backward) = saved
    res.update(events_forward=forward, events_backward=list(events))
    return res


def _run_subgroup(case, rank, mesh):
    """An attention case of case["world"] ranks on a process group of the first ranks only (the
    others idle); what follows in the launch then runs on the whole mesh again."""
    import torch.distributed as dist
    group = dist.new_group(list(range(case["world"])))  # every rank calls new_group
    if rank >= case["world"]:
        return {"idle": True}
    return _run_attention(dict(case, kind="attention"), rank, group)


KINDS = {"attention": _run_attention, "error": _run_error, "compiled": _run_compiled,
         "overlap": _run_overlap, "subgroup": _run_subgroup}


def _main(rank, world, port, cases, results):
    sys.path[:0] = [ROOT, HERE]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    # a collective that waits longer than this raises instead of hanging (the launch's own
    # timeout kills what is left)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,))
    for case in cases:
        try:
            res = KINDS[case["kind"]](case, rank, mesh)
        except Exception as e:  # reported to the test, which decides
            res = {"error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
        results.put((case["name"], rank, res))
    results.put(("__done__", rank, None))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, cases: list[dict], timeout: float = 240.0) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_main, args=(r, world, port, cases, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    done = 0
    deadline = time.monotonic() + timeout
    try:
        while done < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ring workers did not finish within {timeout} s (a hang?); "
                                   f"results so far: { {k: sorted(v) for k, v in out.items()} }")
            try:
                name, rank, res = results.get(timeout=min(left, 5.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a ring worker died with exit code {dead[0].exitcode}")
                continue
            if name == "__done__":
                done += 1
            else:
                out.setdefault(name, {})[rank] = res
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return out
