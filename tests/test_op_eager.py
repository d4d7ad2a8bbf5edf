"""The op's two ways in (lowering/op.py): an eager call on plain tensors runs a
torch.autograd.Function that calls the lowering directly; anything traced (torch.compile,
make_fx, fake tensors, modes, torch.func) calls the custom op torch.ops.hilbert_fx.dilated_attention.
Both give the same values and gradients (bitwise: the same lowering code runs), the eager path
never reaches the custom op's dispatcher, and it keeps what the custom op does in eager use:
autocast's casts, no backward work for an output that is not used, a refused double backward,
the dropout seed of the forward in the backward (under checkpointing too)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch.profiler import ProfilerActivity, profile

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hilbert_fx  # noqa: E402
from hilbert_fx.lowering import dropout  # noqa: E402
from hilbert_fx.lowering import op as op_module  # noqa: E402
from hilbert_fx.lowering import sdpa_lowering  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import (dropout_keep_of_positions, reference_dilated_attention,  # noqa: E402
                       reference_sequences)


def leaves(*shapes, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(s, dtype=dtype).requires_grad_() for s in shapes]


def cases():
    """(name, q, k, v, kwargs of dilated_attention): every kind of call the front takes."""
    n = 13
    q, k, v = leaves((2, 4, n, 8), (2, 4, n, 8), (2, 4, n, 8))
    k2, v2 = leaves((2, 2, n, 8), (2, 2, n, 8), seed=1)
    br = dict(segment_lengths=[4, 8], dilation_rates=[1, 2])
    torch.manual_seed(2)
    yield "plain", q, k, v, dict(br)
    yield "hilbert_causal", q, k, v, dict(segment_lengths=[5, 10], dilation_rates=[1, 5],
                                          hilbert=True, is_causal=True)
    yield "gqa_bool_mask", q, k2, v2, dict(br, enable_gqa=True,
                                           attn_mask=torch.rand(2, 1, n, n) > 0.3)
    yield "float_mask", q, k, v, dict(br, hilbert=True, attn_mask=torch.randn(n, n))
    yield "dropout", q, k, v, dict(br, hilbert=True, is_causal=True, dropout_p=0.25)
    yield "scale", q, k, v, dict(br, is_causal=True, scale=0.7)
    (v_wide,) = leaves((2, 4, n, 12), seed=3)
    yield "dv_wide", q, k, v_wide, dict(br, hilbert=True, is_causal=True)
    packed = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, -1, -1])
    yield "position_ids", q, k, v, dict(br, hilbert=True, is_causal=True, position_ids=packed)
    yield "cu_seqlens", q, k, v, dict(br, is_causal=True, cu_seqlens=torch.tensor([0, 5, 13, 20]))
    (q1,) = leaves((2, 4, 1, 8), seed=4)
    yield "decode", q1, k2, v2, dict(br, is_causal=True, enable_gqa=True,
                                     seqused_k=torch.tensor([13, 9]))
    qs, ks, vs = leaves((2, 4, 40, 8), (2, 2, 50, 8), (2, 2, 50, 8), seed=5)
    yield "chunk", qs, ks, vs, dict(segment_lengths=[16], dilation_rates=[2], is_causal=True,
                                    enable_gqa=True, seqused_k=torch.tensor([50, 44]))
    (e,) = leaves((1, 4, 0, 8), seed=6)
    yield "empty", e, e, e, dict(br, is_causal=True)
    qt, kt, vt = leaves((1, 2, 9, 8), (1, 2, 9, 8), (1, 2, 9, 8), seed=7)
    yield "triton", qt, kt, vt, dict(br, hilbert=True, is_causal=True, lowering="triton")
    yield "triton_dropout", qt, kt, vt, dict(br, dropout_p=0.3, lowering="triton")


CASES = {c[0]: c[1:] for c in cases()}


def eager_or_custom_op(path):
    """A fresh context: the eager path (as a plain call) or the custom op's."""
    return op_module.custom_op_path() if path == "custom_op" else torch.enable_grad()


def run(q, k, v, kw, seed=0):
    """(out, dq, dk, dv, the hilbert_fx ops the dispatcher saw) of one forward and backward."""
    torch.manual_seed(seed)  # the dropout seed is drawn from torch's generator
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = hilbert_fx.dilated_attention(q, k, v, **kw)
        grad = torch.ones_like(out) if out.numel() == 0 else torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad, allow_unused=True)
    ops = {e.name for e in prof.events() if e.name.startswith("hilbert_fx::")}
    return out, grads, ops


@pytest.mark.parametrize("name", list(CASES))
def test_eager_path_equals_the_custom_op_and_skips_its_dispatcher(name):
    q, k, v, kw = CASES[name]
    out, grads, ops = run(q, k, v, kw)
    with op_module.custom_op_path():
        want, want_grads, op_ops = run(q, k, v, kw)
    assert ops == set(), ops  # the eager path: no custom op dispatched, forward or backward
    assert any(o.startswith("hilbert_fx::dilated_attention") for o in op_ops), op_ops
    assert any(o.endswith("_backward") for o in op_ops), op_ops
    assert out.dtype == want.dtype and out.shape == want.shape
    assert torch.equal(out, want)
    for got, exp in zip(grads, want_grads):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("name", ["hilbert_causal", "gqa_bool_mask", "float_mask", "dv_wide"])
def test_eager_path_matches_the_reference(name):
    q, k, v, kw = CASES[name]
    out, grads, _ = run(q, k, v, kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_kw = {key: val for key, val in kw.items()
              if key not in ("segment_lengths", "dilation_rates", "lowering")}
    ref = reference_dilated_attention(q64, k64, v64, kw["segment_lengths"], kw["dilation_rates"],
                                      **ref_kw)
    torch.manual_seed(0)
    grad = torch.randn_like(out)  # what run() drew
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["position_ids", "decode", "chunk"])
def test_eager_sequences_match_the_reference(name):
    q, k, v, kw = CASES[name]
    out, grads, _ = run(q, k, v, kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_sequences(q64, k64, v64, kw["segment_lengths"], kw["dilation_rates"],
                              position_ids=kw.get("position_ids"), seqused_k=kw.get("seqused_k"),
                              hilbert=kw.get("hilbert", False), is_causal=kw["is_causal"],
                              enable_gqa=kw.get("enable_gqa", False))
    torch.manual_seed(0)
    grad = torch.randn_like(out)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- traced calls


def _recording_aot_eager(graphs):
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)
    return backend


@pytest.mark.parametrize("name", ["hilbert_causal", "gqa_bool_mask", "dropout", "position_ids",
                                  "cu_seqlens", "decode"])
def test_eager_and_compiled_agree(name):
    """torch.compile (aot_eager: AOTAutograd traces the op and its registered backward) shows
    the custom op in its graph and runs it; the eager path computes the same."""
    q, k, v, kw = CASES[name]
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: hilbert_fx.dilated_attention(q, k, v, **kw),
                             backend=_recording_aot_eager(graphs))
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = compiled(q, k, v)
        got_grads = torch.autograd.grad(got, (q, k, v), torch.ones_like(got))
    assert any("torch.ops.hilbert_fx.dilated_attention" in g for g in graphs), graphs
    names = {e.name for e in prof.events()}
    assert any(n.startswith("hilbert_fx::dilated_attention") for n in names)
    torch.manual_seed(0)
    want = hilbert_fx.dilated_attention(q, k, v, **kw)
    want_grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _ops_seen(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("hilbert_fx::")}


class _Attention(torch.nn.Module):
    def __init__(self, kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v):
        return hilbert_fx.dilated_attention(q, k, v, **self.kw)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("name", list(CASES))
def test_out_and_gradients_have_the_layouts_the_fakes_give(name, path, layout):
    """out is [B, N, H, Dv] in memory, as FlashAttention's (a model's output projection reads
    it as [B, N, H * Dv] without a copy), and each gradient is laid out as its input
    (torch.empty_like), as the fake implementations tell a compiler, whose compiled code
    checks the strides; inputs contiguous, or [B, N, H, D] transposed as a model's
    projections hand them over."""
    q, k, v, kw = CASES[name]
    if layout == "transposed":
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                   for t in (q, k, v))
    with eager_or_custom_op(path):
        out, grads, _ = run(q, k, v, kw)
    assert out.transpose(1, 2).is_contiguous(), out.stride()
    for grad, x in zip(grads, (q, k, v)):
        assert grad.stride() == x.stride(), (grad.stride(), x.stride())
    from torch._subclasses.fake_tensor import FakeTensorMode
    if "seqused_k" in kw:  # the front reads a cache's lengths: no fake tensors there
        return
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = hilbert_fx.dilated_attention(fq, fk, fv, **kw)
    assert fake.stride() == out.stride()


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_export_shows_the_custom_op(strict):
    q, k, v, kw = CASES["hilbert_causal"]
    inputs = tuple(t.detach() for t in (q, k, v))
    ep = torch.export.export(_Attention(kw), inputs, strict=strict)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "hilbert_fx.dilated_attention.default" in targets, targets
    assert torch.equal(ep.module()(*inputs), _Attention(kw)(*inputs))


def test_make_fx_and_fake_tensors_see_the_custom_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    q, k, v, kw = CASES["hilbert_causal"]
    gm = make_fx(lambda q, k, v: hilbert_fx.dilated_attention(q, k, v, **kw))(q, k, v)
    assert "hilbert_fx.dilated_attention" in gm.code
    gm = make_fx(lambda q, k, v: torch.autograd.grad(
        hilbert_fx.dilated_attention(q, k, v, **kw).sum(), (q, k, v)))(q, k, v)
    assert "hilbert_fx.dilated_attention_backward" in gm.code  # the registered autograd
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out = hilbert_fx.dilated_attention(fq, fk, fv, **kw)
    assert out.shape == q.shape


def test_modes_and_transforms_take_the_custom_op():
    """A torch function mode (here torch.device's) or a torch.func transform must see the op
    as the custom op; the values are those of the eager path."""
    q, k, v, kw = CASES["plain"]
    want = hilbert_fx.dilated_attention(q, k, v, **kw)
    with torch.device("cpu"):
        assert "hilbert_fx::dilated_attention" in _ops_seen(
            lambda: hilbert_fx.dilated_attention(q, k, v, **kw))
        assert torch.equal(hilbert_fx.dilated_attention(q, k, v, **kw), want)
    batched = torch.vmap(lambda q: hilbert_fx.dilated_attention(q, k, v, **kw))(
        torch.stack([q, q]))
    assert torch.equal(batched[1], want)


def test_no_grad_and_inference_mode():
    q, k, v, kw = CASES["hilbert_causal"]
    want = hilbert_fx.dilated_attention(q, k, v, **kw)
    with torch.no_grad():
        a = hilbert_fx.dilated_attention(q, k, v, **kw)
    with torch.inference_mode():
        b = hilbert_fx.dilated_attention(q, k, v, **kw)
    assert a.grad_fn is None and not a.requires_grad and torch.equal(a, want)
    assert b.is_inference() and torch.equal(b, want)


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("mask", [False, True])
def test_autocast_on_the_eager_path_is_the_custom_op_s(mask):
    """Mixed float32 / bfloat16 inputs (Llama's RoPE under autocast): cast as SDPA does, the
    kernels in bfloat16, gradients in each input's own dtype; the same on both paths."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 2, 21, 8, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, 21, 8, dtype=torch.bfloat16, requires_grad=True)
    kw = dict(segment_lengths=[8, 16], dilation_rates=[1, 2], hilbert=True)
    kw.update(attn_mask=torch.randn(21, 21)) if mask else kw.update(is_causal=True)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = hilbert_fx.dilated_attention(q, k, v, **kw)
        return out, torch.autograd.grad(out.float().sum(), (q, k, v))

    (out, grads), ops = _run_and_ops(call)
    with op_module.custom_op_path():
        (want, want_grads), op_ops = _run_and_ops(call)
    assert ops == set() and "hilbert_fx::dilated_attention" in op_ops
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    for a, b in zip(grads, want_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _run_and_ops(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, {e.name for e in prof.events() if e.name.startswith("hilbert_fx::")}


# ----------------------------------------------------------------------------- autograd


class _NoGradient(torch.autograd.Function):
    """Passes x on; its backward hands no gradient (None) to x."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_an_output_that_takes_no_gradient_costs_no_backward(path, monkeypatch):
    """set_materialize_grads(False): no zero gradient is made, and no backward is run."""
    calls = []
    real = sdpa_lowering.backward
    monkeypatch.setattr(sdpa_lowering, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, kw = CASES["plain"]
    with eager_or_custom_op(path):
        out = hilbert_fx.dilated_attention(q, k, v, **kw)
    loss = _NoGradient.apply(out).sum() + q.sum()
    dq, dk = torch.autograd.grad(loss, (q, k), allow_unused=True)
    assert torch.equal(dq, torch.ones_like(q)) and dk is None and calls == []


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_double_backward_is_refused(path):
    q, k, v, kw = CASES["hilbert_causal"]
    with eager_or_custom_op(path):
        out = hilbert_fx.dilated_attention(q, k, v, **kw)
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dq.sum(), q)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointing_keeps_the_forward_s_dropout(use_reentrant):
    """The recomputed forward draws the same seed (checkpoint restores the generator), and the
    backward reads the seed the forward used."""
    q, k, v, kw = CASES["dropout"]

    def grads(checkpointed):
        torch.manual_seed(3)
        f = lambda q, k, v: hilbert_fx.dilated_attention(q, k, v, **kw)  # noqa: E731
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = checkpoint.checkpoint(f, *leaves, use_reentrant=use_reentrant) if checkpointed \
            else f(*leaves)
        out.sum().backward()  # (the reentrant checkpoint does not take autograd.grad)
        return out, [t.grad for t in leaves]

    (out, g), (want, want_g) = grads(True), grads(False)
    assert torch.equal(out, want)
    for a, b in zip(g, want_g):
        assert torch.equal(a, b)
    # and both are dropout with the seed drawn after manual_seed(3): the float64 reference's
    torch.manual_seed(3)
    seed = dropout.new_seed(torch.device("cpu"))
    (b, h, n, _), p = q.shape, kw["dropout_p"]
    keep = dropout_keep_of_positions(seed, b, h, range(n), p)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_kw = {name: value for name, value in kw.items() if name != "dropout_p"}
    ref = reference_dilated_attention(q64, k64, v64, dropout_p=p, dropout_keep=keep, **ref_kw)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, torch.autograd.grad(ref.sum(), (q64, k64, v64))):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)


def test_errors_are_the_front_s_on_both_paths():
    q, k, v, kw = CASES["plain"]
    for path in ("eager", "custom_op"):
        with eager_or_custom_op(path), pytest.raises(ValueError, match="equal lengths"):
            hilbert_fx.dilated_attention(q, k, v, [4, 8], [1])
        with eager_or_custom_op(path), pytest.raises(ValueError, match="same dtype"):
            hilbert_fx.dilated_attention(q, k, v.bfloat16(), **kw)
