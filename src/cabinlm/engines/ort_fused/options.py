"""The fused cpu build's own choices (`cabinlm build` flags), typed and checked once: what its
builder (builder.py) reads from a BuildRequest (request.options_for(FusedBuildOptions))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cabinlm.contract.engines.fused import AttentionKernel, MatmulKernel, Minimums
from cabinlm.contract.errors import BuildError, OptionError


@dataclass(frozen=True)
class FusedBuildOptions:
    """accuracy_level: MatMulNBits' activations (4 = int8, as llama.cpp; 0 = float32); minimums: how
    GGUF Q4_1 block minimums run; attention_kernel, matmul_kernel: whose kernels compute the
    attention and the block matmuls. Engines other than the fused one ignore these (a cpu build
    that keeps the exported graph has no such choices)."""

    # the builds of other engines ignore them (a cpu profile's graph build: the same flags, no fused graph)
    REFUSED_ELSEWHERE: ClassVar[bool] = False

    accuracy_level: int = 4
    minimums: Minimums = Minimums.INT8
    attention_kernel: AttentionKernel = AttentionKernel.AUTO
    matmul_kernel: MatmulKernel = MatmulKernel.AUTO

    def __post_init__(self) -> None:
        try:
            for name, cls in (("minimums", Minimums), ("attention_kernel", AttentionKernel), ("matmul_kernel", MatmulKernel)):
                object.__setattr__(self, name, cls(getattr(self, name)))
        except ValueError as e:
            raise BuildError(str(e)) from e
        if isinstance(self.accuracy_level, bool) or self.accuracy_level not in (0, 1, 2, 3, 4):  # MatMulNBits' levels
            raise OptionError(f"--accuracy-level must be 0..4 (4 = int8 activations, 0 = float32), got {self.accuracy_level!r}")
