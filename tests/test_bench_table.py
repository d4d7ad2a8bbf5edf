"""The benchmark's printed table (hilbert_fx/bench.py's format_table), from made-up rows."""
from hilbert_fx.bench import format_table


def test_table_has_times_ratios_to_the_floor_and_kernels():
    rows = [dict(N=1024, mode="fwd", method="floor", ms=2.0, tflops=500.0),
            dict(N=1024, mode="fwd", method="triton", ms=2.5, tflops=400.0),
            dict(N=2048, mode="fwd", method="triton", ms=5.0, tflops=400.0)]
    text = format_table(rows, "title", ["floor", "triton", "dense"], [1024, 2048], ["fwd"],
                        {("floor", "fwd"): 1024, ("triton", "fwd"): 2048},
                        ["(64, 1) forward: Hopper kernel (Gluon)"])
    lines = text.splitlines()
    assert lines[0] == "title"
    assert lines[3].split() == ["1024", "fwd", "2.00", "(", "500)", "2.50", "(", "400)", "-"]
    assert lines[4].split() == ["2048", "fwd", "-", "5.00", "(", "400)", "-"]
    i = lines.index("floor ms / method ms (1.00 = the floor's speed):")
    assert lines[i + 2].split() == ["1024", "fwd", "1.00", "0.80", "-"]
    assert len(lines) == i + 5  # no ratio row where the floor did not run; N; kernels
    assert lines[-2] == "largest N that fitted: floor fwd: 1024, triton fwd: 2048"
    assert lines[-1] == "kernel per branch: (64, 1) forward: Hopper kernel (Gluon)"


def test_host_bench_runs_on_cpu(capsys):
    """python -m hilbert_fx.host_bench works without a GPU (the SDPA lowering against SDPA): one
    row per N with the CPU and elapsed times of the op and of SDPA, forward and fwd+bwd."""
    from hilbert_fx import host_bench
    host_bench.main(["--device", "cpu", "--seq-lens", "40", "--model-seq-lens", "--calls", "1",
                     "--segment-lengths", "16", "32", "--dilation-rates", "1", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    assert len(cells) == 4
    for cell in cells:
        cpu, elapsed = (float(x) for x in cell.split("/"))
        assert cpu > 0 and elapsed >= cpu * 0.5
