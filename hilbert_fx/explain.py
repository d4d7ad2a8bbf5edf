"""`explain`: run a model under the pass and report every attention site it found."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from .backend import HilbertBackend
from .generation import ISOLATES


@dataclass(frozen=True)
class SiteReport:
    kind: str  # "sdpa" | "mha" | "manual" | "flex"
    module: str | None  # qualified name of the innermost module
    action: str  # "rewritten" | "skipped"
    reason: str  # why skipped; "" when rewritten
    lowering: str  # "triton" | "sdpa" | ""
    config: str  # the configuration used, "" when skipped
    # the sequence structure the op was called with (SPEC section 5), or why a mask is passed
    # as it is (the pattern laid over the row, section 2); "" for a site without a mask
    structure: str = ""


def structure_of(site) -> str:
    """The report's words for what a rewritten site's op was given in place of (or as) a mask."""
    if site.action != "rewritten":
        return ""
    if site.sequences is not None:
        return site.sequences.what
    has_mask = site.attn_mask is not None or (site.shapes is not None and site.shapes.mask is not None)
    if not has_mask:
        return ""
    why = f": {site.note}" if site.note else ""
    return f"attn_mask passed, the pattern laid over the row (SPEC section 2){why}"


@dataclass
class Report:
    sites: list
    graph_before: list
    graph_after: list

    def __str__(self) -> str:
        header = ("kind", "module", "action", "lowering", "reason / configuration")
        rows = [header] + [(s.kind, s.module or "-", s.action, s.lowering or "-",
                            s.reason or "; ".join(x for x in (s.config, s.structure) if x))
                           for s in self.sites]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[4]))
        rewritten = sum(s.action == "rewritten" for s in self.sites)
        lines.append(f"{len(self.sites)} attention sites in {len(self.graph_before)} graphs: "
                     f"{rewritten} rewritten, {len(self.sites) - rewritten} skipped")
        if not self.graph_before:
            lines.append("no graph reached the backend: Dynamo compiled nothing of the model "
                         "(it broke the graph before any tensor operation, or skipped the "
                         "code; TORCH_LOGS=graph_breaks says where), which ran as it is")
        return "\n".join(lines)

    __repr__ = __str__


@contextlib.contextmanager
def _own_compilations_off(model):
    """Modules compiled in place (`module.compile()`, also per layer: regional compilation) call
    their own compiled function, whose graphs would go to the backend they were compiled with
    and not to explain's: while explain runs they call their plain forward."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    compiled = [m for m in modules if getattr(m, "_compiled_call_impl", None) is not None]
    kept = [m._compiled_call_impl for m in compiled]
    for m in compiled:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in zip(compiled, kept):
            m._compiled_call_impl = impl


def explain(model, *args, backend=None, **kwargs) -> Report:
    """Compile `model` with the pass (not Inductor), run it once on the arguments, report."""
    base = backend if backend is not None else HilbertBackend()
    if not isinstance(base, HilbertBackend):
        raise ValueError(f"backend must come from hilbert_fx.backend(), got {base!r}")
    recorder = copy.copy(base)
    recorder.records = []
    recorder.keep_records = True
    recorder.compile_with_inductor = False
    # A backend of its own makes Dynamo compile the model afresh, and leaves what the user
    # compiled before as it was (no torch._dynamo.reset(), no recompilation of their models).
    # Dynamo's entries of one code object are capped (recompile_limit), and every explain adds
    # one: where torch.compile can keep a call's entries apart (isolate_recompiles) they are
    # kept apart, elsewhere the cap is lifted for this call.
    with _own_compilations_off(model):
        if ISOLATES:
            torch.compile(model, backend=recorder, isolate_recompiles=True)(*args, **kwargs)
        else:
            with torch._dynamo.config.patch(recompile_limit=1 << 20):
                torch.compile(model, backend=recorder)(*args, **kwargs)
    sites = []
    for record in recorder.records:
        for s in record.sites:
            config = s.config.describe() if s.config is not None else ""
            if config and isinstance(s.dropout_p, (int, float)) and s.dropout_p > 0:
                config += f", dropout_p={s.dropout_p:g}"  # the model's, kept by the op
            sites.append(SiteReport(s.kind, s.module, s.action, s.reason, s.lowering, config,
                                    structure_of(s)))
    return Report(sites, [r.graph_before for r in recorder.records],
                  [r.graph_after for r in recorder.records])
