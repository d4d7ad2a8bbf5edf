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
- An encoder-decoder model (Bart, T5, Whisper): generate() runs the encoder once, through
  `model.get_encoder()`, before the first forward, so compiling `model.forward` alone leaves the
  encoder's self-attention dense; `compile_for_generate` compiles the encoder's forward too.
"""
from __future__ import annotations

import functools
import inspect

import torch


def _padding_mask_maker(model):
    """What stands for `model.create_masks_for_generate`: the 2-D padding mask, so that the
    model's forward builds its attention mask inside the compiled graph. A model whose own
    version gives a 2-D mask (Bloom pads it to the static cache's length, from which its
    forward builds ALiBi: with the mask as generate() keeps it, its scores and ALiBi differ in
    length) keeps its own; one that builds a 4-D mask (or several) gets the 2-D mask."""
    own = getattr(model, "create_masks_for_generate", None)

    def keep_padding_mask(*args, attention_mask=None, **kwargs):
        if own is not None:
            made = own(*args, attention_mask=attention_mask, **kwargs)
            if isinstance(made, torch.Tensor) and made.ndim == 2:
                return made
        return attention_mask

    keep_padding_mask.keeps_padding_mask = True
    return keep_padding_mask


def compile_for_generate(model, backend="hilbert_dilated", **compile_kwargs):
    """Compile `model.forward` with `backend` so that `model.generate()` runs every forward (the
    prefill and each decoding step, with the dynamic or a static cache) through the pass; returns
    the model. `compile_kwargs` go to torch.compile (mode, dynamic, options, ...). A model
    compiled in place (`model.compile()`) is compiled this way instead from then on."""
    model.forward = _compiled_forward(model.forward, backend, compile_kwargs)
    encoder = _encoder_run_by_generate(model)
    if encoder is not None:
        encoder.forward = _compiled_forward(encoder.forward, backend, compile_kwargs)
    # a model compiled in place (model.compile(), as for transformers' Trainer) would call its
    # own compilation around this forward, and Dynamo would hand generate()'s graphs to that
    # one's backend: from here on the compiled forward serves every call
    if getattr(model, "_compiled_call_impl", None) is not None:
        model._compiled_call_impl = None
    # generate() builds a static cache's 4-D mask outside the forward (an input the pass cannot
    # read); with the 2-D mask the forward builds it where the pass reads it
    if not getattr(getattr(model, "create_masks_for_generate", None), "keeps_padding_mask", False):
        model.create_masks_for_generate = _padding_mask_maker(model)  # (once, if compiled again)
    # generate() would compile __call__ again for a static cache (on CUDA), with its own
    # backend, and run that in place of this forward. Refused on the instance: the generation
    # config's disable_compile would be saved with the model (save_pretrained) and outlive it
    if callable(getattr(type(model), "_valid_auto_compile_criteria", None)):
        model._valid_auto_compile_criteria = _never
    elif getattr(model, "generation_config", None) is not None:
        model.generation_config.disable_compile = True
    return model


def _never(*args, **kwargs) -> bool:
    return False


def _encoder_run_by_generate(model):
    """The module generate() calls before the first forward (an encoder-decoder model's encoder,
    `get_encoder()`), or None."""
    config = getattr(model, "config", None)
    get_encoder = getattr(model, "get_encoder", None)
    if not getattr(config, "is_encoder_decoder", False) or get_encoder is None:
        return None
    encoder = get_encoder()
    return encoder if isinstance(encoder, torch.nn.Module) and encoder is not model else None


# entries of one code object that generate()'s forwards may add (Dynamo's default is 8)
RECOMPILE_LIMIT = 64
# whether torch.compile can keep a compilation's entries apart from others of the same code
ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def _compiled_forward(forward, backend, compile_kwargs: dict):
    """torch.compile(forward) with room for generate()'s entries. transformers 5 runs every
    model's forward through one code object (its `deprecate_kwarg` wrapper), and Dynamo caps
    the entries of a code object (`recompile_limit`, 8): past it Dynamo runs the forward
    uncompiled, with dense attention, and says so only in a warning (tokens no longer the
    argmax of the compiled model's full forwards). The cap counts every torch.compile of the
    code: after a model was compiled for training and evaluated at a few lengths, generate()'s
    prefill and decoding steps passed it. Where torch.compile can keep a compilation's entries
    apart (isolate_recompiles) they are kept apart; and the cap is raised while this forward
    runs, as a few generate() calls with a static cache of other batch sizes or lengths fill 8
    entries of their own."""
    extra = {"isolate_recompiles": True} if ISOLATES else {}
    compiled = torch.compile(forward, backend=backend, **{**extra, **compile_kwargs})
    config = torch._dynamo.config

    def forward_with_room(*args, **kwargs):
        if torch.compiler.is_compiling():  # inside another compiled forward (the encoder's,
            return forward(*args, **kwargs)  # within the model's): traced as part of it
        before = config.recompile_limit  # set and put back by hand: config.patch costs 30x
        if before >= RECOMPILE_LIMIT:
            return compiled(*args, **kwargs)
        config.recompile_limit = RECOMPILE_LIMIT
        try:
            return compiled(*args, **kwargs)
        finally:
            config.recompile_limit = before

    return functools.wraps(forward)(forward_with_room)
