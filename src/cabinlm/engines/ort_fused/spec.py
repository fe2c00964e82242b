"""What a fused cpu build is, as typed data (manifest "build.fused"), and the choices `cabinlm build`
offers for it. Standard library only."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar


class AttentionKernel(str, enum.Enum):
    """Fused cpu builds: which kernel computes the attention over the cache."""

    AUTO = "auto"  # cabinlm's for int8 KV where its library is built, ONNX Runtime's otherwise
    CABINLM = "cabinlm"  # kernels/int8_kv_attention.cc (int8 KV): a prefill chunk about twice as fast
    ONNXRUNTIME = "onnxruntime"  # com.microsoft::GroupQueryAttention


class MatmulKernel(str, enum.Enum):
    """Fused cpu builds: which kernel computes the layers' matmuls over GGUF Q4_1 blocks."""

    AUTO = "auto"  # cabinlm's where the library's fast path (AVX-512 VNNI) is built, ONNX Runtime's otherwise
    CABINLM = "cabinlm"  # kernels/block_q4_matmul.cc: the 4-bit blocks and minimums read as exported
    ONNXRUNTIME = "onnxruntime"  # com.microsoft::MatMulNBits (the blocks as --minimums says)


class Minimums(str, enum.Enum):
    """Fused cpu builds: how GGUF Q4_1 blocks (4-bit codes plus a float block minimum) run."""

    INT8 = "int8"  # 8-bit codes with an integer zero point, the minimum rounded to 1/34 of a step
    EXACT = "exact"  # 4-bit codes plus blocksum(x) @ minimum (two more kernels per matrix)


@dataclass(frozen=True)
class FusedSettings:
    """The fused cpu decoder's choices (engines/ort_fused/graph.py)."""

    KEY: ClassVar[str] = "fused"  # where a build's manifest holds these facts ("build.fused")

    accuracy_level: int = 4  # MatMulNBits activations: 4 = int8, 0 = float32
    minimums: str = "int8"  # Minimums: how GGUF Q4_1 block minimums run
    # AttentionKernel: "onnxruntime" (GroupQueryAttention, writing the cache through its present
    # outputs) or "cabinlm" (kernels/int8_kv_attention.cc, int8 KV only: registered from the build's
    # kernel library at load, writing the cache in place). Builds before it: "onnxruntime".
    attention_kernel: str = "onnxruntime"
    # MatmulKernel: "onnxruntime" (MatMulNBits for every quantized matrix) or "cabinlm"
    # (kernels/block_q4_matmul.cc for the Q4_1 matrices, from the same library). Builds before it: "onnxruntime".
    matmul_kernel: str = "onnxruntime"

    @property
    def own_kernels(self) -> bool:
        """The graph holds cabinlm's own operators (ai.cabinlm): the session registers the build's kernel library."""
        return self.attention_kernel == "cabinlm" or self.matmul_kernel == "cabinlm"

    def __post_init__(self) -> None:
        if isinstance(self.accuracy_level, bool) or self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level!r}")
        if self.minimums not in ("int8", "exact"):
            raise ValueError(f"minimums must be int8 or exact, got {self.minimums!r}")
        if self.attention_kernel not in ("onnxruntime", "cabinlm"):
            raise ValueError(f"attention_kernel must be onnxruntime or cabinlm, got {self.attention_kernel!r}")
        if self.matmul_kernel not in ("onnxruntime", "cabinlm"):
            raise ValueError(f"matmul_kernel must be onnxruntime or cabinlm, got {self.matmul_kernel!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FusedSettings:
        if not isinstance(d, dict):
            raise TypeError(f"build.fused: expected an object, got {type(d).__name__}")
        return cls(**d)
