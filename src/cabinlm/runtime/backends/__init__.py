"""One interface (base.Backend), one module per engine. The artifact's manifest names the backend
(`build.backend`) and its execution provider; `open_backend` loads exactly that, never a guess.

    onnxruntime-graph   exported.ExportedGraphBackend  the exported graph, dynamic token count
    onnxruntime-static  exported.StaticPairBackend     prefill (tokens = chunk) + decode (tokens = 1)
    onnxruntime-fused   fused.FusedBackend             the cpu build's fused decoder, rotated cache
    qnn-htp             qnn.QnnBackend                 QNN HTP context binaries (Snapdragon; x86: simulator)
    tensorrt            tensorrt.TensorRTBackend       a TensorRT engine on an NVIDIA GPU

Adding an engine: a module with a Backend subclass and its loader, a line in `open_backend`, and the
backend's artifact in tests/test_backends.py's conformance run.
"""

from __future__ import annotations

from pathlib import Path

from cabinlm.buildspec import BackendKind
from cabinlm.manifest import Manifest
from cabinlm.runtime.backends.base import Backend, BackendError, StepOutput
from cabinlm.runtime.slots import SlotTable


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> Backend:
    """Load the artifact's graphs on the engine its manifest names, with one dialogue's buffers.

    session_config: extra ONNX Runtime session entries, e.g. {"session.qdq_matmulnbits_accuracy_level":
    "0"} to run block-quantized weights with float32 activations."""
    kind = manifest.runtime_spec.backend
    if kind in (BackendKind.EXPORTED_GRAPH, BackendKind.STATIC_PAIR):
        from cabinlm.runtime.backends.exported import ExportedGraphBackend, StaticPairBackend, load_graphs

        cls = StaticPairBackend if kind == BackendKind.STATIC_PAIR else ExportedGraphBackend
        return cls(load_graphs(folder, manifest, threads, session_config), table)
    if kind == BackendKind.FUSED:
        from cabinlm.runtime.backends.fused import FusedBackend, load_fused

        return FusedBackend(load_fused(folder, manifest, threads, session_config), table)
    if kind == BackendKind.QNN_HTP:
        from cabinlm.runtime.backends.qnn import QnnBackend, load_qnn

        return QnnBackend(load_qnn(folder, manifest, threads), table)
    if kind == BackendKind.TENSORRT:
        from cabinlm.runtime.backends.tensorrt import TensorRTBackend, load_tensorrt

        return TensorRTBackend(load_tensorrt(folder, manifest), table)
    raise BackendError(f"{folder}: backend {kind.value} is not part of this cabinlm runtime")


__all__ = ["Backend", "BackendError", "StepOutput", "open_backend"]
