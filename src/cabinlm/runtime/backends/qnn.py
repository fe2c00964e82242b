"""The decoder on Qualcomm's HTP: the prefill and decode context binaries of an HTP build
(builders/qnn.py), run through ONNX Runtime's QNN plugin. On the car's SoC they run on the Hexagon
NPU; on an x86 host the same calls run them in Qualcomm's HTP simulator (slow: seconds per token).

The graph contract is the static pair's (exported.StaticPairBackend): the cache lives in this
backend's host buffers, bound once; each run hands the chunk's K/V back, and commit writes the
accepted tokens' K/V into their slots. Nothing in a session can run on the CPU (fallback is off and
the context models are EPContext nodes only), so `device` is "qnn-htp" because that is what ran.
"""

from __future__ import annotations

import platform
from pathlib import Path

from cabinlm.buildspec import BackendKind
from cabinlm.qnn_spec import SIMULATOR
from cabinlm.manifest import Manifest
from cabinlm.runtime.backends import qnn_plugin
from cabinlm.runtime.backends.base import BackendError
from cabinlm.runtime.backends.exported import ExportedGraphBackend, LoadedGraphs
from cabinlm.runtime.backends.ort_session import check_io


def simulated() -> bool:
    """The HTP is Qualcomm's x86 simulator here (no Hexagon NPU on an x86 host)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def load_qnn(folder: Path, manifest: Manifest, threads: int | None = None) -> LoadedGraphs:
    """Both context models on the HTP, checked against the manifest's graph I/O. threads: unused
    (the HTP schedules itself); accepted so every backend loads alike."""
    spec = manifest.runtime_spec
    if spec.qnn is None:
        raise BackendError(f"{folder}: the manifest names the QNN HTP backend without its build facts; run `cabinlm build` again")
    # A weight-sharing build (HTP v73+) carries an unshared twin for the x86 simulator, which cannot
    # load shared-weight contexts; on the car the shared pair loads into one context.
    twin = spec.qnn.weight_sharing and simulated()
    sessions = []
    for role, tokens in (("graph", manifest.cache.chunk), ("graph_decode", 1)):
        role += SIMULATOR if twin else ""
        if role not in manifest.files:
            raise BackendError(f"{folder}: no {role!r} context model listed; run `cabinlm build` again")
        path = folder / manifest.files[role].path
        s = qnn_plugin.open_context_session(path, spec.provider, share=spec.qnn.weight_sharing and not twin)
        check_io(s, manifest.io.with_tokens(tokens, manifest.cache.slots), folder, built=True)
        sessions.append(s)
    return LoadedGraphs(manifest, sessions[0], sessions[1], True, [])


class QnnBackend(ExportedGraphBackend):
    """The static pair's contract on the HTP (module docstring)."""

    kind = BackendKind.QNN_HTP

    @property
    def device(self) -> str:
        return "qnn-htp"
