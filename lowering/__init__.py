"""The runtime of hilbert_fx: the dilated-attention op, its index plans and its lowerings.

It never imports hilbert_fx (the compiler front); hilbert_fx imports it. It installs as
hilbert_fx.lowering (pyproject.toml), so its own imports are relative.
"""
from .arguments import check_branches, resolve_lowering
from .op import dilated_attention, dilated_attention_op
from .plans import branch_plan, branch_plans, hilbert_order

__all__ = ["dilated_attention", "dilated_attention_op", "branch_plan", "branch_plans",
           "hilbert_order", "check_branches", "resolve_lowering"]
