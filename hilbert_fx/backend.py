"""The torch.compile backend: find attention, rewrite it, hand the graph on to Inductor."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .config import DilatedConfig
from .detect import find_sites
from .rewrite import rewrite
from .sites import Site


@dataclass
class GraphRecord:
    """What the pass did to one compiled graph."""
    sites: list[Site]
    graph_before: str
    graph_after: str


@dataclass
class HilbertBackend:
    """A torch.compile backend with one configuration (SPEC section 1b)."""
    config: DilatedConfig = field(default_factory=DilatedConfig)
    compile_with_inductor: bool = True
    records: list = field(default_factory=list, repr=False)
    keep_records: bool = False

    def transform(self, gm: fx.GraphModule) -> GraphRecord:
        before = gm.code
        sites = rewrite(gm, find_sites(gm.graph), self.config)
        record = GraphRecord(sites, before, gm.code)
        if self.keep_records:
            self.records.append(record)
        return record

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.transform(gm)
        if not self.compile_with_inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)


def backend(segment_lengths=None, dilation_rates=None, *, hilbert: bool = True,
            lowering: str = "auto", mesh=None) -> HilbertBackend:
    """A configured backend: torch.compile(model, backend=hilbert_fx.backend(...))."""
    defaults = DilatedConfig()
    config = DilatedConfig(
        tuple(segment_lengths) if segment_lengths is not None else defaults.segment_lengths,
        tuple(dilation_rates) if dilation_rates is not None else defaults.dilation_rates,
        hilbert, lowering, mesh)
    return HilbertBackend(config)


def hilbert_dilated(gm: fx.GraphModule, example_inputs):
    """The registered backend "hilbert_dilated", with the default configuration."""
    return HilbertBackend()(gm, example_inputs)
