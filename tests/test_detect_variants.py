"""Hand-written attention in many spellings: every one is found by the one matcher, rewritten,
and under a non-identity dilated configuration equals the float64 reference, forward and
backward. Softmaxes that are not attention are left alone; cross-attention is skipped.

Each variant computes the same attention from x with one weight w (q, k, v = the projections of
x, `project` below) and returns [B, N, E]; only the spelling of the attention differs.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hilbert_fx
from hilbert_fx.lowering import dropout
from reference import dropout_keep_of_positions, reference_dilated_attention, reference_sequences

W, R = (8, 16), (1, 2)
B, N, H, D = 2, 24, 4, 8
E = H * D
HKV = 2  # key/value heads of the GQA variants
OP = torch.ops.hilbert_fx.dilated_attention.default
NEG = float("-inf")
SCALE = 1.0 / math.sqrt(D)


def project(x, w, kv_heads=H):
    """q [B, H, N, D], k and v [B, kv_heads, N, D] from x [B, N, E]."""
    b, n, _ = x.shape
    q, k, v = (x @ w).split([E, kv_heads * D, kv_heads * D], dim=-1)
    q = q.view(b, n, H, D).transpose(1, 2)
    k = k.view(b, n, kv_heads, D).transpose(1, 2)
    v = v.view(b, n, kv_heads, D).transpose(1, 2)
    return q, k, v


def merge(o):
    """[B, H, N, D] -> [B, N, E]."""
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def repeat_kv(x, rep):  # as in Hugging Face Llama
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)


# ---------------------------------------------------------------------------------------------
# The variants: (name, function(m, x, keep), mask kind, kv heads). m is the Variant module (its
# weight m.w, a causal buffer, an nn.Softmax, an nn.Dropout); keep [B, N] is True where a key
# is real (a padding mask). Mask kinds: None, "causal", "padding" or ("alibi", c): the padding
# mask and c times alibi() added to the scores.
# ---------------------------------------------------------------------------------------------
def v_matmul_transpose_mul(m, x, keep):
    q, k, v = project(x, m.w)
    p = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * SCALE, dim=-1)
    return merge(torch.matmul(p, v))


def v_at_div_sqrt(m, x, keep):
    q, k, v = project(x, m.w)
    s = q @ k.transpose(2, 3) / math.sqrt(D)
    return merge(F.softmax(s, dim=-1) @ v)


def v_scale_left_mT(m, x, keep):
    q, k, v = project(x, m.w)
    return merge((SCALE * (q @ k.mT)).softmax(dim=-1) @ v)


def v_permute_scale_on_q(m, x, keep):
    q, k, v = project(x, m.w)
    s = (q * SCALE) @ k.permute(0, 1, 3, 2)
    return merge(s.softmax(-1) @ v)


def v_scale_on_k_sqrt_each(m, x, keep):  # scale split between q and k (as in some ViTs)
    q, k, v = project(x, m.w)
    s = (q * D ** -0.25) @ (k * D ** -0.25).transpose(-1, -2)
    return merge(torch.softmax(s, 3) @ v)


def v_einsum(m, x, keep):
    q, k, v = project(x, m.w)
    s = torch.einsum("bhnd,bhmd->bhnm", q, k) * SCALE
    return merge(torch.einsum("bhnm,bhmd->bhnd", s.softmax(-1), v))


def v_einsum_heads_last(m, x, keep):  # [B, N, H, D] operands, output straight to [B, N, H, D]
    b, n, _ = x.shape
    q, k, v = (t.view(b, n, H, D) for t in (x @ m.w).chunk(3, dim=-1))
    s = torch.einsum("bnhd,bmhd->bhnm", q, k)
    p = torch.softmax(s / math.sqrt(D), dim=-1)
    return torch.einsum("bhnm,bmhd->bnhd", p, v).reshape(b, n, E)


def v_bmm_folded_heads(m, x, keep):
    q, k, v = (t.reshape(B * H, N, D) for t in project(x, m.w))
    p = torch.bmm(q, k.transpose(1, 2)).mul(SCALE).softmax(-1)
    return merge(torch.bmm(p, v).view(B, H, N, D))


def v_baddbmm_alpha(m, x, keep):  # Bloom-style: baddbmm with beta=0 and the scale as alpha
    q, k, v = (t.reshape(B * H, N, D) for t in project(x, m.w))
    zeros = torch.zeros(B * H, N, N, dtype=x.dtype)
    s = torch.baddbmm(zeros, q, k.transpose(-1, -2), beta=0.0, alpha=SCALE)
    return merge(torch.bmm(F.softmax(s, dim=-1), v).view(B, H, N, D))


def v_float_casts(m, x, keep):
    q, k, v = project(x, m.w)
    s = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    p = F.softmax(s.float(), dim=-1, dtype=torch.float32).to(q.dtype)
    return merge(torch.matmul(p, v))


def v_private_softmax_inplace_scale(m, x, keep):
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2)
    s.mul_(SCALE)
    return merge(torch._softmax(s, -1, False) @ v)


def v_softmax_module_dropout_module(m, x, keep):
    q, k, v = project(x, m.w)
    p = m.drop(m.softmax(q @ k.transpose(-1, -2) * SCALE))
    return merge(p @ v)


def v_functional_dropout(m, x, keep):
    q, k, v = project(x, m.w)
    p = F.dropout(torch.softmax(q @ k.transpose(-1, -2) * SCALE, -1), p=0.25, training=m.training)
    return merge(p @ v)


def v_causal_buffer(m, x, keep):  # GPT-2 (old style): a registered lower-triangular buffer
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    n = s.shape[-1]
    s = s.masked_fill(m.bias[:, :, :n, :n] == 0, NEG)
    return merge(s.softmax(-1) @ v)


def v_causal_buffer_where(m, x, keep):  # GPT-2 (transformers 4.x): where(buffer, s, min)
    q, k, v = project(x, m.w)
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    n = s.shape[-1]
    causal = m.bias[:, :, :n, :n].bool()
    s = torch.where(causal, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
    return merge(s.softmax(-1) @ v)


def v_causal_tril(m, x, keep):
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) * SCALE
    n = x.shape[1]
    tri = torch.tril(torch.ones(n, n))
    return merge(s.masked_fill(tri == 0, NEG).softmax(-1) @ v)


def v_causal_triu_inplace(m, x, keep):
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) * SCALE
    n = x.shape[1]
    s.masked_fill_(torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), NEG)
    return merge(s.softmax(-1) @ v)


def v_causal_arange(m, x, keep):
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) * SCALE
    i = torch.arange(x.shape[1])[:, None]
    j = torch.arange(x.shape[1])[None, :]
    return merge(torch.where(j <= i, s, NEG).softmax(-1) @ v)


def v_causal_additive(m, x, keep):  # a float triangle of -inf added, the scale after it
    q, k, v = project(x, m.w)
    bias = torch.full((x.shape[1], x.shape[1]), NEG).triu(1)
    s = (q @ k.transpose(-1, -2) + bias) * SCALE
    return merge(s.softmax(-1) @ v)


def v_causal_gqa_repeat_kv(m, x, keep):  # Llama eager: repeat_kv, causal float mask added
    q, k, v = project(x, m.w, HKV)
    k, v = repeat_kv(k, H // HKV), repeat_kv(v, H // HKV)
    n = x.shape[1]
    mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
    s = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return merge(torch.matmul(p, v))


def v_gqa_repeat_interleave(m, x, keep):
    q, k, v = project(x, m.w, HKV)
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    return merge(F.softmax(q @ k.transpose(-1, -2) * SCALE, dim=3) @ v)


def v_padding_masked_fill(m, x, keep):
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) * SCALE
    return merge(s.masked_fill(~keep[:, None, None, :], NEG).softmax(-1) @ v)


def v_padding_where(m, x, keep):
    q, k, v = project(x, m.w)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * SCALE
    s = s.where(keep[:, None, None, :], torch.finfo(s.dtype).min)
    return merge(torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v))


def v_padding_additive_bert(m, x, keep):  # BERT: (1 - mask) * min, added after the scale
    q, k, v = project(x, m.w)
    ext = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    s = s + ext
    return merge(torch.matmul(s.softmax(-1), v))


def v_padding_inplace_add_folded(m, x, keep):  # heads folded, mask added in place
    q, k, v = (t.reshape(B * H, N, D) for t in project(x, m.w))
    s = torch.bmm(q * SCALE, k.transpose(1, 2))
    s += torch.zeros(B, 1, N, dtype=x.dtype).masked_fill(~keep[:, None, :], NEG).repeat_interleave(H, 0)
    return merge(torch.bmm(s.softmax(-1), v).view(B, H, N, D))


def alibi(n):
    """ALiBi as Bloom and Falcon build it: slope_h times the key's position, [H, 1, n], a float
    bias that depends on neither q nor k."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    return slopes[:, None, None] * torch.arange(n)[None, None, :]


def padding_additive(keep, dtype):
    return (1.0 - keep[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


BETA = 0.5


def v_baddbmm_alibi_regrouped(m, x, keep):  # Bloom: beta * alibi + alpha * q k^T over [B*H, N, N]
    q, k, v = (t.reshape(B * H, N, D) for t in project(x, m.w))
    bias = alibi(N).repeat(B, 1, 1)
    s = bias.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=BETA, alpha=SCALE)
    s = s.view(B, H, N, -1) + padding_additive(keep, x.dtype)  # the padding mask over [B, H, N, N]
    p = m.drop(F.softmax(s, dim=-1, dtype=torch.float32).to(x.dtype))
    return merge(torch.bmm(p.view(B * H, N, -1), v).view(B, H, N, D))


def v_alibi_scaled_in_place(m, x, keep):  # Falcon: alibi added to the scores, then all scaled
    q, k, v = project(x, m.w)
    s = (q @ k.transpose(-1, -2)).view(B, H, N, N)
    s = s + alibi(N).view(1, H, 1, N)
    s *= SCALE
    p = m.drop(F.softmax(s + padding_additive(keep, x.dtype), dim=-1))
    return merge(p.view(B, H, N, N) @ v)


def v_scale_on_kT_regrouped_masked_fill(m, x, keep):  # DeBERTa: bmm(q, k^T / scale), folded
    q, k, v = (t.reshape(B * H, N, D) for t in project(x, m.w))
    s = torch.bmm(q, k.transpose(-1, -2) / torch.sqrt(torch.tensor(D, dtype=torch.float)))
    s = s.view(-1, H, s.size(-2), s.size(-1))
    s = s.masked_fill(~keep[:, None, None, :], torch.finfo(x.dtype).min)
    p = m.drop(F.softmax(s, dim=-1))
    return merge(torch.bmm(p.view(-1, p.size(-2), p.size(-1)), v).view(-1, H, N, D))


VARIANTS = [
    (v_matmul_transpose_mul, None, H),
    (v_at_div_sqrt, None, H),
    (v_scale_left_mT, None, H),
    (v_permute_scale_on_q, None, H),
    (v_scale_on_k_sqrt_each, None, H),
    (v_einsum, None, H),
    (v_einsum_heads_last, None, H),
    (v_bmm_folded_heads, None, H),
    (v_baddbmm_alpha, None, H),
    (v_float_casts, None, H),
    (v_private_softmax_inplace_scale, None, H),
    (v_softmax_module_dropout_module, None, H),
    (v_functional_dropout, None, H),
    (v_causal_buffer, "causal", H),
    (v_causal_buffer_where, "causal", H),
    (v_causal_tril, "causal", H),
    (v_causal_triu_inplace, "causal", H),
    (v_causal_arange, "causal", H),
    (v_causal_additive, "causal", H),
    (v_causal_gqa_repeat_kv, "causal", HKV),
    (v_gqa_repeat_interleave, None, HKV),
    (v_padding_masked_fill, "padding", H),
    (v_padding_where, "padding", H),
    (v_padding_additive_bert, "padding", H),
    (v_padding_inplace_add_folded, "padding", H),
    (v_baddbmm_alibi_regrouped, ("alibi", BETA), H),
    (v_alibi_scaled_in_place, ("alibi", SCALE), H),
    (v_scale_on_kT_regrouped_masked_fill, "padding", H),
]


class Variant(nn.Module):
    def __init__(self, fn, kv_heads=H):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(E, E + 2 * kv_heads * D) * E ** -0.5)
        self.register_buffer("bias", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))
        self.softmax = nn.Softmax(dim=-1)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, keep):
        return self.fn(self, x, keep)


class Recorder:
    """A backend that runs the pass (no Inductor) and keeps the rewritten graphs and sites."""
    def __init__(self):
        self.inner = hilbert_fx.backend(W, R, hilbert=True, lowering="sdpa")
        self.graphs, self.sites = [], []

    def __call__(self, gm, example_inputs):
        self.sites += self.inner.transform(gm).sites
        self.graphs.append(gm)
        return gm.forward


def compile_and_record(model, *args):
    torch._dynamo.reset()
    rec = Recorder()
    out = torch.compile(model, backend=rec, fullgraph=True)(*args)
    return out, rec


def op_calls(rec):
    return [n for gm in rec.graphs for n in gm.graph.nodes if n.target == OP]


def inputs(seed, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, E, generator=g)
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[1, -7:] = False
    return x, keep


def reference(model, x, keep, mask_kind, kv_heads):
    q, k, v = project(x.double(), model.w.double(), kv_heads)
    kwargs = {}
    if mask_kind == "causal":
        kwargs["is_causal"] = True
    elif mask_kind == "padding":
        kwargs["attn_mask"] = keep[:, None, None, :]
    elif mask_kind is not None:  # ("alibi", c)
        bias = mask_kind[1] * alibi(x.shape[1]).to(x.dtype)[None]
        kwargs["attn_mask"] = bias.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = reference_dilated_attention(q, k, v, W, R, hilbert=True, enable_gqa=kv_heads != H,
                                      **kwargs)
    return merge(out)


@pytest.mark.parametrize("fn,mask_kind,kv_heads", VARIANTS, ids=[v[0].__name__[2:] for v in VARIANTS])
def test_variant_is_found_rewritten_and_exact(fn, mask_kind, kv_heads):
    torch.manual_seed(0)
    model = Variant(fn, kv_heads).eval()
    x, keep = inputs(1)
    x.requires_grad_(True)
    out, rec = compile_and_record(model, x, keep)
    assert [(s.kind, s.action, s.reason) for s in rec.sites] == [("manual", "rewritten", "")]
    (call,) = op_calls(rec)
    is_causal, mask = call.args[6], call.args[7]
    assert is_causal == (mask_kind == "causal")
    if mask_kind in (None, "causal"):
        assert mask is None, "no mask may be materialised for a causal triangle"
        for gm in rec.graphs:  # nothing [.., N, N] is computed any more
            for node in gm.graph.nodes:
                ex = node.meta.get("example_value")
                if node.op != "placeholder" and isinstance(ex, torch.Tensor) and ex.dim() >= 2:
                    assert tuple(ex.shape[-2:]) != (N, N), f"{node.format_node()} left in the graph"
    assert (call.args[1].meta.get("example_value") is None
            or call.args[1].meta["example_value"].shape[1] == kv_heads)

    # fresh inputs on the compiled graph, against the float64 reference
    x2, keep2 = inputs(2)
    x2.requires_grad_(True)
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    out = compiled(x2, keep2)
    x_ref = x2.detach().double().requires_grad_(True)
    expected = reference(model, x_ref, keep2, mask_kind, kv_heads)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    grad = torch.randn_like(expected)
    gx, gw = torch.autograd.grad(out, (x2, model.w), grad.float())
    gx_ref, gw_ref = torch.autograd.grad(expected, (x_ref, model.w), grad)
    torch.testing.assert_close(gx.double(), gx_ref, atol=5e-5, rtol=1e-3)
    torch.testing.assert_close(gw, gw_ref, atol=5e-5, rtol=1e-3)


CAUSAL = [v for v in VARIANTS if v[1] == "causal"]


@pytest.mark.parametrize("fn,mask_kind,kv_heads", CAUSAL, ids=[v[0].__name__[2:] for v in CAUSAL])
def test_causal_triangles_are_proved_for_every_length_under_dynamic_shapes(fn, mask_kind, kv_heads):
    """With a symbolic length the triangle cannot be evaluated once: it is read symbolically."""
    torch.manual_seed(0)
    model = Variant(fn, kv_heads).eval()
    x, keep = inputs(1, n=21)
    torch._dynamo.reset()
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, dynamic=True, fullgraph=True)
    compiled(x, keep)
    if fn is v_causal_additive:  # dynamic=True makes the float SCALE a run-time value, and
        # here it scales the mask too: nothing can be said of the scaled mask, so it is skipped
        assert [(s.action, s.reason) for s in rec.sites] == [
            ("skipped", "a mask added before a run-time scale of the scores")]
        return
    (call,) = op_calls(rec)
    assert isinstance(rec.sites[0].shapes["q"][2], torch.SymInt)
    assert (call.args[6], call.args[7]) == (True, None), rec.sites[0]
    for n in (19, 30):  # the same graph at other lengths, against the reference
        x, keep = inputs(n, n=n)
        expected = reference(model, x, keep, mask_kind, kv_heads)
        torch.testing.assert_close(compiled(x, keep).double(), expected, atol=2e-5, rtol=1e-4)
    assert len(rec.graphs) == 1


def v_strict_arange(m, x, keep):  # j < i: the diagonal is forbidden, so not the causal triangle
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) * SCALE
    i, j = torch.arange(x.shape[1])[:, None], torch.arange(x.shape[1])[None, :]
    s = torch.where((j < i) | (i + j == 0), s, NEG)  # the first query keeps its own key
    return merge(s.softmax(-1) @ v)


def strict_mask(n):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j < i) | (i + j == 0)


def shifted_mask(n):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return j - 1 <= i


def v_shifted_arange(m, x, keep):  # j <= i + 1: one step past the diagonal
    q, k, v = project(x, m.w)
    s = q @ k.transpose(-1, -2) * SCALE
    i, j = torch.arange(x.shape[1])[:, None], torch.arange(x.shape[1])[None, :] - 1
    return merge(torch.where(j <= i, s, NEG).softmax(-1) @ v)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fn,allowed", [(v_shifted_arange, shifted_mask),
                                        (v_strict_arange, strict_mask)])
def test_near_causal_triangles_are_not_taken_for_causal(fn, allowed, dynamic):
    """One step past the diagonal, or short of it: the op gets the triangle as a mask (not
    is_causal), and computes the attention that mask allows (the float64 reference)."""
    model = Variant(fn).eval()
    x, keep = inputs(1, n=21)
    torch._dynamo.reset()
    rec = Recorder()
    out = torch.compile(model, backend=rec, dynamic=dynamic, fullgraph=True)(x, keep)
    (call,) = op_calls(rec)
    assert call.args[6] is False and call.args[7] is not None
    q, k, v = project(x.double(), model.w.double())
    expected = merge(reference_dilated_attention(q, k, v, W, R, hilbert=True,
                                                 attn_mask=allowed(x.shape[1])))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", [v_softmax_module_dropout_module, v_functional_dropout])
def test_dropout_on_the_probabilities_becomes_the_ops_dropout(fn):
    torch.manual_seed(0)
    model = Variant(fn).train()
    x, keep = inputs(1)
    _, rec = compile_and_record(model, x, keep)
    assert [(s.action, s.dropout_p) for s in rec.sites] == [("rewritten", 0.1 if "module" in fn.__name__ else 0.25)]
    (call,) = op_calls(rec)
    assert call.args[8] == rec.sites[0].dropout_p
    code = "\n".join(gm.code for gm in rec.graphs)
    assert "dropout(" not in code.replace("dilated_attention", "")
    # what it computes: the float64 reference with the op's keep bits, from the seed the op
    # draws from torch's generator
    p = rec.sites[0].dropout_p
    torch.manual_seed(5)
    out = torch.compile(model, backend=Recorder(), fullgraph=True)(x, keep)
    torch.manual_seed(5)
    seed = dropout.new_seed(torch.device("cpu"))
    q, k, v = project(x.double(), model.w.double())
    expected = merge(reference_dilated_attention(
        q, k, v, W, R, hilbert=True, dropout_p=p,
        dropout_keep=dropout_keep_of_positions(seed, B, H, range(N), p)))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# What is not self-attention
# ---------------------------------------------------------------------------------------------
class NotAttention(nn.Module):
    """A classifier head, an MoE router, and attention-like products softmaxed over queries."""
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, 3 * E) * E ** -0.5)
        self.head = nn.Linear(E, 10)
        self.router = nn.Linear(E, 4)
        self.experts = nn.Parameter(torch.randn(4, E, E) * E ** -0.5)

    def forward(self, x):
        q, k, v = project(x, self.w)
        columns = (q @ k.transpose(-1, -2) * SCALE).softmax(dim=-2) @ v   # softmax over queries
        y = x + merge(columns)
        gates = F.softmax(self.router(y), dim=-1)                         # MoE router
        top, idx = gates.topk(2, dim=-1)
        mixed = torch.einsum("bne,xef->bnxf", y, self.experts)
        y = y + (mixed * gates[..., None]).sum(2)
        logits = self.head(y.mean(1))
        return F.softmax(logits, dim=-1), top, idx                        # classifier head


def test_softmaxes_that_are_not_self_attention_are_not_rewritten():
    torch.manual_seed(0)
    model = NotAttention()
    x, _ = inputs(1)
    report = hilbert_fx.explain(model, x, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    # only the softmax over queries looks like attention, and its row says why it is not one
    assert [s.action for s in report.sites] == ["skipped"], report
    assert "dim -2" in report.sites[0].reason, report.sites[0].reason
    assert "dilated_attention" not in "".join(report.graph_after)
    out = torch.compile(model, backend=hilbert_fx.backend(W, R, lowering="sdpa"))(x)
    for a, b in zip(out, model(x)):
        torch.testing.assert_close(a, b)


def _heads(t):
    b, n, _ = t.shape
    return t.view(b, n, H, D).transpose(1, 2)


class RowsOfOneTensor(nn.Module):
    """Queries and keys/values from one tensor x [B, N, E]: from other rows or positions of it
    (cross-attention by slice, chunk, flip or roll), or one sequence after all (a cut above
    what they share, some heads of the keys, a fused projection's q/k/v stack)."""

    def __init__(self, how: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, 3 * E) * E ** -0.5)
        self.how = how

    def forward(self, x):
        n = x.shape[1]
        other = {"batch rows": lambda t: (t[:1], t[1:]), "chunk": lambda t: t.chunk(2, dim=0),
                 "sequence halves": lambda t: (t[:, : n // 2], t[:, n // 2:]),
                 "flip": lambda t: (t, t.flip(1)), "roll": lambda t: (t, torch.roll(t, 3, 1)),
                 "cut above": lambda t: (t[:, 1:], t[:, 1:])}.get(self.how)
        if other is not None:
            xq, xkv = other(x)
            q = project(xq, self.w)[0]
            _, k, v = project(xkv, self.w)
        elif self.how == "some heads":
            q, k, v = project(x, self.w)
            k, v = k[:, :HKV], v[:, :HKV]
            return merge(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        else:  # "stack": q, k, v picked out of a fused projection's [3, B, H, N, D]
            qkv = (x @ self.w).view(x.shape[0], n, 3, H, D).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        return merge(F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("how", ["batch rows", "chunk", "sequence halves", "flip", "roll",
                                 "cut above", "some heads", "stack"])
def test_keys_from_other_rows_of_the_queries_tensor_are_cross_attention(how):
    """Derived through ops that mix no positions is not enough: keys and values cut from other
    rows or positions of the queries' tensor are another sequence (rewritten before, 0.4 to 0.6
    away from SDPA); a cut they all share, or one of heads or of the q/k/v stack, is not."""
    torch.manual_seed(0)
    model = RowsOfOneTensor(how)
    x = torch.randn(B, N, E)
    report = hilbert_fx.explain(model, x, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    crossing = how in ("batch rows", "chunk", "sequence halves", "flip", "roll")
    assert [s.action for s in report.sites] == ["skipped" if crossing else "rewritten"], report
    if crossing:
        assert "other rows or positions" in report.sites[0].reason, report
        out = torch.compile(model, backend=hilbert_fx.backend(W, R, lowering="sdpa"))(x)
        torch.testing.assert_close(out, model(x))


class LearnedQueryPooling(nn.Module):
    """Attention pooling: learned queries against the sequence's keys and values."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, 3 * E) * E ** -0.5)
        self.latents = nn.Parameter(torch.randn(1, H, 5, D))

    def forward(self, x):
        _, k, v = project(x, self.w)
        return merge(torch.softmax(self.latents @ k.transpose(-1, -2) * SCALE, -1) @ v)


def test_attention_pooling_with_a_learned_query_is_reported():
    """Not self-attention, and not silent: explain has its row, and it runs as written."""
    torch.manual_seed(0)
    model = LearnedQueryPooling()
    x, _ = inputs(1)
    report = hilbert_fx.explain(model, x, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [(s.kind, s.action) for s in report.sites] == [("manual", "skipped")], report
    assert "learned query" in report.sites[0].reason, report
    out = torch.compile(model, backend=hilbert_fx.backend(W, R, lowering="sdpa"))(x)
    torch.testing.assert_close(out, model(x))


class ManualCross(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(E, E) * E ** -0.5)
        self.wkv = nn.Parameter(torch.randn(E, 2 * E) * E ** -0.5)

    def forward(self, x, memory):
        b, n, _ = x.shape
        q = (x @ self.wq).view(b, n, H, D).transpose(1, 2)
        k, v = (memory @ self.wkv).view(b, memory.shape[1], 2, H, D).permute(2, 0, 3, 1, 4)
        return merge(torch.softmax(q @ k.transpose(-1, -2) * SCALE, -1) @ v)


@pytest.mark.parametrize("n_memory", [N, N + 5])
def test_hand_written_cross_attention_is_skipped_with_its_reason(n_memory):
    model = ManualCross()
    x, memory = torch.randn(B, N, E), torch.randn(B, n_memory, E)
    report = hilbert_fx.explain(model, x, memory, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [(s.kind, s.action) for s in report.sites] == [("manual", "skipped")], report
    reason = report.sites[0].reason
    assert ("cross-attention" in reason) if n_memory == N else ("different lengths" in reason), reason
    out = torch.compile(model, backend=hilbert_fx.backend(W, R, lowering="sdpa"))(x, memory)
    torch.testing.assert_close(out, model(x, memory))


class SomeQueries(nn.Module):
    """Self-attention of some of a sequence's tokens (the first or the last 3) over all of it,
    causal (SDPA's is_causal and FlexAttention's q_idx >= kv_idx align top-left) or under a
    mask of the queries' rows built in the graph: no cache, so where the queries stand among
    the keys is nothing the pass can prove."""

    def __init__(self, spelling: str, which: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, 3 * E) / math.sqrt(E))
        self.spelling, self.which = spelling, which

    def forward(self, x):
        q, k, v = project(x, self.w)
        q = q[:, :, :3] if self.which == "first" else q[:, :, -3:]
        n = x.shape[1]
        if self.spelling == "sdpa-causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.spelling == "flex-causal":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 3, n,
                                     device="cpu")
            return flex_attention(q, k, v, block_mask=mask)
        rows = torch.arange(n - 3, n, device=x.device).view(3, 1)  # the last rows' causal mask
        allowed = torch.arange(n, device=x.device).view(1, n) <= rows
        if self.spelling == "sdpa-mask":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, NEG)
        return s.softmax(-1) @ v


@pytest.mark.parametrize("which", ["first", "last"])
@pytest.mark.parametrize("spelling", ["sdpa-causal", "flex-causal", "sdpa-mask", "manual-mask"])
def test_queries_that_are_no_cache_continuation_are_skipped_with_their_reason(spelling, which):
    """The op reads q shorter than k as a cache's last rows (SPEC section 5): without a cache
    the pass can see, such a site keeps its own attention, reported (SDPA with is_causal was
    rewritten bottom-right aligned, 1.3 away from SDPA's top-left)."""
    if spelling == "flex-causal":
        pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    model = SomeQueries(spelling, which).requires_grad_(False)  # FlexAttention on the CPU
    x = torch.randn(B, N, E)
    report = hilbert_fx.explain(model, x, backend=hilbert_fx.backend((256,), (1,),
                                                                     lowering="sdpa"))
    assert [s.action for s in report.sites] == ["skipped"], report
    # the queries are some rows of the keys' tensor (rows.py), or, where the pass cannot see
    # that (the mask read first), no cache places them
    reason = report.sites[0].reason
    assert "other rows or positions" in reason or "no cache the pass can see" in reason, reason
    # the graph as the pass leaves it, run without Inductor (whose CPU FlexAttention at 3
    # queries strays from eager's by up to 40 here, with or without the pass)
    backend = hilbert_fx.backend((256,), (1,), lowering="sdpa")
    backend.compile_with_inductor = False
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))


def v_content_to_position(m, x, keep):  # DeBERTa's c2p: the queries against position embeddings
    q, k, v = project(x, m.w)
    pos = m.w[: x.shape[1], :D]
    s = (q @ k.transpose(-1, -2) + q @ pos.transpose(0, 1)) * SCALE
    return merge(s.softmax(-1) @ v)


def v_position_to_content(m, x, keep):  # DeBERTa's p2c: the keys against position embeddings
    q, k, v = (t.reshape(B * H, N, D) for t in project(x, m.w))
    pos = m.w[: x.shape[1], :D]
    p2c = torch.bmm(k, pos.expand(B * H, -1, -1).transpose(-1, -2)).transpose(-1, -2)
    s = torch.bmm(q, k.transpose(-1, -2) * SCALE) + p2c * SCALE
    s = s.view(B, H, N, N).masked_fill(~keep[:, None, None, :], torch.finfo(x.dtype).min)
    return merge(torch.bmm(s.softmax(-1).view(B * H, N, N), v).view(B, H, N, D))


@pytest.mark.parametrize("fn", [v_content_to_position, v_position_to_content])
def test_terms_computed_from_q_or_k_are_skipped_with_their_reason(fn):
    """A term added to the scores that is a product with q or k (DeBERTa's disentangled
    attention) is part of the scores: the site is reported, skipped, not walked past."""
    torch.manual_seed(0)
    model = Variant(fn).eval()
    x, keep = inputs(1)
    report = hilbert_fx.explain(model, x, keep, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [(s.kind, s.action) for s in report.sites] == [("manual", "skipped")], report
    assert "computed from the queries or keys" in report.sites[0].reason, report
    out = torch.compile(model, backend=hilbert_fx.backend(W, R, lowering="sdpa"))(x, keep)
    torch.testing.assert_close(out, model(x, keep))


def test_returned_attention_weights_are_skipped_with_their_reason():
    def attention(x, w):
        q, k, v = project(x, w)
        p = torch.softmax(q @ k.transpose(-1, -2) * SCALE, -1)
        return merge(p @ v), p

    x, w = torch.randn(B, N, E), torch.randn(E, 3 * E)
    report = hilbert_fx.explain(attention, x, w, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [(s.action, s.reason) for s in report.sites] == [
        ("skipped", "attention weights are used outside the attention")], report


def test_scores_computed_before_a_graph_break_are_reported():
    """softmax(s) @ v whose scores s come in from an earlier graph: a row, skipped, not nothing."""
    def attention(x, w):
        q, k, v = project(x, w)
        s = q @ k.transpose(-1, -2) * SCALE
        torch._dynamo.graph_break()
        return merge(torch.softmax(s, -1) @ v)

    x, w = torch.randn(B, N, E), torch.randn(E, 3 * E)
    report = hilbert_fx.explain(attention, x, w, backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    assert [(s.kind, s.action) for s in report.sites] == [("manual", "skipped")], report
    assert "graph break" in report.sites[0].reason, report


# ---------------------------------------------------------------------------------------------
# transformers 5.17 under torch.compile hands SDPA a boolean mask: causal AND "same document",
# the documents found from position ids. With position ids 0..N-1 (one document) that is the
# causal triangle; with packed documents it is a real mask and must stay.
# ---------------------------------------------------------------------------------------------
def sdpa_document_mask(m, x, position_ids):
    b, n, _ = x.shape
    if position_ids is None:
        position_ids = (torch.arange(n) + 0).unsqueeze(0)
    first = position_ids[:, :1] - 1
    documents = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    batch_idx = torch.arange(b)[:, None, None, None]
    q_idx = (torch.arange(n) + 0)[None, None, :, None]
    kv_idx = (torch.arange(n) + 0)[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool)
    mask = mask & (kv_idx <= q_idx).to(x.device)
    mask = mask & documents[batch_idx, q_idx].__eq__(documents[batch_idx, kv_idx]).to(x.device)
    q, k, v = project(x, m.w)
    return merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(b, -1, n, n)))


def document_mask(position_ids, n):
    first = position_ids[:, :1] - 1
    documents = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return causal & (documents[:, :, None] == documents[:, None, :])[:, None]


@pytest.mark.parametrize("limit", [None, 64], ids=["evaluated", "read_symbolically"])
def test_one_document_mask_is_causal(limit, monkeypatch):
    """limit 64: the [N, N] mask is too large to evaluate at compile time (as at 32K tokens),
    so it is read symbolically; the document ids ([1, N]) are still small enough to evaluate."""
    from hilbert_fx import constants
    if limit is not None:
        monkeypatch.setattr(constants, "CONSTANT_NUMEL_LIMIT", limit)
    torch.manual_seed(0)
    model = Variant(lambda m, x, keep: sdpa_document_mask(m, x, None)).eval()
    x, keep = inputs(1)
    _, rec = compile_and_record(model, x, keep)
    assert [(s.kind, s.action) for s in rec.sites] == [("sdpa", "rewritten")]
    (call,) = op_calls(rec)
    assert (call.args[6], call.args[7]) == (True, None)
    for gm in rec.graphs:  # the mask is dead and gone
        for node in gm.graph.nodes:
            ex = node.meta.get("example_value")
            if isinstance(ex, torch.Tensor) and ex.dim() >= 2:
                assert tuple(ex.shape[-2:]) != (N, N), f"{node.format_node()} left in the graph"
    x2, keep2 = inputs(2)
    x2.requires_grad_(True)
    out = torch.compile(model, backend=rec, fullgraph=True)(x2, keep2)
    x_ref = x2.detach().double().requires_grad_(True)
    expected = reference(model, x_ref, keep2, "causal", H)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    grad = torch.randn_like(expected)
    (gx,) = torch.autograd.grad(out, (x2,), grad.float())
    (gx_ref,) = torch.autograd.grad(expected, (x_ref,), grad)
    torch.testing.assert_close(gx.double(), gx_ref, atol=5e-5, rtol=1e-3)


def test_packed_documents_run_per_document():
    """A causal mask of same-document pairs built from position ids (transformers' packing) is
    read as the documents themselves (SPEC section 5): is_causal and position_ids instead of the
    N x N mask, each document getting the op on itself alone."""
    torch.manual_seed(0)
    model = Variant(lambda m, x, pos: sdpa_document_mask(m, x, pos)).eval()
    x, _ = inputs(3)
    pos = torch.cat([torch.arange(10), torch.arange(N - 10)]).expand(B, N)
    out, rec = compile_and_record(model, x, pos)
    (call,) = op_calls(rec)
    assert call.args[6] is True and call.args[7] is None and call.args[12] is not None
    q, k, v = project(x.double(), model.w.double())
    expected = reference_sequences(q, k, v, W, R, hilbert=True, is_causal=True, position_ids=pos)
    torch.testing.assert_close(out.double(), merge(expected), atol=2e-5, rtol=1e-4)
