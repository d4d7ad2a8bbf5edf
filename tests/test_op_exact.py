"""hilbert_fx.dilated_attention against the independent float64 reference (SPEC section 2)."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():  # Triton can only run interpreted here (SPEC section 3)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hilbert_fx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import reference_dilated_attention  # noqa: E402

LOWERINGS = ["sdpa", "triton"]


def op(q, k, v, segs, rates, lowering="sdpa", **kw):
    return hilbert_fx.dilated_attention(q, k, v, list(segs), list(rates), lowering=lowering, **kw)


def require_lowering(lowering):
    """Skip cleanly when the Triton lowering cannot run here."""
    if lowering != "triton":
        return
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        pytest.skip(f"triton not importable: {e!r}")


def assert_matches(got, ref, what, rel=1e-5, atol=1e-5, rtol=1e-5, scale=None):
    """||got-ref|| <= rel*||ref|| (+ slack) and element-wise allclose.

    The absolute slack is atol times `scale`, the size of the numbers involved (default: the
    largest |ref| entry, at least 1). Float32 rounding is relative to the terms summed, not to
    the result: dq is exactly 0 when every query has one key (counted twice), yet the op's
    merge of two branches leaves ~1e-6-size noise there; an entry near 0 of a gradient whose
    entries reach 10 carries rounding of the size of the big ones.
    """
    assert got.shape == ref.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    got = got.detach().double()
    ref = ref.detach().double()
    if scale is None:
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    err, nrm = (got - ref).norm().item(), ref.norm().item()
    assert err <= rel * nrm + atol * scale * math.sqrt(ref.numel()), \
        f"{what}: ||got-ref||={err:.3g}, ||ref||={nrm:.3g}"
    torch.testing.assert_close(got, ref, atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def common_scale(*tensors):
    """The size of the numbers of one problem: max |entry| over its reference results."""
    return max([1.0] + [t.detach().abs().max().item() for t in tensors if t.numel()])


def run_both(cfg, dtype=torch.float32, lowering="sdpa", grads=True, transposed=False):
    """Draw inputs from cfg, run op and reference; return (outputs, grads) of each.
    transposed: q, k, v laid out as [B, N, H, D] in memory, as a model's projections give them."""
    torch.manual_seed(cfg["seed"])
    B, Hq, Hkv, N, D = cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["N"], cfg["D"]

    def draw(h):
        x = torch.randn(B, N, h, D, dtype=dtype).transpose(1, 2) if transposed \
            else torch.randn(B, h, N, D, dtype=dtype)
        return x.requires_grad_(grads)
    q, k, v = draw(Hq), draw(Hkv), draw(Hkv)
    kw = dict(hilbert=cfg["hilbert"], is_causal=cfg["causal"], scale=cfg["scale"],
              enable_gqa=cfg["gqa"])
    mask = cfg["mask"]
    if mask is not None:
        kind, shape, full_rows = mask
        shape = [{"B": B, "H": Hq, "N": N, "1": 1}[c] for c in shape]
        if kind == "bool":
            m = torch.rand(shape) > 0.3
            if full_rows:
                m[..., N // 2, :] = False
        else:
            m = 2 * torch.randn(shape)
            m[torch.rand(shape) < 0.25] = float("-inf")
            if full_rows:
                m[..., N // 2, :] = float("-inf")
            m = m.to(dtype)
        kw["attn_mask"] = m
    out = op(q, k, v, cfg["segs"], cfg["rates"], lowering=lowering, **kw)
    # the reference sees the same (rounded) values, as float64 leaves of its own
    q64, k64, v64 = (t.detach().double().requires_grad_(grads) for t in (q, k, v))
    ref = reference_dilated_attention(q64, k64, v64, cfg["segs"], cfg["rates"], **kw)
    if not grads:
        return out, ref, None, None
    g = torch.randn(out.shape, dtype=torch.float64).to(out.dtype)  # the same g for both
    g_out = torch.autograd.grad(out, (q, k, v), g)
    g_ref = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    return out, ref, g_out, g_ref


@st.composite
def configs(draw, max_n=40, max_heads=4, max_branches=3):
    branches = []
    for _ in range(draw(st.integers(1, max_branches))):
        r = draw(st.sampled_from([1, 1, 2, 3, 4]))
        w = r * draw(st.integers(1, 9)) if draw(st.integers(0, 4)) else r * 16  # w <= 64
        branches.append((w, r))
    Hq = draw(st.integers(1, max_heads))
    gqa = draw(st.booleans())
    Hkv = draw(st.sampled_from([d for d in range(1, Hq + 1) if Hq % d == 0])) if gqa else Hq
    masking = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    mask = None
    if masking in ("bool", "float"):
        shape = draw(st.sampled_from(["NN", "B1NN", "1HNN", "BHNN"]))
        mask = (masking, shape, draw(st.booleans()))
    return dict(
        segs=[w for w, _ in branches], rates=[r for _, r in branches],
        N=draw(st.sampled_from(range(1, max_n + 1))),  # uniform: integers() favours 1
        B=draw(st.integers(1, 2)), Hq=Hq, Hkv=Hkv, gqa=gqa,
        D=draw(st.sampled_from([4, 8, 16])), hilbert=draw(st.booleans()),
        causal=masking == "causal", mask=mask,
        scale=draw(st.sampled_from([None, None, 0.1, 0.7, 1.3, -0.5])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_matches_reference(lowering):
    require_lowering(lowering)
    tiny = lowering == "triton"  # the interpreter is slow: few, small examples

    @settings(max_examples=10 if tiny else 150, deadline=None, derandomize=tiny,
              suppress_health_check=[HealthCheck.too_slow])
    @given(configs(max_n=12 if tiny else 40, max_heads=2 if tiny else 4,
                   max_branches=2 if tiny else 3))
    def check(cfg):
        out, ref, g_out, g_ref = run_both(cfg, lowering=lowering)
        assert out.dtype == torch.float32
        assert_matches(out, ref, f"out {cfg}")
        sc = common_scale(ref, *g_ref)
        for name, a, b in zip("qkv", g_out, g_ref):
            assert_matches(a, b, f"d{name} {cfg}", scale=sc)

    check()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_negative_scale_causal(lowering):
    """PyTorch's CPU SDPA kernel returns NaN for a negative scale with is_causal
    (F.scaled_dot_product_attention too); the SDPA lowering passes it -q and -scale instead."""
    require_lowering(lowering)
    cfg = dict(segs=[16, 8], rates=[1, 2], N=13, B=1, Hq=2, Hkv=2, gqa=False, D=4,
               hilbert=True, causal=True, mask=None, scale=-0.5, seed=0)
    out, ref, g_out, g_ref = run_both(cfg, lowering=lowering)
    assert_matches(out, ref, f"out {cfg}")
    sc = common_scale(ref, *g_ref)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name} {cfg}", scale=sc)


def _cfg(**kw):
    base = dict(segs=[4, 8], rates=[1, 2], N=13, B=2, Hq=4, Hkv=2, gqa=True, D=8, hilbert=True,
                causal=False, mask=None, scale=None, seed=0)
    base.update(kw)
    return base


# A few fixed configurations that hypothesis might only reach by luck.
FIXED = [
    _cfg(),
    _cfg(N=5, segs=[8], rates=[2]),                                 # N < w
    _cfg(N=37, segs=[6, 12, 24], rates=[1, 2, 3], causal=True),      # non-power-of-two w
    _cfg(N=31, segs=[9, 30], rates=[3, 5], mask=("float", "BHNN", True)),
    _cfg(N=20, segs=[16, 64], rates=[4, 8], mask=("bool", "B1NN", True), Hkv=1),
    _cfg(N=17, segs=[1, 3], rates=[1, 3], hilbert=False, scale=0.25, gqa=False, Hkv=4),
]


@pytest.mark.parametrize("cfg", FIXED, ids=lambda c: f"N{c['N']}-{c['segs']}-{c['rates']}")
def test_fixed_configs(cfg):
    out, ref, g_out, g_ref = run_both(cfg)
    assert_matches(out, ref, "out")
    sc = common_scale(ref, *g_ref)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name}", scale=sc)


@pytest.mark.parametrize("cfg", FIXED[:4], ids=lambda c: f"N{c['N']}-{c['segs']}-{c['rates']}")
def test_float64(cfg):
    out, ref, g_out, g_ref = run_both(cfg, dtype=torch.float64)
    assert out.dtype == torch.float64
    assert_matches(out, ref, "out", rel=1e-10, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name}", rel=1e-10, atol=1e-10, rtol=1e-10)


def test_float64_gradcheck():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True)
    f = lambda q, k, v: op(q, k, v, [2, 4], [1, 2], hilbert=True, enable_gqa=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("cfg", FIXED[:4], ids=lambda c: f"N{c['N']}-{c['segs']}-{c['rates']}")
def test_bfloat16(cfg):
    out, ref, g_out, g_ref = run_both(cfg, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # reference sees the same bf16-rounded inputs; error is the op's bf16 output rounding etc.
    assert_matches(out, ref, "out", rel=2e-2, atol=2e-2, rtol=2e-2)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert a.dtype == torch.bfloat16
        assert_matches(a, b, f"d{name}", rel=5e-2, atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------- identity: one branch (w >= N, 1)

@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("hilbert", [False, True])
@pytest.mark.parametrize("w", [11, 16, 50])
@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "gqa", "scale"])
def test_identity_is_sdpa(lowering, hilbert, w, case):
    require_lowering(lowering)
    torch.manual_seed(7)
    B, Hq, Hkv, N, D = (2, 4, 4, 11, 8) if lowering == "sdpa" else (1, 2, 2, 11, 8)
    kw = {}
    if case == "gqa":
        Hkv, kw["enable_gqa"] = Hq // 2, True
    q = torch.randn(B, Hq, N, D, requires_grad=True)
    k = torch.randn(B, Hkv, N, D, requires_grad=True)
    v = torch.randn(B, Hkv, N, D, requires_grad=True)
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool":
        kw["attn_mask"] = torch.rand(B, 1, N, N) > 0.3
    elif case == "float":
        m = torch.randn(1, Hq, N, N)
        m[0, 0, 1, 2:] = float("-inf")
        kw["attn_mask"] = m
    elif case == "scale":
        kw["scale"] = 0.3
    out = op(q, k, v, [w], [1], lowering=lowering, hilbert=hilbert, **kw)
    exp = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(out, exp, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(exp, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- queries without keys

@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("hilbert", [False, True])
def test_queries_without_keys_are_zero(lowering, hilbert):
    require_lowering(lowering)
    torch.manual_seed(3)
    N = 10
    q, k, v = (torch.randn(1, 4, N, 8, requires_grad=True) for _ in range(3))
    m = torch.ones(N, N, dtype=torch.bool)
    m[2] = False                                   # a row masked out entirely
    out = op(q, k, v, [4], [4], hilbert=hilbert, attn_mask=m, lowering=lowering)
    ref = reference_dilated_attention(q, k, v, [4], [4], hilbert=hilbert, attn_mask=m)
    empty = (ref == 0).all(-1)                     # (4,4): each head selects 1 of 4 -> most empty
    assert empty.sum() >= 4 * (N - 3)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert_matches(out, ref, "out")
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_float_mask_minus_inf_rows_are_zero(lowering):
    require_lowering(lowering)
    torch.manual_seed(4)
    N = 9
    q, k, v = (torch.randn(2, 2, N, 4, requires_grad=True) for _ in range(3))
    m = torch.randn(2, 1, N, N)
    m[:, :, 0] = float("-inf")                     # row 0 masked entirely
    m[1, :, 5, :8] = float("-inf")                 # row 5's segments in (4,1) and (8,2) lie
    out = op(q, k, v, [4, 8], [1, 2], attn_mask=m, lowering=lowering)  # in [0, 8): no keys left
    ref = reference_dilated_attention(q, k, v, [4, 8], [1, 2], attn_mask=m)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.equal(out[1, :, 5], torch.zeros_like(out[1, :, 5]))
    assert_matches(out, ref, "out")
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


# ------------------------------------------------------------- dropout

def _dropout_inputs(dtype=torch.float32, N=8, D=4):
    torch.manual_seed(11)
    return [torch.randn(1, 2, N, D, dtype=dtype, requires_grad=True) for _ in range(3)]


SEGS, RATES = [4, 8], [1, 2]


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_dropout_zero_changes_nothing(lowering):
    """dropout_p=0.0 draws no seed (the generator's state is left as it was) and computes the
    attention without dropout: the float64 reference's, forward and backward."""
    require_lowering(lowering)
    q, k, v = _dropout_inputs()
    state = torch.get_rng_state()
    out = op(q, k, v, SEGS, RATES, hilbert=True, dropout_p=0.0, lowering=lowering)
    assert torch.equal(torch.get_rng_state(), state)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_dilated_attention(q64, k64, v64, SEGS, RATES, hilbert=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert_matches(out, ref, "out")
    sc = common_scale(ref, *ref_grads)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_matches(a, b, f"d{name}", scale=sc)


def test_dropout_deterministic_given_seed():
    q, k, v = _dropout_inputs()
    base = op(q, k, v, SEGS, RATES)
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(op(q, k, v, SEGS, RATES, dropout_p=0.3))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
    assert not torch.equal(outs[0], base)


def test_dropout_scales_probabilities_keeps_denominator():
    # v = identity rows (D = N): out[p, :] is then the attention row itself. Each entry must be
    # (kept copies) * P[p, p'] / (C[p, p'] * (1 - p_drop)) with 0 <= kept copies <= C[p, p'],
    # where P is the no-dropout probability and C the branch count (SPEC: dropout as in SDPA).
    from reference import count_matrix
    N, p_drop = 8, 0.3
    q, k, _ = _dropout_inputs(N=N, D=N)
    v = torch.eye(N).expand(1, 2, N, N)
    P = op(q, k, v, SEGS, RATES).detach().double()
    C = count_matrix(N, 2, SEGS, RATES, False)[None]
    seen_drop = False
    for seed in range(5):
        torch.manual_seed(seed)
        out = op(q, k, v, SEGS, RATES, dropout_p=p_drop).detach().double()
        unit = torch.where(C > 0, P / C.clamp(min=1) / (1 - p_drop), torch.ones_like(P))
        copies = out / unit
        assert torch.allclose(copies, copies.round(), atol=1e-4), copies
        assert ((copies.round() >= 0) & (copies.round() <= C)).all()
        assert (out[C == 0] == 0).all()
        seen_drop |= bool((copies.round() < C).any())
    assert seen_drop


def test_dropout_mean_approaches_no_dropout():
    q, k, v = _dropout_inputs()
    p_drop, n = 0.3, 600
    base = op(q, k, v, SEGS, RATES).detach()
    acc = torch.zeros_like(base)
    for seed in range(n):
        torch.manual_seed(seed)
        acc += op(q, k, v, SEGS, RATES, dropout_p=p_drop).detach()
    # Bound on one sample's variance, per element: p/(1-p) * sum_j P[p,j]^2 v[j]^2 (dropping
    # whole probabilities; dropping per branch copy only lowers it). P from the reference.
    v64 = v.detach().double()
    ones = torch.eye(8, dtype=torch.float64).expand(1, 2, 8, 8)
    P = reference_dilated_attention(q.detach(), k.detach(), ones, SEGS, RATES)
    var = p_drop / (1 - p_drop) * (P ** 2) @ (v64 ** 2)
    sigma = (var / n).sqrt().max().item()
    assert (acc / n - base).abs().max().item() < 6 * sigma + 1e-4


def test_dropout_backward_matches_forward():
    q, k, v = (t.detach().double().requires_grad_() for t in _dropout_inputs(N=6, D=3))

    def f(q, k, v):
        torch.manual_seed(1234)  # the same dropout mask at every evaluation
        return op(q, k, v, [2, 4], [1, 2], hilbert=True, dropout_p=0.3)

    assert not torch.equal(f(q, k, v), op(q, k, v, [2, 4], [1, 2], hilbert=True))
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("n,w,r", [(300, 256, 4), (1000, 64, 2), (37, 64, 8)])
def test_kernel_positions_padded(n, w, r):
    """The kernels load a tile of positions, and the next tile's, without a mask: each set's
    members in ascending order (from the reference's Hilbert order), then 0 up to at least one
    whole tile of POSITION_PAD past the set's end."""
    from hilbert_fx.lowering.plans import branch_plan
    from hilbert_fx.lowering.triton_lowering import POSITION_PAD, _plan_tensors
    from reference import hilbert_order
    plan = branch_plan(n, w, r, hilbert=True)
    pos, cnt, strided, _ = _plan_tensors(plan, torch.device("cpu"))
    assert not strided and pos.dtype == torch.int32
    assert pos.shape[-1] >= w // r + POSITION_PAD and pos.shape[-1] % POSITION_PAD == 0
    order = [int(p) for p in hilbert_order(w)]
    for o in range(r):
        for j in range(plan.num_segments):
            expected = sorted(j * w + p for t, p in enumerate(order) if t % r == o and j * w + p < n)
            c = int(cnt[o, j])
            assert c == len(expected)
            assert pos[o, j, :c].tolist() == expected
            assert not pos[o, j, c:].any()


@pytest.mark.parametrize("keep_divisible_m", [True, False])
def test_shrunk_tiles_keep_the_walk_divisible(keep_divisible_m):
    """After running out of GPU resources the launcher retries with _shrunk configs: stages go
    first, then tiles halve, never below 16, the tile walked in whole steps (BLOCK_M for fwd and
    dq, BLOCK_N for dkdv) staying a multiple of the other, until nothing smaller is left."""
    from hilbert_fx.lowering.triton_lowering import TileConfig, _shrunk
    sizes = (16, 32, 64, 128, 256)
    for big in sizes:
        for small in (s for s in sizes if s <= big):
            bm, bn = (big, small) if keep_divisible_m else (small, big)
            cfg, steps = TileConfig(bm, bn, 4, 3), 0
            while True:
                nxt = _shrunk(cfg, keep_divisible_m)
                if nxt is None:
                    assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (16, 16, 1)
                    break
                steps += 1
                if cfg.num_stages > 1:
                    assert (nxt.block_m, nxt.block_n, nxt.num_stages) == (
                        cfg.block_m, cfg.block_n, cfg.num_stages - 1)
                else:
                    assert nxt.block_m * nxt.block_n < cfg.block_m * cfg.block_n
                    assert min(nxt.block_m, nxt.block_n) >= 16
                    b, s = (nxt.block_m, nxt.block_n) if keep_divisible_m else (nxt.block_n, nxt.block_m)
                    assert b % s == 0
                cfg = nxt
            assert steps < 20


class _PoisonedTorch:
    """torch, except that torch.empty returns NaN-filled floating tensors: a kernel that reads a
    buffer row nothing wrote then yields NaN instead of whatever the allocator left there."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


# Backward launch orders of the Triton lowering: an r == 1 branch last writing the inputs'
# dtype after float32 sums of non-nested Hilbert sets; no r == 1 branch at all; a GQA group
# larger than r (a dK/dV program loops over the heads of its offset class); and an r == 1
# branch alone (no float32 buffer). N crosses the interpreter's 16- and 32-row tiles.
TRITON_ORDERS = [
    _cfg(N=45, segs=[8, 18, 40], rates=[1, 2, 4], B=1, Hq=4, Hkv=4, gqa=False, D=8),
    _cfg(N=41, segs=[6, 24], rates=[2, 3], B=2, Hq=3, Hkv=3, gqa=False, causal=True),
    _cfg(N=38, segs=[20, 12], rates=[2, 1], B=1, Hq=4, Hkv=1, mask=("bool", "BHNN", True)),
    _cfg(N=35, segs=[16], rates=[1], B=1, Hq=2, Hkv=1),
]


@pytest.mark.parametrize("atomic_dq", ["0", "1"])
@pytest.mark.parametrize("cfg", TRITON_ORDERS, ids=lambda c: f"N{c['N']}-{c['segs']}-{c['rates']}")
def test_triton_backward_orders(cfg, atomic_dq, monkeypatch):
    """The Triton lowering's backward adds each branch's share into float32 buffers that are
    never zeroed, reading only rows an earlier launch wrote, and lets the r == 1 branch write
    the final gradients: poisoned buffers show any read of a row nobody wrote."""
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering, tuning
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    monkeypatch.setenv("HILBERT_FX_TRITON_ATOMIC_DQ", atomic_dq)
    monkeypatch.setattr(tuning, "_current", None)  # the knobs are read once: read them again
    out, ref, g_out, g_ref = run_both(cfg, lowering="triton")
    assert_matches(out, ref, "out")
    sc = common_scale(ref, *g_ref)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name}", scale=sc)


def test_triton_dq_summed_in_float32_reaches_q_layout(monkeypatch):
    """dq summed by atomics in a float32 buffer is cast into q's dtype and layout by its own
    launch (triton_kernels._cast_dq): q, k, v transposed as [B, N, H, D] in memory, the
    gradients against the reference and laid out as their inputs."""
    require_lowering("triton")
    from hilbert_fx.lowering import tuning
    monkeypatch.setenv("HILBERT_FX_TRITON_ATOMIC_DQ", "1")
    monkeypatch.setattr(tuning, "_current", None)
    cfg = _cfg(N=45, segs=[8, 18, 40], rates=[1, 2, 4], B=2, Hq=4, Hkv=2, gqa=True, D=8,
               causal=True)
    out, ref, g_out, g_ref = run_both(cfg, lowering="triton", transposed=True)
    assert_matches(out, ref, "out")
    sc = common_scale(ref, *g_ref)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name}", scale=sc)
    assert g_out[0].stride() == (45 * 4 * 8, 8, 4 * 8, 1)  # q's: [B, N, H, D] in memory


@pytest.mark.parametrize("cfg", TRITON_ORDERS, ids=lambda c: f"N{c['N']}-{c['segs']}-{c['rates']}")
def test_triton_backward_int64_offsets(cfg, monkeypatch):
    """The backward's epilogues address gradient rows with int32 offsets within a head unless
    N * BLOCK_D reaches 2**31 (WIDE); lowering the limit runs the int64 path on small shapes."""
    require_lowering("triton")
    from hilbert_fx.lowering import triton_lowering, tuning
    monkeypatch.setattr(triton_lowering, "torch", _PoisonedTorch())
    monkeypatch.setattr(triton_lowering, "INT32_OFFSET_LIMIT", 1)
    monkeypatch.setenv("HILBERT_FX_TRITON_ATOMIC_DQ", "0")
    monkeypatch.setattr(tuning, "_current", None)  # the knobs are read once: read them again
    out, ref, g_out, g_ref = run_both(cfg, lowering="triton")
    sc = common_scale(ref, *g_ref)
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_matches(a, b, f"d{name}", scale=sc)
