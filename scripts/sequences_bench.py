"""Sequences on one GPU (SPEC section 5): a check against the float64 reference, then the timings
of BENCHMARKS.md's "Packed documents and decoding".

    PYTHONPATH=.:tests python scripts/sequences_bench.py --steps check sync packed decode model --out $OUT

check    packed rows (ragged, padding, B = 2), cached queries (Nq = 1 and 5, per-row cache lengths)
         against tests/reference.py, out and gradients, every lowering; exits non-zero on a failure
packed   a 64K row of documents of 1K to 16K tokens, causal, bf16, H = 16, D = 128: the op with
         position_ids against the same documents one by one and against FlexAttention with the
         document mask and the dilated pattern; forward and forward+backward; peak memory
decode   one query per row against a cache of 8K, 32K and 128K tokens: the op (called eagerly, and
         as a compiled graph calls it) against dense SDPA over the whole cache; CPU time to
         issue a call, GPU time per call, and a CUDA graph's
sync     packed rows (position_ids, cu_seqlens), a chunk of queries and a decoding step against
         a cache, forward and backward on both lowerings, with torch.cuda.set_sync_debug_mode
         ("error"): a host synchronisation fails the call; then a packed forward+backward captured
         in a CUDA graph and replayed with other documents, and a transformers Llama trained on
         packed batches under mode="reduce-overhead", both against calls without graphs
model    a 12-layer Llama (width 1024) generating with the compiled forward after a prompt of
         8K, 32K and 128K tokens: time per new token, dilated against dense
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from reference import reference_sequences  # noqa: E402

import hilbert_fx  # noqa: E402
from hilbert_fx.lowering import dilated_attention  # noqa: E402
from hilbert_fx.lowering.plans import class_of  # noqa: E402

BRANCHES = ((2048, 4096, 8192, 16384), (1, 2, 4, 8))
DOCS = (16384, 1024, 8192, 4096, 12288, 2048, 6144, 3072, 9216, 1024, 2048)  # 65536 tokens


def log(out, text):
    print(text, flush=True)
    with open(os.path.join(out, "sequences.txt"), "a") as f:
        f.write(text + "\n")


def rel(x, ref):
    return ((x.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- check


def check(out, device, lowerings=("sdpa", "triton")):
    torch.manual_seed(0)
    w, r = (64, 128, 256), (1, 2, 4)
    failures = 0
    cases = []
    pos_packed = torch.cat([torch.arange(n) for n in (37, 200, 64, 90)] + [torch.full((9,), -1)])
    pos_left = torch.cat([torch.full((30,), -1), torch.arange(370)])
    cases.append(("packed+padding", dict(position_ids=torch.stack([pos_packed, pos_left])), 400, 400))
    cases.append(("decode Nq=1", dict(seqused_k=torch.tensor([700, 333])), 1, 700))
    cases.append(("chunk Nq=5 left pad", dict(position_ids=torch.cat(
        [torch.full((50,), -1), torch.arange(650)]).expand(2, 700)), 5, 700))
    cases.append(("chunk Nq=40", dict(seqused_k=torch.tensor([512, 611])), 40, 700))
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for lowering in lowerings:
            for hilbert, (name, kw, nq, nk), causal in itertools.product((False, True), cases,
                                                                         (False, True)):
                if not causal and nq < nk:  # a cache continuation is causal
                    continue
                failures += compare(out, device, name, kw, 2, nq, nk, w, r, dtype, 64, tol,
                                    lowering, hilbert, causal)
    return (failures + check_holes(out, device, lowerings) + check_whole(out, device, lowerings)
            + check_partial(out, device, lowerings))


def check_holes(out, device, lowerings):
    """Cached queries (decode, Nq <= 16) of a sequence with padding between its tokens: keys are
    found by rank among the real tokens (the Triton decode kernel's HOLES path); against the
    reference on the row with its padding removed."""
    torch.manual_seed(1)
    w, r = (64, 128, 256), (1, 2, 4)
    pos = torch.cat([torch.arange(300), torch.full((40,), -1), torch.arange(300, 560),
                     torch.full((3,), -1), torch.arange(560, 657)])  # 700 rows, 657 tokens
    real = pos >= 0
    failures = 0
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for lowering, hilbert, nq in itertools.product(lowerings, (False, True), (1, 3, 16)):
            q = torch.randn(1, 8, nq, 64, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(1, 4, 700, 64, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(1, 4, 700, 64, device=device, dtype=dtype, requires_grad=True)
            o = dilated_attention(q, k, v, w, r, hilbert=hilbert, is_causal=True, enable_gqa=True,
                                  lowering=lowering, position_ids=pos.view(1, -1).to(device))
            g = torch.randn_like(o)
            o.backward(g)
            n = int(real.sum())
            qd = torch.zeros(1, 8, n, 64, dtype=torch.float64)
            qd[:, :, n - nq:] = q.detach().double().cpu()
            kd, vd = (x.detach().double().cpu()[:, :, real] for x in (k, v))
            qd, kd, vd = (x.requires_grad_() for x in (qd, kd, vd))
            ref = reference_sequences(qd, kd, vd, w, r, hilbert=hilbert, is_causal=True,
                                      enable_gqa=True, position_ids=pos[real])
            gd = torch.zeros_like(ref)
            gd[:, :, n - nq:] = g.double().cpu()
            ref.backward(gd)
            errs = [rel(o.detach(), ref.detach()[:, :, n - nq:]), rel(q.grad, qd.grad[:, :, n - nq:]),
                    rel(k.grad[:, :, real.to(device)], kd.grad),
                    rel(v.grad[:, :, real.to(device)], vd.grad)]
            ok = all(e < tol for e in errs) and not k.grad[:, :, ~real.to(device)].any()
            failures += not ok
            log(out, f"{'ok  ' if ok else 'FAIL'} {str(dtype)[6:]:9s} {lowering:6s} "
                     f"hilbert={hilbert!s:5s} decode holes Nq={nq:<2d}        out {errs[0]:.1e} "
                     f"dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e}")
    return failures


def check_whole(out, device, lowerings):
    """Packed documents that fill whole segments of every branch (w / r >= 128): on an H100 or
    H200 the Hopper kernels run these plans, their runs found from the order's table."""
    torch.manual_seed(2)
    pos = torch.cat([torch.arange(512), torch.arange(256), torch.arange(256)]).view(1, -1)
    return sum(compare(out, device, "packed whole segments", dict(position_ids=pos), 1, 1024, 1024,
                       (128, 256), (1, 2), torch.bfloat16, 64, 3e-2, *case)
               for case in itertools.product(lowerings, (False, True), (False, True)))


def check_partial(out, device, lowerings):
    """Packed documents of ragged lengths (shorter than a segment, spanning several) with padding,
    branches whose sets are 128 members (w / r = 128): on an H100 or H200 the Hopper kernels run
    these partial sets (each set's count read by the kernel), forward and backward."""
    torch.manual_seed(3)
    docs = torch.cat([torch.arange(n) for n in (300, 77, 513, 134)])  # 1024 tokens
    pos = torch.stack([torch.cat([docs, torch.full((100,), -1)]),
                       torch.cat([torch.full((60,), -1), torch.arange(1064)])])  # [2, 1124]
    failures = sum(compare(out, device, f"packed partial D={d}", dict(position_ids=pos), 2, 1124,
                           1124, (128, 256, 512), (1, 2, 4), dtype, d, 3e-2, *case)
                   for (dtype, d), *case in itertools.product(
                       ((torch.bfloat16, 64), (torch.float16, 128)), lowerings, (False, True),
                       (False, True)))
    if device.type == "cuda":
        from hilbert_fx.lowering import gluon_forward
        log(out, "kernels that ran: " + "; ".join(gluon_forward.kernel_choices()))
    return failures


def compare(out, device, name, kw, b, nq, nk, w, r, dtype, d, tol, lowering, hilbert,
            causal) -> int:
    """1 if the op (8 query heads, 4 kv heads, B = b, Nq queries against Nk keys, structure
    arguments kw) differs from the float64 reference in out or a gradient by more than tol
    (relative), else 0; logs a line either way."""
    q = torch.randn(b, 8, nq, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, 4, nk, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, 4, nk, d, device=device, dtype=dtype, requires_grad=True)
    o = dilated_attention(q, k, v, w, r, hilbert=hilbert, is_causal=causal, enable_gqa=True,
                          lowering=lowering, **{a: t.to(device) for a, t in kw.items()})
    g = torch.randn_like(o)
    o.backward(g)
    qd, kd, vd = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    ref = reference_sequences(qd, kd, vd, w, r, hilbert=hilbert, is_causal=causal,
                              enable_gqa=True, **kw)
    ref.backward(g.double().cpu())
    errs = [rel(o.detach(), ref.detach())] + [rel(x.grad, y.grad) for x, y in
                                              ((q, qd), (k, kd), (v, vd))]
    ok = all(e < tol for e in errs)
    log(out, f"{'ok  ' if ok else 'FAIL'} {str(dtype)[6:]:9s} {lowering:6s} hilbert={hilbert!s:5s} "
             f"causal={causal!s:5s} {name:22s} out {errs[0]:.1e} dq {errs[1]:.1e} "
             f"dk {errs[2]:.1e} dv {errs[3]:.1e}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- sync


def sync(out, device):
    torch.manual_seed(4)
    w, r = (128, 256, 512), (1, 2, 4)
    n, failures = 1024, 0

    def docs(lengths, b=2):  # each row: documents of these lengths, then padding
        rows = [torch.cat([torch.arange(x) for x in lengths] + [torch.full((n - sum(lengths),), -1)])
                for _ in range(b)]
        return torch.stack(rows).to(device)

    def cu(lengths, b=2):
        return torch.tensor([0] + list(itertools.accumulate(list(lengths) * b)), device=device,
                            dtype=torch.int32) if sum(lengths) == n else None

    qkv = [torch.randn(2, 8, n, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3)]
    cases = [("position_ids", lambda: dict(position_ids=docs((300, 77, 513, 10))), n),
             ("cu_seqlens", lambda: dict(cu_seqlens=cu((300, 77, 513, 134))), n),
             ("chunk Nq=40", lambda: dict(seqused_k=torch.tensor([900, 611], device=device)), 40),
             ("decode Nq=1", lambda: dict(seqused_k=torch.tensor([900, 611], device=device)), 1)]
    for lowering, (name, kw, nq) in itertools.product(("triton", "sdpa"), cases):
        q = qkv[0][:, :, :nq].detach().requires_grad_()
        k, v = qkv[1], qkv[2]

        def call(structure):
            o = dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True, enable_gqa=True,
                                  lowering=lowering, **structure)
            torch.autograd.grad(o, (q, k, v), grad)
        grad = torch.randn(2, 8, nq, 64, device=device, dtype=torch.bfloat16)
        call(kw())  # the first call of a configuration makes its tables and compiles kernels
        structure = kw()  # new tensors (new plans), copied to the GPU before the check
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            call(structure)
            ok, why = True, ""
        except RuntimeError as e:
            import traceback
            ours = [f for f in traceback.extract_tb(e.__traceback__)
                    if "/lowering/" in f.filename or "/hilbert_fx/" in f.filename]
            where = f" at {ours[-1].filename.split('/')[-1]}:{ours[-1].lineno} {ours[-1].line}" \
                if ours else ""
            ok, why = False, str(e).splitlines()[0][:80] + where
        finally:
            torch.cuda.set_sync_debug_mode(0)
        failures += not ok
        log(out, f"{'ok  ' if ok else 'FAIL'} no host sync: {lowering:6s} {name:14s} {why}")
    return failures + graph_replay(out, device, docs) + llama_graphs(out, device)


def graph_replay(out, device, docs):
    """A packed forward+backward captured once, replayed with other documents in the same
    position tensor: equal to eager calls on those documents."""
    torch.manual_seed(5)
    w, r = (128, 256, 512), (1, 2, 4)
    q, k, v = (torch.randn(2, 8, 1024, 64, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    g = torch.randn(2, 8, 1024, 64, device=device, dtype=torch.bfloat16)
    layouts = [(300, 77, 513, 10), (1024,), (5, 1, 700, 3, 200), (64,) * 16]

    def step(pos):
        o = dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True, enable_gqa=True,
                              lowering="triton", position_ids=pos)
        return (o, *torch.autograd.grad(o, (q, k, v), g))

    failures = 0
    static = docs(layouts[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static.clone())  # warm up: tables, kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static)
    for lengths in layouts:
        static.copy_(docs(lengths))
        graph.replay()
        want = step(docs(lengths))
        errs = [rel(a.float(), b.double().cpu()) for a, b in zip(outs, want)]
        ok = all(e < 1e-2 for e in errs)
        failures += not ok
        log(out, f"{'ok  ' if ok else 'FAIL'} CUDA graph replay, documents {lengths}: out, dq, dk, "
                 f"dv against eager " + " ".join(f"{e:.1e}" for e in errs))
    return failures


def llama_graphs(out, device):
    """A small transformers Llama, packed batches of other documents each step, compiled with
    the backend under mode="reduce-overhead" against the default mode: equal losses and
    gradients, and Inductor's count of graphs it ran without CUDA graphs."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(6)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device)
    options = dict(segment_lengths=(256, 512), dilation_rates=(1, 2), hilbert=True)
    layouts = [(700, 200, 124), (1024,), (3, 500, 21, 500), (100,) * 10 + (24,)]

    def batch(lengths):
        pos = torch.cat([torch.arange(x) for x in lengths]).view(1, -1).to(device)
        ids = torch.randint(0, 512, pos.shape, device=device)
        return ids, pos

    def run(mode):
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model, backend=hilbert_fx.backend(**options), mode=mode)
        result = []
        for lengths in layouts:
            ids, pos = batch(lengths)
            model.zero_grad(set_to_none=True)
            loss = fn(input_ids=ids, position_ids=pos, labels=ids).loss
            loss.backward()
            result.append((loss.detach().clone(),
                           model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
        return result, counters["inductor"]["cudagraph_skips"]

    torch.manual_seed(7)
    plain, _ = run(None)
    torch.manual_seed(7)
    graphs, skips = run("reduce-overhead")
    failures = 0
    for lengths, (l0, g0), (l1, g1) in zip(layouts, plain, graphs):
        errs = (abs(l0 - l1).item(), rel(g1, g0.double().cpu()))
        ok = errs[0] < 1e-3 and errs[1] < 1e-2
        failures += not ok
        log(out, f"{'ok  ' if ok else 'FAIL'} Llama packed {lengths}, reduce-overhead vs default: "
                 f"loss diff {errs[0]:.1e}, q_proj grad {errs[1]:.1e}")
    log(out, f"{'ok  ' if skips == 0 else 'FAIL'} Inductor graphs run without CUDA graphs: {skips}")
    return failures + (skips != 0)


# ----------------------------------------------------------------------------- timing


def gpu_time(fn, reps=20):
    """(CPU us to issue one call, GPU us per call over reps calls back to back), medians of 3."""
    fn()
    torch.cuda.synchronize()
    cpu, gpu = [], []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        cpu.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / reps * 1e3)
    return sorted(cpu)[1], sorted(gpu)[1]


def graph_time(fn, reps=20):
    """GPU us per replay of a CUDA graph of fn (None if it cannot be captured)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return gpu_time(graph.replay, reps)[1]
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:200]})")
        return None


@contextlib.contextmanager
def hopper_kernels_off():
    """HILBERT_FX_GLUON=0 inside the block (the knobs are read once: read again on the way in
    and out)."""
    from hilbert_fx.lowering import tuning
    saved = os.environ.get("HILBERT_FX_GLUON")
    os.environ["HILBERT_FX_GLUON"] = "0"
    tuning._current = None
    try:
        yield
    finally:
        if saved is None:
            del os.environ["HILBERT_FX_GLUON"]
        else:
            os.environ["HILBERT_FX_GLUON"] = saved
        tuning._current = None


def packed(out, device, flex_too: bool = True):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, or_masks
    n, h, d = sum(DOCS), 16, 128
    w, r = BRANCHES
    pos = torch.cat([torch.arange(x) for x in DOCS]).to(device)
    q, k, v = (torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    starts = [0]
    for x in DOCS:
        starts.append(starts[-1] + x)

    def op():
        return dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True, position_ids=pos)

    def op_new_plans():  # another batch's position tensor each call: its plans built anew
        return dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True,
                                 position_ids=pos.clone())

    def plain_row():  # the same row as one sequence: no documents
        return dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True)

    def one_by_one():
        return torch.cat([dilated_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], w, r,
                                            hilbert=True, is_causal=True)
                          for a, b in zip(starts, starts[1:])], dim=2)

    # FlexAttention with the same attention: one softmax over the keys any branch selects (same
    # document, same segment, the head's class, causal), each weighted by the number of
    # branches selecting it (a score_mod adding its log), which is what the op's merge computes
    doc = torch.repeat_interleave(torch.arange(len(DOCS), device=device),
                                  torch.tensor(DOCS, device=device))
    classes = [class_of(wi, ri, True)[0].to(device) for wi, ri in zip(w, r)]

    def count(hd, qi, ki):
        c = (qi * 0).to(torch.int32)
        same_doc = (doc[qi] == doc[ki]) & (ki <= qi)
        for wi, ri, cls in zip(w, r, classes):
            sel = same_doc & (pos[qi] // wi == pos[ki] // wi)
            sel = sel & (cls[pos[qi] % wi] == hd % ri) & (cls[pos[ki] % wi] == hd % ri)
            c = c + sel.to(torch.int32)
        return c

    def branch_mod(wi, ri, cls):
        def mod(b, hd, qi, ki):
            sel = (doc[qi] == doc[ki]) & (ki <= qi) & (pos[qi] // wi == pos[ki] // wi)
            return sel & (cls[pos[qi] % wi] == hd % ri) & (cls[pos[ki] % wi] == hd % ri)
        return mod

    # the block mask from boolean masks alone (a count summed in create_block_mask's trace made
    # it materialise the whole N x N grid)
    mask_mod = or_masks(*(branch_mod(wi, ri, cls) for wi, ri, cls in zip(w, r, classes)))

    def score_mod(score, b, hd, qi, ki):
        return score + torch.log(count(hd, qi, ki).clamp(min=1).to(score.dtype))

    # _compile: the block mask is built without materialising the N x N mask first
    if flex_too:
        block_mask = create_block_mask(mask_mod, 1, h, n, n, device=device, _compile=True)
        flex = torch.compile(flex_attention)

    def flex_op():
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

    with torch.no_grad():
        ref = one_by_one()
        err = (op() - ref).abs().max().item()
        ferr = (flex_op() - ref).abs().max().item() if flex_too else float("nan")
    log(out, f"packed 64K: op vs one by one max |diff| {err:.2e}, flex vs one by one {ferr:.2e}")
    log(out, "| method | forward ms | forward+backward ms | peak memory GiB (fwd+bwd) |")
    log(out, "|---|---|---|---|")
    for name, fn in (("op, position_ids", op),
                     ("op, position_ids, plans built each call", op_new_plans),
                     ("op, position_ids, Triton kernels only (HILBERT_FX_GLUON=0)", op),
                     ("op, the row as one sequence (no documents)", plain_row),
                     ("documents one by one", one_by_one),
                     ("FlexAttention, document mask", flex_op)):
        if fn is flex_op and not flex_too:
            continue
        with hopper_kernels_off() if "GLUON=0" in name else contextlib.nullcontext():
            time_packed(out, name, fn, h, n, d, device)


def time_packed(out, name, fn, h, n, d, device):
    with torch.no_grad():
        _, fwd = gpu_time(fn, reps=5)
    grad = torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16)

    def step():
        fn().backward(grad)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    _, both = gpu_time(step, reps=5)
    log(out, f"| {name} | {fwd / 1e3:.2f} | {both / 1e3:.2f} | {peak:.2f} |")


def decode(out, device):
    h, d = 16, 128
    w, r = BRANCHES
    log(out, "| cache | op CPU us | op GPU us | op graph us | custom op CPU / GPU us | SDPA CPU us "
             "| SDPA GPU us | SDPA graph us |")
    log(out, "|---|---|---|---|---|---|---|---|")
    for length in (8192, 32768, 131072):
        q = torch.randn(1, h, 1, d, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, h, length, d, device=device, dtype=torch.bfloat16) for _ in range(2))
        with torch.no_grad():
            full = dilated_attention(torch.cat([torch.zeros_like(k[:, :, :-1]), q], 2), k, v, w, r,
                                     hilbert=True, is_causal=True)[:, :, -1:]
            got = dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True)
        err = (got.float() - full.float()).abs().max().item()

        def op():
            return dilated_attention(q, k, v, w, r, hilbert=True, is_causal=True)

        def custom_op():  # what a compiled model's graph calls: the front's checks are not run
            return torch.ops.hilbert_fx.dilated_attention.default(
                q, k, v, list(w), list(r), True, True, None, 0.0, None, d ** -0.5, "triton")

        def dense():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        with torch.no_grad():
            oc, og = gpu_time(op)
            cc, cg = gpu_time(custom_op, reps=200)
            dc, dg = gpu_time(dense)
            ograph, dgraph = graph_time(op), graph_time(dense)
        fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
        log(out, f"| {length // 1024}K | {oc:.0f} | {og:.0f} | {fmt(ograph)} | {cc:.0f} / {cg:.0f} "
                 f"| {dc:.0f} | {dg:.0f} | {fmt(dgraph)} |  (decode vs full row max |diff| "
                 f"{err:.1e})")


def model(out, device, lengths=(8192, 32768, 131072)):
    from torch._dynamo.utils import counters
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=1024,
                         max_position_embeddings=140000)
    import transformers
    w, r = BRANCHES

    def dense_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        **kwargs):
        """Dense baseline without an N x N mask: causal for the prompt, every cached key for a
        decoding step (no padding here)."""
        o = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=query.shape[2] == key.shape[2], scale=scaling)
        return o.transpose(1, 2).contiguous(), None
    transformers.AttentionInterface.register("dense_decode", dense_attention)
    transformers.AttentionMaskInterface.register("dense_decode", lambda *a, **k: None)
    # the dense baseline compiles a graph per layer and phase (transformers' cache guards): room
    # for them all, so that no layer falls back to running uncompiled mid-measurement
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    log(out, "generate(): ms per new token, the prompt's time subtracted (medians of 3); "
             "forward loop: the compiled forward called token after token as generate() does "
             "(dynamic cache), elapsed ms per step and the host's ms to issue one")
    log(out, "| prompt | dense generate | dilated generate | dense loop (host) | dilated loop (host) "
             "| graphs compiled (dense, dilated) |")
    log(out, "|---|---|---|---|---|---|")
    for length in lengths:
        times, loops, graphs = {}, {}, {}
        for name in ("dense", "dilated"):
            torch.manual_seed(0)
            config._attn_implementation = "dense_decode" if name == "dense" else "sdpa"
            m = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
            backend = "inductor" if name == "dense" else hilbert_fx.backend(
                segment_lengths=w, dilation_rates=r, hilbert=True)
            hilbert_fx.compile_for_generate(m, backend=backend, dynamic=True)
            prompt = torch.randint(0, 1024, (1, length), device=device)
            compiled = counters["stats"]["unique_graphs"]
            with torch.no_grad():
                m.generate(prompt, max_new_tokens=40, do_sample=False)  # compiles every size

                def run(tokens):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    m.generate(prompt, max_new_tokens=tokens, do_sample=False)
                    torch.cuda.synchronize()
                    return time.perf_counter() - t0
                # generate() is host-bound and its time varies from run to run
                prefill = sorted(run(1) for _ in range(3))[1]
                both = sorted(run(33) for _ in range(3))[1]
                times[name] = (both - prefill) / 32 * 1e3
                loops[name] = forward_loop(m, config, prompt, 32, DynamicCache)
            graphs[name] = counters["stats"]["unique_graphs"] - compiled
            del m
            torch.cuda.empty_cache()
        fmt = lambda x: f"{x[0]:.2f} ({x[1]:.2f})"  # noqa: E731
        log(out, f"| {length // 1024}K | {times['dense']:.2f} | {times['dilated']:.2f} | "
                 f"{fmt(loops['dense'])} | {fmt(loops['dilated'])} | {graphs['dense']}, "
                 f"{graphs['dilated']} |")


def forward_loop(m, config, prompt, steps, cache_class):
    """(elapsed ms per decoding step, median host ms to issue one) of the compiled forward
    called as generate() calls it (the 2-D mask, cache_position), greedy, after one warm-up."""
    length = prompt.shape[1]
    mask = torch.ones(1, length + steps + 1, dtype=torch.long, device=prompt.device)

    def run():
        cache = cache_class(config=config)
        out = m(input_ids=prompt, attention_mask=mask[:, :length], past_key_values=cache,
                use_cache=True, cache_position=torch.arange(length, device=prompt.device))
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        host, t0 = [], time.perf_counter()
        for i in range(steps):
            n = length + i
            a = time.perf_counter()
            out = m(input_ids=tok, attention_mask=mask[:, :n + 1], past_key_values=cache,
                    use_cache=True, cache_position=torch.arange(n, n + 1, device=prompt.device))
            tok = out.logits[:, -1:].argmax(-1)
            host.append(time.perf_counter() - a)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e3, sorted(host)[steps // 2] * 1e3
    run()
    return run()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", nargs="+", default=["check", "packed", "decode", "model"])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--device", default="cuda", help="cpu runs the check only (sdpa lowering)")
    p.add_argument("--model-lens", type=int, nargs="+", default=[8192, 32768, 131072],
                   help="prompt lengths of the model step, in this order")
    p.add_argument("--no-flex", action="store_true",
                   help="packed: leave FlexAttention out (its compile and run take minutes)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cpu":
        sys.exit(1 if check(args.out, device, ("sdpa",)) else 0)
    log(args.out, f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    failures = 0
    for step in args.steps:
        log(args.out, f"=== {step}")
        try:
            steps = {"check": check, "sync": sync, "decode": decode,
                     "packed": lambda o, d: packed(o, d, not args.no_flex),
                     "model": lambda o, d: model(o, d, args.model_lens)}
            result = steps[step](args.out, device)
            failures += result or 0
        except Exception as e:  # noqa: BLE001 - a failed step fails the run, the others still run
            import traceback
            traceback.print_exc()
            log(args.out, f"FAILED step {step}: {type(e).__name__}: {e}")
            failures += 1
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
