"""DistributedDataParallel with the backend on several GPUs: Dynamo's DDP optimizer cuts the
compiled graph at DDP's gradient buckets; with buckets smaller than one projection's weight it
cuts between q's and k, v's projections, and the pass must still rewrite every self-attention
(hilbert_fx/ddp_pieces.py) and compute what the model compiled without DDP computes.

    torchrun --nproc_per_node 2 scripts/ddp_check.py --bucket-mb 5 --dtype float32
    torchrun --nproc_per_node 2 scripts/ddp_check.py --bucket-mb 5 --time
    torchrun --nproc_per_node 2 scripts/ddp_check.py --bucket-mb 5 --dtype float32 --attention-mask
    torchrun --nproc_per_node 2 scripts/ddp_check.py --bucket-mb 5 --dtype float32 --padding

A transformers Llama (4 layers, width 2048, 16 heads, N = 8192, random weights, the same ids on
every rank; --attention-mask: with a 2-D attention mask of ones, as tokenizers give, which a
piece receives as the 4-D mask built in another piece; --padding: two rows, one padded on the
left and one on the right by N / 8 tokens, the loss over real tokens, whose sequences a piece
reads from the rows of that 4-D mask), one forward and backward under DDP against the same
model compiled without it:
the sites rewritten (each rank), the loss and the largest relative gradient difference, beside
the same comparison for dense attention (backend="inductor"), which says how far two
compilations of one step differ in that dtype. --time: median step time (AdamW) of the dilated
and the dense model under DDP. Exits non-zero when a site is not rewritten, or, in float32, when
the loss or a gradient differs by more than 1e-5 / 1e-4 relative.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import hilbert_fx  # noqa: E402


def largest_grad_difference(model, reference) -> float:
    return max(((p.grad.float() - q.grad.float()).norm()
                / q.grad.float().norm().clamp_min(1e-30)).item()
               for p, q in zip(model.parameters(), reference.parameters()))


def loss_of(step_model, ids, mask=None):
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    loss = step_model(input_ids=ids, labels=labels, attention_mask=mask).loss
    loss.backward()
    return loss.item()


def step_time(step_model, model, ids, steps=8) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def main() -> int:
    import transformers
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--attention-mask", action="store_true")
    ap.add_argument("--padding", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    n, dtype = args.seq_len, getattr(torch, args.dtype)
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=4096, max_position_embeddings=n,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", dtype)
    plain, dense_ddp, dense_plain = (copy.deepcopy(model) for _ in range(3))
    ids = torch.randint(0, 4096, (2 if args.padding else 1, n), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    mask = torch.ones_like(ids) if args.attention_mask or args.padding else None
    if args.padding:
        mask[0, :n // 8] = 0
        mask[1, n - n // 8:] = 0

    def backend():
        return hilbert_fx.backend(segment_lengths=(2048, 4096, 8192), dilation_rates=(1, 2, 4),
                                  hilbert=False)

    be = backend()
    be.keep_records = True
    dilated = torch.compile(DDP(model, bucket_cap_mb=args.bucket_mb), backend=be)
    loss = loss_of(dilated, ids, mask)
    sites = [s for record in be.records for s in record.sites]
    rewritten = sum(s.action == "rewritten" for s in sites)
    print(f"rank {rank}: {len(be.records)} graphs, {rewritten} of {len(sites)} sites rewritten"
          + "".join(f"; {s.module}: {s.reason}" for s in sites if s.action != "rewritten"))
    plain_loss = loss_of(torch.compile(plain, backend=backend()), ids, mask)
    worst = largest_grad_difference(model, plain)
    dense = torch.compile(DDP(dense_ddp, bucket_cap_mb=args.bucket_mb), backend="inductor")
    dense_loss = loss_of(dense, ids, mask)
    dense_plain_loss = loss_of(torch.compile(dense_plain, backend="inductor"), ids, mask)
    dense_worst = largest_grad_difference(dense_ddp, dense_plain)
    print(f"rank {rank}, {args.dtype}, buckets {args.bucket_mb} MB: dilated loss under DDP "
          f"{loss:.6f}, without {plain_loss:.6f}, largest relative gradient difference "
          f"{worst:.3e}; dense {dense_loss:.6f}, {dense_plain_loss:.6f}, {dense_worst:.3e}")
    failed = rewritten != len(sites) or not sites
    if dtype == torch.float32:
        failed |= abs(loss - plain_loss) > 1e-5 * abs(plain_loss) or worst > 1e-4
    if args.time:
        print(f"rank {rank}: step at N = {n} under DDP: dilated "
              f"{step_time(dilated, model, ids):.1f} ms, dense "
              f"{step_time(dense, dense_ddp, ids):.1f} ms")
    dist.destroy_process_group()
    print(f"rank {rank}: {'FAILED' if failed else 'passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
