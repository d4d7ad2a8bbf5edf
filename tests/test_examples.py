"""The training and ViT examples run end to end on the CPU, at toy sizes (their real runs are on the GPU:
BENCHMARKS.md)."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def run_example(name, *args):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_long_gpt_trains_both_backends(tmp_path):
    out = run_example("train_long_gpt.py", "--device", "cpu", "--layers", "1", "--width", "64", "--heads", "4",
                      "--seq-len", "256", "--steps", "3", "--compare-steps", "2", "--segment-lengths", "32", "64",
                      "--dilation-rates", "1", "2", "--out", str(tmp_path))
    assert "distance 33 doubling up to 129" in out
    result = json.loads((tmp_path / "train_long_gpt.json").read_text())
    dilated, dense = result["train"]
    assert (dilated["backend"], dense["backend"]) == ("hilbert_dilated", "inductor")
    assert (len(dilated["losses"]), len(dense["losses"])) == (3, 2)
    assert dilated["distances"][0] == 33
    assert all(math.isfinite(x) for x in dilated["losses"] + dense["losses"])
    # same weights and batch, different attention (N = 256 spans several segments of 64): the
    # first losses differ only if the dilated backend rewrote the model's attention
    assert abs(dilated["losses"][0] - dense["losses"][0]) > 1e-4


def test_vit_hilbert_rewrites_and_draws(tmp_path):
    out = run_example("vit_hilbert.py", "--out", str(tmp_path), "--device", "cpu")
    assert "2 attention sites in 1 graphs: 2 rewritten, 0 skipped" in out
    assert "dilated output finite: True" in out
    assert (tmp_path / "vit_pattern.png").stat().st_size > 10_000
