"""Where the backend starts to pay: python -m hilbert_fx.host_bench [options]

Per sequence length N, for the op (the lowering the device gets: Triton on a GPU, SDPA on the
CPU) and for dense SDPA (is_causal), forward and forward+backward:
  CPU us   the host's time to issue one call (no synchronisation)
  time us  the elapsed time per call over calls back to back (CUDA events on a GPU; on the CPU
           the same wall clock, since the CPU does the work). Where it equals the CPU time, the
           device waited for the host.
Then a transformers Llama training step under torch.compile (--layers, --width), the dilated
backend against dense (inductor, SDPA is_causal), and the ratio dense / dilated. Runs on the
CPU (small defaults) as on a GPU.

--op-layer: instead, the host time of the op's own layer (its front, checks, autograd and
dispatch) with the lowering's forward and backward replaced by stand-ins that return tensors
made once: per N, the median of --layer-calls calls each timed alone, forward (no grad) and
forward+backward (torch.autograd.grad, so that no .grad is accumulated), on the eager path
(what an eager call runs) and on the custom op's path (torch.ops.hilbert_fx.dilated_attention
with its registered autograd: what a traced graph runs), beside an autograd.Function that only
returns the stand-ins (what autograd's engine costs any op on this host), taken in turn 3 times.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from .lowering import dilated_attention


def _timed(fn, calls: int, device: torch.device) -> tuple[float, float]:
    """(CPU us per call, elapsed us per call): medians of 3 runs of `calls` calls."""
    fn()
    cpu, elapsed = [], []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter() - t0
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            elapsed.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            elapsed.append(issued * 1e6 / calls)
        cpu.append(issued * 1e6 / calls)
    return statistics.median(cpu), statistics.median(elapsed)


def op_rows(args, device) -> list[str]:
    dtype = getattr(torch, args.dtype)
    lines = ["| N | op forward: CPU / time us | op fwd+bwd: CPU / time us | "
             "SDPA forward: CPU / time us | SDPA fwd+bwd: CPU / time us |", "|---|---|---|---|---|"]
    for n in args.seq_lens:
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def op():
            return dilated_attention(q, k, v, args.segment_lengths, args.dilation_rates,
                                     hilbert=True, is_causal=True)

        def dense():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        cells = []
        for fn in (op, dense):
            with torch.no_grad():
                fwd = _timed(fn, args.calls, device)
            both = _timed(lambda fn=fn: fn().backward(grad), args.calls, device)
            cells += [f"{fwd[0]:.0f} / {fwd[1]:.0f}", f"{both[0]:.0f} / {both[1]:.0f}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _per_call_us(fn, calls: int, device: torch.device) -> float:
    """Median CPU time of one call (us), each call timed alone."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _floor_function(out, grads):
    """An autograd.Function that only returns the stand-ins: what autograd alone costs a call
    on this host (the floor of the eager path)."""
    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return out

        @staticmethod
        def backward(ctx, dout):
            return grads
    return Floor


def op_layer_rows(args, device) -> list[str]:
    from .lowering import op as op_module
    from .lowering.arguments import resolve_lowering
    dtype = getattr(torch, args.dtype)
    lower = op_module._lowering_module(resolve_lowering("auto", device))
    real = lower.forward, lower.backward
    lines = ["| N | path | forward us | fwd+bwd us |", "|---|---|---|---|"]
    try:
        for n in args.seq_lens:
            shape = (1, args.heads, n, args.head_dim)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            grad, out, dq, dk, dv = (torch.randn(shape, device=device, dtype=dtype)
                                     for _ in range(5))
            lse = torch.randn(shape[:3], device=device)
            lower.forward = lambda *a, **kw: (out, lse)
            lower.backward = lambda *a, **kw: (dq, dk, dv)

            def call():
                return dilated_attention(q, k, v, args.segment_lengths, args.dilation_rates,
                                         hilbert=True, is_causal=True)

            floor = _floor_function(torch.empty_like(out), (dq, dk, dv))
            paths = {"eager": (call, contextlib.nullcontext),
                     "custom op": (call, op_module.custom_op_path),
                     "autograd.Function floor": (lambda: floor.apply(q, k, v),
                                                 contextlib.nullcontext)}
            times = {(path, kind): [] for path in paths for kind in ("forward", "both")}
            for _ in range(3):
                for path, (fn, context) in paths.items():
                    def forward(fn=fn):
                        with torch.no_grad():
                            fn()

                    def both(fn=fn):
                        torch.autograd.grad(fn(), (q, k, v), grad)

                    with context():
                        for kind, timed in (("forward", forward), ("both", both)):
                            for _ in range(10):  # warm: checks made, plans built
                                timed()
                            times[path, kind].append(_per_call_us(timed, args.layer_calls,
                                                                  device))
            for path in paths:
                lines.append(f"| {n} | {path} | {statistics.median(times[path, 'forward']):.1f} "
                             f"| {statistics.median(times[path, 'both']):.1f} |")
    finally:
        lower.forward, lower.backward = real
    return lines


def causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The dense baseline: SDPA with is_causal=True (FlashAttention on a GPU), no N x N mask."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout,
                                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def llama(*, vocab: int, width: int, layers: int, heads: int, seq_len: int, dense: bool,
          device, dtype: torch.dtype):
    """A transformers Llama with random weights (no download); dense: attention through
    `causal_sdpa` (the baseline), else transformers' own SDPA path, which the backend rewrites."""
    import transformers
    impl = "sdpa"
    if dense:
        transformers.AttentionInterface.register("causal_sdpa", causal_sdpa)
        transformers.AttentionMaskInterface.register("causal_sdpa", lambda *a, **k: None)
        impl = "causal_sdpa"
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=seq_len, attn_implementation=impl, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device, dtype)


def model_rows(args, device) -> list[str]:
    from . import backend as dilated_backend
    lines = ["| N | dense step ms | dilated step ms | dense / dilated |", "|---|---|---|---|"]
    for n in args.model_seq_lens:
        times = {}
        for name in ("dense", "dilated"):
            model = llama(vocab=args.vocab, width=args.width, layers=args.layers,
                          heads=args.heads, seq_len=n, dense=name == "dense", device=device,
                          dtype=getattr(torch, args.dtype))
            be = "inductor" if name == "dense" else dilated_backend(
                segment_lengths=args.segment_lengths, dilation_rates=args.dilation_rates,
                hilbert=True)
            step_model = torch.compile(model, backend=be)
            ids = torch.randint(0, args.vocab, (1, n), device=device)

            def step():
                model.zero_grad(set_to_none=True)
                step_model(input_ids=ids, labels=ids).loss.backward()
            for _ in range(2):  # compiles, then warms the allocator
                step()
            times[name] = _timed(step, args.steps, device)[1] / 1e3
            del model, step_model
        lines.append(f"| {n} | {times['dense']:.1f} | {times['dilated']:.1f} | "
                     f"{times['dense'] / times['dilated']:.2f}x |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hilbert_fx.host_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-lens", type=int, nargs="+", help="N of the op rows")
    p.add_argument("--model-seq-lens", type=int, nargs="*", help="N of the Llama step rows")
    p.add_argument("--heads", type=int, default=None, help="16 on a GPU, 4 on the CPU")
    p.add_argument("--head-dim", type=int, default=None, help="128 on a GPU, 64 on the CPU")
    p.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--segment-lengths", type=int, nargs="+", default=None)
    p.add_argument("--dilation-rates", type=int, nargs="+", default=None)
    p.add_argument("--calls", type=int, default=None, help="calls per timing")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None, help="32000 on a GPU, 1000 on the CPU")
    p.add_argument("--steps", type=int, default=None, help="training steps per timing")
    p.add_argument("--op-layer", action="store_true",
                   help="the op's own layer, the lowering replaced by stand-ins (see above)")
    p.add_argument("--layer-calls", type=int, default=500,
                   help="calls per timing of --op-layer")
    args = p.parse_args(argv)
    gpu = args.device != "cpu"
    defaults = dict(seq_lens=[4096, 8192, 16384] if gpu else [256, 1024, 4096],
                    model_seq_lens=[4096, 8192, 16384, 32768] if gpu else [512, 2048],
                    dtype="bfloat16" if gpu else "float32",
                    segment_lengths=[2048, 4096, 8192, 16384] if gpu else [256, 512],
                    dilation_rates=[1, 2, 4, 8] if gpu else [1, 2],
                    calls=30 if gpu else 5, layers=12 if gpu else 2, width=1024 if gpu else 256,
                    steps=5 if gpu else 2, heads=16 if gpu else 4, vocab=32000 if gpu else 1000, head_dim=128 if gpu else 64)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, B = 1, H = {args.heads}, "
          f"D = {args.head_dim}, causal, branches {list(zip(args.segment_lengths, args.dilation_rates))}")
    if args.op_layer:
        print("the op's layer alone (the lowering's forward and backward stand-ins), "
              f"median of {args.layer_calls} calls")
        for line in op_layer_rows(args, device):
            print(line, flush=True)
        return
    for line in op_rows(args, device):
        print(line, flush=True)
    if args.model_seq_lens:
        print(f"\nLlama training step: {args.layers} layers, width {args.width}, {args.dtype}")
        for line in model_rows(args, device):
            print(line, flush=True)


if __name__ == "__main__":
    main()
