"""The decoder on Qualcomm's HTP: the prefill and decode context binaries of an HTP build
(builder.py), run through ONNX Runtime's QNN plugin. On the car's SoC they run on the Hexagon
NPU; on an x86 host the same calls run them in Qualcomm's HTP simulator (slow: seconds per token).

The graph contract is the static pair's (engines/ort_static): the cache lives in this
backend's host buffers, bound once (fp16, or for an int8-KV build uint8 with zero point 128 and one
scale per tensor held by the binaries: half the bytes, no value scales); each run hands the chunk's K/V back, and commit writes the
accepted tokens' K/V into their slots. Nothing in a session can run on the CPU (fallback is off and
the context models are EPContext nodes only), so `device` is "qnn-htp" because that is what ran.

A uint8 cache with rotated keys (build.qnn.rotated_keys; engines/qnn_htp/rotated_graph.py) holds every
key rotated once, at its virtual position, as the fused cpu build does, with that build's bookkeeping
(engines/onnxruntime/rotated.RotatedKeys): before each run the chunk's rotation rows at L + i + E
(rope_cos / rope_sin), and after a step that evicted the sink / pinned keys re-rotated at rank + E from
their un-rotated fp16 copy, rounded with the key tensor's one scale, written as uint8 (+ 128). A recall
region (docs/design.md, "The recall region") is kept as on the fused cpu build: its keys' copy after the
pinned ones, re-rotated at rank + O, O = E - r taking E's place (StepPlan.offset), so a refresh of the
region moves the window's ranks without touching its uint8 keys:

    key_source   (layers, kv_heads, sink + pinned + recall, head_dim)  float16   the sink / pinned / recall
                                                                        keys, un-rotated (the graph's new_key_source)

Sessions save it with the cache (buffers()); E is the slot table's.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from cabinlm.contract.files import FileRole
from cabinlm.contract.engines import BackendKind
from cabinlm.contract import io_spec as io
from cabinlm.engines.backend import StepOutput
from cabinlm.engines.onnxruntime.rotated import RotatedKeys
from cabinlm.contract.engines.qnn import KV_ZERO_POINT, SIMULATOR, QnnSettings
from cabinlm.contract.manifest import Manifest
from cabinlm.engines.qnn_htp import plugin as qnn_plugin
from cabinlm.engines.backend import BackendError
from cabinlm.engines.ort_graph.backend import ExportedGraphBackend, LoadedGraphs
from cabinlm.engines.onnxruntime.session import check_io
from cabinlm.contract.slots import SlotTable, StepPlan


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
    for role, tokens in ((FileRole.GRAPH, manifest.cache.chunk), (FileRole.GRAPH_DECODE, 1)):
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

    def __init__(self, graphs: LoadedGraphs, table: SlotTable):
        self.graphs = graphs  # rotated_keys (read while the base class binds) asks its manifest
        self.rotated: RotatedKeys | None = None
        self.key_source: np.ndarray | None = None
        super().__init__(graphs, table)
        if self.rotated_keys:
            m, lay = self.manifest, self.layout
            L, H, _, D = lay.buffer_shape
            self.key_source = np.zeros((L, H, lay.window_start, D), dtype=np.float16)  # sink, pinned, recall
            scales = np.array([self.kv_scales[io.key_cache_name(i)] for i in range(L)], np.float32)  # one per tensor
            self.rotated = RotatedKeys(lay, self.keys, self.key_source, m.rotary.inv_freq, m.rotary.scale,
                                       np.broadcast_to(scales[:, None, None], (L, H, D)), zero_point=KV_ZERO_POINT)  # fmt: skip

    @property
    def cache_dtype(self) -> str | None:  # type: ignore[override]
        """uint8 for a build with the HTP's 8-bit cache (build.qnn.kv_cache): half the bytes of fp16."""
        qnn = self.graphs.manifest.runtime_spec.facts_as(QnnSettings)
        return "uint8" if qnn is not None and qnn.kv_cache == "uint8" else None

    @property
    def rotated_keys(self) -> bool:
        """The uint8 cache holds rotated keys (build.qnn.rotated_keys; module docstring)."""
        qnn = self.graphs.manifest.runtime_spec.facts_as(QnnSettings)
        return qnn is not None and qnn.rotated_keys

    @property
    def kv_scales(self) -> dict[str, float]:
        """The uint8 cache's {cache input name: its one scale} (build.qnn.kv_scales); the rotated keys'
        refresh rounds with the key tensors'."""
        qnn = self.graphs.manifest.runtime_spec.facts_as(QnnSettings)
        return qnn.kv_scales if qnn is not None else {}

    def _outputs(self, kv: np.dtype, kv_onnx: str) -> list[tuple[str, tuple, np.dtype, str]]:
        outs = super()._outputs(kv, kv_onnx)
        if self.rotated_keys:  # after the new K/V (a uint8 cache has no value scales): run()'s out.new[2]
            lay, f16 = self.layout, np.dtype(np.float16)
            outs += [(io.new_key_source_name(i), (lay.kv_heads, "tokens", lay.head_dim), f16, "float16") for i in range(lay.layers)]
        return outs

    def _positions(self, plan: StepPlan, pos: np.ndarray, cache_pos: np.ndarray | None, size: int) -> dict[str, np.ndarray]:
        """Rotated keys: the sink / pinned keys at rank + E (re-written only when E or their set changed),
        and the chunk's rotation rows at L + i + E (rows past the chunk: pad tokens, whose outputs go)."""
        if self.rotated is None:
            return super()._positions(plan, pos, cache_pos, size)
        self.rotated.refresh(plan)
        self.rotated.chunk_tables(plan)
        return {io.ROPE_COS: self.rotated.cos[:size], io.ROPE_SIN: self.rotated.sin[:size]}

    def commit(self, plan: StepPlan, out: StepOutput) -> None:
        super().commit(plan, out)
        if self.rotated is not None:  # the un-rotated copy of the chunk's sink / pinned keys
            self.rotated.keep_keys(plan, out.new[2])

    def buffers(self) -> dict[str, np.ndarray]:
        bufs = super().buffers()
        if self.key_source is not None:
            bufs["key_source"] = self.key_source
        return bufs

    def reset(self) -> None:
        if self.rotated is not None:
            self.rotated.forget()

    def restored(self) -> None:
        if self.rotated is not None:  # the sink / pinned rows are re-written before the next step
            self.rotated.forget()

    @property
    def device(self) -> str:
        return "qnn-htp"


def open_camera_encoder(folder: Path, manifest: Manifest, threads: int | None = None):
    """An HTP build's camera encoder: the tower's context binary where the build compiled it (files
    "vision_context", engines/qnn_htp/vision_build.py; CPU fallback off: it runs on the HTP or not at
    all), else the vision graph on the CPU provider."""
    if FileRole.VISION_CONTEXT not in manifest.files:
        from cabinlm.engines.onnxruntime.session import vision_session

        return vision_session(folder, manifest, threads), "cpu"
    path = folder / manifest.files[FileRole.VISION_CONTEXT].path
    return qnn_plugin.open_context_session(path, manifest.runtime_spec.provider, share=False), "qnn-htp"


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
