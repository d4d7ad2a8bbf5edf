"""The examples run end to end on the CPU, at toy sizes (their real runs are on the GPU: BENCHMARKS.md),
and what they compile computes SPEC section 2: each example's model (its builders, weights, batch and
branches, imported from the example) compiled with the example's backend is checked against the same
model run eagerly in float64 with the independent reference attention (tests/reference.py), and
dense attention is checked to give a clearly different output, so the comparison sees the pattern."""
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from models import register_reference_attention
from reference import reference_dilated_attention

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
CPU = torch.device("cpu")
TOL = 1e-5     # relative error allowed between the compiled float32 model and the float64 reference
DENSE = 1e-3   # dense attention must be at least this far (relative) from the reference


def run_example(name, *args):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def load_example(name):
    """The example's module (its builders), imported from examples/ without running main()."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative(got, expected):
    """max |got - expected| / max |expected|, in float64."""
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((got - expected).abs().max() / expected.abs().max()).item()


# ------------------------------------------------------------------ examples/train_long_gpt.py

GPT_ARGV = ["--device", "cpu", "--layers", "1", "--width", "64", "--heads", "4", "--seq-len", "256",
            "--steps", "3", "--compare-steps", "2", "--segment-lengths", "32", "64", "--dilation-rates", "1", "2"]


def gpt_first_batch(example, args):
    """The batch of the example's first training step: train() draws it from Generator seed 1 at
    the curriculum's first distance (--d0 33 here; the example's JSON records it, checked below)."""
    return example.batch(args, args.seq_len, CPU, torch.Generator().manual_seed(1), args.d0)


def grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def gpt_reference():
    """The example's model (its weights, torch.manual_seed(0) in build_model) on its first batch,
    run eagerly in float64 with the reference attention (causal, the example's branches and hilbert
    flag), and with the dense baseline's attention: loss, logits, gradients, gradient norm of each."""
    example = load_example("train_long_gpt")
    args = example.parse_args(GPT_ARGV)
    tokens, labels = gpt_first_batch(example, args)
    runs = {}
    for name in ("reference", "dense"):
        args.backend = "hilbert_dilated" if name == "reference" else "inductor"
        model = example.build_model(args, CPU).double()
        if name == "reference":
            model.config._attn_implementation = register_reference_attention(
                args.segment_lengths, args.dilation_rates, hilbert=bool(args.hilbert))
        out = model(input_ids=tokens, labels=labels)
        out.loss.backward()
        g = grads(model)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g.values()])).item()
        runs[name] = dict(loss=out.loss.item(), logits=out.logits.detach(), grads=g, grad_norm=norm)
    assert relative(runs["dense"]["logits"], runs["reference"]["logits"]) > 0.1  # the pattern matters
    return example, args, runs


def test_train_long_gpt_trains_both_backends(tmp_path, gpt_reference):
    out = run_example("train_long_gpt.py", *GPT_ARGV, "--out", str(tmp_path))
    assert "distance 33 doubling up to 129" in out
    result = json.loads((tmp_path / "train_long_gpt.json").read_text())
    dilated, dense = result["train"]
    assert (dilated["backend"], dense["backend"]) == ("hilbert_dilated", "inductor")
    assert (len(dilated["losses"]), len(dense["losses"])) == (3, 2)
    assert dilated["distances"][0] == dense["distances"][0] == 33
    assert all(math.isfinite(x) for x in dilated["losses"] + dense["losses"])
    # same weights and batch, different attention (N = 256 spans several segments of 64): the
    # first losses differ only if the dilated backend rewrote the model's attention
    assert abs(dilated["losses"][0] - dense["losses"][0]) > 1e-4

    # The run's first step (before any update) is the float64 reference's: its loss and the norm
    # of its gradient (clip_grad_norm_'s, before clipping). The dense run's are clearly not.
    _, _, ref = gpt_reference
    expected = ref["reference"]
    first = {"loss": "losses", "grad_norm": "grad_norms"}  # reference's key: the run's list
    errors = {key: relative(dilated[runs][0], expected[key]) for key, runs in first.items()}
    dense_gaps = {key: relative(dense[runs][0], expected[key]) for key, runs in first.items()}
    print(f"train_long_gpt first step against the float64 reference: dilated {errors}, dense {dense_gaps}")
    assert all(e < TOL for e in errors.values()), errors
    assert all(e > 10 * TOL for e in dense_gaps.values()), dense_gaps
    # the reference's own dense run gives the dense backend's first step
    for key, runs in first.items():
        assert relative(dense[runs][0], ref["dense"][key]) < TOL, (key, dense[runs], ref["dense"][key])


def test_train_long_gpt_model_compiled_matches_the_reference(gpt_reference):
    """Elementwise: the logits and every parameter's gradient of the example's model compiled with
    the example's backend (make_backend: its branches, hilbert flag, the lowering CPU gets)."""
    example, args, ref = gpt_reference
    args.backend = "hilbert_dilated"
    tokens, labels = gpt_first_batch(example, args)
    model = example.build_model(args, CPU)
    torch._dynamo.reset()
    out = torch.compile(model, backend=example.make_backend(args), dynamic=False)(input_ids=tokens, labels=labels)
    out.loss.backward()
    torch._dynamo.reset()
    expected, dense = ref["reference"], ref["dense"]
    got = grads(model)
    assert got.keys() == expected["grads"].keys()
    logits_err = relative(out.logits.detach(), expected["logits"])
    grad_err = max(relative(got[name], expected["grads"][name]) for name in got)
    dense_grad_gap = max(relative(dense["grads"][name], expected["grads"][name]) for name in got)
    print(f"train_long_gpt compiled against the float64 reference: logits {logits_err:.2e}, "
          f"gradients {grad_err:.2e} (dense: logits {relative(dense['logits'], expected['logits']):.2e}, "
          f"gradients {dense_grad_gap:.2e})")
    assert logits_err < 10 * TOL, logits_err
    assert grad_err < 10 * TOL, grad_err
    assert dense_grad_gap > DENSE, dense_grad_gap


# ------------------------------------------------------------------ examples/vit_hilbert.py

def test_vit_hilbert_rewrites_and_draws(tmp_path):
    out = run_example("vit_hilbert.py", "--out", str(tmp_path), "--device", "cpu")
    assert "2 attention sites in 1 graphs: 2 rewritten, 0 skipped" in out
    assert "dilated output finite: True" in out
    assert (tmp_path / "vit_pattern.png").stat().st_size > 10_000


def test_vit_hilbert_compiled_matches_the_reference():
    """The example's ViT, images and backend (build()): bidirectional, hilbert=True, its branches."""
    example = load_example("vit_hilbert")
    model, images, backend = example.build("cpu")
    reference = copy.deepcopy(model).double()
    reference.config._attn_implementation = register_reference_attention(
        example.SEGMENTS, example.RATES, hilbert=True, causal=False)
    torch._dynamo.reset()
    with torch.no_grad():
        dilated = torch.compile(model, backend=backend)(pixel_values=images).last_hidden_state
        dense = model(pixel_values=images).last_hidden_state
        expected = reference(pixel_values=images.double()).last_hidden_state
    torch._dynamo.reset()
    err, gap = relative(dilated, expected), relative(dense, expected)
    print(f"vit_hilbert compiled against the float64 reference: {err:.2e} (dense: {gap:.2e})")
    assert err < 10 * TOL, err
    assert gap > DENSE, gap


# ------------------------------------------------------------------ examples/quickstart.py

def test_quickstart_gpt_compiled_matches_the_reference(monkeypatch):
    """Section 1 of the quickstart: its GPT, seed and tokens, compiled with backend="hilbert_dilated"
    (SPEC's defaults: branches (2048, 1), (4096, 2), (8192, 4), (16384, 8), hilbert=True; causal
    as the GPT's SDPA calls are), forward and backward."""
    example = load_example("quickstart")
    torch.manual_seed(0)
    model = example.GPT().eval()
    tokens = torch.randint(0, 256, (2, 300))
    reference = copy.deepcopy(model).double()
    dense = copy.deepcopy(model).double()
    torch._dynamo.reset()
    logits = torch.compile(model, backend="hilbert_dilated")(tokens)
    logits.square().mean().backward()
    torch._dynamo.reset()
    dense_logits = dense(tokens)
    dense_logits.square().mean().backward()

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        assert attn_mask is None and dropout_p == 0.0 and not kwargs, kwargs
        return reference_dilated_attention(q, k, v, (2048, 4096, 8192, 16384), (1, 2, 4, 8),
                                           hilbert=True, is_causal=is_causal)

    with monkeypatch.context() as patch:
        patch.setattr(example.F, "scaled_dot_product_attention", attention)
        expected = reference(tokens)
    expected.square().mean().backward()
    got, want, dense_grads = grads(model), grads(reference), grads(dense)
    logits_err, gap = relative(logits.detach(), expected.detach()), relative(dense_logits.detach(), expected.detach())
    grad_err = max(relative(got[name], want[name]) for name in want)
    grad_gap = max(relative(dense_grads[name], want[name]) for name in want)
    print(f"quickstart compiled against the float64 reference: logits {logits_err:.2e}, gradients "
          f"{grad_err:.2e} (dense: logits {gap:.2e}, gradients {grad_gap:.2e})")
    assert got.keys() == want.keys()
    assert logits_err < 10 * TOL and grad_err < 10 * TOL, (logits_err, grad_err)
    assert gap > DENSE and grad_gap > DENSE, (gap, grad_gap)
