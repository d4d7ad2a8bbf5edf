"""Golden rewritten graphs: a change to the pass shows up here in review.

Regenerate after an intended change with: EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden_graphs.py
"""
from __future__ import annotations

import re

import expecttest
import torch
import torch.nn.functional as F

import hilbert_fx

BACKEND = hilbert_fx.backend((8, 16), (1, 2), hilbert=True, lowering="sdpa")


def graph_after(fn, *args):
    report = hilbert_fx.explain(fn, *args, backend=BACKEND)
    code = "\n".join(report.graph_after)
    code = re.sub(r";  [^\n]* = None", "", code)  # drop the "x = None" frees: noise for review
    return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())


def causal_gqa(x, wq, wkv):
    q = (x @ wq).unflatten(-1, (4, 8)).transpose(1, 2)
    k, v = (x @ wkv).unflatten(-1, (2, 2, 8)).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.5)


def cross(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def masked(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


def manual_causal_folded(x, w):
    """Hand-written: heads folded into the batch, scale on q, a causal tril mask, float casts."""
    b, n, _ = x.shape
    q, k, v = (t.reshape(b, n, 2, 8).transpose(1, 2).reshape(b * 2, n, 8) for t in (x @ w).chunk(3, -1))
    s = torch.bmm(q * 0.25, k.transpose(1, 2))
    s = s.masked_fill(torch.tril(torch.ones(n, n)) == 0, float("-inf"))
    p = F.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.bmm(p, v).view(b, 2, n, 8).transpose(1, 2).reshape(b, n, 16)


def manual_alibi_baddbmm(x, w, bias, mask):
    """Bloom: beta * alibi + alpha * q k^T over [B*H, N, N], unfolded to [B, H, N, N] for the
    padding mask and the softmax, folded back for the product with v."""
    b, n, _ = x.shape
    q, k, v = (t.reshape(b, n, 2, 8).transpose(1, 2).reshape(b * 2, n, 8) for t in (x @ w).chunk(3, -1))
    s = bias.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=0.5, alpha=0.25)
    p = F.softmax(s.view(b, 2, n, -1) + mask, dim=-1, dtype=torch.float32)
    return torch.bmm(p.view(b * 2, n, -1), v).view(b, 2, n, 8).transpose(1, 2).reshape(b, n, 16)


MHA = torch.nn.MultiheadAttention(16, 2, batch_first=True)


def mha_padded(x, padding):
    return MHA(x, x, x, key_padding_mask=padding, need_weights=False)[0]


class GoldenGraphs(expecttest.TestCase):
    def test_manual_attention_folded_heads_causal(self):
        x, w = torch.randn(1, 10, 16), torch.nn.Parameter(torch.randn(16, 48))
        self.assertExpectedInline(graph_after(manual_causal_folded, x, w), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_w_ = L_w_
    matmul = l_x_ @ l_w_
    chunk = matmul.chunk(3, -1)
    t = chunk[0]
    t_1 = chunk[1]
    t_2 = chunk[2]
    reshape = t.reshape(1, 10, 2, 8)
    transpose = reshape.transpose(1, 2)
    q = transpose.reshape(2, 10, 8)
    reshape_2 = t_1.reshape(1, 10, 2, 8)
    transpose_1 = reshape_2.transpose(1, 2)
    k = transpose_1.reshape(2, 10, 8)
    reshape_4 = t_2.reshape(1, 10, 2, 8)
    transpose_2 = reshape_4.transpose(1, 2)
    v = transpose_2.reshape(2, 10, 8)
    mul = q * 0.25
    unflatten = mul.unflatten(0, (-1, 2))
    unflatten_1 = k.unflatten(0, (-1, 2))
    unflatten_2 = v.unflatten(0, (-1, 2))
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(unflatten, unflatten_1, unflatten_2, [8, 16], [1, 2], True, True, None, 0.0, None, 1.0, 'sdpa')
    getitem_3 = dilated_attention_default[0]
    flatten = getitem_3.flatten(0, 1)
    view = flatten.view(1, 2, 10, 8)
    transpose_4 = view.transpose(1, 2)
    reshape_6 = transpose_4.reshape(1, 10, 16)
    return (reshape_6,)""")

    def test_manual_attention_alibi_baddbmm_regrouped(self):
        x, w = torch.randn(2, 10, 16), torch.nn.Parameter(torch.randn(16, 48))
        bias = torch.arange(10.0).expand(4, 1, 10)
        mask = torch.zeros(2, 1, 10, 10)
        mask[1, ..., -3:] = float("-inf")
        self.assertExpectedInline(graph_after(manual_alibi_baddbmm, x, w, bias, mask), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.nn.parameter.Parameter, L_bias_ : torch.Tensor, L_mask_ : torch.Tensor):
    l_x_ = L_x_
    l_w_ = L_w_
    l_bias_ = L_bias_
    l_mask_ = L_mask_
    matmul = l_x_ @ l_w_
    chunk = matmul.chunk(3, -1)
    t = chunk[0]
    t_1 = chunk[1]
    t_2 = chunk[2]
    reshape = t.reshape(2, 10, 2, 8)
    transpose = reshape.transpose(1, 2)
    q = transpose.reshape(4, 10, 8)
    reshape_2 = t_1.reshape(2, 10, 2, 8)
    transpose_1 = reshape_2.transpose(1, 2)
    k = transpose_1.reshape(4, 10, 8)
    reshape_4 = t_2.reshape(2, 10, 2, 8)
    transpose_2 = reshape_4.transpose(1, 2)
    v = transpose_2.reshape(4, 10, 8)
    unflatten = q.unflatten(0, (-1, 2))
    unflatten_1 = k.unflatten(0, (-1, 2))
    unflatten_2 = v.unflatten(0, (-1, 2))
    combine_masks = hilbert_fx_detect_combine_masks((('add', 1.0), ('add', 0.5)), 2, l_mask_, l_bias_)
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(unflatten, unflatten_1, unflatten_2, [8, 16], [1, 2], True, False, combine_masks, 0.0, None, 0.25, 'sdpa')
    getitem_3 = dilated_attention_default[0]
    flatten = getitem_3.flatten(0, 1)
    view_2 = flatten.view(2, 2, 10, 8)
    transpose_4 = view_2.transpose(1, 2)
    reshape_6 = transpose_4.reshape(2, 10, 16)
    return (reshape_6,)""")

    def test_multihead_attention_with_padding(self):
        x = torch.randn(2, 10, 16)
        padding = torch.zeros(2, 10, dtype=torch.bool)
        padding[1, -3:] = True
        self.assertExpectedInline(graph_after(mha_padded, x, padding), """\
def forward(self, L_padding_ : torch.Tensor, L_x_ : torch.Tensor, G_MHA_parameters_in_proj_bias_ : torch.nn.parameter.Parameter, G_MHA_parameters_in_proj_weight_ : torch.nn.parameter.Parameter, G_MHA_modules_out_proj_parameters_weight_ : torch.nn.parameter.Parameter, G_MHA_modules_out_proj_parameters_bias_ : torch.nn.parameter.Parameter):
    l_padding_ = L_padding_
    l_x_ = L_x_
    g_mha_parameters_in_proj_bias_ = G_MHA_parameters_in_proj_bias_
    g_mha_parameters_in_proj_weight_ = G_MHA_parameters_in_proj_weight_
    g_mha_modules_out_proj_parameters_weight_ = G_MHA_modules_out_proj_parameters_weight_
    g_mha_modules_out_proj_parameters_bias_ = G_MHA_modules_out_proj_parameters_bias_
    zeros_like = torch.zeros_like(l_padding_, dtype = torch.float32)
    mask = zeros_like.masked_fill_(l_padding_, -inf)
    query = l_x_.transpose(1, 0)
    mha_in_projection = hilbert_fx_detect_mha_mha_in_projection(query, query, query, 2, False, g_mha_parameters_in_proj_weight_, g_mha_parameters_in_proj_bias_)
    getitem_1 = mha_in_projection[0]
    getitem_2 = mha_in_projection[1]
    getitem_3 = mha_in_projection[2]
    unsqueeze = mask.unsqueeze(1)
    unsqueeze_1 = unsqueeze.unsqueeze(1)
    combine_masks = hilbert_fx_detect_combine_masks((('add', 1.0),), 2, unsqueeze_1)
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(getitem_1, getitem_2, getitem_3, [8, 16], [1, 2], True, False, combine_masks, 0.0, None, 0.35355339059327373, 'sdpa')
    getitem_4 = dilated_attention_default[0]
    mha_out_projection = hilbert_fx_detect_mha_mha_out_projection(getitem_4, g_mha_modules_out_proj_parameters_weight_, g_mha_modules_out_proj_parameters_bias_, False)
    attn_output_1 = mha_out_projection.transpose(1, 0)
    return (attn_output_1,)""")

    def test_sdpa_causal_gqa(self):
        x = torch.randn(1, 10, 16)
        wq, wkv = torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(16, 32))
        self.assertExpectedInline(graph_after(causal_gqa, x, wq, wkv), """\
def forward(self, L_x_ : torch.Tensor, L_wq_ : torch.nn.parameter.Parameter, L_wkv_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_wq_ = L_wq_
    l_wkv_ = L_wkv_
    matmul = l_x_ @ l_wq_
    unflatten = matmul.unflatten(-1, (4, 8))
    q = unflatten.transpose(1, 2)
    matmul_1 = l_x_ @ l_wkv_
    unflatten_1 = matmul_1.unflatten(-1, (2, 2, 8))
    permute = unflatten_1.permute(2, 0, 3, 1, 4)
    k = permute[0]
    v = permute[1]
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(q, k, v, [8, 16], [1, 2], True, True, None, 0.0, None, 0.5, 'sdpa')
    getitem_2 = dilated_attention_default[0]
    return (getitem_2,)""")

    def test_queries_and_keys_from_different_inputs_are_left_intact(self):
        q, k = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
        self.assertExpectedInline(graph_after(cross, q, k, k), """\
def forward(self, L_q_ : torch.Tensor, L_k_ : torch.Tensor):
    l_q_ = L_q_
    l_k_ = L_k_
    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(l_q_, l_k_, l_k_)
    return (scaled_dot_product_attention,)""")

    def test_sdpa_with_mask(self):
        q = torch.randn(2, 2, 10, 8)
        mask = torch.rand(2, 1, 10, 10) > 0.5
        self.assertExpectedInline(graph_after(masked, q, q, q, mask), """\
def forward(self, L_q_ : torch.Tensor, L_mask_ : torch.Tensor):
    l_q_ = L_q_
    l_mask_ = L_mask_
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(l_q_, l_q_, l_q_, [8, 16], [1, 2], True, False, l_mask_, 0.0, None, 0.35355339059327373, 'sdpa')
    getitem = dilated_attention_default[0]
    mul = getitem * 2
    return (mul,)""")


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else None
