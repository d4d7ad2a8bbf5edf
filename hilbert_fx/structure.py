"""The sequence structure of an attention site (SPEC section 5), proved from the model.

A row may hold several sequences (packed documents), padding, or the last tokens of a sequence
whose earlier keys and values come from a cache. Models say so with masks: transformers builds
"causal and same document" from position_ids, "causal and not padding" from a 2-D attention
mask, "causal from the cache position" for queries against a KV cache. The op takes that
structure directly (position_ids, seqused_k; lowering/op.py), so the pass reads what a mask means
(triangles.py's symbolic reading, over every size and every value of the tensors it reads) and,
where it is one of these structures, calls the op with the structure instead of the mask:

- causal and same run of consecutive position ids (transformers' packed sequences,
  DataCollatorWithFlattening's restart at 0): is_causal, position_ids = each token's place in
  its run (`run_positions`);
- the key not padding (a 2-D padding mask), causal (decoders) or not (encoders: BERT's
  bidirectional mask): position_ids = cumsum(mask) - 1, -1 on padding (`padding_positions`).
  The real tokens of a row are its one sequence wherever the padding lies: left, right, or
  between them (a mask with holes, whose real tokens the op reads as consecutive);
- same document id (FlexAttention's document masks), causal or not: each row's tokens put in
  document order (`document_order`), position_ids = each token's place in its document;
- either kind of documents and a 2-D padding mask (packed rows padded to a fixed length):
  position_ids = each real token's place among its document's real tokens, -1 on padding
  (`padded_run_positions`, `padded_document_positions`);
- queries shorter than keys, where the keys are a cache: torch.cat of the cached rows and the
  rows this step computed (DynamicCache: the mask must be causal aligned bottom-right, or absent
  for one query), or a buffer this step wrote its rows into (StaticCache: index_copy_ /
  index_put_ / setitem at cache_position) under a mask j <= i + c or j <= cache_position[i],
  which places query i at row c + i: is_causal, seqused_k = c + Nq (`cache_lengths`, the
  mask's own c, whichever layer's counter it read); a padding mask beside it gives
  position_ids. A prefill into an empty static cache that reads its own rows back
  (buf[:, :, :Nq]) is plain causal self-attention.

The tensors are computed on the device by graph ops the rewrite inserts (Recipes), once per
graph; where the mask was built outside a checkpointed region, they are computed outside too
and passed in. Anything else is not proved: the mask is passed and the pattern is laid over the
row (section 2), and the report says why.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from .detect import FORBIDDEN
from .fx_vocab import arg, example, is_inplace, same_size, target_name
from .triangles import Conj, Full, Rel, Sel, Tri, canonical, norm, same_offset


# ---------------------------------------------------------------------------------------------
# Run time: the structure's tensors, computed on the device from what the model holds
# ---------------------------------------------------------------------------------------------
def run_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B or 1, N] int64: each token's place in its run of consecutive position ids (a new run
    starts wherever the id is not the one before plus 1: transformers' packed documents)."""
    p = position_ids.reshape(-1, position_ids.shape[-1]).to(torch.int64)
    index = torch.arange(p.shape[-1], device=p.device)
    before = torch.cat([p[:, :1] - 1, p[:, :-1]], dim=-1)
    start = torch.where(p - before != 1, index, 0).cummax(dim=-1).values
    return index - start


def padding_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 from a 2-D padding mask (nonzero on real tokens): cumsum(mask) - 1 on real
    tokens, -1 on padding. Padding between real tokens is skipped: the op reads a row's real
    tokens as one sequence, 0, 1, 2, ..., as the mask lets each see the others."""
    real = mask.reshape(-1, mask.shape[-1]) != 0
    return torch.where(real, real.to(torch.int64).cumsum(-1) - 1, -1)


def _places(start: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each real token's place among the real tokens from `start` (the index of the first token
    of its run) on; -1 on padding. Padding anywhere in a run is skipped, so the real tokens of a
    run count 0, 1, 2, ... whatever lies between them (lowering/sequences.py reads them so)."""
    count = real.to(torch.int64).cumsum(-1)
    before = count.gather(-1, start) - real.gather(-1, start).to(torch.int64)
    return torch.where(real, count - before - 1, -1)


def padded_run_positions(position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, N] int64: each real token's place among the real tokens of its run of consecutive
    position ids (packed documents), -1 where the 2-D padding mask is 0."""
    n = position_ids.shape[-1]
    p = position_ids.reshape(-1, n).to(torch.int64)
    p, real = torch.broadcast_tensors(p, mask.reshape(-1, n) != 0)
    index = torch.arange(n, device=p.device)
    before = torch.cat([p[:, :1] - 1, p[:, :-1]], dim=-1)
    start = torch.where(p - before != 1, index, 0).cummax(dim=-1).values
    return _places(start, real)


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 from a causal mask of sequences [B, 1, N, N] (boolean, or additive with 0
    where allowed: a query sees the real tokens of its own document up to it), as
    padded_run_positions gives from the tensors it was built from: a real query sees its
    sequence's real tokens up to itself, so their count less one is its place; a padding query
    does not see itself, -1. For a piece of a DDP model's graph, which receives the mask but not
    the tensors it was built from (ddp_pieces.py)."""
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    count = allowed.to(torch.int64).sum(-1)
    return torch.where(allowed.diagonal(dim1=-2, dim2=-1), count - 1, -1)


def tensor_offset(counter: torch.Tensor, const: int) -> torch.Tensor:
    """The cache row of the first query, counter + const (a one-element integer tensor: a
    StaticCache's length before this step), as a 0-dim int64 tensor."""
    return counter.reshape(-1)[0].to(torch.int64) + const


def first_row(rows: torch.Tensor) -> torch.Tensor:
    """The cache row of the first query, from the rows of every query (cache_position)."""
    return rows.reshape(-1)[0].to(torch.int64)


def cache_lengths(first, q: torch.Tensor) -> torch.Tensor:
    """seqused_k [B]: the queries stand at cache rows first, first + 1, ..., so each batch row
    uses keys [0, first + Nq) (cache_position[-1] + 1). `first`: a 0-dim tensor or an int."""
    if not isinstance(first, torch.Tensor):
        return torch.full((q.shape[0],), first + q.shape[2], dtype=torch.int64, device=q.device)
    return (first + q.shape[2]).expand(q.shape[0]).contiguous()


def document_order(ids: torch.Tensor) -> torch.Tensor:
    """[B or 1, N] int64: a stable sort of each row by document id, so that every document's
    tokens are consecutive and in their order (a causal mask within a document is unchanged)."""
    ids = ids.reshape(-1, ids.shape[-1])
    return torch.sort(ids, dim=-1, stable=True).indices


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """[B or 1, N] int64: each token's place in its document, read in document order."""
    ids = ids.reshape(-1, ids.shape[-1])
    ordered = torch.sort(ids, dim=-1, stable=True).values
    index = torch.arange(ids.shape[-1], device=ids.device)
    before = torch.cat([ordered[:, :1], ordered[:, :-1]], dim=-1)
    new = (ordered != before) | (index == 0)
    start = torch.where(new, index, 0).cummax(dim=-1).values
    return index - start


def padded_document_positions(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, N] int64, read in document order (`document_order`): each real token's place among
    the real tokens of its document, -1 where the 2-D padding mask is 0."""
    n = ids.shape[-1]
    ids, real = torch.broadcast_tensors(ids.reshape(-1, n), mask.reshape(-1, n) != 0)
    order = torch.sort(ids, dim=-1, stable=True).indices
    ordered, real = ids.gather(-1, order), real.gather(-1, order)
    index = torch.arange(n, device=ids.device)
    before = torch.cat([ordered[:, :1], ordered[:, :-1]], dim=-1)
    start = torch.where((ordered != before) | (index == 0), index, 0).cummax(dim=-1).values
    return _places(start, real)


def first_keys(position_ids: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The positions of k's rows: the first Nk of a longer per-token tensor's."""
    return position_ids[..., :k.shape[2]]


def rows_in_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, H, N, D] with each batch row's tokens taken in `order` [B or 1, N]."""
    index = order.view(order.shape[0], 1, order.shape[1], 1).expand(x.shape[0], x.shape[1], -1, x.shape[3])
    return x.gather(2, index)


def rows_back(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of rows_in_order: x's rows put back where `order` took them from."""
    return rows_in_order(x, torch.argsort(order, dim=-1))


# ---------------------------------------------------------------------------------------------
# Compile time: what a site's mask and keys prove
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """A tensor the rewritten graph computes once: fn(*args), inserted right after the last of
    its operands (so that every site of the graph can use it)."""
    fn: Callable
    args: tuple


@dataclass(frozen=True)
class Sequences:
    """The structure a site is rewritten with. `what`: the sentence the report shows.
    `trim`: position_ids is computed over a per-token tensor longer than k (a padding mask
    whose length is symbolic where k's is not): the op takes its first Nk columns.
    `first_row`: for queries against a buffer longer than what it holds (a static cache), the
    first query's row there, an int or a Recipe of a 0-dim tensor (seqused_k = first_row + Nq,
    computed at the site). `order`: rows put in document order before the op and back after it. `new_kv`: for
    queries against a cache, the key and value rows this step computed, from which the
    self-attention proof reads (the cached rows are the same sequence's, by the cache)."""
    what: str
    is_causal: bool
    position_ids: Optional[Recipe] = None
    first_row: object = None  # Recipe | int
    order: Optional[Recipe] = None
    new_kv: Optional[tuple] = None
    trim: bool = False  # position_ids cover more tokens than k has rows: the first Nk are k's
    # the site's own mask goes to the op beside the cache (its rows of the queries, section 2
    # over the sequence's rows), where the mask is a bias the pass does not read (T5's relative
    # positions): is_causal is then False, position_ids None
    keep_mask: bool = False


@dataclass(frozen=True)
class _Cache:
    kind: str  # "dynamic" | "static"
    new_k: fx.Node
    new_v: fx.Node
    rows: Optional[fx.Node] = None  # static: the cache rows the new keys were written to


def _concatenated(node, nq) -> Optional[fx.Node]:
    """The new rows of a DynamicCache's torch.cat((past, new), dim=-2), or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.cat):
        return None
    pieces, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
    if not isinstance(pieces, (list, tuple)) or len(pieces) != 2 or dim not in (2, -2):
        return None
    new = pieces[1]
    ex = example(new)
    if not isinstance(ex, torch.Tensor) or ex.dim() != 4 or not same_size(ex.shape[2], nq):
        return None
    return new


def _written(flow, buf, site: fx.Node, nq) -> Optional[tuple]:
    """(rows, new) when `buf` is a StaticCache buffer whose one in-place write before `site`
    put `new` [B, H, nq, D] at `rows` [nq] along dim 2: buf.index_copy_(2, rows, new),
    buf[:, :, rows] = new, or buf.index_put_((None, None, rows), new)."""
    if not isinstance(buf, fx.Node):
        return None
    order = flow.order
    writes = [u for u in buf.users if is_inplace(u) and u.args and u.args[0] is buf
              and order.get(u, len(order)) < order[site]]
    if len(writes) != 1:
        return None
    w = writes[0]
    name = target_name(w)
    rows = new = None
    if name == "index_copy_":
        if arg(w, 1, "dim") in (2, -2):
            rows, new = arg(w, 2, "index"), arg(w, 3, "source")
    elif w.target is operator.setitem:
        index, new = w.args[1], w.args[2]
        index = list(index) if isinstance(index, tuple) else [index]
        if len(index) >= 3 and index[0] == slice(None) and index[1] == slice(None) \
                and all(i == slice(None) or i is Ellipsis for i in index[3:]):
            rows = index[2]
    elif name == "index_put_":
        index, new = arg(w, 1, "indices"), arg(w, 2, "values")
        if isinstance(index, (list, tuple)) and len(index) == 3 and index[0] is None and index[1] is None:
            rows = index[2]
    rex, nex = example(rows), example(new)
    if not isinstance(rows, fx.Node) or not isinstance(rex, torch.Tensor) or rex.dim() != 1 \
            or rex.is_floating_point() or rex.dtype == torch.bool or not same_size(rex.shape[0], nq):
        return None
    if not isinstance(nex, torch.Tensor) or nex.dim() != 4 or not same_size(nex.shape[2], nq):
        return None
    return rows, new


def _read_back(flow, node, site: fx.Node, nq) -> Optional[fx.Node]:
    """The new rows, when `node` is buf[:, :, :nq] of a buffer whose one write before `site` put
    nq rows computed by this step (transformers' prefill into an empty StaticCache reads its
    rows back so)."""
    if not (isinstance(node, fx.Node) and target_name(node) == "getitem"):
        return None
    index = node.args[1]
    index = list(index) if isinstance(index, tuple) else [index]
    if len(index) < 3 or index[0] != slice(None) or index[1] != slice(None) \
            or not all(i == slice(None) for i in index[3:]):
        return None
    rows = index[2]
    if not isinstance(rows, slice) or rows.start not in (None, 0) or rows.step not in (None, 1) \
            or not same_size(rows.stop if not isinstance(rows.stop, fx.Node) else example(rows.stop), nq):
        return None
    written = _written(flow, node.args[0], site, nq)
    return None if written is None else written[1]


def cache_of(flow, k, v, site: fx.Node, nq, nk) -> Optional[_Cache]:
    """How k and v hold a cache: the queries continue it (q shorter than k), or read their own
    rows back from it ("prefill")."""
    if same_size(nq, nk):
        new_k, new_v = _read_back(flow, k, site, nq), _read_back(flow, v, site, nq)
        return None if new_k is None or new_v is None else _Cache("prefill", new_k, new_v)
    new_k, new_v = _concatenated(k, nq), _concatenated(v, nq)
    if new_k is not None and new_v is not None:
        return _Cache("dynamic", new_k, new_v)
    wk, wv = _written(flow, k, site, nq), _written(flow, v, site, nq)
    if wk is not None and wv is not None:
        (rows_k, new_k), (rows_v, new_v) = wk, wv
        same = canonical(rows_k) is canonical(rows_v) or (
            flow.triangle(rows_k) is not None and flow.triangle(rows_k) == flow.triangle(rows_v))
        if same:
            return _Cache("static", new_k, new_v, rows_k)
    return None


def mask_atoms(flow, mask: Optional[fx.Node]) -> Optional[set]:
    """The atoms of an attention mask (all of them must hold for a key to be attended): a
    boolean mask (True = allowed) or an additive one (0 allowed, -inf or a large negative
    forbidden), read by triangles.py. None where the mask is not such a reading."""
    if mask is None:
        return set()
    ex = example(mask)
    if not isinstance(ex, torch.Tensor):
        return None
    value = flow.triangle(mask)
    if ex.dtype == torch.bool:
        cond = value
    elif ex.is_floating_point():
        if isinstance(value, Full) and value.value == 0:
            return set()
        if not (isinstance(value, Sel) and value.a == 0 and value.b <= FORBIDDEN):
            return None
        cond = value.tri
    else:
        return None
    if isinstance(cond, Full):
        return set() if cond.value is True else None
    if isinstance(cond, Tri):
        return {cond}
    if isinstance(cond, Conj):
        return set(cond.atoms)
    return None


def _rels(atoms, kind) -> list:
    return [a for a in atoms if isinstance(a, Rel) and a.kind == kind]


def _batch_ok(atoms, mask) -> bool:
    """Rels that read a batch index read it along the scores' batch dim (-4 of [B, H, i, j];
    a mask_mod's b, where `mask` is None)."""
    ex = example(mask) if mask is not None else None
    for a in atoms:
        if isinstance(a, Rel) and a.bdim is not None and (
                a.bdim != -4 or (mask is not None and (ex is None or ex.dim() != 4))):
            return False
    return True


def read_site(flow, q, k, v, attn_mask, is_causal: bool, site: fx.Node, atoms=None) -> tuple:
    """(Sequences or None, reason): the structure the site is rewritten with. (None, "") where
    there is no structure to read (no cache, no per-token mask: section 2 as it stands);
    (None, reason) where there is one the pass cannot prove. `atoms`: the mask's atoms where
    they were read elsewhere (a FlexAttention mask_mod), instead of from attn_mask."""
    qex, kex = example(q), example(k)
    if not (isinstance(qex, torch.Tensor) and isinstance(kex, torch.Tensor) and qex.dim() == 4
            and kex.dim() == 4):
        return None, ""
    nq, nk = qex.shape[2], kex.shape[2]
    cache = cache_of(flow, k, v, site, nq, nk)
    if attn_mask is not None and is_causal:
        return None, ""
    from_mask = atoms is None
    atoms = mask_atoms(flow, attn_mask) if from_mask else set(atoms)
    shorter = not same_size(nq, nk)
    if atoms is None:
        what = ("the mask is not one the pass reads as a sequence structure (causal, packed "
                "documents, padding, a cache)")
        if isinstance(attn_mask, fx.Node) and attn_mask in flow.outer:
            what = (f"the mask is built {flow.outer_where} from tensors this graph does not "
                    "receive, so the pass passes it as it is")
        elif isinstance(attn_mask, fx.Node) and attn_mask.op == "placeholder":
            what = ("the mask is an input of the compiled graph, built outside it (in an earlier "
                    "graph, across a graph break, or by generate() for a static cache), so the "
                    "pass cannot read what it allows")
        kept = _kept_beside_cache(flow, cache, attn_mask, nq) if shorter else None
        if kept is not None:
            return kept, ""
        if shorter:
            beside = "" if cache is not None else ", and k and v are no cache the pass can see"
            return None, (f"q and k have different lengths (q has {nq} positions, k has {nk})"
                          f"{beside}: {what}")
        return None, what
    if not _batch_ok(atoms, attn_mask if from_mask else None):
        return None, "the mask reads its per-token tensors at an index that is not the batch's"
    rels = [a for a in atoms if isinstance(a, Rel)]
    lengths = f"q and k have different lengths (q has {nq} positions, k has {nk})"
    if shorter and cache is None:
        # no structure: find._placed reports queries that no cache places, after the
        # self-attention proof, for every finder
        return None, ""
    if cache is None and not rels:
        # triangles over the row alone: causal, and what else a model lays over it (a sliding
        # window) stays a mask, which the report names
        others = sorted(_atom_words(a) for a in atoms if a != Tri(True, 0))
        if attn_mask is not None and others:
            return None, f"the mask holds {', '.join(others)}, kept as a mask"
        return None, ""
    if shorter and attn_mask is None and is_causal:
        return None, (f"{lengths} with is_causal: SDPA aligns its causal mask top-left, so the "
                      f"queries are not the last rows of the cached sequence")
    rest = set(atoms)
    causal = False
    seqused = None
    if cache is not None and cache.kind == "prefill":
        # the keys are the rows this step wrote, read back: plain causal self-attention
        is_causal = is_causal or Tri(True, 0) in rest
        rest.discard(Tri(True, 0))
        if rest or not is_causal:
            return None, ("the keys are read back from a cache this step wrote, under a mask the "
                          "pass does not read")
        return Sequences("causal; the keys are this step's rows, read back from a static cache",
                         True, new_kv=(cache.new_k, cache.new_v)), ""
    if cache is None:
        if Tri(True, 0) in rest or is_causal:
            rest.discard(Tri(True, 0))
            causal = True
        for le in _rels(rest, "pos_le"):  # positions causal within a run: rows causal
            if Rel("same_run", le.node, le.bdim) in rest:
                rest.discard(le)
                causal = True
    elif cache.kind == "dynamic":
        tris = [a for a in rest if isinstance(a, Tri)]
        for t in tris:
            if t.lower and same_offset(t.k, norm(_expr(nk) - _expr(nq))):
                rest.discard(t)
                causal = True
        # one query against every key: the last row of a causal mask
        if not causal and same_size(nq, 1) and not tris and not _rels(rest, "key_le"):
            causal = True
    else:
        # The mask places the queries in the buffer: key j <= i + c (query i at row c + i), or
        # j <= rows[i] (cache_position). The op reads keys [0, c + Nq) with query i at row c + i:
        # the mask's own reading, whichever layer's counter c is.
        for t in [a for a in rest if isinstance(a, Tri)]:
            recipe = _offset_recipe(flow, t.k) if t.lower else None
            if recipe is not None and seqused is None:
                rest.discard(t)
                causal, seqused = True, recipe
        for le in _rels(rest, "key_le"):
            if seqused is None:
                rest.discard(le)
                causal, seqused = True, Recipe(first_row, (le.node,))
    if cache is not None and not causal:
        return None, (f"{lengths}: k and v are a cache, but the mask does not prove that each "
                      f"query sees exactly the keys at or before its own row")
    new_kv = (cache.new_k, cache.new_v) if cache is not None else None
    where = ("" if cache is None else " against a dynamic cache (torch.cat)" if cache.kind == "dynamic"
             else " against a static cache (seqused_k = the first query's cache row + Nq)")
    if not rest:
        if cache is None:
            return None, ""
        return Sequences(f"causal{where}", True, None, seqused, None, new_kv), ""
    if len(rest) == 1:
        (atom,) = rest
        ex = example(atom.node) if isinstance(atom, Rel) else None
        trim = isinstance(ex, torch.Tensor) and not same_size(ex.shape[-1], nk)
        if isinstance(atom, Rel) and atom.kind == "key" and ex.dim() == 2:
            # a cache came with causal (checked above); without one, either way
            return Sequences(("causal with padding" if causal else "bidirectional with padding")
                             + f" (position_ids = cumsum of the 2-D mask - 1, -1 on padding)"
                             f"{where}", causal, Recipe(padding_positions, (atom.node,)),
                             seqused, None, new_kv, trim), ""
        if isinstance(atom, Rel) and atom.kind == "same_run" and cache is None:
            return Sequences(("causal, " if causal else "") + "packed sequences (position_ids "
                             "from runs of consecutive position ids)", causal,
                             Recipe(run_positions, (atom.node,)), trim=trim), ""
        if isinstance(atom, Rel) and atom.kind == "same_id" and cache is None:
            return Sequences(("causal, " if causal else "") + "documents by id (rows sorted by "
                             "document, position_ids within each)", causal,
                             Recipe(document_positions, (atom.node,)), None,
                             Recipe(document_order, (atom.node,))), ""
    if len(rest) == 2 and cache is None and all(isinstance(a, Rel) for a in rest):
        padded = _padded_documents(rest, causal, nk)
        if padded is not None:
            return padded, ""
    names = sorted(_atom_words(a) for a in rest)
    return None, (f"the mask combines {', '.join(names)}{' with causal' if causal else ''}: not "
                  f"one sequence structure the op takes")


def _kept_beside_cache(flow, cache: Optional[_Cache], attn_mask, nq) -> Optional[Sequences]:
    """A decoding step's mask that the pass does not read (a bias: T5's relative positions)
    beside a cache it proved: the op takes the mask's rows of the queries, which stand at the
    cache's last rows (a dynamic cache) or at the rows this step wrote (a static one), as the
    full forward keeps the same mask over the whole row (section 2). Only a mask built in this
    graph: one passed in may hold anything, and a window's cache may have dropped its first
    tokens (a window is a triangle the pass reads, and then not kept here)."""
    if (cache is None or cache.kind not in ("dynamic", "static")
            or not isinstance(attn_mask, fx.Node) or attn_mask.op == "placeholder"
            or attn_mask in flow.outer):
        return None
    first = None
    if cache.kind == "static":
        if cache.rows is None:
            return None
        first = Recipe(first_row, (cache.rows,))
    where = ("a dynamic cache (torch.cat)" if cache.kind == "dynamic" else
             "a static cache (seqused_k = the first query's cache row + Nq)")
    return Sequences(f"the mask (a bias the pass does not read) kept beside {where}: the "
                     f"queries' rows of it, over the sequence's rows", False, None, first, None,
                     (cache.new_k, cache.new_v), keep_mask=True)


def _atom_words(a) -> str:
    """An atom of a mask in the report's words."""
    if isinstance(a, Rel):
        return {"pos_le": "causal over position ids", "same_run": "same run of position ids",
                "same_id": "same document id", "key": "a padding mask",
                "key_le": "keys up to the cache position"}.get(a.kind, a.kind)
    k = str(a.k)
    shift = "" if a.k == 0 else f" - {k[1:]}" if k.startswith("-") else f" + {k}"
    return f"a triangle (j {'<=' if a.lower else '>='} i{shift})"


def _padded_documents(rest, causal: bool, nk) -> Optional[Sequences]:
    """Packed documents (runs of consecutive position ids, or document ids) and a 2-D padding
    mask: position_ids = each real token's place among its document's real tokens, -1 on
    padding. None where the two per-token tensors are not that pair over the same tokens."""
    keys = [a for a in rest if a.kind == "key"]
    docs = [a for a in rest if a.kind in ("same_run", "same_id")]
    if len(keys) != 1 or len(docs) != 1:
        return None
    (key,), (doc,) = keys, docs
    kex, dex = example(key.node), example(doc.node)
    if not (isinstance(kex, torch.Tensor) and isinstance(dex, torch.Tensor)) or kex.dim() != 2 \
            or dex.dim() not in (1, 2) or not same_size(kex.shape[-1], dex.shape[-1]):
        return None
    trim = not same_size(kex.shape[-1], nk)
    head = "causal, " if causal else ""
    if doc.kind == "same_run":
        return Sequences(f"{head}packed sequences with padding (position_ids from runs of "
                         f"consecutive position ids, -1 on padding)", causal,
                         Recipe(padded_run_positions, (doc.node, key.node)), trim=trim)
    if trim:  # the rows are put in document order: the order must cover k's rows exactly
        return None
    return Sequences(f"{head}documents by id with padding (rows sorted by document, "
                     f"position_ids within each, -1 on padding)", causal,
                     Recipe(padded_document_positions, (doc.node, key.node)), None,
                     Recipe(document_order, (doc.node,)))


def _offset_recipe(flow, k):
    """The offset k as the first query's row: an int as it is, a run-time counter plus an int as
    a recipe that reads the counter before any in-place write to it (as the mask read it)."""
    if isinstance(k, int):
        return k if k >= 0 else None
    const, terms = k.as_coeff_add()
    if len(terms) != 1 or terms[0] not in flow.atoms or not const.is_Integer:
        return None
    node, version = flow.atoms[terms[0]]
    return Recipe(tensor_offset, (node, int(const))) if version == 0 else None


def _expr(x):
    import sympy
    return x if isinstance(x, int) else sympy.sympify(x.node.expr)


def structure_specs(sequences: Optional[Sequences], q, k, shapes=None) -> dict:
    """TensorSpecs of the op's structure arguments (for the rule book), from q's and k's shapes
    (the canonical `shapes` a finder recorded, where it did)."""
    from .lowering.arguments import TensorSpec
    if sequences is None:
        return {}
    if shapes is not None:
        b, nk = shapes.q[0], shapes.k[2]
    else:
        b, nk = example(q).shape[0], example(k).shape[2]
    specs = {}
    if sequences.position_ids is not None:
        specs["position_ids"] = TensorSpec((b, nk), torch.int64)
    if sequences.first_row is not None:
        specs["seqused_k"] = TensorSpec((b,), torch.int64)
    return specs


def _fake_value(fn, args):
    """What fn(*args) gives on the args' recorded (fake) values, for the new node's meta."""
    values = [example(a) if isinstance(a, fx.Node) else a for a in args]
    mode = next((getattr(v, "fake_mode", None) for v in values
                 if getattr(v, "fake_mode", None) is not None), None)
    if mode is None:
        return None
    try:
        with mode:
            return fn(*values)
    except Exception:  # noqa: BLE001  (the meta is a convenience; the graph is right without it)
        return None


def insert_recipe(flow, recipe: Recipe) -> fx.Node:
    """The node computing `recipe` in flow's graph, made once per graph, right after its last
    operand (after the graph's inputs where the operands are inputs), so that every site can read
    it. Operands of the caller of a region (a checkpointed body, whose mask was built outside it)
    are computed there and passed in, as one more operand of every call of the region."""
    graph, memo = flow.graph, flow.recipes
    key = (recipe.fn, tuple(id(a) if isinstance(a, fx.Node) else a for a in recipe.args))
    if key in memo:
        return memo[key]
    nodes = [a for a in recipe.args if isinstance(a, fx.Node)]
    if any(n.graph is not graph for n in nodes):
        node = _passed_in(flow, insert_recipe(flow.callers[1], recipe))
    else:
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max(nodes, key=order.__getitem__)
        if last.op == "placeholder":
            last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            node = graph.call_function(recipe.fn, recipe.args)
        value = _fake_value(recipe.fn, recipe.args)
        if value is not None:
            node.meta["example_value"] = value
    memo[key] = node
    return node


def _passed_in(flow, outer: fx.Node) -> fx.Node:
    """A new input of flow's region standing for `outer`, a node of its caller, which every
    call of the region passes after the operands it passed before."""
    _, caller, calls = flow.callers
    placeholders = [n for n in flow.graph.nodes if n.op == "placeholder"]
    with flow.graph.inserting_after(placeholders[-1]):
        node = flow.graph.placeholder(f"hilbert_fx_{outer.name}")
    if "example_value" in outer.meta:
        node.meta["example_value"] = outer.meta["example_value"]
    for call in calls:
        call.args = tuple(call.args) + (outer,)
    flow.outer[node] = (caller, outer)
    return node


def prune_passed(flow, used_before: set) -> list:
    """Inputs of flow's region that the rewrite left without users (a mask built outside it,
    replaced by its structure): removed from the region and from every call of it. Returns the
    caller's nodes no longer passed (their computation may now be dead there)."""
    if flow.callers is None:
        return []
    _, _, calls = flow.callers
    placeholders = [n for n in flow.graph.nodes if n.op == "placeholder"]
    freed = []
    for i in reversed(range(len(placeholders))):
        p = placeholders[i]
        if p.users or p not in used_before:
            continue
        for call in calls:
            body_at = next(j for j, a in enumerate(call.args)
                           if isinstance(a, fx.Node) and a.op == "get_attr")
            args = list(call.args)
            freed.append(args.pop(body_at + 1 + i))
            call.args = tuple(args)
        flow.outer.pop(p, None)
        flow.graph.erase_node(p)
    return [n for n in freed if isinstance(n, fx.Node)]
