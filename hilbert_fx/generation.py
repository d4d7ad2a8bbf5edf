"""Generating with a compiled model: transformers' `model.generate()` with the backend.

What each way of compiling runs (transformers 5.x):
- `torch.compile(model).generate(...)`: nothing compiled. The compiled wrapper hands `generate`
  to the model, whose forward calls are the uncompiled module's.
- `model.forward = torch.compile(model.forward, backend=...)`: every forward of generate() is
  compiled: the prefill, then the decoding steps (one query against the cache). With the dynamic
  cache the pass reads the cache (torch.cat of the cached and the new rows) and the mask.
  With a static cache, generate() builds the 4-D mask before calling forward, so it reaches the
  compiled graph as an input the pass cannot read; `compile_for_generate` hands forward the 2-D
  padding mask instead, and the model builds the mask inside the graph, where it is read.
- `generation_config.compile_config` (a static cache): generate() compiles `model.__call__`
  for the decoding steps only (on CUDA, or CPU with `_compile_all_devices`); the prefill runs
  uncompiled (dense), and the 4-D mask is an input, as above. Not the way to use the backend.
"""
from __future__ import annotations

import torch


def keep_padding_mask(*args, attention_mask=None, **kwargs):
    """Stands for a model's `create_masks_for_generate`: the 2-D padding mask as it is, so that
    the model's forward builds its attention mask inside the compiled graph."""
    return attention_mask


def compile_for_generate(model, backend="hilbert_dilated", **compile_kwargs):
    """Compile `model.forward` with `backend` so that `model.generate()` runs every forward (the
    prefill and each decoding step, with the dynamic or a static cache) through the pass; returns
    the model. `compile_kwargs` go to torch.compile (mode, dynamic, options, ...)."""
    model.forward = torch.compile(model.forward, backend=backend, **compile_kwargs)
    # generate() builds a static cache's 4-D mask outside the forward (an input the pass cannot
    # read); with the 2-D mask the forward builds it where the pass reads it
    model.create_masks_for_generate = keep_padding_mask
    config = getattr(model, "generation_config", None)
    if config is not None:
        # generate() would compile __call__ again for a static cache (on CUDA), with its own
        # backend, and run that in place of this forward
        config.disable_compile = True
    return model
