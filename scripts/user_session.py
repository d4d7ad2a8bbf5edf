"""A user's session on one GPU, end to end: a transformers Llama (bf16, head dim 64) trained under
torch.compile with the backend, gradient checkpointing and packed documents
(DataCollatorWithFlattening), evaluated packed and document by document, then generating with
`hilbert_fx.compile_for_generate` and the dynamic and the static cache, in one process.

    PYTHONPATH=. python scripts/user_session.py [--device cpu]

Prints the losses, `explain`'s rows and the kernels that ran, each document's largest logit
difference packed against alone (a bf16 step or two: the kernels differ), and for each cache
how many of 12 greedy tokens are the argmax of a full forward of the compiled model over the
sequence so far (and within 5% of the largest logit). Exits non-zero if a document differs by
more than 5% of its largest logit or a token is not within 5%. --device cpu runs a small
float32 version (the SDPA lowering), a check of the script itself.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import transformers

import hilbert_fx
from hilbert_fx.lowering import gluon_forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    dev = ap.parse_args().device
    small = dev == "cpu"
    t0 = time.time()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64 if small else 512,
                                   num_attention_heads=8, num_key_value_heads=4,
                                   intermediate_size=128 if small else 1024, vocab_size=1024,
                                   max_position_embeddings=8192, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(dev, torch.float32 if small else torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    be = hilbert_fx.backend(segment_lengths=(16, 32) if small else (256, 512),
                            dilation_rates=(1, 2), hilbert=True)
    compiled = torch.compile(model, backend=be)
    collate = transformers.DataCollatorWithFlattening()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    lens = (40, 23, 61, 30) if small else (700, 300, 1100, 948)
    losses = []
    for _ in range(4):
        docs = [{"input_ids": torch.randint(3, 1024, (n,), generator=g).tolist()} for n in lens]
        batch = {k: v.to(dev) for k, v in collate(docs).items()}
        out = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       labels=batch["labels"], use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(out.loss.item(), 4))
    print("losses", losses, f"({time.time() - t0:.0f} s)")
    print(hilbert_fx.explain(model, input_ids=batch["input_ids"],
                             position_ids=batch["position_ids"], use_cache=False, backend=be))
    print("kernels:", *gluon_forward.kernel_choices(), sep="\n  ")
    failures = []
    model.eval()
    with torch.no_grad():
        ids, pos = batch["input_ids"], batch["position_ids"]
        packed = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
        start = 0
        for n in lens:
            alone = compiled(input_ids=ids[:, start:start + n], use_cache=False).logits.float()
            diff, top = (packed[:, start:start + n] - alone).abs().max().item(), alone.abs().max().item()
            print(f"document of {n} tokens: packed against alone {diff:.3e} (logits up to {top:.2f})")
            if diff > 0.05 * top:
                failures.append(f"document of {n}")
            start += n
    hilbert_fx.compile_for_generate(model, backend=be, dynamic=True)
    p = 30 if small else 600
    prompt = torch.randint(3, 1024, (1, p), generator=g).to(dev)
    for cache in ("dynamic", "static"):
        kw = {} if cache == "dynamic" else dict(cache_implementation="static")
        with torch.no_grad():
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                 do_sample=False, eos_token_id=None, **kw)
            argmax = near = 0
            for t in range(12):
                logits = model(input_ids=gen[:, :p + t], use_cache=False).logits[0, -1].float()
                token = gen[0, p + t]
                argmax += int(logits.argmax() == token)
                near += int(logits.max() - logits[token] <= 0.05 * logits.abs().max())
        print(f"generate, {cache} cache: {argmax} of 12 tokens the argmax of the full forward, "
              f"{near} within 5% of its largest logit ({time.time() - t0:.0f} s)")
        if near < 12:
            failures.append(f"generate, {cache} cache")
    print("FAILED: " + ", ".join(failures) if failures else "all checks pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
