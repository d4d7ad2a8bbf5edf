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


class GoldenGraphs(expecttest.TestCase):
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
