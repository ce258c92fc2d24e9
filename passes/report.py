"""What a pass changed, tensor by tensor: for the caller, the command's table and `--json`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TensorChange:
    name: str
    shape: tuple
    dtype: str  # element type before the pass, e.g. "float16"
    scheme: str  # e.g. "int8/channel(axis=0)/sym", "kept: 1-D", "folded"
    bytes_before: int
    bytes_after: int
    snr_db: float | None = None  # weight SNR, 10*log10(sum w^2 / sum (w - w_hat)^2)
    location: str = "initializer"  # "initializer", "Constant node", or "subgraph <node>/<attr>: ..."

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass
class Report:
    """Filled by a pass when the caller passes one in (`report=Report()`)."""

    pass_name: str = ""
    tensors: list[TensorChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # model-level changes: opset raised, ...

    def add(self, change: TensorChange) -> None:
        self.tensors.append(change)

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pass": self.pass_name,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "notes": list(self.notes),
            "tensors": [t.to_dict() for t in self.tensors],
        }
