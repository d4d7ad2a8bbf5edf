"""Why the attention of examples/train_long_gpt.py costs more in the model than in the benchmark.

Compiles the Llama of train_long_gpt (few layers) with the dilated backend on the GPU and:
1. records what the Triton lowering receives at each call (shapes, strides, dtypes, causal,
   mask) and its GPU time there (synchronised, so slower than a plain step);
2. replays one recorded call alone, with the same strides, and contiguous;
3. writes the rewritten graphs to $OUT/graph_after_*.txt and lists every node that builds a
   [.., N, N] tensor (an attention mask the pass should have made dead);
4. profiles one plain training step, per kernel.

    PYTHONPATH=. python scripts/diagnose_train.py --layers 2 --seq-len 32768 --out $OUT
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hilbert_fx
from lowering import triton_lowering


CALLS = []


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} stride {x.stride()} {str(x.dtype)[6:]}"
    return repr(x)


def _recording(name, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - start)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        CALLS.append(dict(name=name, ms=ms, args=[_describe(a) for a in tensors],
                          causal=kwargs.get("is_causal"), mask=_describe(kwargs.get("attn_mask")),
                          plans=[(p.segment_length, p.dilation_rate, p.is_strided) for p in args[len(tensors)]],
                          tensors=tensors, kwargs=kwargs, plan_list=args[len(tensors)]))
        return result
    return wrapper


def replay(call, contiguous):
    tensors = [x.detach().clone() if not contiguous else x.detach().contiguous() for x in call["tensors"]]
    if not contiguous:  # same strides as recorded
        tensors = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
                   for x in call["tensors"]]
    fn = triton_lowering.forward.__wrapped_original__ if call["name"] == "forward" else \
        triton_lowering.backward.__wrapped_original__
    for _ in range(3):
        fn(*tensors, call["plan_list"], **call["kwargs"])
    torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        fn(*tensors, call["plan_list"], **call["kwargs"])
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    dev = torch.device("cuda")
    config = LlamaConfig(vocab_size=64, hidden_size=1024, intermediate_size=2816, num_hidden_layers=a.layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=a.seq_len,
                         attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config).to(dev)
    backend = hilbert_fx.backend(segment_lengths=[2048, 4096, 8192, 16384, 32768],
                                 dilation_rates=[1, 2, 4, 8, 16], hilbert=True)
    backend.keep_records = True
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def step():
        tokens = torch.randint(0, 64, (1, a.seq_len), device=dev)
        labels = tokens.clone()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=tokens, labels=labels).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"== step, {a.layers} layers, N={a.seq_len}: {1e3 * (time.perf_counter() - t0) / 3:.1f} ms", flush=True)

    # 3. the rewritten graphs and any N x N tensor left in them
    n = a.seq_len
    for i, rec in enumerate(backend.records):
        with open(os.path.join(a.out, f"graph_after_{i}.txt"), "w") as f:
            f.write(rec.graph_after)
        print(f"graph {i}: {len(rec.sites)} sites: " +
              "; ".join(f"{s.kind} {s.action} {s.reason} {s.config.describe() if s.config else ''}" for s in rec.sites))
    for line in backend.records[0].graph_after.splitlines() if backend.records else []:
        if f"{n}, {n}" in line or "new_ones" in line or "bitwise_and" in line:
            print("  N x N?", line.strip()[:200])

    # 4. profile one plain step
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=80), flush=True)

    # 1. what the lowering receives, timed at the call
    for name in ("forward", "backward"):
        fn = getattr(triton_lowering, name)
        w = _recording(name, fn)
        w.__wrapped_original__ = fn
        setattr(triton_lowering, name, w)
    step()
    torch.cuda.synchronize()
    for c in CALLS[:2] + CALLS[-2:]:
        print(f"{c['name']}: {c['ms']:.2f} ms causal={c['causal']} mask={c['mask']} plans={c['plans']}")
        for s in c["args"]:
            print("   ", s)
    print(f"calls: {len(CALLS)}, total {sum(c['ms'] for c in CALLS):.1f} ms "
          f"(fwd {sum(c['ms'] for c in CALLS if c['name'] == 'forward'):.1f}, "
          f"bwd {sum(c['ms'] for c in CALLS if c['name'] == 'backward'):.1f})", flush=True)

    # 2. replay alone: recorded strides, then contiguous
    for c in (CALLS[0], CALLS[-1]):
        print(f"replay {c['name']}: recorded strides {replay(c, False):.2f} ms, contiguous {replay(c, True):.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
