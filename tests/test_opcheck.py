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
    # SPEC section 5: packed rows with padding, and queries against a cache (decode path, and
    # a chunk long enough for the path that places the queries at their rows)
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, -1, -1]]).expand(2, n).contiguous()
    yield "packed", (q, k, v, [4, 8], [1, 2], True, True, None, 0.0, None, 0.3, "sdpa", packed, None)
    used = torch.tensor([13, 9])
    q1 = torch.randn(2, 4, 1, 8, requires_grad=True)
    yield "decode", (q1, k2, v2, [4, 8], [1, 2], True, True, None, 0.0, None, 0.3, "sdpa", None, used)
    qs = torch.randn(2, 4, 40, 8, requires_grad=True)
    ks, vs = (torch.randn(2, 2, 50, 8, requires_grad=True) for _ in range(2))
    yield "chunk", (qs, ks, vs, [16], [2], False, True, None, 0.0, None, 0.3, "sdpa", None,
                    torch.tensor([50, 44]))


@pytest.mark.parametrize("name,args", list(cases()), ids=[c[0] for c in cases()])
def test_opcheck(name, args):
    torch.library.opcheck(OP, args)


def test_packed_rows_run_the_op_that_cuda_graphs_capture():
    """Packed rows build their plans on the device, reading nothing on the host: they run the
    one op, which no tag keeps out of CUDA graphs."""
    assert not hasattr(torch.ops.hilbert_fx, "dilated_attention_varlen")
    tags = getattr(OP, "tags", ())
    assert all(t.name != "cudagraph_unsafe" for t in tags)


