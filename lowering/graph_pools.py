"""Calls of the op while Inductor's CUDA graph trees warm a graph up (torch.compile's
mode="reduce-overhead").

Why: the trees run a graph's first calls eagerly on a stream of their own, with every
allocation of the calling thread going to the graph's memory pool, and then refuse the pool if
it holds an allocation that is no output of the graph ("Detected N tensor(s) in the cudagraph
pool not tracked as outputs"). The op keeps what it builds for a configuration on the device
(plans, tables, the launch programs' constants) for later calls, so the first call of a
configuration there left such allocations, and a compiled model in that mode failed on its
first step. During a warm-up the op runs on a thread of its own instead, whose allocations
stay outside the pool: what it keeps is made as in any eager call. Its stream starts after the
caller's and the caller's waits for it, so the order of the GPU work is the caller's; its
results are copied into the pool (the trees require a graph's outputs there). A capture
(the trees' recording, or torch.cuda.graph) keeps nothing it makes; the warm-up before it built
what the capture reads.
"""
from __future__ import annotations

import sys
import threading

import torch

_streams: dict = {}  # a side stream per device, for the warm-up's thread


def warming_up(device: torch.device) -> bool:
    """Whether this call runs inside a warm-up of Inductor's CUDA graph trees on `device`: the
    current stream is the trees' own (the one their warm-ups and recordings run on) and no
    capture is under way."""
    if device.type != "cuda":
        return False
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not torch._C._is_key_in_tls("tree_manager_containers"):
        return False  # no CUDA graph trees on this thread
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        container = trees.get_obj(trees.local, "tree_manager_containers").get(index)
        manager = None if container is None else container.tree_manager
        if manager is None or torch.cuda.current_stream(index) != manager.stream:
            return False
    except Exception:  # noqa: BLE001 - another torch: no trees this module knows of
        return False
    return not torch.cuda.is_current_stream_capturing()


def outside_the_pool(fn, device: torch.device, *args):
    """fn(*args) run on a thread of its own, with gradients off, on a side stream ordered after
    the caller's current stream and before it; the tensors it returns (a tuple's) copied on the
    caller's thread, into the pool, where the trees look for a graph's outputs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(index)
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream(index)
    result, error = [], []

    def run():
        try:
            torch.cuda.set_device(index)
            with torch.cuda.stream(side), torch.no_grad():
                side.wait_stream(caller)
                result.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="hilbert_fx graph warm-up")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    caller.wait_stream(side)
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in result[0])
