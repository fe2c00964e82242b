"""What a static-shape ONNX Runtime build records (manifest "build.shared_weights"): where each weight
of its prefill / decode pair lies in the one weights file both graphs read. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cabinlm.contract.io_spec import DecoderIO, DecoderShape

_WEIGHT_DTYPES = frozenset({"float32", "float16", "int64", "int32", "int8", "uint8"})


@dataclass(frozen=True)
class SharedWeight:
    """One weight of a static graph pair, where it lies in the shared weights file."""

    name: str
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    offset: int
    length: int  # bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"shared weight {self.name!r}: unsupported dtype {self.dtype!r}")
        if self.offset < 0 or self.length < 0 or any(d < 0 for d in self.shape):
            raise ValueError(f"shared weight {self.name!r}: negative offset, length or dimension")


@dataclass(frozen=True)
class SharedWeights:
    """The weights two graphs of a build share, held in memory once (one map of `file`)."""

    KEY: ClassVar[str] = "shared_weights"  # where a build's manifest holds these facts

    file: str
    tensors: tuple[SharedWeight, ...]

    def decoder_io(self, shape: DecoderShape) -> DecoderIO:
        """The exported contract: the pair's graphs are the export's with their token count fixed."""
        return shape.exported()

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.length] for t in self.tensors]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SharedWeights:
        if not isinstance(d, dict):
            raise TypeError(f"build.shared_weights: expected an object, got {type(d).__name__}")
        return cls(file=str(d["file"]), tensors=tuple(SharedWeight(*row) for row in d["tensors"]))
