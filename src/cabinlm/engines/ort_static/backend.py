"""A static-shape build on ONNX Runtime: the prefill graph (tokens = chunk) and the decode graph
(tokens = 1) over one memory map of the weights file, the exported graph's contract with every
dimension fixed (engines/ort_graph/backend.py runs it, padding a short chunk)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from cabinlm.engines.backend import BackendError
from cabinlm.engines.onnxruntime.session import mapped_weights
from cabinlm.engines.ort_graph.backend import ExportedGraphBackend, load_graphs
from cabinlm.contract.engines.static import SharedWeights
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import Manifest
from cabinlm.contract.slots import SlotTable


def shared_weights(folder: Path, manifest: Manifest) -> list[tuple[str, ort.OrtValue]]:
    """The weights a static graph pair shares, as OrtValues over one read-only memory map of the
    weights file: handed to both sessions, they are held in memory once."""
    table = manifest.runtime_spec.facts_as(SharedWeights)
    if table is None:
        raise BackendError(f"{folder}: the manifest names a static pair without its weight table; run `cabinlm build` again")
    return mapped_weights(folder, table)


class StaticPairBackend(ExportedGraphBackend):
    """A static-shape build: prefill graph (tokens = chunk) and decode graph (tokens = 1) over one
    memory map of the weights. The same contract as the exported graph, with every dimension fixed."""

    kind = BackendKind.STATIC_PAIR


def unavailable() -> str | None:
    """A static pair runs on ONNX Runtime's CPU provider, always there."""
    return None


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> StaticPairBackend:
    try:
        weights = shared_weights(folder, manifest)
    except ValueError as e:
        raise BackendError(f"{folder}: {e}; run `cabinlm build` again") from e
    return StaticPairBackend(load_graphs(folder, manifest, threads, session_config, static=True, weights=weights), table)
