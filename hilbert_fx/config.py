"""Configuration of the rewrite: which branches, Hilbert order or not, which lowering, which mesh."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .lowering import check_branches
from .lowering.arguments import check_lowering

DEFAULT_SEGMENT_LENGTHS = (2048, 4096, 8192, 16384)
DEFAULT_DILATION_RATES = (1, 2, 4, 8)


@dataclass(frozen=True)
class DilatedConfig:
    segment_lengths: tuple[int, ...] = DEFAULT_SEGMENT_LENGTHS
    dilation_rates: tuple[int, ...] = DEFAULT_DILATION_RATES
    hilbert: bool = True
    lowering: str = "auto"
    mesh: Any = field(default=None, compare=False)

    def __post_init__(self):
        w, r = check_branches(self.segment_lengths, self.dilation_rates)
        object.__setattr__(self, "segment_lengths", w)
        object.__setattr__(self, "dilation_rates", r)
        check_lowering(self.lowering)
        if not isinstance(self.hilbert, bool):
            raise ValueError(f"hilbert must be a bool, got {self.hilbert!r}")
        if self.mesh is not None and getattr(self.mesh, "ndim", 1) != 1:
            raise ValueError(f"mesh must be a one-dimensional DeviceMesh, got {self.mesh!r}")

    def describe(self) -> str:
        branches = ", ".join(f"({w},{r})" for w, r in zip(self.segment_lengths, self.dilation_rates))
        return f"branches {branches} hilbert={self.hilbert} lowering={self.lowering}"
