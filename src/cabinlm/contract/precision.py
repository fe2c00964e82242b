"""Precisions, one enum per concept. Standard library only.

    KVDType       how the KV cache buffers store keys and values: fp32, fp16, int8, fp8 (E4M3)
    WeightFormat  how a model's weight matrices are held: fp32, fp16, int8, int4

Both are str enums, so the TOML profiles, the manifest and the command line use their values
("int8") directly, and typer takes them as option types.

WeightFormat covers every place weights have a precision: what the exported ONNX graph stores
(`cabinlm export --weights`), and what a device profile's engine holds (`weight_dtype`, the
planner's weight bytes). The exporter writes fp32 or int8 / int4 blocks (`in_graph`); fp16 exists
only where an engine converts the fp32 graph when it builds (TensorRT, QNN), so a profile may name
it and the export refuses it.
"""

from __future__ import annotations

import enum


class KVDType(str, enum.Enum):
    """Storage precision of the KV cache buffers."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def itemsize(self) -> int:
        return {"fp32": 4, "fp16": 2, "int8": 1, "fp8": 1}[self.value]

    @property
    def numpy_name(self) -> str:
        # fp8 is stored as raw uint8 bytes on the runtime side (numpy has no float8).
        return {"fp32": "float32", "fp16": "float16", "int8": "int8", "fp8": "uint8"}[self.value]

    @property
    def onnx_name(self) -> str:
        return {"fp32": "float", "fp16": "float16", "int8": "int8", "fp8": "float8e4m3fn"}[self.value]

    @property
    def quantized(self) -> bool:
        """int8 / fp8: values carry scales (per channel for keys, per token for values)."""
        return self in (KVDType.INT8, KVDType.FP8)


class WeightFormat(str, enum.Enum):
    """Precision of the weight matrices (see the module docstring for where each one applies)."""

    FP32 = "fp32"
    FP16 = "fp16"  # an engine's build-time precision only; never written by the exporter
    INT8 = "int8"  # blocks of 32, symmetric (export/wquant.py)
    INT4 = "int4"  # blocks of 32, asymmetric (integer zero point, or GGUF Q4_1's float minimum)

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}[self.value]

    @property
    def quantized(self) -> bool:
        """int8 / int4: block-quantized matrices (DequantizeLinear + MatMul in the graph)."""
        return self in (WeightFormat.INT8, WeightFormat.INT4)

    @property
    def in_graph(self) -> bool:
        """The exporter can store weights this way in the ONNX graph (fp32, int8, int4)."""
        return self is WeightFormat.FP32 or self.quantized
