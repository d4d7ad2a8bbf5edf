"""Settings for running the suite across processes with pytest-xdist.

README's test command runs `pytest -n auto --dist loadfile tests`: one worker process per core,
each test file run whole, in its own order, by one worker (so a module-scoped fixture is built
once, and tests/test_ring.py's gloo launches run one after the other, never two at once).
Without xdist (`pytest tests`, or `-n 0`) nothing here applies.

Each worker gets its share of the cores for torch's intra-op threads (and, through
OMP_NUM_THREADS, for the processes it starts), so that N workers do not run N x cores threads;
Inductor compiles in the worker's own process rather than in a pool of its own.
"""
from __future__ import annotations

import os


def _threads_per_worker() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


if os.environ.get("PYTEST_XDIST_WORKER") is not None:
    # before any test module imports torch: OpenMP and Inductor's config read these at import
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker()))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    def pytest_configure(config):
        import torch
        torch.set_num_threads(_threads_per_worker())
