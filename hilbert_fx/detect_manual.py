"""Hand-written attention: softmax(scale * q k^T + mask) v, however it is spelled.

One normalising matcher, not a list of patterns. From each softmax over the last dimension it
walks up the producers of the scores and down to the product with v, reading every node as one
of a few canonical steps:

    scores side:  cast | regroup | scale (x * c, c * x, x / c) | additive mask (x + m, x - m) |
                  boolean mask (masked_fill(m, -inf), where(m, x, -inf)) | the score product
                  (matmul, @, bmm, einsum, baddbmm with its alpha and beta*input)
    probs side:   cast | regroup | dropout | the product with v (matmul, @, bmm, einsum)

A regroup is a view / reshape / flatten / unflatten that keeps the last two dims (queries, keys)
and either keeps the shape or folds [B, H] into [B*H] or unfolds it back, as Bloom, Falcon and
DeBERTa do between their folded products and a [B, H, N, N] softmax; its H tells the head count.

In-place steps (x.mul_(c), x += m, masked_fill_) are read as the value they leave behind. The
score product fixes q and k: k^T may be k.transpose, permute, .mT or einsum subscripts; heads
folded into the batch (3-D bmm) are unfolded with the head count read from an upstream reshape;
repeat_kv'd keys and values become GQA. Masks are kept as terms (sign and scale tracked), so
that causal triangles become is_causal and the rest one attn_mask (detect.resolve_masks).

A softmax whose scores are not a product of two activations, or whose probabilities reach no
product with another tensor (classifier heads, MoE routers), is not attention and not reported.
One that is attention but cannot be expressed (a softcap, weights returned, a term added to the
scores that is computed from q or k, such as DeBERTa's content-to-position bias) is reported,
skipped, with the reason. Nothing is changed in the graph here: canonical nodes are inserted by
Match.adapt_inputs / adapt_output when the site is rewritten.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.fx as fx

from .dataflow import DataFlow
from .detect import FORBIDDEN, MaskTerm, build_mask, mask_shape, resolve_masks
from .fx_vocab import (arg, example, is_inplace, is_tensor, op_name, same_size, shape_of, target_name,
                       unrepeat_pair)
from .sites import Match, Shapes
from .structure import read_site

class _Fail(Exception):
    """Why a softmax's scores or probabilities cannot be read. `graph_input`: the reading stopped
    at an input of the graph (the scores were computed before a graph break)."""
    def __init__(self, reason: str, graph_input: bool = False):
        super().__init__(reason)
        self.graph_input = graph_input


@dataclass
class _Scores:
    product: fx.Node                # the score product
    factor: float                   # scale applied to q.k
    terms: list                     # MaskTerms
    region: set = field(default_factory=set)
    runtime: list = field(default_factory=list)  # (op, scalar node): run-time scales of q.k
    heads: list = field(default_factory=list)    # H of every regroup that folds or unfolds heads


# ---------------------------------------------------------------------------------------------
# Reading values through in-place steps
# ---------------------------------------------------------------------------------------------
def _read(flow: DataFlow, consumer: fx.Node, x):
    """The node whose value `consumer` reads when it names x: x itself, or the last in-place
    step on x (x.mul_(c), x += m, ...) that runs before the consumer."""
    if not isinstance(x, fx.Node):
        return x
    group, stack = {x}, [x]
    while stack:
        a = stack.pop()
        for u in a.users:
            if u not in group and u.args and u.args[0] is a and is_inplace(u):
                group.add(u)
                stack.append(u)
    before = [m for m in group if m is not x and flow.order[m] < flow.order[consumer]]
    return max(before, key=flow.order.__getitem__) if before else x


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def _operands(node: fx.Node) -> list:
    """Positional operands, with a method's self first."""
    return list(node.args)


def _number(flow: DataFlow, x) -> Optional[float]:
    """x as a Python float, when it is a compile-time constant scalar."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node):
        ex = example(x)
        if isinstance(ex, torch.Tensor) and ex.numel() != 1:
            return None
        value = flow.constant_value(x)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() or (
                isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool):
            return float(value.reshape(()).item())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _softmax_dim(node: fx.Node):
    if node.op == "call_module":
        return node.graph.owning_module.get_submodule(node.target).dim
    return arg(node, 1, "dim")


def _regroup(node: fx.Node) -> tuple[bool, Optional[int]]:
    """A "reshape" step over scores or probabilities: (True, None) when it keeps the shape,
    (True, H) when it folds [B, H, i, j] into [B*H, i, j] or unfolds [B*H, i, j] into
    [B, H, i, j] (views are row-major, so these are the only readings), (False, None) otherwise."""
    src, out = shape_of(node.args[0]) if node.args else None, shape_of(node)
    if src is None or out is None:
        return False, None
    if len(src) == len(out) and all(same_size(a, b) for a, b in zip(src, out)):
        return True, None
    if len(src) < 2 or len(out) < 2 or not (same_size(src[-1], out[-1])
                                            and same_size(src[-2], out[-2])):
        return False, None
    if len(src) == 4 and len(out) == 3 and same_size(src[0] * src[1], out[0]):
        heads = src[1]
    elif len(src) == 3 and len(out) == 4 and same_size(out[0] * out[1], src[0]):
        heads = out[1]
    else:
        return False, None
    return (True, heads) if isinstance(heads, int) else (False, None)


# ---------------------------------------------------------------------------------------------
# The scores side
# ---------------------------------------------------------------------------------------------
def _runtime_scalar(x) -> bool:
    """A scalar known only at run time (a float attribute made dynamic, a symbolic size)."""
    return isinstance(x, fx.Node) and isinstance(example(x), (torch.SymFloat, torch.SymInt))


def _walk_scores(flow: DataFlow, consumer: fx.Node, x, factor: float, depth: int = 0,
                 runtime: Optional[list] = None, heads: Optional[list] = None) -> _Scores:
    terms, region = [], set()
    runtime = [] if runtime is None else runtime
    heads = [] if heads is None else heads

    def unscaled(what):  # masks applied before a run-time scale would be scaled by it
        if runtime:
            raise _Fail(f"{what} before a run-time scale of the scores")
    for _ in range(48):
        if not isinstance(x, fx.Node):
            raise _Fail("the scores are not a tensor of the graph")
        x = _read(flow, consumer, x)
        region.add(x)
        if x.op == "placeholder" and flow.is_activation(x):
            raise _Fail("the scores come from outside this graph (a graph break before the "
                        "softmax): the pass cannot see that they are q k^T", graph_input=True)
        name = op_name(x)
        args = _operands(x)
        if name == "cast":
            consumer, x = x, args[0]
            continue
        if name == "reshape":
            ok, h = _regroup(x)
            if not ok:
                raise _Fail(f"a {x.target if x.op == 'call_method' else 'reshape'} between the "
                            f"scores and the softmax that does more than fold or unfold the heads")
            if h is not None:
                heads.append(h)
            consumer, x = x, args[0]
            continue
        if name in ("mul", "div"):
            if x.kwargs.get("rounding_mode") is not None:
                raise _Fail("a rounding division between the scores and the softmax")
            a, b = args[0], (args[1] if len(args) > 1 else x.kwargs.get("other"))
            ca, cb = _number(flow, a), _number(flow, b)
            if name == "mul" and cb is not None and is_tensor(a):
                factor, chain = factor * cb, a
            elif name == "mul" and ca is not None and is_tensor(b):
                factor, chain = factor * ca, b
            elif name == "div" and cb is not None and cb != 0 and is_tensor(a):
                factor, chain = factor / cb, a
            elif name in ("mul", "div") and _runtime_scalar(b) and is_tensor(a):
                runtime.append((name, b))
                chain = a
            elif name == "mul" and _runtime_scalar(a) and is_tensor(b):
                runtime.append((name, a))
                chain = b
            else:
                raise _Fail("the scores are scaled by a value that is not a compile-time constant")
            consumer, x = x, chain
            continue
        if name in ("add", "sub"):
            a, b = args[0], (args[1] if len(args) > 1 else x.kwargs.get("other"))
            alpha = x.kwargs.get("alpha", 1)
            sign = -1.0 if name == "sub" else 1.0
            if not isinstance(alpha, (int, float)):
                raise _Fail("an add with a run-time alpha between the scores and the softmax")
            if not is_tensor(b) and _number(flow, b) is not None:
                consumer, x = x, a  # a constant shift: the softmax does not see it
                continue
            if not is_tensor(a) and _number(flow, a) is not None and name == "add":
                consumer, x = x, b
                continue
            if depth > 4:
                raise _Fail("too many masks added to the scores")
            unscaled("a mask added")
            marks = len(runtime), len(heads)
            try:
                inner = _walk_scores(flow, x, a, factor, depth + 1, runtime, heads)
                term = MaskTerm(b, "add", factor * sign * alpha)
            except _Fail as first:
                if name == "sub":
                    raise
                del runtime[marks[0]:], heads[marks[1]:]  # what the failed reading collected
                try:
                    inner = _walk_scores(flow, x, b, factor, depth + 1, runtime, heads)
                    term = MaskTerm(a, "add", factor)
                except _Fail:
                    raise first from None
            if not is_tensor(term.node):
                raise _Fail("an additive mask that is not a tensor")
            inner.terms = terms + [term] + inner.terms
            inner.region |= region
            return inner
        if name == "masked_fill":
            unscaled("a masked_fill")
            mask, value = args[1], (args[2] if len(args) > 2 else x.kwargs.get("value"))
            v = _number(flow, value)
            if v is None or factor <= 0 or not v * factor <= FORBIDDEN:
                raise _Fail(f"masked_fill with {value!r} before the softmax does not forbid keys")
            terms.append(MaskTerm(mask, "forbid"))
            consumer, x = x, args[0]
            continue
        if name in ("where", "where_method"):
            unscaled("a where()")
            if name == "where":
                if len(args) < 3:
                    raise _Fail("a where() with one argument between the scores and the softmax")
                cond, a, b = args[0], args[1], args[2]
            else:
                cond, a, b = args[1], args[0], (args[2] if len(args) > 2 else x.kwargs.get("other"))
            va, vb = _number(flow, a), _number(flow, b)
            if vb is not None and is_tensor(a) and example(a).shape == example(x).shape and factor > 0 and vb * factor <= FORBIDDEN:
                terms.append(MaskTerm(cond, "allow"))
                consumer, x = x, a
                continue
            if va is not None and is_tensor(b) and example(b).shape == example(x).shape and factor > 0 and va * factor <= FORBIDDEN:
                terms.append(MaskTerm(cond, "forbid"))
                consumer, x = x, b
                continue
            raise _Fail("a where() between the scores and the softmax that is not a mask")
        if name in ("matmul", "bmm", "einsum"):
            return _Scores(x, factor, terms, region, runtime, heads)
        if name == "baddbmm":  # beta * input + alpha * (batch1 @ batch2)
            beta = x.kwargs.get("beta", 1)
            alpha = x.kwargs.get("alpha", 1)
            if not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
                raise _Fail("baddbmm with run-time beta or alpha")
            if beta != 0:
                unscaled("baddbmm's input")
                bias = arg(x, 0, "input", x.kwargs.get("self"))
                if not is_tensor(bias):
                    raise _Fail("baddbmm's input is not a tensor")
                terms.append(MaskTerm(bias, "add", factor * beta))
            return _Scores(x, factor * alpha, terms, region, runtime, heads)
        what = target_name(x) or str(x.target)
        if what == "cat":  # gpt-oss's attention sinks: a logit per head beside the keys'
            raise _Fail("cat between the scores and the softmax (logits beside the keys', such "
                        "as attention sinks) is not part of attention")
        raise _Fail(f"{what} between the scores and the softmax is not part of attention")
    raise _Fail("the scores are computed through too many steps")


def _product_operands(node: fx.Node) -> tuple[Optional[str], list]:
    """(einsum equation or None, tensor operands) of a product node."""
    name = op_name(node)
    args = _operands(node)
    if name == "einsum":
        spec = args[0]
        ops = args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        return spec, list(ops)
    if name == "baddbmm":  # alibi.baddbmm(batch1=q, batch2=k^T) names its operands
        return None, [arg(node, 1, "batch1"), arg(node, 2, "batch2")]
    return None, [args[0], args[1] if len(args) > 1 else node.kwargs.get("other")]


def _looks_like_attention_upstream(flow: DataFlow, x, depth: int = 8) -> bool:
    """Is there a product of two activations a few steps above x (for reporting sites that are
    attention but cannot be matched)?"""
    frontier, seen = [x], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if op_name(n) in ("matmul", "bmm", "einsum", "baddbmm"):
                _, ops = _product_operands(n)
                if sum(flow.is_activation(o) for o in ops if isinstance(o, fx.Node)) >= 2:
                    return True
            nxt.extend(a for a in n.all_input_nodes if flow.is_activation(a))
        frontier = nxt
    return False


# ---------------------------------------------------------------------------------------------
# The probabilities side
# ---------------------------------------------------------------------------------------------
def _value_products(flow: DataFlow, softmax: fx.Node, depth: int = 6) -> list:
    """Products (matmul, bmm, einsum) that the probabilities reach through shape-preserving
    steps, regroups and indexing, with the tensor they multiply: [(product, probs operand, v
    operand)]. Indexing is followed so that a site which drops columns of the probabilities
    (gpt-oss's attention sinks: extra logits concatenated before the softmax, sliced off after)
    is found and reported with its reason rather than passed by in silence."""
    found, frontier, seen = [], [softmax], {softmax}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                name = op_name(u)
                if name in ("matmul", "bmm", "einsum"):
                    spec, ops = _product_operands(u)
                    if len(ops) == 2 and n in ops and all(is_tensor(o) for o in ops):
                        other = ops[1] if ops[0] is n else ops[0]
                        if spec is not None or ops[0] is n:
                            found.append((u, n, other))
                            continue
                if shape_of(u) == shape_of(n) or (
                        name == "reshape" and u.args[0] is n and _regroup(u)[0]) or (
                        u.target is operator.getitem and u.args[0] is n):
                    nxt.append(u)
        frontier = nxt
    return found


def _walk_probs(flow: DataFlow, product: fx.Node, x, softmax: fx.Node) -> tuple[float, set, list]:
    """From the product's probs operand up to the softmax: (dropout_p, region, the H of every
    regroup that folds or unfolds heads)."""
    dropout_p, region, consumer, heads = 0.0, set(), product, []
    for _ in range(24):
        x = _read(flow, consumer, x)
        region.add(x)
        if x is softmax:
            return dropout_p, region, heads
        name = op_name(x)
        args = _operands(x)
        if name == "cast":
            consumer, x = x, args[0]
            continue
        if name == "reshape":
            ok, h = _regroup(x)
            if not ok:
                raise _Fail("a view of the attention probabilities that does more than fold or "
                            "unfold the heads")
            if h is not None:
                heads.append(h)
            consumer, x = x, args[0]
            continue
        if name == "dropout":
            if x.op == "call_module":
                module = x.graph.owning_module.get_submodule(x.target)
                p, training = module.p, module.training
            else:
                p = arg(x, 1, "p", 0.5)
                training = arg(x, 2, "train" if x.target is torch.dropout else "training", True)
            # out of training p does not matter (a float attribute made dynamic, say)
            if not isinstance(training, bool) or (training and not isinstance(p, (int, float))):
                raise _Fail("dropout on the attention probabilities with run-time arguments")
            if training and p > 0:
                if dropout_p:
                    raise _Fail("two dropouts on the attention probabilities")
                dropout_p = float(p)
            consumer, x = x, args[0]
            continue
        what = target_name(x) or str(x.target)
        raise _Fail(f"the attention probabilities go through {what} before the product with v")
    raise _Fail("the probabilities reach v through too many steps")


# ---------------------------------------------------------------------------------------------
# Geometry: q, k, v and the output in [B, H, N, D]
# ---------------------------------------------------------------------------------------------
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def parse_einsum(spec: str, ndims: list) -> Optional[tuple[list, str]]:
    """(input subscripts, output subscripts) with '...' spelled out, or None."""
    if not isinstance(spec, str):
        return None
    spec = spec.replace(" ", "")
    lhs, arrow, out = spec.partition("->")
    ins = lhs.split(",")
    if len(ins) != len(ndims):
        return None
    used = set(spec) - set(".,->")
    free = [c for c in _LETTERS if c not in used]
    widths = [nd - (len(s) - 3) for s, nd in zip(ins, ndims) if "..." in s]
    width = max(widths, default=0)
    ell = "".join(free[:width])
    fixed = []
    for s, nd in zip(ins, ndims):
        if "..." in s:
            w = nd - (len(s) - 3)
            s = s.replace("...", ell[width - w:] if w else "")
        if len(s) != nd or not s.isalpha():
            return None
        fixed.append(s)
    if not arrow:
        counts = {}
        for s in fixed:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        out = ell + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    else:
        out = out.replace("...", ell)
    if any(len(set(s)) != len(s) for s in fixed + [out]):
        return None
    return fixed, out


@dataclass
class _Operand:
    """How to get a canonical operand from a node: permute, then unsqueeze missing dims, or
    transpose the last two dims (k^T given), then unfold folded heads."""
    node: fx.Node
    perm: Optional[tuple] = None
    unsqueeze: tuple = ()
    swap_last: bool = False

    @property
    def plain(self) -> bool:
        return self.perm is None and not self.unsqueeze and not self.swap_last

    def shape(self) -> tuple:
        s = list(shape_of(self.node))
        if self.perm is not None:
            s = [s[i] for i in self.perm]
        for pos in self.unsqueeze:
            s.insert(pos, 1)
        if self.swap_last:
            s[-1], s[-2] = s[-2], s[-1]
        return tuple(s)

    def build(self, graph: fx.Graph) -> fx.Node:
        n = self.node
        if self.perm is not None:
            n = graph.call_method("permute", (n, *self.perm))
        for pos in self.unsqueeze:
            n = graph.call_method("unsqueeze", (n, pos))
        if self.swap_last:
            n = graph.call_method("transpose", (n, -2, -1))
        return n


def _swapped(node) -> Optional[fx.Node]:
    """x when node is x with its last two dims swapped (x.transpose(-2, -1), .mT, permute)."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    shape = shape_of(node)
    if shape is None or len(shape) < 2:
        return None
    nd = len(shape)
    if name == "mT" or (name == "T" and nd == 2):
        return node.args[0]
    if name == "transpose":
        d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
        if isinstance(d0, int) and isinstance(d1, int) and {d0 % nd, d1 % nd} == {nd - 2, nd - 1}:
            return node.args[0]
    if name == "permute":
        dims = node.args[1:] if node.op == "call_method" else node.args[1]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = [d % nd for d in dims] if all(isinstance(d, int) for d in dims) else None
        if dims == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return node.args[0]
    return None


def _pad(node: fx.Node, nd: int) -> _Operand:
    """node left-padded with size-1 dims to nd dims (matmul's broadcasting)."""
    have = len(shape_of(node))
    return _Operand(node, unsqueeze=tuple(range(nd - have)))


def _canonical(sub: str, target: str, node: fx.Node) -> _Operand:
    perm = tuple(sub.index(c) for c in target if c in sub)
    missing = tuple(i for i, c in enumerate(target) if c not in sub)
    return _Operand(node, None if perm == tuple(range(len(sub))) else perm, missing)


def _score_geometry(scores: fx.Node, spec, ops) -> tuple[_Operand, _Operand, int, Optional[list]]:
    """(q, k, batch dims, einsum letters of the scores or None)."""
    sshape = shape_of(scores)
    nd = len(sshape)
    if nd not in (3, 4):
        raise _Fail(f"scores of shape {sshape}: neither [B, H, N, N] nor [B*H, N, N]")
    a, b = ops
    if spec is None:
        if len(shape_of(a)) > nd or len(shape_of(b)) > nd or len(shape_of(a)) < 2 or len(shape_of(b)) < 2:
            raise _Fail("a score product with unusual operand ranks")
        q = _pad(a, nd)
        k_plain = _swapped(b)
        if k_plain is not None and len(shape_of(k_plain)) == len(shape_of(b)):
            k = _pad(k_plain, nd)
        else:
            k = _Operand(b, unsqueeze=tuple(range(nd - len(shape_of(b)))), swap_last=True)
        return q, k, nd - 2, None
    parsed = parse_einsum(spec, [len(shape_of(a)), len(shape_of(b))])
    if parsed is None:
        raise _Fail(f"einsum {spec!r} is not a product the pass understands")
    (sa, sb), so = parsed
    if len(so) != nd:
        raise _Fail(f"einsum {spec!r} is not a product the pass understands")
    i, j, batch = so[-2], so[-1], so[:-2]
    contracted = (set(sa) & set(sb)) - set(so)
    summed = (set(sa) | set(sb)) - set(so) - contracted
    if len(contracted) != 1 or summed or i not in sa or i in sb or j not in sb or j in sa:
        raise _Fail(f"einsum {spec!r} is not q.k over one feature dimension")
    c = contracted.pop()
    return _canonical(sa, batch + i + c, a), _canonical(sb, batch + j + c, b), len(batch), list(so)


def _value_geometry(product: fx.Node, probs, v, score_letters: Optional[list], nb: int):
    """(v operand, permutation of the op's canonical output to the product's output or None)."""
    spec, ops = _product_operands(product)
    if spec is None:
        nd = len(shape_of(product))
        if nd != nb + 2 or len(shape_of(v)) > nd:
            raise _Fail("the product with v does not keep the scores' batch dims")
        return _pad(v, nd), None
    ndims = [len(shape_of(o)) for o in ops]
    parsed = parse_einsum(spec, ndims)
    if parsed is None:
        raise _Fail(f"einsum {spec!r} is not a product the pass understands")
    subs, so = parsed
    sp, sv = (subs[0], subs[1]) if ops[0] is probs else (subs[1], subs[0])
    batch, i, j = sp[:-2], sp[-2], sp[-1]
    d = [c for c in sv if c not in sp]
    if (len(d) != 1 or j not in sv or j in so or sorted(so) != sorted(batch + i + d[0])
            or any(c not in sp[:-2] + j + d[0] for c in sv)):
        raise _Fail(f"einsum {spec!r} is not the product of the probabilities with v")
    canon = batch + i + d[0]
    perm = tuple(canon.index(c) for c in so)
    return _canonical(sv, batch + j + d[0], v), (None if perm == tuple(range(len(so))) else perm)


_SHAPE_STEPS = {"view", "reshape", "transpose", "permute", "contiguous", "to", "float", "half",
                "bfloat16", "type_as", "flatten", "unflatten", "mul", "div", "clone", "getitem",
                "split", "chunk", "unbind", "tensor_split", "squeeze", "unsqueeze"}


def _heads_upstream(node: fx.Node, bh: int, n: int, d: int) -> Optional[int]:
    """The number of heads H of a folded [B*H, n, d] operand, read from the shapes it was
    reshaped from: [B, H, n, d], [B, n, H, d], [n, B, H, d] or [B, n, H*d] / [n, B, H*d]."""
    x = node
    for _ in range(10):
        if not isinstance(x, fx.Node):
            return None
        shape = shape_of(x)
        if x is not node and shape is not None:
            if len(shape) == 4:
                for p1, p2 in ((0, 1), (0, 2), (1, 2)):
                    rest = [s for idx, s in enumerate(shape) if idx not in (p1, p2)]
                    if shape[p1] * shape[p2] == bh and sorted(rest) == sorted([n, d]) and shape[p2] > 1:
                        return shape[p2]
            if len(shape) == 3 and shape != shape_of(node) and n in shape[:2] and shape[2] % d == 0:
                h = shape[2] // d
                other = shape[1] if shape[0] == n else shape[0]
                if h > 0 and other * h == bh:
                    return h
        name = target_name(x)
        if name not in _SHAPE_STEPS or not x.args:
            return None
        x = x.args[0]
    return None


def _heads_downstream(node: fx.Node, bh: int) -> Optional[int]:
    for u in node.users:
        shape = shape_of(u)
        name = target_name(u)
        if name in ("view", "reshape", "unflatten") and shape and len(shape) == 4 and shape[0] * shape[1] == bh:
            return shape[1]
    return None


# ---------------------------------------------------------------------------------------------
# The finder
# ---------------------------------------------------------------------------------------------
def _content_term(flow: DataFlow, terms: list, q: fx.Node, k: fx.Node) -> Optional[MaskTerm]:
    """The first mask term computed from the content of q or k (a node on their way from the
    activation they share), or None. Such a term (DeBERTa's c2p / p2c: q, k times position
    embeddings) is part of the scores, not a mask that the op could take. What q and k read
    besides that activation (rotary tables from position ids, say) is no content: masks may
    share it."""
    candidates = [t for t in terms if flow.is_activation(t.node)]
    if not candidates:
        return None
    source, _ = flow.common_source([q, k])
    if source is None:
        return None  # not self-attention: the site is skipped with that reason
    content = (flow.ancestors(q) | flow.ancestors(k)) & flow.descendants(source)
    for t in candidates:
        if flow.ancestors(t.node) & content:
            return t
    return None


def _match(flow: DataFlow, softmax: fx.Node) -> Optional[Match]:
    shape = shape_of(softmax)
    if shape is None or len(shape) < 2:
        return None
    products = _value_products(flow, softmax)
    products = [p for p in products if flow.is_activation(p[2])]
    src = softmax.args[0]
    if not products:
        return None
    try:
        scores = _walk_scores(flow, softmax, src, 1.0)
    except _Fail as fail:
        if fail.graph_input or _looks_like_attention_upstream(flow, src):
            return Match(kind="manual", output=products[0][0], reason=str(fail))
        return None
    spec, ops = _product_operands(scores.product)
    if len(ops) != 2 or not all(is_tensor(o) for o in ops):
        return None
    if not all(flow.is_activation(o) for o in ops):
        active = [o for o in ops if flow.is_activation(o)]
        if len(active) == 1 and flow.common_source([active[0], products[0][2]])[0] is not None:
            # a learned query against the sequence's keys and values: attention pooling
            return Match(kind="manual", output=products[0][0], reason=(
                "the queries (or keys) of the scores are not computed from the input: a learned "
                "query against the sequence (attention pooling), not self-attention"))
        return None  # scores of a linear layer, not of two activations: not attention
    product, probs, v = products[0]
    found = Match(kind="manual", output=product)
    if len(products) > 1:
        return replace(found, reason="the attention probabilities feed more than one product")
    dim = _softmax_dim(softmax)
    if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
        return replace(found, reason=f"the softmax is over dim {dim}, not the keys (the last "
                                     "dimension)")
    try:
        dropout_p, probs_region, probs_heads = _walk_probs(flow, product, probs, softmax)
        q, k, nb, letters = _score_geometry(scores.product, spec, ops)
        vop, out_perm = _value_geometry(product, probs, v, letters, nb)
    except _Fail as fail:
        return replace(found, reason=str(fail))
    region = scores.region | probs_region | {softmax, product, scores.product}
    escapes = flow.escapes(region, product)
    if escapes:
        inner = escapes[0][0]
        after = flow.order[inner] >= flow.order[softmax]
        return replace(found, reason=("attention weights are used outside the attention" if after
                                      else "the attention scores are used outside the attention"))
    content = _content_term(flow, scores.terms, q.node, k.node)
    if content is not None:
        what = "a term added to the scores" if content.kind == "add" else "a mask of the scores"
        return replace(found, reason=(
            f"{what} is computed from the queries or keys (content-to-position relative "
            f"attention, as DeBERTa's c2p / p2c): not a mask, which must not depend on q or k"))
    view_heads = set(scores.heads) | set(probs_heads)
    if len(view_heads) > 1:
        return replace(found, reason=(f"the views between the scores and v fold different head "
                                      f"counts {sorted(view_heads)}"))
    view_h = next(iter(view_heads), None)
    found = replace(found, region=frozenset(region), scale=float(scores.factor),
                    dropout_p=dropout_p, q=q.node, k=k.node, v=vop.node)  # for the data-flow proof

    qs, ks, vs = q.shape(), k.shape(), vop.shape()
    heads = None
    if nb == 1:  # heads folded into the batch: [B*H, N, D]
        bh, n, d = qs
        heads = (view_h or _heads_upstream(q.node, bh, n, d)
                 or _heads_upstream(k.node, bh, ks[1], ks[2])
                 or _heads_upstream(vop.node, bh, vs[1], vs[2]) or _heads_downstream(product, bh))
        if heads is None:
            return replace(found, reason=("the heads are folded into the batch ([B*H, N, D]) and "
                                          "no reshape tells how many there are"))
        if ks[0] != bh or vs[0] != bh:
            return replace(found, reason="folded q, k and v do not have the same batch")
        qs, ks, vs = ((bh // heads, heads) + s[1:] for s in (qs, ks, vs))
    else:
        # GQA: keys and values repeated to the query heads (repeat_kv) go to the op as they were
        kb = k.node if k.plain else None
        if kb is not None and vop.plain:
            k0, v0, rep = unrepeat_pair(kb, vop.node)
            if rep > 1:
                k, vop = _Operand(k0), _Operand(v0)
                ks, vs = k.shape(), vop.shape()

    n = qs[2] if len(qs) == 4 else None
    # the sequence structure one mask and the keys prove (SPEC section 5: structure.py); a
    # run-time scale of the scores (a float attribute under dynamic=True reaches the graph as
    # a tensor's item()) goes onto q and changes no structure
    sequences, note = None, ""
    terms = scores.terms
    if n is not None and heads is None and q.plain and k.plain and vop.plain \
            and len(terms) <= 1 \
            and all(t.factor == 1.0 and t.kind in ("add", "allow") for t in terms):
        sequences, note = read_site(flow, q.node, k.node, vop.node,
                                    terms[0].node if terms else None, False, found.output)
        if note and not same_size(qs[2], ks[2]):
            return replace(found, reason=note)
    if sequences is not None:
        is_causal, kept = sequences.is_causal, (list(terms) if sequences.keep_mask else [])
    else:
        is_causal, kept = resolve_masks(flow, terms, n) if n is not None else (False, terms)
    # Masks met where the scores are [B*H, i, j] are unfolded by the head count. Where they are
    # [B, H, i, j] a 3-D mask broadcasts as [1 or H, i, j], which the same unfold reads right.
    mask_heads = heads if heads is not None else view_h
    shapes = Shapes(qs, ks, vs, mask_shape(kept, mask_heads))
    simple_mask = not kept or (len(kept) == 1 and mask_heads is None and (
        (kept[0].kind == "allow" and getattr(example(kept[0].node), "dtype", None) == torch.bool)
        or (kept[0].kind == "add" and kept[0].factor == 1.0)))
    attn_mask, adapt_inputs, adapt_output = None, None, None
    if q.plain and k.plain and vop.plain and heads is None and simple_mask and not scores.runtime:
        attn_mask = kept[0].node if kept else None
    else:
        def adapt_inputs(graph: fx.Graph, q=q, k=k, vop=vop, heads=heads, kept=kept,
                         runtime=tuple(scores.runtime), mask_heads=mask_heads):
            nodes = [op.build(graph) for op in (q, k, vop)]
            for op, scalar in runtime:  # run-time scales of the scores go onto q
                nodes[0] = graph.call_function(operator.mul if op == "mul" else operator.truediv,
                                               (nodes[0], scalar))
            if heads is not None:
                nodes = [graph.call_method("unflatten", (x, 0, (-1, heads))) for x in nodes]
            return (*nodes, build_mask(graph, kept, mask_heads))

    if heads is not None or out_perm is not None:
        def adapt_output(graph: fx.Graph, out: fx.Node, heads=heads, out_perm=out_perm):
            if heads is not None:
                out = graph.call_method("flatten", (out, 0, 1))
            if out_perm is not None:
                out = graph.call_method("permute", (out, *out_perm))
            return out
    return replace(found, k=k.node, v=vop.node, attn_mask=attn_mask, is_causal=is_causal,
                   enable_gqa=len(qs) == 4 and len(ks) == 4 and qs[1] != ks[1], shapes=shapes,
                   adapt_inputs=adapt_inputs, adapt_output=adapt_output, sequences=sequences,
                   note=note if kept else "")


def find_manual_sites(graph: fx.Graph, flow: Optional[DataFlow] = None) -> list[Match]:
    sites = []
    for node in graph.nodes:
        if op_name(node) != "softmax":
            continue
        flow = flow or DataFlow(graph)
        site = _match(flow, node)
        if site is not None:
            sites.append(site)
    return sites
