"""Where a training step of examples/train_long_gpt.py spends its GPU time, per kernel.

    PYTHONPATH=. python scripts/profile_train.py --layers 12 --seq-len 32768 --backend hilbert_dilated

The example's Llama (width 1024, 16 heads, its default branches, bf16 autocast), compiled with
--backend (hilbert_dilated, or inductor for dense attention), three warm-up steps, then one step
under torch.profiler: the table of CUDA kernels by total time. It splits the step into the
attention's kernels and the rest of the model, which bounds what a faster attention kernel can
give the step (BENCHMARKS.md). The optimizer step is not in the profiled step.
"""
import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "examples")
import train_long_gpt as t  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--backend", default="hilbert_dilated")
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    ns = argparse.Namespace(vocab=64, width=1024, heads=16, layers=a.layers, probe=[], seq_len=a.seq_len,
                            batch=1, shift=1, hilbert=0, segment_lengths=[2048, 4096, 8192, 16384, 32768],
                            dilation_rates=[1, 2, 4, 8, 16], backend=a.backend)
    model = t.build_model(ns, torch.device("cuda"))
    compiled = torch.compile(model, backend=t.make_backend(ns), dynamic=False)
    gen = torch.Generator().manual_seed(1)

    def step():
        tokens, labels = t.batch(ns, ns.seq_len, torch.device("cuda"), gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=tokens, labels=labels).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"== {a.backend}, {a.layers} layers, N={a.seq_len}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
