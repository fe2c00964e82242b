"""The engines an artifact can name, and the typed facts each engine's builds record.

    kind                 facts (manifest build.<KEY>)        module
    onnxruntime-graph    none
    onnxruntime-static   SharedWeights     "shared_weights"  static.py
    onnxruntime-fused    FusedSettings     "fused"           fused.py
    qnn-htp              QnnSettings       "qnn"             qnn.py
    tensorrt             TensorRTSettings  "tensorrt"        tensorrt.py

The manifest names the kind (`build.backend`); engines/registry.py maps each kind to the folder whose
code builds and runs it. Standard library only.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Protocol

from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.engines.qnn import QnnSettings
from cabinlm.contract.engines.static import SharedWeights
from cabinlm.contract.engines.tensorrt import TensorRTSettings
from cabinlm.contract.io_spec import DecoderIO, DecoderShape


class BackendKind(str, enum.Enum):
    """How the decoder graph(s) of an artifact are run: one engine folder each (engines/registry.py)."""

    EXPORTED_GRAPH = "onnxruntime-graph"
    STATIC_PAIR = "onnxruntime-static"
    FUSED = "onnxruntime-fused"
    QNN_HTP = "qnn-htp"
    TENSORRT = "tensorrt"


class EngineFacts(Protocol):
    """An engine's typed build facts: written under build.<KEY> in the manifest; its graphs' contract
    computed from the export's shape (the manifest asks the facts, never which engine it holds)."""

    KEY: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    def decoder_io(self, shape: DecoderShape) -> DecoderIO: ...


# The class of the facts each kind's builds record (None: it records none).
FACTS: dict[BackendKind, type | None] = {
    BackendKind.EXPORTED_GRAPH: None,
    BackendKind.STATIC_PAIR: SharedWeights,
    BackendKind.FUSED: FusedSettings,
    BackendKind.QNN_HTP: QnnSettings,
    BackendKind.TENSORRT: TensorRTSettings,
}
assert set(FACTS) == set(BackendKind), "every BackendKind has its facts line"
