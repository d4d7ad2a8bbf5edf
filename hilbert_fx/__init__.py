"""hilbert_fx: a torch.compile backend that rewrites self-attention into LongNet dilated
attention with an optional per-segment Hilbert-curve order (see SPEC.md).

    model = torch.compile(model, backend="hilbert_dilated")
"""
import importlib.util as _util
import os as _os
import sys as _sys


def _runtime_from_checkout() -> None:
    """Installed, the runtime is hilbert_fx.lowering (pyproject.toml maps the repository's
    lowering/ folder there, so no generic top-level `lowering` lands in site-packages). Run from
    a checkout without installing, that subpackage is the lowering/ folder beside this one."""
    if _util.find_spec(__name__ + ".lowering") is not None:
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    folder = _os.path.join(_os.path.dirname(here), "lowering")
    spec = _util.spec_from_file_location(__name__ + ".lowering",
                                         _os.path.join(folder, "__init__.py"),
                                         submodule_search_locations=[folder])
    module = _util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_runtime_from_checkout()

from .lowering import dilated_attention, hilbert_order  # noqa: E402

from .backend import HilbertBackend, backend, hilbert_dilated  # noqa: E402
from .config import DilatedConfig  # noqa: E402
from .explain import Report, SiteReport, explain  # noqa: E402
from .generation import compile_for_generate  # noqa: E402
from .pattern import key_counts, plot_pattern  # noqa: E402
from .scope import dilate, undilate  # noqa: E402

__all__ = ["backend", "compile_for_generate", "dilate", "dilated_attention", "explain",
           "hilbert_dilated", "hilbert_order", "key_counts", "plot_pattern", "undilate",
           "DilatedConfig", "HilbertBackend", "Report", "SiteReport"]
