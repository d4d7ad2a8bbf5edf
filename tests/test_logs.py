"""TORCH_LOGS=hilbert_fx shows each site's decision and the lowering chosen, once per site."""
import os
import subprocess
import sys

CODE = """
import torch, torch.nn as nn, torch.nn.functional as F
import hilbert_fx

class M(nn.Module):
    def forward(self, x, y):
        a = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        return a, F.scaled_dot_product_attention(x, y, y)  # cross-attention: skipped

be = hilbert_fx.backend(segment_lengths=(8, 16), dilation_rates=(1, 2))
torch.compile(M(), backend=be)(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 24, 8))
"""


def test_torch_logs_show_each_decision_once():
    env = dict(os.environ, TORCH_LOGS="hilbert_fx")
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(__file__))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [l for l in res.stderr.splitlines() if "attention in" in l]
    assert len(lines) == 2, lines
    assert "rewritten, lowering=sdpa, branches (8,1), (16,2)" in lines[0] + lines[1]
    assert any("skipped:" in l for l in lines), lines


KERNEL_CODE = """
import torch
import hilbert_fx
q = torch.randn(1, 2, 64, 16)
hilbert_fx.dilated_attention(q, q, q, [32, 64], [1, 2], lowering="triton")
"""


def test_torch_logs_show_the_forward_kernel_of_each_branch():
    env = dict(os.environ, TORCH_LOGS="hilbert_fx", TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", KERNEL_CODE], capture_output=True, text=True,
                         env=env, timeout=300, cwd=os.path.dirname(__file__))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [l for l in res.stderr.splitlines() if "forward: Triton kernel" in l]
    assert len(lines) == 2, res.stderr[-3000:]
    assert all("not the Hopper one: not a compute capability 9.x GPU" in l for l in lines), lines
    assert "branch (32, 1)" in lines[0] + lines[1] and "branch (64, 2)" in lines[0] + lines[1]
