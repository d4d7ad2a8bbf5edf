"""Under torch.autocast the op behaves as SDPA does: q, k, v (and a float mask) are cast to the
autocast dtype. Without autocast, q, k, v of different dtypes are an error naming them.

Hugging Face Llama under autocast hands SDPA float32 q, k (RoPE multiplies by float32 cos/sin)
and a bfloat16 v; the rewritten site must run in bfloat16 like SDPA does, not in float32."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hilbert_fx
from reference import reference_dilated_attention

SEGS, RATES = [8, 16], [1, 2]


def test_mixed_dtypes_without_autocast_name_the_tensors():
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    v = torch.randn(1, 2, 20, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q, k and v must have the same dtype.*v torch.bfloat16"):
        hilbert_fx.dilated_attention(q, k, v, SEGS, RATES)


@pytest.mark.parametrize("causal", [False, True])
def test_autocast_casts_inputs_like_sdpa(causal):
    n = 37
    q, k = torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 8)
    v = torch.randn(2, 2, n, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hilbert_fx.dilated_attention(q, k, v, SEGS, RATES, hilbert=True, is_causal=causal)
    assert out.dtype == torch.bfloat16
    qb, kb = q.bfloat16(), k.bfloat16()  # what autocast hands the op
    ref = reference_dilated_attention(qb.double(), kb.double(), v.double(), SEGS, RATES, hilbert=True,
                                      is_causal=causal)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    # the tolerance above cannot tell bf16 inputs from float32 ones (1.7e-3 against 2.6e-3):
    # the cast itself is checked as bitwise equality with the op on explicitly cast inputs,
    # which a float32 run (q, k left as they are, v widened) does not give
    assert torch.equal(out, hilbert_fx.dilated_attention(qb, kb, v, SEGS, RATES, hilbert=True,
                                                         is_causal=causal))
    widened = hilbert_fx.dilated_attention(q, k, v.float(), SEGS, RATES, hilbert=True,
                                           is_causal=causal)
    assert not torch.equal(out, widened.bfloat16())


class RopeLikeAttention(nn.Module):
    """q and k leave the block in float32 (as Llama's RoPE under autocast), v in bfloat16."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.cos = nn.Parameter(torch.rand(8))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q * self.cos, k * self.cos, v, is_causal=True)


def test_compiled_site_under_autocast_runs_in_the_autocast_dtype():
    torch.manual_seed(0)
    m, x = RopeLikeAttention(), torch.randn(2, 30, 16)
    be = hilbert_fx.backend(segment_lengths=(64,), dilation_rates=(1,))  # identity: equals SDPA
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = m(x)
        report = hilbert_fx.explain(m, x, backend=be)
        compiled = torch.compile(m, backend=be)(x)
    assert [s.action for s in report.sites] == ["rewritten"]
    assert eager.dtype == compiled.dtype == torch.bfloat16
    assert (compiled.float() - eager.float()).abs().max() < 2e-2
