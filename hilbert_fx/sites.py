"""What the detectors find: one attention site of an FX graph, in canonical form."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

KINDS = ("sdpa", "mha", "manual", "flex")


@dataclass
class Site:
    """An attention out = softmax(scale * q k^T + mask) v found in a graph.

    `output` is the node whose value is the attention output, [B, H, N, Dv]; q, k, v are nodes of
    shape [B, H, N, D] (k and v with Hkv heads) that the rewrite feeds to the op, and `region` the
    nodes that only this attention uses (they die with it). `reason` is set when it cannot be
    rewritten.
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
    module: Optional[str] = None
    module_types: list = field(default_factory=list)
    reason: str = ""
    action: str = ""
    lowering: str = ""
    config: object = None
    # Rewrites of shape the rewrite applies around the op: a callable (graph, op_output) -> node
    # that turns the op's [B, H, N, Dv] output into what `output` produced, or None.
    adapt_output: object = None
    # The other way round, for sites whose q, k, v (and mask) are not yet nodes of canonical form
    # (nn.MultiheadAttention, hand-written attention with k transposed or heads folded into the
    # batch, masks that must be combined or inverted): a callable (graph) -> (q, k, v, attn_mask)
    # that inserts the canonical nodes at the graph's insertion point, or None. Until it is
    # called, q, k, v are the nodes the canonical ones are computed from (for the data-flow proof
    # and the device) and `shapes` holds the canonical shapes (see below).
    adapt_inputs: object = None
    # Canonical shapes when adapt_inputs is set: {"q": shape, "k": shape, "v": shape,
    # "mask": (shape, dtype, requires_grad) or None}; None otherwise (read from q, k, v).
    shapes: Optional[dict] = None
    # The nodes that only this attention uses, output included (proved closed by the finder).
    region: set = field(default_factory=set)


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
