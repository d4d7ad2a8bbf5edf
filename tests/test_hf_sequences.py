"""SPEC section 5 on transformers models (small configs, random weights, nothing downloaded):
what a user does around a sequence does not change what the compiled model computes for it.

- packed documents (position_ids restarting at 0, as DataCollatorWithFlattening packs them)
  give each document's logits and gradients as the document alone;
- a left- or right-padded batch gives each row's logits as the row alone;
- an encoder's (BERT, RoBERTa) left-, right- or hole-padded batch gives each row's hidden
  states as the row alone (transformers' bidirectional mask with a 2-D padding mask);
- packed documents padded to a fixed length (a 4-D mask from transformers' own mask functions:
  same document, and the key not padding), causal or bidirectional, give each document alone;
- generate() with the dynamic and the static cache (hilbert_fx.compile_for_generate) picks, at
  each of 20 steps, the argmax of a full forward of the compiled model over the sequence so far.

The branches (8, 1), (16, 2) are shorter than the sequences, so the pattern matters: the compiled
model differs from the dense one, and a mask laid over the row (section 2) would differ from the
document or row alone. The pass runs without Inductor (the rewritten graph runs as it is), for
time; tests/test_hf_models.py runs the whole backend.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hilbert_fx  # noqa: E402
from models import recorded_sites, recording_backend, register_reference_attention  # noqa: E402
from reference import reference_dilated_attention  # noqa: E402

W, R = (8, 16), (1, 2)
VOCAB, LAYERS = 96, 2
ATOL, RTOL = 2e-5, 1e-4


def llama(impl="sdpa"):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation=impl))


def qwen2(impl="sdpa"):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation=impl))


def bert(impl="sdpa"):
    return transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
        attn_implementation=impl), add_pooling_layer=False)


def roberta(impl="sdpa"):
    """Its position ids count the tokens that are not pad_token_id: padding anywhere is skipped."""
    return transformers.RobertaModel(transformers.RobertaConfig(
        num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=1,
        attn_implementation=impl), add_pooling_layer=False)


FAMILIES = {"llama": llama, "qwen2": qwen2, "llama-eager": lambda: llama("eager")}
ENCODERS = {"bert": bert, "roberta": roberta}


def model_of(family):
    torch.manual_seed(0)
    return {**FAMILIES, **ENCODERS}[family]().eval()


def described(be):
    return [(s.kind, s.module, s.action, s.reason,
             s.sequences.what if s.sequences is not None else "") for s in recorded_sites(be)]


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


PACKED = [(family, None) for family in FAMILIES] + [("llama-eager", True)]


@pytest.mark.parametrize("family,dynamic", PACKED,
                         ids=[f + ("-dynamic" if d else "") for f, d in PACKED])
def test_packed_documents_equal_each_document_alone(family, dynamic):
    """Three documents packed by DataCollatorWithFlattening (one row, position_ids restarting at
    0, labels -100 at each document's start): logits and the gradients of the loss equal those
    of each document alone; transformers' causal-and-same-document mask became is_causal with
    position_ids (no N x N mask). dynamic=True: the scaling of hand-written attention reaches
    the graph as a run-time scalar."""
    model = model_of(family)
    lengths = (13, 21, 9)
    docs = [tokens(n, seed) for seed, n in enumerate(lengths)]
    collate = transformers.DataCollatorWithFlattening()
    packed_batch = collate([{"input_ids": d[0].tolist()} for d in docs])
    alone_batches = [collate([{"input_ids": d[0].tolist()}]) for d in docs]
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(model, backend=be, dynamic=dynamic)

    def run(batch):
        """Logits and the gradients of the summed next-token loss (labels shifted by one)."""
        logits = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                          use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:],
                                                 ignore_index=-100, reduction="sum")
        return logits, torch.autograd.grad(loss, list(model.parameters()))

    packed, packed_grads = run(packed_batch)
    packed_sites = recorded_sites(be)
    alone = [run(batch) for batch in alone_batches]
    torch.testing.assert_close(packed, torch.cat([a for a, _ in alone], 1), atol=ATOL, rtol=RTOL)
    for g, *parts in zip(packed_grads, *(grads for _, grads in alone)):
        torch.testing.assert_close(g, sum(parts), atol=1e-4, rtol=1e-3)
    assert [s.action for s in packed_sites] == ["rewritten"] * LAYERS, described(be)
    assert all(s.is_causal and s.attn_mask is None and "packed" in s.sequences.what
               for s in packed_sites), described(be)
    with torch.no_grad():  # the pattern matters at these lengths
        dense = model(input_ids=docs[1], use_cache=False).logits
    assert (alone[1][0] - dense).abs().max() > 1e-3


def test_new_documents_compile_nothing():
    """Batches of other documents (the same length) run the graph compiled for the first: the
    plans come from position_ids at run time, so nothing is specialised on the documents; each
    batch's logits equal its documents alone."""
    model = model_of("llama")
    collate = transformers.DataCollatorWithFlattening()
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(model, backend=be)
    alone_be = recording_backend(W, R)  # the documents alone: graphs of their own lengths
    compiled_alone = torch.compile(model, backend=alone_be)
    for layout, lengths in enumerate([(13, 21, 9), (43,), (1, 17, 2, 23), (5,) * 7 + (8,)]):
        docs = [tokens(n, 10 * layout + i) for i, n in enumerate(lengths)]
        batch = collate([{"input_ids": d[0].tolist()} for d in docs])
        with torch.no_grad():
            packed = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                              use_cache=False).logits
            alone = torch.cat([compiled_alone(input_ids=d, use_cache=False).logits
                               for d in docs], 1)
        torch.testing.assert_close(packed, alone, atol=ATOL, rtol=RTOL)
    assert len(be.records) == 1, [[s.sequences for s in r.sites] for r in be.records]
    assert [(s.action, "packed" in s.sequences.what) for s in be.records[0].sites] == [
        ("rewritten", True)] * LAYERS, described(be)
    with torch.no_grad():  # the pattern matters at these lengths
        dense = model(input_ids=docs[-1], use_cache=False).logits
        last = compiled_alone(input_ids=docs[-1], use_cache=False).logits
    assert (last - dense).abs().max() > 1e-3


def test_packed_documents_under_gradient_checkpointing():
    """transformers' gradient checkpointing puts each layer in a checkpointed region, the mask
    built outside: the packed structure is computed outside and passed into every region, and
    the N x N mask is no longer built. Logits and gradients equal each document alone."""
    model = model_of("llama")
    model.gradient_checkpointing_enable()
    model.train()
    lengths = (13, 21, 9)
    docs = [tokens(n, seed) for seed, n in enumerate(lengths)]
    ids = torch.cat(docs, 1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(model, backend=be)

    def run(x, p):
        logits = compiled(input_ids=x, position_ids=p, use_cache=False).logits
        return logits, torch.autograd.grad(logits.square().sum(), list(model.parameters()))

    packed, packed_grads = run(ids, position_ids)
    record = be.records[0]
    alone = [run(d, torch.arange(d.shape[1])[None]) for d in docs]
    torch.testing.assert_close(packed, torch.cat([a for a, _ in alone], 1), atol=ATOL, rtol=RTOL)
    for g, *parts in zip(packed_grads, *(grads for _, grads in alone)):
        torch.testing.assert_close(g, sum(parts), atol=1e-4, rtol=1e-3)
    assert [(s.action, "packed" in s.sequences.what) for s in record.sites] == [
        ("rewritten", True)] * LAYERS, described(be)
    assert "tag_activation_checkpoint" in record.graph_after
    assert "cumsum" in record.graph_before and "cumsum" not in record.graph_after


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_rows_equal_each_row_alone(family, side):
    """A batch of rows 30 and 41 tokens long, the shorter padded (position_ids from the mask, as
    generate() makes them): each row's real tokens get the logits of the row alone."""
    model = model_of(family)
    rows = [tokens(30, 1), tokens(41, 2)]
    n = 41
    ids = torch.zeros(2, n, dtype=torch.long)
    mask = torch.zeros(2, n, dtype=torch.long)
    for b, row in enumerate(rows):
        where = slice(n - row.shape[1], n) if side == "left" else slice(0, row.shape[1])
        ids[b, where], mask[b, where] = row[0], 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        batch = compiled(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        batch_sites = recorded_sites(be)
        for b, row in enumerate(rows):
            alone = compiled(input_ids=row).logits[0]
            torch.testing.assert_close(batch[b][mask[b].bool()], alone, atol=ATOL, rtol=RTOL)
        dense = model(input_ids=rows[1]).logits[0]  # the pattern matters at these lengths
    assert (alone - dense).abs().max() > 1e-3
    assert [s.action for s in batch_sites] == ["rewritten"] * LAYERS, described(be)
    assert all(s.attn_mask is None and "padding" in s.sequences.what
               for s in batch_sites), described(be)


def placed(rows, n, layout, pad_id=0, seed=0):
    """(ids, mask) [len(rows), n]: each row's tokens at the left or right end, or spread over the
    row in order with padding between them ("holes")."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for b, row in enumerate(rows):
        m = row.shape[1]
        where = {"left": torch.arange(n - m, n), "right": torch.arange(m),
                 "holes": torch.randperm(n, generator=g)[:m].sort().values}[layout]
        ids[b, where], mask[b, where] = row[0], 1
    return ids, mask


@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_padded_rows_equal_each_row_alone(family):
    """A row of 30 tokens in a batch of 41-token rows, padded on the left, on the right, or with
    padding between its tokens: its real tokens get the hidden states of the row alone (BERT is
    given position_ids that skip the padding, as a user gives them; RoBERTa makes its own).
    transformers' bidirectional mask with a 2-D padding mask became position_ids, -1 on padding
    (no N x N mask), and explain's rows say so."""
    model = model_of(family)
    pad_id = model.config.pad_token_id
    rows = [tokens(30, 1), tokens(41, 2)]
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        alone = compiled(input_ids=rows[0]).last_hidden_state[0]
        be.records.clear()
        for layout in ("left", "right", "holes"):
            ids, mask = placed(rows, 41, layout, pad_id, seed=3)
            kwargs = dict(input_ids=ids, attention_mask=mask)
            if family.startswith("bert"):
                kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
            batch = compiled(**kwargs).last_hidden_state
            torch.testing.assert_close(batch[0][mask[0].bool()], alone, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{layout}: {m}")
            assert torch.isfinite(batch).all()
        batch_sites = recorded_sites(be)
        dense = model(input_ids=rows[0]).last_hidden_state[0]
    assert batch_sites and all(
        s.action == "rewritten" and not s.is_causal and s.attn_mask is None
        and "bidirectional with padding" in s.sequences.what for s in batch_sites), described(be)
    assert (alone - dense).abs().max() > 1e-3  # the pattern matters at these lengths
    if family == "bert":
        with torch.no_grad():
            report = hilbert_fx.explain(model, **kwargs,
                                        backend=hilbert_fx.backend(W, R, lowering="sdpa"))
        assert str(report).count("bidirectional with padding") == LAYERS, report


def packed_padded(lengths, pads, seed=0):
    """(ids, position_ids, mask, documents) of one row: documents of `lengths` with `pads[i]`
    padding tokens before document i (and pads[-1] after the last). The padding's position ids
    are 0 before a document and continue the document before it after one, so that in either
    case it shares a run of consecutive position ids with real tokens."""
    docs = [tokens(n, seed + i) for i, n in enumerate(lengths)]
    ids, pos, mask = [], [], []
    for i, pad in enumerate(pads):
        last = pos[-1] + 1 if pos else 0
        ids += [0] * pad
        pos += list(range(last, last + pad)) if i == len(lengths) else [0] * pad
        mask += [0] * pad
        if i < len(lengths):
            ids += docs[i][0].tolist()
            pos += list(range(lengths[i]))
            mask += [1] * lengths[i]
    return (torch.tensor([ids]), torch.tensor([pos]), torch.tensor([mask]), docs)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_packed_and_padded_rows_equal_each_document_alone(family):
    """Packed documents padded to a fixed length, the mask built in the compiled function by
    transformers' own mask functions (causal for Llama, bidirectional for BERT; and the same run
    of consecutive position ids; and the key not padding), handed to the model as a 4-D mask:
    each document's outputs equal the document alone, and the site took position_ids = the place
    in the run on real tokens, -1 on padding."""
    from transformers.masking_utils import (and_masks, bidirectional_mask_function,
                                            causal_mask_function, find_packed_sequence_indices,
                                            packed_sequence_mask_function, sdpa_mask)
    model = model_of(family)
    causal = family == "llama"

    def forward(ids, position_ids, mask):
        documents = find_packed_sequence_indices(position_ids)
        full = sdpa_mask(batch_size=ids.shape[0], q_length=ids.shape[1], kv_length=ids.shape[1],
                         mask_function=and_masks(
                             causal_mask_function if causal else bidirectional_mask_function,
                             packed_sequence_mask_function(documents)),
                         attention_mask=mask.bool(), allow_is_causal_skip=False)
        out = model(input_ids=ids, position_ids=position_ids, attention_mask=full)
        return out.logits if causal else out.last_hidden_state

    ids, position_ids, mask, docs = packed_padded((13, 21, 9), (3, 0, 2, 4))
    torch._dynamo.reset()
    be = recording_backend(W, R)
    compiled = torch.compile(forward, backend=be)
    with torch.no_grad():
        packed = compiled(ids, position_ids, mask)[0]
        packed_sites = recorded_sites(be)
        alone = [compiled(d, torch.arange(d.shape[1])[None], torch.ones_like(d))[0] for d in docs]
    torch.testing.assert_close(packed[mask[0].bool()], torch.cat(alone), atol=ATOL, rtol=RTOL)
    assert [s.action for s in packed_sites] == ["rewritten"] * LAYERS, described(be)
    assert all(s.is_causal == causal and s.attn_mask is None
               and "packed sequences with padding" in s.sequences.what
               for s in packed_sites), described(be)


GENERATE = [("llama", "dynamic", 1, None), ("llama", "static", 1, None),
            ("llama", "dynamic", 2, None), ("llama", "static", 2, None),
            ("qwen2", "dynamic", 1, None), ("qwen2", "static", 1, None),
            ("llama-eager", "dynamic", 1, None), ("llama-eager", "static", 2, None),
            ("llama", "dynamic", 2, True), ("llama", "static", 2, True),
            ("llama-eager", "dynamic", 2, True), ("llama-eager", "static", 2, True)]


@pytest.mark.parametrize("family,cache,batch,dynamic", GENERATE,
                         ids=[f"{f}-{c}-batch{b}" + ("-dynamic" if d else "")
                              for f, c, b, d in GENERATE])
def test_generate_picks_the_argmax_of_full_forwards(family, cache, batch, dynamic):
    """compile_for_generate, then greedy generate() for 20 new tokens: each step's logits are
    those of a full forward of the compiled model over the sequence so far (so its token is
    their argmax). Batch 2: the second prompt is shorter, left-padded; its full forwards run on
    the row alone. Every decoding step's attention is rewritten against the cache. dynamic=True
    from the first call: sizes are symbols, and Dynamo passes the model's float attributes
    (a norm's eps, hand-written attention's scaling) as 0-d tensors, which the pass must not
    take for activations, nor let hide the sequence structure."""
    model = model_of(family)
    prompts = [tokens(17, 3), tokens(11, 4)][:batch]
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1]:], mask[b, width - p.shape[1]:] = p[0], 1
    torch._dynamo.reset()
    be = recording_backend(W, R)
    hilbert_fx.compile_for_generate(model, backend=be, dynamic=dynamic)
    new = 20
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, cache_implementation=cache, eos_token_id=None,
                             return_dict_in_generate=True, output_logits=True)
        generate_sites = recorded_sites(be)
        for b, p in enumerate(prompts):
            seq = torch.cat([p, out.sequences[b:b + 1, width:]], 1)
            for t in range(new):
                full = model(input_ids=seq[:, :p.shape[1] + t], use_cache=False).logits[0, -1]
                torch.testing.assert_close(out.logits[t][b], full, atol=1e-4, rtol=1e-4)
                assert out.sequences[b, width + t] == full.argmax()
    decoding = [s for s in generate_sites if example_length(s) == 1]
    assert decoding and all(s.action == "rewritten" and f"{cache} cache" in s.sequences.what
                            for s in decoding), described(be)
    assert all(s.action == "rewritten" for s in generate_sites), described(be)


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile", "module.compile"])
@pytest.mark.parametrize("isolates", [True, False] if hilbert_fx.generation.ISOLATES else [False],
                         ids=lambda x: "isolated" if x else "limit raised")
def test_generate_after_training_in_the_same_process(monkeypatch, isolates, in_place):
    """A user's session: a model trained under torch.compile on packed documents with gradient
    checkpointing, evaluated at other lengths, then compile_for_generate and generate() with
    the dynamic and the static cache. transformers 5 runs every model's forward through one
    code object, whose compiled entries Dynamo caps (recompile_limit, 8) over every
    torch.compile of it: the training's entries must not leave generate()'s forwards to run
    uncompiled, with dense attention (here a forward that would, raises). Every decoding step
    is rewritten and picks the argmax of a full forward of the compiled model. `isolates`
    False: the path for a torch.compile without isolate_recompiles. `in_place`: the training
    compiled the model in place (model.compile(), as for transformers' Trainer), which calls
    its own compilation from then on."""
    monkeypatch.setattr(hilbert_fx.generation, "ISOLATES", isolates)
    model = model_of("llama").train()
    model.gradient_checkpointing_enable()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        if in_place:
            model.compile(backend=recording_backend(W, R))
            compiled = model
        else:
            compiled = torch.compile(model, backend=recording_backend(W, R))
        collate = transformers.DataCollatorWithFlattening()
        for step in range(2):
            batch = collate([{"input_ids": tokens(n, step + n)[0].tolist()} for n in (19, 7, 26)])
            compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     labels=batch["labels"], use_cache=False).loss.backward()
        model.eval()
        with torch.no_grad():
            compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     use_cache=False)
            for n in (9, 30, 41):
                compiled(input_ids=tokens(n, n), use_cache=False)
        be = recording_backend(W, R)
        hilbert_fx.compile_for_generate(model, backend=be)
        prompt, new = tokens(15, 7), 6
        for cache in ("dynamic", "static"):
            be.records.clear()
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     cache_implementation=cache, eos_token_id=None)
                decoding = [s for s in recorded_sites(be) if example_length(s) == 1]
                for t in range(new):
                    full = model(input_ids=out[:, :15 + t], use_cache=False).logits[0, -1]
                    assert out[0, 15 + t] == full.argmax(), (cache, t)
            assert decoding and all(s.action == "rewritten" and f"{cache} cache" in s.sequences.what
                                    for s in decoding), (cache, described(be))


def test_generate_refuses_its_own_compile_without_saving_that(tmp_path):
    """generate() would compile the model again for a static cache on CUDA, with its own
    backend, in place of compile_for_generate's forward: that is refused on the instance, not
    by the generation config's disable_compile, which save_pretrained would write for a model
    reloaded later without the backend."""
    model = hilbert_fx.compile_for_generate(model_of("llama"), backend=recording_backend(W, R))
    cache = transformers.StaticCache(config=model.config, max_cache_len=8)
    config = model.generation_config
    config.compile_config = transformers.CompileConfig()
    config.compile_config._compile_all_devices = True  # compiled on the CPU too, as on CUDA
    assert not model._valid_auto_compile_criteria({"cache": cache}, config)
    model.save_pretrained(tmp_path)
    saved = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert not saved.disable_compile


def test_many_generate_calls_stay_compiled():
    """generate() calls with both caches, padded batches of other sizes and lengths, add
    compiled entries of their own: past Dynamo's cap of 8 (isolated or not; the fourth call
    here) the forwards would run uncompiled, with dense attention, after only a warning (here
    a forward that would, raises). The last call still picks the argmax of the compiled
    model's full forwards."""
    model = model_of("llama")
    torch._dynamo.reset()
    hilbert_fx.compile_for_generate(model, backend=recording_backend(W, R))
    calls = [("dynamic", 2, 7), ("dynamic", 3, 12), ("static", 2, 7), ("static", 3, 12),
             ("dynamic", 4, 9), ("static", 4, 9), ("static", 2, 20)]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
        for i, (cache, batch, n) in enumerate(calls):
            ids = torch.cat([tokens(n, batch + j) for j in range(batch)])
            mask = torch.ones_like(ids)
            mask[0, :2] = 0 if i < len(calls) - 1 else 1  # padded, but for the last call
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, cache_implementation=cache, eos_token_id=None)
        for t in range(3):
            full = model(input_ids=out[:, :n + t], use_cache=False).logits[:, -1]
            assert torch.equal(out[:, n + t], full.argmax(-1)), t


def bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, init_std=0.3,
        attn_implementation="sdpa"))


@pytest.mark.parametrize("isolates", [True, False] if hilbert_fx.generation.ISOLATES else [False],
                         ids=lambda x: "isolated" if x else "limit raised")
def test_encoder_decoder_generate_runs_the_encoder_through_the_pass(monkeypatch, isolates):
    """generate() runs an encoder-decoder model's encoder once, through get_encoder(), before
    its first forward: compile_for_generate compiles the encoder too, so that each token is the
    argmax of a full forward of the compiled model (with the encoder left dense, most were
    not) and the encoder's self-attention is rewritten during generate(). A full forward still
    runs as one graph: the encoder's compiled forward is traced as part of the model's."""
    monkeypatch.setattr(hilbert_fx.generation, "ISOLATES", isolates)
    torch.manual_seed(0)
    model = bart().eval()
    src, new = tokens(48, 5), 8
    torch._dynamo.reset()
    be = recording_backend(W, R)
    hilbert_fx.compile_for_generate(model, backend=be)
    with torch.no_grad():
        out = model.generate(src, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None)
        generate_sites = recorded_sites(be)
        be.records.clear()
        for t in range(1, new + 1):
            full = model(input_ids=src, decoder_input_ids=out[:, :t], use_cache=False)
            assert out[0, t] == full.logits[0, -1].argmax(), t
        graphs = {len(r.sites) for r in be.records}
    # the encoder's graph names its sites from the encoder down
    encoder = {s.module for s in generate_sites if s.module.startswith("layers.")
               and s.action == "rewritten"}
    assert encoder == {f"layers.{i}.self_attn" for i in range(LAYERS)}, \
        [(s.module, s.action) for s in generate_sites]
    assert graphs == {3 * LAYERS}, graphs  # one graph a forward: encoder, decoder, cross sites


def t5():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=LAYERS,
        num_decoder_layers=LAYERS, relative_attention_num_buckets=8, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, attn_implementation="sdpa"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that greedy tokens differ from step to step
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return model.eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_t5_decodes_with_its_position_bias_beside_the_cache(cache):
    """T5's decoder self-attention adds a relative-position bias the pass does not read: the
    full forward keeps it as a mask over the row (section 2), and each decoding step hands the
    op its rows beside the cache (structure.read_site keep_mask), so every step is rewritten
    and each token is the argmax of the compiled model's full forward (the steps ran dense
    before: 7 of 14 tokens differed)."""
    torch.manual_seed(0)
    model = t5()
    src, new = tokens(13, 7), 10
    torch._dynamo.reset()
    be = recording_backend(W, R)
    hilbert_fx.compile_for_generate(model, backend=be)
    with torch.no_grad():
        out = model.generate(src, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, cache_implementation=cache,
                             return_dict_in_generate=True, output_logits=True)
        sites = recorded_sites(be)
        for t in range(new):
            full = model(input_ids=src, decoder_input_ids=out.sequences[:, :t + 1],
                         use_cache=False).logits[0, -1]
            torch.testing.assert_close(out.logits[t][0], full, atol=1e-4, rtol=1e-4)
            assert out.sequences[0, t + 1] == full.argmax(), t
    decoding = [s for s in sites if "SelfAttention" in s.module and s.module.startswith("decoder")]
    assert decoding and all(s.action == "rewritten" for s in decoding), \
        [(s.module, s.action, s.reason) for s in decoding]
    assert any("kept beside" in (s.sequences.what if s.sequences else "") for s in decoding)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_beam_search_gives_each_row_what_the_reference_gives_it_alone(cache):
    """Beam search (3 beams, the cache reordered between steps) over a batch whose second
    prompt is left-padded: each row's tokens and score are those of the same beam search run
    on the row alone by the float64 reference attention (tests/reference.py, no cache, every
    step a full forward), so neither the padding nor the beams' reordering of the cache changes
    what a row gets."""
    name = register_reference_attention(W, R, hilbert=True)
    reference = model_of("llama").double()
    reference.config._attn_implementation = name
    model = model_of("llama")
    torch._dynamo.reset()
    be = recording_backend(W, R)
    hilbert_fx.compile_for_generate(model, backend=be)
    prompts = [tokens(13, 3), tokens(9, 4)]
    ids = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros(2, 13, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 13 - p.shape[1]:], mask[b, 13 - p.shape[1]:] = p[0], 1
    beams = dict(num_beams=3, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                 eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache_implementation=cache, **beams)
        for b, p in enumerate(prompts):
            alone = reference.generate(p, use_cache=False, **beams)
            assert out.sequences[b, 13:].tolist() == alone.sequences[0, p.shape[1]:].tolist(), b
            torch.testing.assert_close(out.sequences_scores[b].double(),
                                       alone.sequences_scores[0].double(), atol=1e-5, rtol=1e-5)
    decoding = [s for s in recorded_sites(be) if example_length(s) == 1]
    assert decoding and all(s.action == "rewritten" for s in decoding), described(be)


def test_prompt_lookup_and_a_continued_conversation_pick_the_greedy_tokens():
    """Two ways generate() runs several queries against a cache: prompt lookup decoding (chunks
    of proposed tokens checked at once, the cache cropped where they are refused) picks greedy
    decoding's tokens, and a conversation continued with the returned cache (a turn of 7
    tokens, then decoding) picks those of generating from the whole text afresh."""
    model = model_of("llama")
    torch._dynamo.reset()
    be = recording_backend(W, R)
    hilbert_fx.compile_for_generate(model, backend=be, dynamic=True)
    base = tokens(8, 3)
    prompt = torch.cat([base, base, base[:, :5]], 1)  # repeats: prompt lookup proposes tokens
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        greedy = model.generate(prompt, return_dict_in_generate=True, **kw)
        looked_up = model.generate(prompt, prompt_lookup_num_tokens=3, **kw)
        assert looked_up.tolist() == greedy.sequences.tolist()
        text = torch.cat([greedy.sequences, tokens(7, 5)], 1)
        continued = model.generate(text, past_key_values=greedy.past_key_values, **kw)
        assert continued.tolist() == model.generate(text, **kw).tolist()
    chunks = [s for s in recorded_sites(be) if 1 < example_length(s) and s.sequences is not None]
    assert chunks and all(s.action == "rewritten" for s in recorded_sites(be)), described(be)


def example_length(site):
    """The number of queries of a site (from q's recorded shape)."""
    q = site.match.q
    ex = q.meta.get("example_value", q.meta.get("val"))
    return ex.shape[2] if site.shapes is None else site.shapes.q[2]


def test_compiled_module_generate_runs_the_uncompiled_forward():
    """torch.compile(model).generate() hands generate to the model: no forward is compiled (the
    reason compile_for_generate compiles model.forward)."""
    model = model_of("llama")
    torch._dynamo.reset()
    be = recording_backend(W, R)
    with torch.no_grad():
        torch.compile(model, backend=be).generate(tokens(9, 5), max_new_tokens=3, do_sample=False)
    assert be.records == []


def test_a_models_own_2d_mask_for_generate_is_kept():
    """Bloom's create_masks_for_generate pads the 2-D mask to the static cache's length, from
    which its forward builds ALiBi; compile_for_generate keeps a model's own 2-D mask (with the
    mask as generate() keeps it, scores and ALiBi differed in length: a crash). Under the
    identity configuration the tokens are those of the uncompiled model."""
    model = transformers.BloomForCausalLM(transformers.BloomConfig(
        n_layer=LAYERS, hidden_size=32, n_head=4, vocab_size=VOCAB, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.cat([tokens(13, 3), tokens(13, 4)])
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0

    def generate():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              cache_implementation="static", eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        plain = generate()
        torch._dynamo.reset()
        hilbert_fx.compile_for_generate(model, backend=hilbert_fx.backend((256,), (1,)))
        assert torch.equal(generate(), plain)


def test_static_cache_mask_built_by_generate_is_reported():
    """Compiled without compile_for_generate's mask hook, a static cache's decoding steps get the
    4-D mask generate() built as a graph input: the pass cannot read it, says so, and leaves the
    site as it is."""
    model = model_of("llama")
    torch._dynamo.reset()
    be = recording_backend(W, R)
    model.forward = torch.compile(model.forward, backend=be)
    with torch.no_grad():
        model.generate(tokens(9, 5), max_new_tokens=3, do_sample=False,
                       cache_implementation="static")
    decoding = [s for s in recorded_sites(be) if example_length(s) == 1]
    assert decoding and all(s.action == "skipped" and "input of the compiled graph" in s.reason
                            for s in decoding), described(be)


def test_a_mask_the_pass_cannot_take_keeps_section_2_and_says_why():
    """Mistral's sliding window beside a padding mask is no structure the op takes: the mask is
    passed (the pattern over the row, SPEC section 2) and the report's row says which parts."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, sliding_window=6,
        attn_implementation="sdpa")).eval()
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        report = hilbert_fx.explain(model, input_ids=tokens(20, 1).expand(2, -1),
                                    attention_mask=mask, use_cache=False,
                                    backend=hilbert_fx.backend(W, R, lowering="sdpa"))
    (site,) = report.sites
    assert site.action == "rewritten", report
    assert "attn_mask passed" in site.structure and "a padding mask" in site.structure, report
    assert "attn_mask passed" in str(report)
    with torch.no_grad():  # the window alone: the row names it too
        (alone,) = hilbert_fx.explain(model, input_ids=tokens(20, 1), use_cache=False,
                                      backend=hilbert_fx.backend(W, R, lowering="sdpa")).sites
    assert alone.action == "rewritten" and "a triangle (j >= i - 5)" in alone.structure, alone

    # what it computes: the float64 reference with the model's mask (causal, window, padding)
    # laid over the row's pattern, on every real query
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        assert attention_mask is not None and attention_mask.dtype == torch.bool
        out = reference_dilated_attention(query, key, value, W, R, hilbert=True,
                                          attn_mask=attention_mask, scale=scaling,
                                          enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    name = "hilbert_fx_reference_section_2"
    transformers.AttentionInterface.register(name, attention)
    transformers.AttentionMaskInterface.register(name, transformers.masking_utils.sdpa_mask)
    reference = copy.deepcopy(model).double()
    reference.config._attn_implementation = name
    ids = tokens(20, 1).expand(2, -1)
    torch._dynamo.reset()
    be = recording_backend(W, R)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(input_ids=ids, attention_mask=mask,
                                               use_cache=False).logits
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert [s.action for s in recorded_sites(be)] == ["rewritten"]
    real = mask.bool()
    torch.testing.assert_close(out[real].double(), expected[real], atol=1e-5, rtol=1e-5)
