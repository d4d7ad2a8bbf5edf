"""Which dims of a graph's tensors are an activation input's own dims, and where a slice, chunk,
flip or roll cut one: where queries, keys and values derive from one tensor through ops that
mix no positions (dataflow.common_source), they are still not one sequence if such a cut, below
the tensor they share, took the keys from other rows or positions than the queries (q from
x[:1], k and v from x[1:]; q from the first half of a sequence, k and v from the second).

`RowLabels.labels(node)` gives, per dim of the node's value, the (activation input, dim) it
stands for, or ("cut", that, where) once a slice, split piece or reorder at `where` cut it, or
None: projections keep the leading dims, views keep the dims whose sizes they keep at either
end, transposes move them, elementwise ops keep them. An input's features (its last dim), and
dims made by splitting them (the q/k/v stack of a fused projection), carry no label, so picking
q, k and v out of them cuts nothing. Anything not understood carries no label either: the check
then finds nothing, as before it. `cut_apart(nodes)`: whether the queries' and the keys'
batch or sequence dims are different cuts of one dim.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .fx_vocab import example, same_size, target_name

_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "expand",
          "expand_as", "view_as", "reshape_as", "contiguous", "clone", "detach", "to", "type",
          "float", "half", "bfloat16", "double", "repeat"}
_PROJECTIONS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum"}
_REORDERS = {"flip", "roll", "index_select", "gather", "take_along_dim", "sort", "argsort",
             "fliplr", "flipud"}
_SPLITS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes", "hsplit", "vsplit"}


def _shape(node):
    ex = example(node)
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else None


def _dim(d, rank: int):
    return d % rank if isinstance(d, int) and rank else None


def _kept_ends(labels: tuple, shape_in: tuple, shape_out: tuple) -> tuple:
    """A view's labels: the dims of equal size at the start, then at the end, keep theirs."""
    out = [None] * len(shape_out)
    i = 0
    while i < min(len(shape_in), len(shape_out)) and same_size(shape_in[i], shape_out[i]):
        out[i] = labels[i]
        i += 1
    j = 1
    while (j <= min(len(shape_in), len(shape_out)) - i
           and same_size(shape_in[-j], shape_out[-j])):
        out[-j] = labels[-j]
        j += 1
    return tuple(out)


class RowLabels:
    """Labels of one graph's nodes (the module's docstring), computed once, in graph order."""

    def __init__(self, flow):
        self.flow = flow
        self._labels: dict = {}
        for node in flow.graph.nodes:
            try:
                self._labels[node] = self._of(node)
            except Exception:  # noqa: BLE001 - an op read wrongly labels nothing
                self._labels[node] = None

    def labels(self, node):
        return self._labels.get(node)

    def cut_apart(self, nodes) -> bool:
        """Whether the batch or sequence dims of the nodes (0 and 2 of [B, H, N, D], 0 and 1 of
        three dims) stand for different cuts of one dim: some rows for the queries, others for
        the keys. The same cut everywhere (one slice shared, or written twice) is one sequence."""
        slots: dict = {}
        for node in nodes:
            labels = self._labels.get(node)
            if not isinstance(labels, tuple) or _is_pieces(labels):
                continue
            rank = len(labels)
            for slot, d in enumerate((0, 2) if rank == 4 else (0, 1) if rank == 3 else ()):
                slots.setdefault(slot, set()).add(labels[d])
        return any(len(seen) > 1 and any(_is_cut(x) for x in seen) for seen in slots.values())

    # -- transfer ----------------------------------------------------------------------------
    def _input(self, node):
        """(the activation input, its labels): the activation input of the output's shape, or
        else the first one (a rotary table or a mask beside it lines up from the end)."""
        found, shape = [], _shape(node)
        for inp in node.all_input_nodes:
            labels = self._labels.get(inp)
            if (self.flow.is_activation(inp) and isinstance(labels, tuple)
                    and not _is_pieces(labels)):
                found.append((inp, labels))
        for inp, labels in found:
            if shape is not None and _shape(inp) == shape:
                return inp, labels
        return found[0] if found else (None, None)

    def _of(self, node):
        if node.op == "placeholder":
            shape = _shape(node)
            if shape is None or not self.flow.is_activation(node):
                return None
            # every dim but the features (the last): q from some features of a token and k
            # from others are still one sequence
            return tuple((node, i) for i in range(len(shape) - 1)) + (None,)
        if node.op not in ("call_function", "call_method", "call_module"):
            return None
        if node.op == "call_function" and node.target is operator.getitem:
            return self._getitem(node)
        src, labels = self._input(node)
        if src is None:
            return None
        name = target_name(node).split(".")[-1]
        shape_in, shape_out = _shape(src), _shape(node)
        if name in _SPLITS:
            return self._split(node, name, labels)
        if shape_out is None:
            return None
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = (_dim(x, len(labels)) for x in self._dims(node, 2))
            out = list(labels)
            out[a], out[b] = out[b], out[a]
            return tuple(out)
        if name == "permute":
            order = self._permutation(node)
            return tuple(labels[i] for i in order) if order else None
        if name in _VIEWS:
            return _kept_ends(labels, shape_in, shape_out)
        if name in _REORDERS or name in ("narrow", "select"):
            return self._reorder(node, name, labels)
        if name in _PROJECTIONS or node.op == "call_module":
            if len(shape_out) == len(shape_in):  # the leading dims kept, the last one new
                return tuple(labels[:-1]) + (None,)
            return None
        if name in ("cat", "concat", "concatenate", "stack"):
            return None
        # elementwise, norms, activations, dropout, casts: the activation's dims, where the
        # output lines up with them from the end (broadcasting)
        if len(shape_out) >= len(shape_in) and all(
                same_size(a, b) for a, b in zip(shape_in[::-1], shape_out[::-1])):
            return (None,) * (len(shape_out) - len(shape_in)) + labels
        return None

    def _dims(self, node, count: int) -> list:
        args = list(node.args[1:])  # after the tensor (a method's self, a function's input)
        names = ("dim0", "dim1")
        return [args[i] if i < len(args) else node.kwargs.get(names[i]) for i in range(count)]

    def _permutation(self, node):
        dims = node.args[1:] if len(node.args) > 1 else ()
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = dims or node.kwargs.get("dims", ())
        return [int(d) for d in dims] if all(isinstance(d, int) for d in dims) else None

    def _acted_dim(self, node, name: str, rank: int):
        """The dim a reorder, narrow, select or split acts on (None if not a constant)."""
        if name in ("roll",):
            d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims")
        elif name in ("flip",):
            d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dims")
        elif name in ("fliplr",):
            d = 1
        elif name in ("flipud",):
            d = 0
        elif name in ("sort", "argsort"):
            d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        elif name in ("unbind",):
            d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        elif name in ("split", "chunk", "tensor_split", "split_with_sizes"):
            d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        elif name in ("hsplit", "vsplit"):
            d = 1 if name == "hsplit" else 0
        else:  # narrow, select, index_select, gather, take_along_dim: (input, dim, ...)
            d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if isinstance(d, (list, tuple)):
            return [_dim(x, rank) for x in d]
        return [_dim(d, rank)]

    def _reorder(self, node, name, labels):
        dims = self._acted_dim(node, name, len(labels))
        if None in dims:
            return None
        if name == "roll" and (len(node.args) <= 2 and node.kwargs.get("dims") is None):
            dims = list(range(len(labels)))  # roll of the flattened tensor
        if name == "select":  # the dim goes: what stood for it is gone with it
            return tuple(l for i, l in enumerate(labels) if i != dims[0])
        return tuple(_cut(l, _where(node)) if i in dims else l for i, l in enumerate(labels))

    def _split(self, node, name, labels):
        (d,) = self._acted_dim(node, name, len(labels))[:1] or (None,)
        if d is None:
            return None
        if name == "unbind":
            piece = tuple(l for i, l in enumerate(labels) if i != d)
        else:
            piece = tuple(("split", d) if i == d else l for i, l in enumerate(labels))
        return ("pieces", piece, labels[d])

    def _getitem(self, node):
        base, index = node.args[0], node.args[1]
        labels = self._labels.get(base)
        if _is_pieces(labels):  # one piece of a split, chunk or unbind: cut where it was split
            piece = _cut(labels[2], (_where(base), index))
            return tuple(piece if isinstance(l, tuple) and l[:1] == ("split",) else l
                         for l in labels[1])
        if not isinstance(labels, tuple) or not isinstance(example(base), torch.Tensor):
            return None
        index = index if isinstance(index, tuple) else (index,)
        shape = _shape(base)
        explicit = sum(1 for i in index if i is not None and i is not Ellipsis)
        out, dim = [], 0
        for item in index:
            if item is Ellipsis:
                for _ in range(len(shape) - explicit):
                    out.append(labels[dim])
                    dim += 1
            elif item is None:
                out.append(None)
            elif isinstance(item, slice):
                whole = (item.start in (None, 0) and item.step in (None, 1)
                         and (item.stop is None or same_size(item.stop, shape[dim])))
                out.append(labels[dim] if whole else _cut(labels[dim], _where(node)))
                dim += 1
            elif isinstance(item, int):
                dim += 1  # the dim goes
            else:  # a tensor index: rows picked by value
                out.append(_cut(labels[dim], _where(node)))
                dim += 1
        out.extend(labels[dim:])
        return tuple(out)


def _is_pieces(labels) -> bool:
    return isinstance(labels, tuple) and len(labels) == 3 and labels[0] == "pieces"


def _is_cut(label) -> bool:
    return isinstance(label, tuple) and len(label) == 3 and label[0] == "cut"


def _where(node: fx.Node) -> tuple:
    """A cut, by what it does rather than by node: the same slice of one tensor written twice
    (q from x[:, 1:], k and v from another x[:, 1:]) is one cut."""
    base = node.args[0] if node.args else None
    return (target_name(node), base, str(node.args[1:]), str(sorted(node.kwargs.items())))


def _cut(label, where):
    """A labelled dim cut at `where` (a node, or a split and the piece taken); None stays."""
    if label is None:
        return None
    return ("cut", label[1] if _is_cut(label) else label, where)
