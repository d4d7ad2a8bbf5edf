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


def packed_documents(x, w, position_ids):
    """transformers' packed sequences: causal over position ids and same run of consecutive ids."""
    b, n, _ = x.shape
    q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
    documents = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    batch = torch.arange(b)[:, None, None, None]
    qi, ki = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    mask = (position_ids[batch, ki] <= position_ids[batch, qi]) & (
        documents[batch, qi] == documents[batch, ki])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def encoder_padded(x, w, attention_mask):
    """An encoder over a 2-D padding mask, as transformers builds it for BERT and RoBERTa
    (sdpa_mask: bidirectional, q_idx >= 0, and the key not padding, expanded to [B, 1, N, N])."""
    b, n, _ = x.shape
    q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
    padding = attention_mask.bool()
    batch = torch.arange(b)[:, None, None, None]
    qi, ki = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    mask = ((qi >= 0) & padding[batch, ki]).expand(b, -1, n, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_dynamic_cache(x, w, past_k, past_v):
    """One query against a DynamicCache: the cached rows and this step's, concatenated."""
    q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
    k, v = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
    return F.scaled_dot_product_attention(q, k, v)


def decode_static_cache(x, w, k_cache, v_cache, length):
    """One query against a StaticCache: this step's rows written at the cache length, the mask
    from the same length (the buffer is longer than what it holds)."""
    q, k, v = (x @ w).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
    rows = torch.arange(x.shape[1]) + length
    k_cache.index_copy_(2, rows, k)
    v_cache.index_copy_(2, rows, v)
    qi = (torch.arange(x.shape[1]) + length)[None, None, :, None]
    ki = torch.arange(k_cache.shape[2])[None, None, None, :]
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=ki <= qi)


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


    def test_sdpa_packed_documents(self):
        x, w = torch.randn(1, 12, 16), torch.nn.Parameter(torch.randn(16, 48))
        position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
        self.assertExpectedInline(graph_after(packed_documents, x, w, position_ids), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.nn.parameter.Parameter, L_position_ids_ : torch.Tensor):
    l_x_ = L_x_
    l_w_ = L_w_
    l_position_ids_ = L_position_ids_
    run_positions = hilbert_fx_structure_run_positions(l_position_ids_)
    matmul = l_x_ @ l_w_
    unflatten = matmul.unflatten(-1, (3, 2, 8))
    permute = unflatten.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(q, k, v, [8, 16], [1, 2], True, True, None, 0.0, None, 0.35355339059327373, 'sdpa', run_positions, None)
    getitem_11 = dilated_attention_default[0]
    return (getitem_11,)""")

    def test_sdpa_encoder_with_padding(self):
        x, w = torch.randn(2, 12, 16), torch.nn.Parameter(torch.randn(16, 48))
        attention_mask = torch.ones(2, 12, dtype=torch.long)
        attention_mask[1, :5] = 0
        self.assertExpectedInline(graph_after(encoder_padded, x, w, attention_mask), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.nn.parameter.Parameter, L_attention_mask_ : torch.Tensor):
    l_x_ = L_x_
    l_w_ = L_w_
    l_attention_mask_ = L_attention_mask_
    matmul = l_x_ @ l_w_
    unflatten = matmul.unflatten(-1, (3, 2, 8))
    permute = unflatten.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    padding = l_attention_mask_.bool()
    padding_positions = hilbert_fx_structure_padding_positions(padding)
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(q, k, v, [8, 16], [1, 2], True, False, None, 0.0, None, 0.35355339059327373, 'sdpa', padding_positions, None)
    getitem_7 = dilated_attention_default[0]
    return (getitem_7,)""")

    def test_sdpa_decoding_against_a_dynamic_cache(self):
        x, w = torch.randn(1, 1, 16), torch.nn.Parameter(torch.randn(16, 48))
        past = torch.randn(1, 2, 9, 8)
        self.assertExpectedInline(graph_after(decode_dynamic_cache, x, w, past, past * 2), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.nn.parameter.Parameter, L_past_k_ : torch.Tensor, L_past_v_ : torch.Tensor):
    l_x_ = L_x_
    l_w_ = L_w_
    l_past_k_ = L_past_k_
    l_past_v_ = L_past_v_
    matmul = l_x_ @ l_w_
    unflatten = matmul.unflatten(-1, (3, 2, 8))
    permute = unflatten.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    k_1 = torch.cat([l_past_k_, k], dim = -2)
    v_1 = torch.cat([l_past_v_, v], dim = -2)
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(q, k_1, v_1, [8, 16], [1, 2], True, True, None, 0.0, None, 0.35355339059327373, 'sdpa', None, None)
    getitem_3 = dilated_attention_default[0]
    return (getitem_3,)""")

    def test_sdpa_decoding_against_a_static_cache(self):
        x, w = torch.randn(1, 1, 16), torch.nn.Parameter(torch.randn(16, 48))
        k_cache, v_cache = torch.zeros(1, 2, 32, 8), torch.zeros(1, 2, 32, 8)
        self.assertExpectedInline(graph_after(decode_static_cache, x, w, k_cache, v_cache,
                                              torch.tensor(9)), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.nn.parameter.Parameter, L_length_ : torch.Tensor, L_k_cache_ : torch.Tensor, L_v_cache_ : torch.Tensor):
    l_x_ = L_x_
    l_w_ = L_w_
    l_length_ = L_length_
    l_k_cache_ = L_k_cache_
    l_v_cache_ = L_v_cache_
    tensor_offset = hilbert_fx_structure_tensor_offset(l_length_, 0)
    matmul = l_x_ @ l_w_
    unflatten = matmul.unflatten(-1, (3, 2, 8))
    permute = unflatten.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    arange = torch.arange(1)
    rows = arange + l_length_
    index_copy_ = l_k_cache_.index_copy_(2, rows, k)
    index_copy__1 = l_v_cache_.index_copy_(2, rows, v)
    cache_lengths = hilbert_fx_structure_cache_lengths(tensor_offset, q)
    dilated_attention_default = torch.ops.hilbert_fx.dilated_attention.default(q, l_k_cache_, l_v_cache_, [8, 16], [1, 2], True, True, None, 0.0, None, 0.35355339059327373, 'sdpa', None, cache_lengths)
    getitem_5 = dilated_attention_default[0]
    return (getitem_5,)""")


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else None
