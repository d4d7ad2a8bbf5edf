"""hilbert_fx: a torch.compile backend that rewrites self-attention into LongNet dilated
attention with an optional per-segment Hilbert-curve order (see SPEC.md).

    model = torch.compile(model, backend="hilbert_dilated")
"""
from lowering import dilated_attention, hilbert_order

from .backend import HilbertBackend, backend, hilbert_dilated
from .config import DilatedConfig
from .explain import Report, SiteReport, explain
from .pattern import key_counts, plot_pattern
from .scope import dilate, undilate

__all__ = ["backend", "dilate", "dilated_attention", "explain", "hilbert_dilated",
           "hilbert_order", "key_counts", "plot_pattern", "undilate", "DilatedConfig", "HilbertBackend", "Report", "SiteReport"]
