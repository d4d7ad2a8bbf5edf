"""What the pass found and what it did with it, one attention site of an FX graph at a time.

- Match: what a finder found (frozen): out = softmax(scale * q k^T + mask) v, in canonical form.
- Decision: what the pass did with it (frozen): rewritten with a configuration and a lowering, or
  skipped with a reason.
- Site: the two together; `HilbertBackend.transform(gm).sites` and the report rows read it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch.fx as fx

if TYPE_CHECKING:
    from .config import DilatedConfig
    from .structure import Sequences

KINDS = ("sdpa", "mha", "manual", "flex")

# (graph) -> (q, k, v, attn_mask): inserts the canonical operands at the graph's insertion point
InputsAdapter = Callable[[fx.Graph], "tuple[fx.Node, fx.Node, fx.Node, Optional[fx.Node]]"]
# (graph, the op's [B, H, N, Dv] output) -> the node that stands for what the site's output was
OutputAdapter = Callable[[fx.Graph, fx.Node], fx.Node]


@dataclass(frozen=True)
class Shapes:
    """Canonical shapes of a site whose q, k, v are not yet canonical nodes: [B, H, N, D] each
    (k and v with Hkv heads), and the op's attn_mask as (shape, dtype, requires_grad) or None."""
    q: tuple
    k: tuple
    v: tuple
    mask: Optional[tuple] = None

    def __getitem__(self, name: str):
        """shapes["q"]: readers of a site index its shapes by name, as a mapping."""
        return getattr(self, name)


@dataclass(frozen=True, eq=False)
class Match:
    """An attention out = softmax(scale * q k^T + mask) v that a finder found in a graph.

    `output` is the node whose value is the attention output. Without `adapt_inputs`, q, k, v
    are nodes of shape [B, H, N, D] (k and v with Hkv heads) that the op takes as they are, with
    `attn_mask`. With it (nn.MultiheadAttention, hand-written attention with k transposed or
    heads folded into the batch, masks that must be combined or inverted), q, k, v are the nodes
    the canonical ones are computed from (for the data-flow proof and the device), and
    `adapt_inputs` inserts the canonical operands at rewrite time. `shapes`: the canonical
    shapes where the finder worked them out (always with adapt_inputs), None where they are read
    from q, k, v. `adapt_output` turns the op's output into what `output` produced, or is None.
    `region`: the nodes that only this attention uses, output included (proved closed by the
    finder). `reason`: why it cannot be rewritten
    ("" when it can); `module`, `module_types`: where it is (innermost module's name, module
    classes outermost first). `sequences`: the sequence structure (SPEC section 5) the op is
    called with instead of a mask (structure.py), or None; `note`: why a mask that may carry such
    a structure is passed as it is (its pattern laid over the row, section 2).
    """
    kind: str
    output: fx.Node
    q: Optional[fx.Node] = None
    k: Optional[fx.Node] = None
    v: Optional[fx.Node] = None
    attn_mask: Optional[fx.Node] = None
    is_causal: bool = False
    scale: Optional[float] = None
    dropout_p: float = 0.0
    enable_gqa: bool = False
    shapes: Optional[Shapes] = None
    adapt_inputs: Optional[InputsAdapter] = None
    adapt_output: Optional[OutputAdapter] = None
    region: frozenset = frozenset()
    reason: str = ""
    module: Optional[str] = None
    module_types: tuple = ()
    sequences: Optional["Sequences"] = None
    note: str = ""


@dataclass(frozen=True)
class Decision:
    """What the pass did with a match: "rewritten" (with `config` and `lowering`, the op called
    on `inputs`, the q, k, v, attn_mask nodes it was given) or "skipped" (with `reason`)."""
    action: str
    reason: str = ""
    lowering: str = ""
    config: Optional[DilatedConfig] = None
    inputs: Optional[tuple] = None


@dataclass(frozen=True, eq=False)
class Site:
    """A match and the decision taken on it. q, k, v and attn_mask are what the op was called
    with when the site was rewritten, the match's own otherwise."""
    match: Match
    decision: Decision

    kind = property(lambda self: self.match.kind)
    output = property(lambda self: self.match.output)
    module = property(lambda self: self.match.module)
    module_types = property(lambda self: self.match.module_types)
    is_causal = property(lambda self: self.match.is_causal)
    scale = property(lambda self: self.match.scale)
    dropout_p = property(lambda self: self.match.dropout_p)
    enable_gqa = property(lambda self: self.match.enable_gqa)
    shapes = property(lambda self: self.match.shapes)
    region = property(lambda self: self.match.region)
    sequences = property(lambda self: self.match.sequences)
    note = property(lambda self: self.match.note)
    action = property(lambda self: self.decision.action)
    reason = property(lambda self: self.decision.reason)
    lowering = property(lambda self: self.decision.lowering)
    config = property(lambda self: self.decision.config)

    def _operand(self, i: int, name: str):
        inputs = self.decision.inputs
        return inputs[i] if inputs is not None else getattr(self.match, name)

    q = property(lambda self: self._operand(0, "q"))
    k = property(lambda self: self._operand(1, "k"))
    v = property(lambda self: self._operand(2, "v"))
    attn_mask = property(lambda self: self._operand(3, "attn_mask"))


# "L['self'].layers.0", "L['args'][0].model.layers.0": the frame's local, then the path in it
_ROOT = re.compile(r"^L\['[^']*'\](\[\d+\])*\.?")


def module_stack(node: fx.Node) -> tuple[Optional[str], list[type]]:
    """(qualified name of the innermost module, module classes outermost first) of a node."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = list(stack.values())
    if not entries:
        return None, []
    types = [t for _, t in entries]
    name = entries[-1][0]
    name = _ROOT.sub("", name) if isinstance(name, str) else None
    return (name or None), [t for t in types if isinstance(t, type)]


def qualified_name(node: fx.Node, names: dict) -> Optional[str]:
    """The innermost module's name in the outermost known root (scope.module_names), from the
    module ids that key Dynamo's module stack; None where they are not ids of known modules."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    key = list(stack)[-1]
    try:
        return names.get(int(key)) or None
    except (TypeError, ValueError):
        return None
