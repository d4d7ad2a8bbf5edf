"""Golden rewritten graphs under a device mesh: the pass inserts the ring op (SPEC section 4).

The graph a rank compiles does not depend on the number of ranks, so these run in this process
on a one-rank gloo group (the collectives of tests/test_ring.py run across 2 and 4 processes).
The group's name is written GROUP.

Regenerate after an intended change with: EXPECTTEST_ACCEPT=1 python -m pytest tests/test_ring_graph.py
"""
from __future__ import annotations

import re

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hilbert_fx

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)


def graph_after(fn, *args, mesh):
    be = hilbert_fx.backend((8, 16), (1, 2), hilbert=True, lowering="sdpa", mesh=mesh)
    report = hilbert_fx.explain(fn, *args, backend=be)
    code = "\n".join(report.graph_after)
    code = code.replace(repr(mesh.get_group().group_name), "'GROUP'")
    code = re.sub(r";  [^\n]* = None", "", code)  # drop the "x = None" frees: noise for review
    code = "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())
    return code, report


def causal_gqa(x, wq, wkv):
    q = (x @ wq).unflatten(-1, (4, 8)).transpose(1, 2)
    k, v = (x @ wkv).unflatten(-1, (2, 2, 8)).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.5)


def masked(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


class RingGoldenGraphs(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.own_group = not dist.is_initialized()
        if cls.own_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        cls.mesh = init_device_mesh("cpu", (1,))

    @classmethod
    def tearDownClass(cls):
        if cls.own_group:
            dist.destroy_process_group()

    def test_sdpa_causal_gqa_becomes_the_ring_op(self):
        x = torch.randn(1, 16, 16)
        wq, wkv = torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(16, 32))
        code, report = graph_after(causal_gqa, x, wq, wkv, mesh=self.mesh)
        self.assertEqual([s.action for s in report.sites], ["rewritten"])
        self.assertExpectedInline(code, """\
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
    ring_dilated_attention_default = torch.ops.hilbert_fx.ring_dilated_attention.default(q, k, v, [8, 16], [1, 2], True, True, None, 0.0, None, 0.5, 'sdpa', 'GROUP')
    getitem_2 = ring_dilated_attention_default[0]
    return (getitem_2,)""")

    def test_masked_site_is_skipped_under_a_mesh(self):
        q = torch.randn(2, 2, 16, 8)
        mask = torch.rand(2, 1, 16, 16) > 0.5
        code, report = graph_after(masked, q, q, q, mask, mesh=self.mesh)
        self.assertEqual([(s.action, s.reason) for s in report.sites],
                         [("skipped", "attn_mask with mesh=: the ring op over a device mesh "
                                      "takes no mask")])
        self.assertExpectedInline(code, """\
def forward(self, L_q_ : torch.Tensor, L_mask_ : torch.Tensor):
    l_q_ = L_q_
    l_mask_ = L_mask_
    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(l_q_, l_q_, l_q_, attn_mask = l_mask_)
    mul = scaled_dot_product_attention * 2
    return (mul,)""")
