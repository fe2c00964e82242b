"""The engines cabinlm builds for and runs on, by backend kind: one line each.

    kind                 folder                    what a build of it is
    onnxruntime-graph    engines/ort_graph/        the exported graph (dynamic tokens), as exported or optimized
    onnxruntime-static   engines/ort_static/       a prefill graph (tokens = chunk) and a decode graph (tokens = 1)
    onnxruntime-fused    engines/ort_fused/        the cpu build's fused decoder over a rotated cache (+ its kernels)
    qnn-htp              engines/qnn_htp/          QNN HTP context binaries through ONNX Runtime's QNN plugin
    tensorrt             engines/tensorrt/         a TensorRT engine (or, before it is built on the target, its bundle)

Every engine folder holds the same parts (its typed build facts live in the contract,
contract/engines/, with BackendKind):

    builder.py   BUILDER: a engines.builder.Builder (check -> build -> BuildSpec); may import onnx
    backend.py   open_backend(...) -> engines.backend.Backend, and unavailable() -> why it cannot run
                 here (None: it can); imports numpy and onnxruntime (and the engine's own SDK) only;
                 optionally held_once_bytes(manifest, seat_bytes) (what a loaded build holds beyond
                 its files and seats) and open_camera_encoder(folder, manifest, threads) (how the
                 engine runs the camera encoder) and custom_ops_libraries(folder, spec, ort_version)
                 (the checked custom-op libraries its graphs need), which the functions of the same
                 names below ask for

The manifest names the kind (`build.backend`); the runtime loads exactly that engine, never a guess.
An engine outside this package registers its kind (contract.engines.register_kind) and its folder
(register_engine): tests/test_toy_engine.py does, and the conformance suite runs it.
Adding an engine: a folder with those two modules, its kind and facts in contract/engines/, and a
line in ENGINES.
The conformance suite (tests/test_backends.py) runs over every kind listed here that can run on the
machine. This module imports no engine code until one is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from cabinlm.contract.engines import BUILT_IN, FACTS, BackendKind, EngineFacts  # noqa: F401 - EngineFacts re-exported

if TYPE_CHECKING:
    from pathlib import Path

    from cabinlm.engines.backend import Backend
    from cabinlm.engines.builder import Builder
    from cabinlm.contract.buildspec import BuildSpec
    from cabinlm.contract.manifest import Manifest
    from cabinlm.contract.slots import SlotTable


@dataclass(frozen=True)
class EngineEntry:
    kind: BackendKind
    package: str  # the engine's folder as a package: its builder and backend modules live there
    summary: str

    @property
    def facts(self) -> type | None:
        """The class of the facts its builds record (None: it records none)."""
        return FACTS[self.kind]

    def backend_module(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.backend")

    def builder(self) -> Builder:
        return importlib.import_module(f"{self.package}.builder").BUILDER  # type: ignore[no-any-return]

    def unavailable(self) -> str | None:
        """Why this engine cannot run on this machine (None: it can)."""
        return self.backend_module().unavailable()  # type: ignore[no-any-return]


ENGINES: dict[BackendKind, EngineEntry] = {e.kind: e for e in (
    EngineEntry(BackendKind.EXPORTED_GRAPH, "cabinlm.engines.ort_graph", "the exported graph on ONNX Runtime"),
    EngineEntry(BackendKind.STATIC_PAIR, "cabinlm.engines.ort_static",
                "a static prefill / decode pair sharing one weights file, on ONNX Runtime"),
    EngineEntry(BackendKind.FUSED, "cabinlm.engines.ort_fused",
                "the fused cpu decoder on ONNX Runtime, with cabinlm's kernels where built"),
    EngineEntry(BackendKind.QNN_HTP, "cabinlm.engines.qnn_htp",
                "QNN HTP context binaries (Snapdragon; Qualcomm's simulator on x86)"),
    EngineEntry(BackendKind.TENSORRT, "cabinlm.engines.tensorrt", "a TensorRT engine on an NVIDIA GPU"),
)}  # fmt: skip
assert set(ENGINES) == set(BackendKind), "every BackendKind has its line in ENGINES"


def register_engine(entry: EngineEntry) -> None:
    """An engine from outside this package (its kind registered with contract.engines.register_kind):
    `cabinlm build` then offers its builder to every profile and the runtime opens the artifacts
    whose manifest names its kind, as for the built-in ones."""
    if entry.kind in ENGINES:
        raise ValueError(f"the {entry.kind.value} engine is registered already")
    ENGINES[entry.kind] = entry


def unregister_engine(kind: BackendKind) -> None:
    """Remove an engine registered with register_engine (its kind stays until unregister_kind)."""
    if kind in BUILT_IN:
        raise ValueError(f"{kind.value} is a built-in engine")
    del ENGINES[kind]


def held_once_bytes(manifest: Manifest, seat_bytes: int) -> int:
    """What loading the build holds once beyond its files and its seats' buffers, as its engine says
    (its backend module's held_once_bytes(manifest, seat_bytes); 0 where it says nothing): the
    runtime's seat limit counts it before the model loads."""
    module = ENGINES[manifest.runtime_spec.backend].backend_module()
    hook = getattr(module, "held_once_bytes", None)
    return int(hook(manifest, seat_bytes)) if hook is not None else 0


def open_camera_encoder(folder: Path, manifest: Manifest, threads: int | None = None) -> tuple[Any, str] | None:
    """The session that runs the artifact's camera encoder and what it runs on, where its engine runs
    it its own way (its backend module's open_camera_encoder); None: the vision graph on ONNX
    Runtime's CPU provider (runtime/vision.py opens it)."""
    module = ENGINES[manifest.runtime_spec.backend].backend_module()
    hook = getattr(module, "open_camera_encoder", None)
    return hook(folder, manifest, threads) if hook is not None else None


def custom_ops_libraries(folder: Path, spec: BuildSpec, ort_version: str) -> list[Path]:
    """The custom-op libraries the build's graphs need registered, each checked by its engine (its
    backend module's custom_ops_libraries(folder, spec, ort_version); none where it has no such hook)."""
    module = ENGINES[spec.backend].backend_module()
    hook = getattr(module, "custom_ops_libraries", None)
    return list(hook(folder, spec, ort_version)) if hook is not None else []


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> Backend:
    """Load the artifact's graphs on the engine its manifest names, with one dialogue's buffers.

    session_config: extra ONNX Runtime session entries, e.g. {"session.qdq_matmulnbits_accuracy_level":
    "0"} to run block-quantized weights with float32 activations."""
    entry = ENGINES[manifest.runtime_spec.backend]
    return entry.backend_module().open_backend(folder, manifest, table, threads, session_config)  # type: ignore[no-any-return]
