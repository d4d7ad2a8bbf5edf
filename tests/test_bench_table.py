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


def test_per_branch_pairs_launches_by_branch():
    """scripts/profile_kernels.py --per-branch: our kernels (in the forward's order, r == 1
    last) and the floor's (forwards in the branches' order, backwards reversed) paired by
    branch; None when a branch ran on other kernels (counts differ)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "scripts" / "profile_kernels.py"
    spec = importlib.util.spec_from_file_location("profile_kernels", path)
    pk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pk)
    ours = [("fill", 2.0), ("_fwd_kernel", 20.0), ("_fwd_kernel", 40.0), ("_fwd_kernel", 10.0),
            ("_bwd_preprocess", 5.0), ("_bwd_kernel", 21.0), ("_bwd_kernel", 41.0),
            ("_bwd_kernel", 11.0), ("_cast_dq", 3.0)]
    floor = [("Memset", 1.0), ("sdpa_flash_fprop_a", 12.0), ("sdpa_flash_fprop_b", 22.0),
             ("sdpa_flash_fprop_c", 42.0), ("dot_do_o", 1.0), ("sdpa_flash_bprop", 43.0),
             ("sdpa_flash_bprop", 23.0), ("convert_dq", 1.0), ("sdpa_flash_bprop", 13.0)]
    order = [(512, 2), (1024, 4), (256, 1)]
    branches = [(256, 1), (512, 2), (1024, 4)]
    assert pk.per_branch(ours, floor, order, branches) == [
        ((256, 1), 10.0, 12.0, 11.0, 13.0), ((512, 2), 20.0, 22.0, 21.0, 23.0),
        ((1024, 4), 40.0, 42.0, 41.0, 43.0)]
    triton_backward = [(n.replace("_bwd_kernel", "_bwd_dkdv_kernel"), us) for n, us in ours]
    assert pk.per_branch(triton_backward, floor, order, branches) is None
