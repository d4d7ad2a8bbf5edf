"""What a user meets around the pass: torch.compile's modes and options, graphs the pass must
not touch (vmap, FlexAttention), `explain` beside compiled models, `dilate` and torch.save,
module names, configuration messages, optional dependencies."""
from __future__ import annotations

import builtins
import copy
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hilbert_fx
from models import SelfAttention, TinyTransformer
from reference import reference_dilated_attention

W, R = (8, 16), (1, 2)


def attention(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


@pytest.mark.parametrize("kwargs", [dict(mode="reduce-overhead"), dict(mode="max-autotune"),
                                    dict(mode="max-autotune-no-cudagraphs"),
                                    dict(options={"max_autotune": False, "trace.enabled": False})],
                         ids=["reduce-overhead", "max-autotune", "no-cudagraphs", "options"])
@pytest.mark.parametrize("registered", [False, True], ids=["configured", "registered"])
def test_compile_modes_and_options_go_on_to_inductor(kwargs, registered):
    torch._dynamo.reset()
    q = torch.randn(1, 2, 23, 8)
    if registered:  # the default branches (2048, 1), (4096, 2), ...
        be, w, r = "hilbert_dilated", (2048, 4096, 8192, 16384), (1, 2, 4, 8)
    else:
        be, w, r = hilbert_fx.backend(W, R, lowering="sdpa"), W, R
    out = torch.compile(attention, backend=be, **kwargs)(q)
    expected = reference_dilated_attention(q, q, q, w, r, hilbert=True, is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_options_reach_inductor():
    """An option Inductor does not know fails as it does with backend="inductor"."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no_such_option"):
        torch.compile(attention, backend=hilbert_fx.backend(W, R),
                      options={"no_such_option": 1})(torch.randn(1, 2, 9, 8))


def test_a_graph_without_attention_reaches_inductor_unchanged():
    """vmap's nesting calls have no users; dead-code elimination would drop them."""
    def f(x):
        return x.sin() * 2

    be = hilbert_fx.backend((32,), (1,))
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    out = torch.compile(lambda x: torch.vmap(f)(x) + 1, backend=be)(x)
    torch.testing.assert_close(out, f(x) + 1)
    report = hilbert_fx.explain(lambda x: torch.vmap(f)(x) + 1, x, backend=be)
    assert report.graph_before == report.graph_after
    assert "_vmap_increment_nesting" in report.graph_after[0]


def test_vmap_beside_a_rewritten_site_is_kept():
    def f(q):
        return attention(q) + torch.vmap(torch.sin)(q)

    q = torch.randn(1, 2, 23, 8)
    torch._dynamo.reset()
    out = torch.compile(f, backend=hilbert_fx.backend(W, R, lowering="sdpa"))(q)
    expected = reference_dilated_attention(q, q, q, W, R, hilbert=True, is_causal=True) + q.sin()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_flex_attention_is_rewritten():
    """transformers' flex_attention path: its causal mask_mod is read, the sites are rewritten,
    and under the identity configuration (one branch of every row) the model equals eager."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=96,
                                      attn_implementation="flex_attention")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 96, (2, 12))
    be = hilbert_fx.backend((64,), (1,))
    with torch.no_grad():
        report = hilbert_fx.explain(model, input_ids=ids, backend=be)
        torch._dynamo.reset()
        out = torch.compile(model, backend=be)(input_ids=ids).logits
        torch.testing.assert_close(out, model(input_ids=ids).logits)
    assert [(s.kind, s.module, s.action) for s in report.sites] == [
        ("flex", "model.layers.0.self_attn", "rewritten"),
        ("flex", "model.layers.1.self_attn", "rewritten")], str(report)


def counting_backend():
    """A backend that runs graphs as they are, and the list of the graphs it was given."""
    compilations = []

    def counting(gm, example_inputs):
        compilations.append(gm)
        return gm.forward

    return counting, compilations


def test_explain_leaves_compiled_models_alone():
    counting, compilations = counting_backend()
    model = TinyTransformer()
    tokens = torch.randint(0, 50, (1, 20))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)
    compiled(tokens)
    for _ in range(10):  # more than Dynamo's recompile limit of one code object
        report = hilbert_fx.explain(model, tokens, backend=hilbert_fx.backend(W, R))
        assert [s.action for s in report.sites] == ["rewritten", "rewritten"]
    compiled(tokens)
    assert len(compilations) == 1


@pytest.mark.parametrize("where", ["model", "each layer"])
def test_explain_sees_modules_compiled_in_place(where):
    """A model compiled in place (`model.compile()`, or each layer: regional compilation) calls
    its own compiled function: explain still reports every site (their graphs had gone to the
    model's own backend, and explain reported none), and afterwards the model calls its own
    compilation again (its backend sees no new graph for the same input)."""
    counting, compilations = counting_backend()
    model = TinyTransformer()
    tokens = torch.randint(0, 50, (1, 20))
    torch._dynamo.reset()
    for module in [model] if where == "model" else model.layers:
        module.compile(backend=counting)
    model(tokens)
    seen = len(compilations)
    report = hilbert_fx.explain(model, tokens, backend=hilbert_fx.backend(W, R))
    assert [s.action for s in report.sites] == ["rewritten", "rewritten"], str(report)
    assert len(compilations) == seen
    model(tokens)
    assert len(compilations) == seen and all(
        m._compiled_call_impl is not None for m in ([model] if where == "model" else model.layers))


def test_dilated_instance_survives_torch_save_and_can_be_undone():
    model = TinyTransformer()
    hilbert_fx.dilate(model.layers[0].attn, segment_lengths=(4,), dilation_rates=(2,))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    config = hilbert_fx.DilatedConfig((4,), (2,))
    assert type(loaded.layers[0].attn).__mro__[1] is SelfAttention
    assert type(loaded.layers[0].attn)._hilbert_fx_config == config
    tokens = torch.randint(0, 50, (1, 21))
    torch.testing.assert_close(loaded(tokens), model(tokens))
    report = hilbert_fx.explain(loaded, tokens, backend=hilbert_fx.backend(W, R))
    assert [(s.module, s.action) for s in report.sites] == [
        ("layers.0.attn", "rewritten"), ("layers.1.attn", "skipped")]

    assert hilbert_fx.undilate(loaded.layers[0].attn) is loaded.layers[0].attn
    assert type(loaded.layers[0].attn) is SelfAttention
    report = hilbert_fx.explain(loaded, tokens, backend=hilbert_fx.backend(W, R))
    assert [s.action for s in report.sites] == ["rewritten", "rewritten"]


def test_undilate_a_class():
    class Marked(SelfAttention):
        pass

    hilbert_fx.dilate(Marked, segment_lengths=(4,), dilation_rates=(2,))
    assert hasattr(Marked, "_hilbert_fx_config")
    hilbert_fx.undilate(Marked)
    assert not hasattr(Marked, "_hilbert_fx_config")
    with pytest.raises(ValueError, match="undilate"):
        hilbert_fx.undilate(3)


def test_transformers_module_names_start_at_the_compiled_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=96,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        report = hilbert_fx.explain(model, input_ids=torch.randint(1, 96, (1, 12)),
                                    backend=hilbert_fx.backend((8,), (1,)))
    assert [s.module for s in report.sites] == ["model.layers.0.self_attn",
                                                "model.layers.1.self_attn"], str(report)


def test_backend_says_which_default_it_used():
    with pytest.raises(ValueError, match=r"dilation_rates was not given.*\(1, 2, 4, 8\)"):
        hilbert_fx.backend(segment_lengths=(64, 128))
    with pytest.raises(ValueError, match=r"segment_lengths was not given"):
        hilbert_fx.backend(dilation_rates=(1, 2))
    assert hilbert_fx.backend(segment_lengths=(64, 128, 256, 512)).config.dilation_rates == (1, 2, 4, 8)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m.startswith("matplotlib")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"hilbert-fx\[bench\]"):
        hilbert_fx.plot_pattern((8,), (1,), seq_len=16, path=os.devnull)


def test_torch_logs_name_transformers_modules_from_the_model():
    pytest.importorskip("transformers")
    code = (
        "import torch, transformers, hilbert_fx\n"
        "c = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,"
        " intermediate_size=64, vocab_size=96, attn_implementation='sdpa')\n"
        "m = transformers.LlamaForCausalLM(c)\n"
        "with torch.no_grad():\n"
        "    torch.compile(m, backend=hilbert_fx.backend((8,), (1,)))(input_ids=torch.ones(1, 9, dtype=torch.long))\n")
    env = dict(os.environ, TORCH_LOGS="hilbert_fx")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sdpa attention in model.layers.0.self_attn: rewritten" in res.stderr, res.stderr[-3000:]


class LatentValueAttention(torch.nn.Module):
    """Values with their own head dim (Dv != D), as in latent attention."""
    def __init__(self, width=32, heads=4, d=8, dv=12):
        super().__init__()
        self.heads, self.d, self.dv = heads, d, dv
        self.qk = torch.nn.Linear(width, 2 * heads * d)
        self.v = torch.nn.Linear(width, heads * dv)

    def forward(self, x):
        b, n, _ = x.shape
        q, k = self.qk(x).view(b, n, 2, self.heads, self.d).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, n, self.heads, self.dv).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def test_values_with_their_own_head_dim_are_rewritten_and_exact():
    torch.manual_seed(0)
    model = LatentValueAttention()
    x = torch.randn(2, 29, 32, requires_grad=True)
    torch._dynamo.reset()
    be = hilbert_fx.backend(W, R, lowering="sdpa")
    report = hilbert_fx.explain(model, x, backend=be)
    assert [s.action for s in report.sites] == ["rewritten"], str(report)
    out = torch.compile(model, backend=be)(x)
    b, n, _ = x.shape
    q, k = model.qk(x).view(b, n, 2, 4, 8).permute(2, 0, 3, 1, 4)
    v = model.v(x).view(b, n, 4, 12).transpose(1, 2)
    expected = reference_dilated_attention(q.double(), k.double(), v.double(), W, R, hilbert=True,
                                           is_causal=True).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, grad)
    (dx_ref,) = torch.autograd.grad(expected, x, grad.double())
    torch.testing.assert_close(dx.double(), dx_ref.double(), atol=5e-5, rtol=1e-3)


def ddp_run(model, inputs, tmp_path, monkeypatch, be, cap=2 ** -10, **config):
    """Forward and backward of `model` under DistributedDataParallel (one process, gloo), with
    buckets of `cap` MB: by default 1 KB, so that Dynamo's DDP optimizer cuts the graph after
    every weight (between q's and k, v's projections among others); (outputs, gradients)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", int(cap * 2 ** 20))
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(**config):
            out = torch.compile(ddp, backend=be)(*inputs)
            out.square().sum().backward()
    finally:
        dist.destroy_process_group()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("optimize_ddp", [True, False], ids=["cut", "whole"])
def test_ddp_pieces_are_read_against_the_whole_graph(tmp_path, monkeypatch, optimize_ddp):
    """Under DistributedDataParallel, Dynamo's DDP optimizer cuts the model's graph at its
    gradient buckets and hands the backend each piece alone; where q arrives cut from k, v's
    projections the pass proves self-attention on the whole graph (read at the first piece):
    every site rewritten, outputs and gradients those of the model compiled without DDP."""
    from models import recorded_sites, recording_backend
    torch.manual_seed(0)
    model = TinyTransformer()
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (2, 23))
    be = recording_backend(W, R)
    out, grads = ddp_run(model, (tokens,), tmp_path, monkeypatch, be, optimize_ddp=optimize_ddp)
    sites = recorded_sites(be)
    assert len(be.records) > 2 or not optimize_ddp, len(be.records)
    assert [s.action for s in sites] == ["rewritten"] * 2, [(s.action, s.reason) for s in sites]
    torch._dynamo.reset()
    expected = torch.compile(plain, backend=recording_backend(W, R))(tokens)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected.detach())
    for g, e in zip(grads, [p.grad for p in plain.parameters()]):
        torch.testing.assert_close(g, e)


def test_ddp_pieces_keep_cross_attention_dense(tmp_path, monkeypatch):
    """Read against the whole graph, a cross-attention cut from its queries stays a
    cross-attention: skipped with the whole graph's reason."""
    from models import EncoderDecoder, recorded_sites, recording_backend
    torch.manual_seed(0)
    be = recording_backend(W, R)
    src, tgt = torch.randn(1, 23, 32), torch.randn(1, 23, 32)
    ddp_run(EncoderDecoder(), (src, tgt), tmp_path, monkeypatch, be)
    sites = {s.module.removeprefix("module."): s for s in recorded_sites(be)}
    described = {m: (s.action, s.reason) for m, s in sites.items()}
    assert sites["encoder.attn"].action == sites["self_attn"].action == "rewritten", described
    cross = sites["cross_attn"]
    assert cross.action == "skipped" and "cross-attention" in cross.reason, cross.reason


@pytest.mark.parametrize("padded", [False, True], ids=["mask of ones", "padded"])
def test_ddp_pieces_read_a_mask_built_in_another_piece(tmp_path, monkeypatch, padded):
    """A transformers Llama given a 2-D attention mask, cut by the DDP optimizer: the model
    compiled whole reads the mask as sequences (SPEC section 5) from the 2-D mask; a piece
    receives only the 4-D mask built from it in another piece, and reads the same sequences
    from its rows. Outputs on real tokens and gradients are those of the model compiled
    without DDP, for a mask of ones and for a batch padded on the left and on the right."""
    transformers = pytest.importorskip("transformers")
    from models import recorded_sites, recording_backend
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=96, max_position_embeddings=64, pad_token_id=0))
    plain = copy.deepcopy(model)
    ids = torch.randint(3, 96, (2, 23))
    mask = torch.ones(2, 23, dtype=torch.long)
    if padded:
        mask[1, :6] = 0
        mask[0, 19:] = 0

    class Logits(torch.nn.Module):  # DDP's forward takes positional arguments only
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).logits

    be = recording_backend(W, R)
    out, grads = ddp_run(Logits(model), (ids, mask), tmp_path, monkeypatch, be)
    sites = recorded_sites(be)
    assert len(be.records) > 2 and [s.action for s in sites] == ["rewritten"] * 2, \
        [(s.action, s.reason) for s in sites]
    assert all("read from the rows of the 4-D mask" in s.sequences.what for s in sites), \
        [s.sequences for s in sites]
    torch._dynamo.reset()
    expected = torch.compile(Logits(plain), backend=recording_backend(W, R))(ids, mask)
    expected.square().sum().backward()
    real = mask.bool()
    torch.testing.assert_close(out[real], expected.detach()[real])
    for g, p in zip(grads, plain.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_ddp_with_one_bucket_hands_the_whole_graph_over(tmp_path, monkeypatch):
    """Buckets larger than the model: the optimizer cuts nothing and the backend gets the
    whole graph, as without DDP; a cross-attention's reason says nothing of pieces."""
    from models import EncoderDecoder, recorded_sites, recording_backend
    torch.manual_seed(0)
    be = recording_backend(W, R)
    ddp_run(EncoderDecoder(), (torch.randn(1, 23, 32), torch.randn(1, 23, 32)), tmp_path,
            monkeypatch, be, cap=25)
    sites = {s.module.removeprefix("module."): s for s in recorded_sites(be)}
    assert len(be.records) == 1, len(be.records)
    assert sites["encoder.attn"].action == sites["self_attn"].action == "rewritten"
    assert sites["cross_attn"].reason == "keys/values are not computed from the queries' " \
        "sequence (cross-attention)", sites["cross_attn"].reason


def test_fsdp2_layers_are_rewritten(tmp_path):
    """FSDP2 (fully_shard per layer and the root; one process, gloo): its hooks break the graph
    around each layer, and each layer's attention is rewritten; outputs and gradients are those
    of the model compiled without it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from models import recorded_sites, recording_backend
    torch.manual_seed(0)
    model = TinyTransformer()
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (2, 23))
    be = recording_backend(W, R)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        torch._dynamo.reset()
        out = torch.compile(model, backend=be)(tokens)
        out.square().sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    sites = recorded_sites(be)
    assert sites and all(s.action == "rewritten" for s in sites), [(s.action, s.reason) for s in sites]
    torch._dynamo.reset()
    expected = torch.compile(plain, backend=recording_backend(W, R))(tokens)
    expected.square().sum().backward()
    torch.testing.assert_close(out.detach(), expected.detach())
    for g, p in zip(grads, plain.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_explain_says_when_no_graph_reached_the_backend():
    """A model Dynamo compiles nothing of (here its forward is disabled) runs as it is: explain
    says so rather than only counting 0 sites in 0 graphs."""
    model = TinyTransformer()
    model.forward = torch._dynamo.disable(model.forward)
    report = str(hilbert_fx.explain(model, torch.randint(0, 50, (1, 9)),
                                    backend=hilbert_fx.backend(W, R, lowering="sdpa")))
    assert "0 attention sites in 0 graphs" in report and "no graph reached the backend" in report


class GptFastAttention(torch.nn.Module):
    """gpt-fast's decoder attention: a KV cache of registered buffers written at input_pos
    (k_cache[:, :, input_pos] = k), SDPA over the whole buffer under a causal_mask buffer's rows
    read at input_pos."""

    def __init__(self, dim=32, heads=4, max_len=4200):
        super().__init__()
        self.heads, self.wqkv = heads, torch.nn.Linear(dim, 3 * dim, bias=False)
        self.cached = False
        self.register_buffer("k_cache", torch.zeros(1, heads, max_len, dim // heads))
        self.register_buffer("v_cache", torch.zeros(1, heads, max_len, dim // heads))

    def forward(self, x, mask, input_pos):
        b, n, dim = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.wqkv(x).split(dim, -1))
        if self.cached:
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
            k, v = self.k_cache, self.v_cache
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, dim)


class GptFast(torch.nn.Module):
    """max_len 4200: a causal_mask past the pass's limit on constants it evaluates (2**24
    elements), compared with the triangle by blocks of rows instead."""

    def __init__(self, vocab=64, dim=32, layers=2, max_len=4200):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
        self.layers = torch.nn.ModuleList(GptFastAttention(dim, max_len=max_len)
                                          for _ in range(layers))
        self.register_buffer("causal_mask", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        if not self.layers[0].cached:  # no cache: the keys are the sequence itself
            mask = mask[..., :idx.shape[1]]
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x, mask, input_pos)
        return self.out(x)


@pytest.mark.parametrize("branches", [((64,), (1,)), (W, R)], ids=["identity", "dilated"])
def test_gpt_fast_decoding_is_rewritten_against_its_buffers(branches):
    """A home-made decoder in gpt-fast's style: the prompt and each decoding step read the
    static cache through the causal_mask buffer's rows at input_pos, so every site is rewritten
    against the cache (skipped as an unread mask before), and each step's logits are those of a
    full forward over the sequence so far; with one branch covering the sequence, the
    uncompiled model's."""
    torch.manual_seed(0)
    model, ids, prompt = GptFast().eval(), torch.randint(0, 64, (1, 30)), 20
    be = hilbert_fx.backend(*branches, lowering="sdpa")
    be.keep_records = True

    def decode(fn):
        for layer in model.layers:
            layer.cached = True
            layer.k_cache.zero_(), layer.v_cache.zero_()
        logits = [fn(ids[:, :prompt], torch.arange(prompt))[0, -1]]
        logits += [fn(ids[:, t:t + 1], torch.tensor([t]))[0, -1] for t in range(prompt, 30)]
        for layer in model.layers:
            layer.cached = False
        return torch.stack(logits)

    torch._dynamo.reset()
    with torch.no_grad():
        steps = decode(torch.compile(model, backend=be))
        sites = [s for r in be.records for s in r.sites]
        full = torch.compile(model, backend=be)
        expected = torch.stack([full(ids[:, :t], torch.arange(t))[0, -1]
                                for t in range(prompt, 31)])
        plain = decode(model)
    assert sites and all(s.action == "rewritten" and "static cache" in s.sequences.what
                         for s in sites), [(s.action, s.reason) for s in sites]
    torch.testing.assert_close(steps, expected, atol=2e-5, rtol=1e-4)
    if branches[0] == (64,):
        torch.testing.assert_close(steps, plain, atol=2e-5, rtol=1e-4)
    else:
        assert (steps - plain).abs().max() > 1e-2  # the pattern shows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_reduce_overhead_trains_from_a_fresh_process():
    """mode="reduce-overhead" as a compiled model's first calls meet it: Inductor's CUDA graph
    trees warm the graphs up with every allocation in their memory pool while the op builds
    what it keeps (lowering/graph_pools.py). A fresh process, CUDA graphs first, against the
    default mode: scripts/graphs_check.py exits non-zero on a difference or a failure."""
    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "graphs_check.py")],
                          cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
