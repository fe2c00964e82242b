"""The decoder on Qualcomm's HTP: the prefill and decode context binaries of an HTP build
(builder.py), run through ONNX Runtime's QNN plugin. On the car's SoC they run on the Hexagon
NPU; on an x86 host the same calls run them in Qualcomm's HTP simulator (slow: seconds per token).

The graph contract is the static pair's (engines/ort_static): the cache lives in this
backend's host buffers, bound once (fp16, or for an int8-KV build uint8 with zero point 128 and one
scale per tensor held by the binaries: half the bytes, no value scales); each run hands the chunk's K/V back, and commit writes the
accepted tokens' K/V into their slots. Nothing in a session can run on the CPU (fallback is off and
the context models are EPContext nodes only), so `device` is "qnn-htp" because that is what ran.
"""

from __future__ import annotations

import platform
from pathlib import Path

from cabinlm.engines.registry import BackendKind
from cabinlm.engines.qnn_htp.spec import SIMULATOR, QnnSettings
from cabinlm.manifest import Manifest
from cabinlm.engines.qnn_htp import plugin as qnn_plugin
from cabinlm.engines.backend import BackendError
from cabinlm.engines.ort_graph.backend import ExportedGraphBackend, LoadedGraphs
from cabinlm.engines.onnxruntime.session import check_io
from cabinlm.runtime.slots import SlotTable


def simulated() -> bool:
    """The HTP is Qualcomm's x86 simulator here (no Hexagon NPU on an x86 host)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def load_qnn(folder: Path, manifest: Manifest, threads: int | None = None) -> LoadedGraphs:
    """Both context models on the HTP, checked against the manifest's graph I/O. threads: unused
    (the HTP schedules itself); accepted so every backend loads alike."""
    spec = manifest.runtime_spec
    qnn = spec.facts_as(QnnSettings)
    if qnn is None:
        raise BackendError(f"{folder}: the manifest names the QNN HTP backend without its build facts; run `cabinlm build` again")
    # A weight-sharing build (HTP v73+) carries an unshared twin for the x86 simulator, which cannot
    # load shared-weight contexts; on the car the shared pair loads into one context.
    twin = qnn.weight_sharing and simulated()
    sessions = []
    for role, tokens in (("graph", manifest.cache.chunk), ("graph_decode", 1)):
        role += SIMULATOR if twin else ""
        if role not in manifest.files:
            raise BackendError(f"{folder}: no {role!r} context model listed; run `cabinlm build` again")
        path = folder / manifest.files[role].path
        s = qnn_plugin.open_context_session(path, spec.provider, share=qnn.weight_sharing and not twin)
        check_io(s, manifest.io.with_tokens(tokens, manifest.cache), folder, built=True)
        sessions.append(s)
    return LoadedGraphs(manifest, sessions[0], sessions[1], True, [])


class QnnBackend(ExportedGraphBackend):
    """The static pair's contract on the HTP (module docstring)."""

    kind = BackendKind.QNN_HTP

    @property
    def cache_dtype(self) -> str | None:  # type: ignore[override]
        """uint8 for a build with the HTP's 8-bit cache (build.qnn.kv_cache): half the bytes of fp16."""
        qnn = self.graphs.manifest.runtime_spec.facts_as(QnnSettings)
        return "uint8" if qnn is not None and qnn.kv_cache == "uint8" else None

    @property
    def device(self) -> str:
        return "qnn-htp"


def unavailable() -> str | None:
    """Why the HTP (or its simulator) cannot be had here: the onnxruntime-qnn plugin is missing."""
    try:
        qnn_plugin.require()
    except BackendError as e:
        return str(e)
    return None


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> QnnBackend:
    """session_config: not applied (the HTP's sessions are its context binaries)."""
    return QnnBackend(load_qnn(folder, manifest, threads), table)
