"""torch.library.opcheck on the op: schema, fake implementation, autograd registration and
AOT dispatch agree with the real implementation."""
from __future__ import annotations

import pytest
import torch

import hilbert_fx.lowering as lowering  # noqa: F401  (registers the op)

OP = torch.ops.hilbert_fx.dilated_attention.default


def cases():
    torch.manual_seed(0)
    n = 13
    q, k, v = (torch.randn(2, 4, n, 8, requires_grad=True) for _ in range(3))
    k2, v2 = (torch.randn(2, 2, n, 8, requires_grad=True) for _ in range(2))
    mask = torch.rand(2, 1, n, n) > 0.3
    yield "plain", (q, k, v, [4, 8], [1, 2], False, False, None, 0.0, None, 0.3, "sdpa")
    yield "hilbert_causal", (q, k, v, [5, 10], [1, 5], True, True, None, 0.0, None, 0.3, "sdpa")
    yield "gqa_mask", (q, k2, v2, [6], [2], True, False, mask, 0.0, None, 0.3, "sdpa")
    yield "float_mask", (q, k, v, [16], [4], True, False, torch.randn(n, n), 0.0, None, 0.3, "sdpa")
    yield "dropout", (q, k, v, [4, 8], [1, 2], True, True, None, 0.25,
                      torch.tensor(1234), 0.3, "sdpa")


@pytest.mark.parametrize("name,args", list(cases()), ids=[c[0] for c in cases()])
def test_opcheck(name, args):
    torch.library.opcheck(OP, args)
