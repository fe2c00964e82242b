"""The exported graph on ONNX Runtime (a plain export, or a dynamic-shape build of it): the graph
contract of io_spec.decoder_io. The static engines (ort_static, qnn_htp) run the same contract with
every dimension fixed, through this class (a short chunk padded to the graph's size).

Buffers (allocated once per dialogue; the graph reads them in place through OrtValues over this
memory, bound once at load):

    keys, values     (layers, kv_heads, slots, head_dim)  kv dtype (fp8: its uint8 bytes)   un-rotated
    value_scales     (layers, kv_heads, slots, 1)         float16, int8 / fp8 KV only
    local_keys, local_values, local_value_scales         the same over the local layers' rings
                     (local layers, kv_heads, R, ...)     (CacheLayout.local_layers; absent without)

(`layers` above: the global layers, CacheLayout.buffer_shape; all of them without local layers.)

A step binds ids, positions, mask and logit rows; the chunk's K/V come back as outputs (buffers
allocated once for single-token decode) and commit writes them into their slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cabinlm.contract.files import FileRole
from cabinlm.contract import io_spec as io
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import Manifest
from cabinlm.engines.backend import Backend, StepOutput, exported_graph_verifies_drafts
from cabinlm.engines.onnxruntime.binding import Binding, adapter_inputs, ortvalue
from cabinlm.engines.onnxruntime.session import check_io, open_session, session_options
from cabinlm.contract.slots import MASK_VALUE, SlotTable, StepPlan


@dataclass
class LoadedGraphs:
    """What every dialogue on one loaded artifact shares: sessions (and the weights they hold)."""

    manifest: Manifest
    prefill: ort.InferenceSession  # any chunk size, or exactly `chunk` tokens (static)
    decode: ort.InferenceSession  # one token (the same session unless static)
    static: bool
    weights: list[tuple[str, ort.OrtValue]]  # a static pair's shared weights, kept alive here
    # The switchable LoRA inputs' zeros (no adapter: the base model), by input name, shared by every seat
    lora_zeros: dict[str, np.ndarray] = field(default_factory=dict)


def load_graphs(folder: Path, manifest: Manifest, threads: int | None, extra: dict[str, str] | None,
                static: bool = False, weights: list[tuple[str, ort.OrtValue]] | None = None) -> LoadedGraphs:
    """The artifact's graph sessions: one for every chunk size, or (static) the prefill graph
    ("graph", tokens = chunk) and the decode graph ("graph_decode", tokens = 1). weights: initializers
    handed to every session (a static pair's shared weights), held in memory once."""
    spec = manifest.runtime_spec
    weights = weights or []

    def session(role: str, tokens: int | None) -> ort.InferenceSession:
        so = session_options(spec, threads, extra)
        for name, ov in weights:
            so.add_initializer(name, ov)
        if weights:  # pre-packing would give each session its own re-laid-out copy of every matrix
            so.add_session_config_entry("session.disable_prepacking", "1")
        path = folder / manifest.files[role].path
        s = open_session(path, so, spec)
        lay = manifest.cache
        check_io(s, manifest.io if tokens is None else manifest.io.with_tokens(tokens, lay), folder,
                 built=manifest.build is not None)  # fmt: skip
        return s

    zeros = {t.name: np.zeros(t.shape, dtype=np.float32) for t in manifest.io.inputs if t.name.startswith("lora_")}
    if static:
        return LoadedGraphs(manifest, session(FileRole.GRAPH, manifest.cache.chunk), session(FileRole.GRAPH_DECODE, 1), True, weights,
                            zeros)  # fmt: skip
    s = session(FileRole.GRAPH, None)
    return LoadedGraphs(manifest, s, s, False, weights, zeros)


def allocate(layout, cache_dtype: str | None = None) -> dict[str, np.ndarray]:
    """This backend's cache buffers for a layout (the module docstring's table). cache_dtype "uint8":
    a build's own 8-bit cache (io_spec.decoder_io's cache_dtype; the HTP's), zero point 128 (the
    value an empty slot holds), one static scale per tensor in the graph: no value scales."""
    dtype = np.dtype(cache_dtype or layout.kv_dtype.numpy_name)
    fill = 128 if cache_dtype == "uint8" else 0
    bufs = {}
    kinds = [("", layout.buffer_shape)] + ([("local_", layout.local_buffer_shape)] if layout.local_layers else [])
    for prefix, (L, H, N, D) in kinds:
        bufs[f"{prefix}keys"] = np.full((L, H, N, D), fill, dtype=dtype)
        bufs[f"{prefix}values"] = np.full((L, H, N, D), fill, dtype=dtype)
        if layout.quantized and cache_dtype is None:
            bufs[f"{prefix}value_scales"] = np.zeros((L, H, N, 1), dtype=np.float16)
    return bufs


def layer_view(bufs: dict[str, np.ndarray], name: str, layout, layer: int) -> np.ndarray:
    """One layer's (kv_heads, slots or R, X) view of buffer `name` ("keys", "values", "value_scales")."""
    local, j = layout.buffer_index(layer)
    return bufs[f"local_{name}" if local else name][j]


class ExportedGraphBackend(Backend):
    """io_spec.decoder_io on ONNX Runtime; static pairs pad a prompt's last chunk to the graph's size."""

    kind = BackendKind.EXPORTED_GRAPH
    # A build's own cache type (allocate's cache_dtype; QnnBackend's uint8), None: the layout's KV dtype
    cache_dtype: str | None = None

    def __init__(self, graphs: LoadedGraphs, table: SlotTable):
        super().__init__(graphs.manifest, table)
        self.graphs = graphs
        m = self.manifest
        lay = self.layout
        self.bufs = allocate(lay, self.cache_dtype)
        self.keys, self.values = self.bufs["keys"], self.bufs["values"]
        self.value_scales = self.bufs.get("value_scales")
        self._index = np.dtype(m.index_dtype)
        self._rows = np.arange(lay.chunk, dtype=self._index)
        if m.vision is not None:  # text chunks of a vision-language model: no image rows
            self._no_embeds = np.zeros((lay.chunk, m.vision.embed_dim), dtype=np.float32)
            self._no_image = np.zeros((lay.chunk, 1), dtype=bool)
            self._all_image = np.ones((lay.chunk, 1), dtype=bool)
        self._bind()

    def _bind(self) -> None:
        lay, kv_onnx = self.layout, self.cache_dtype or self.layout.kv_dtype.onnx_name
        kv = np.dtype(self.cache_dtype or lay.kv_dtype.numpy_name)
        cache = []  # OrtValues over this dialogue's buffers, shared by both bindings
        for i in range(lay.layers):
            cache += [(io.key_cache_name(i), ortvalue(layer_view(self.bufs, "keys", lay, i), kv_onnx)),
                      (io.value_cache_name(i), ortvalue(layer_view(self.bufs, "values", lay, i), kv_onnx))]  # fmt: skip
            if self.value_scales is not None:
                cache.append((io.value_scale_name(i), ortvalue(layer_view(self.bufs, "value_scales", lay, i), "float16")))
        self._cache_values = cache
        outs = self._outputs(kv, kv_onnx)
        self._decode = Binding(self.graphs.decode, cache, outs, tokens=1, rows=1)
        size = lay.chunk if self.graphs.static else None  # a static prefill graph returns a row per token
        self._prefill = Binding(self.graphs.prefill, cache, outs, tokens=size, rows=size)
        if self.graphs.lora_zeros:
            self.set_adapter(None)

    def set_adapter(self, inputs: dict[str, np.ndarray] | None) -> None:
        """The adapter inputs bound once in both bindings (OrtValues over the arrays: no copy); a run
        then feeds them without a word. None: the shared zeros."""
        zeros = self.graphs.lora_zeros
        if not zeros:
            super().set_adapter(inputs)
        self._adapter_values = adapter_inputs(zeros, inputs)  # kept alive here
        for b in (self._decode, self._prefill):
            for name, ov in self._adapter_values:
                b.binding.bind_ortvalue_input(name, ov)

    def _outputs(self, kv: np.dtype, kv_onnx: str) -> list[tuple[str, tuple, np.dtype, str]]:
        """(name, shape, numpy dtype, ONNX type) of the graph's outputs, in the order run() splits
        them: logits, new keys, new values, then the value scales (int8 / fp8 KV), or what a
        subclass adds (QnnBackend: the rotated-key build's new_key_source)."""
        lay = self.layout
        H, D, V = lay.kv_heads, lay.head_dim, self.graphs.manifest.model.vocab_size
        outs = [(io.LOGITS, ("rows", V), np.dtype(np.float32), "float")]
        outs += [(io.new_key_name(i), (H, "tokens", D), kv, kv_onnx) for i in range(lay.layers)]
        outs += [(io.new_value_name(i), (H, "tokens", D), kv, kv_onnx) for i in range(lay.layers)]
        if self.value_scales is not None:
            f16 = np.dtype(np.float16)
            outs += [(io.new_value_scale_name(i), (H, "tokens", 1), f16, "float16") for i in range(lay.layers)]
        return outs

    def _positions(self, plan: StepPlan, pos: np.ndarray, cache_pos: np.ndarray | None, size: int) -> dict[str, np.ndarray]:
        """The chunk's position inputs (pos: padded to `size` tokens where the graph is static)."""
        index = self._index
        return {io.POSITION_IDS: pos,
                io.CACHE_POSITION_IDS: plan.cache_position_ids.astype(index, copy=False) if cache_pos is None else cache_pos}  # fmt: skip

    @property
    def fixed_chunk(self) -> bool:
        return self.graphs.static

    @property
    def verifies_drafts(self) -> bool:
        return exported_graph_verifies_drafts(self.layout)

    def buffers(self) -> dict[str, np.ndarray]:
        return dict(self.bufs)

    def seat(self, table: SlotTable) -> ExportedGraphBackend:
        return type(self)(self.graphs, table)

    def run(self, plan: StepPlan, ids: np.ndarray, all_logits: bool, embeds: np.ndarray | None) -> StepOutput:
        n, index = plan.tokens, self._index
        binding = self._decode if n == 1 else self._prefill
        size = binding.tokens if binding.tokens is not None else n  # a static graph's fixed token count
        ids = np.ascontiguousarray(ids, dtype=index)
        pos, mask = plan.position_ids.astype(index, copy=False), plan.attention_mask
        cache_pos = None
        vision = self.graphs.manifest.vision
        if vision is not None and vision.mrope:  # (3, tokens) and (3, slots): time, row, column (docs/vlm.md)
            pos, cache_pos = plan.mrope_positions(vision.image_tokens, vision.grid)
            pos, cache_pos = pos.astype(index, copy=False), cache_pos.astype(index, copy=False)
        inputs = {}
        if self.graphs.manifest.vision is not None:
            if embeds is None:
                inputs = {io.IMAGE_EMBEDS: self._no_embeds[:size], io.IMAGE_MASK: self._no_image[:size]}
            else:
                rows = np.zeros((size, embeds.shape[1]), dtype=np.float32)
                rows[:n] = embeds
                inputs = {io.IMAGE_EMBEDS: rows, io.IMAGE_MASK: self._all_image[:size]}
        elif embeds is not None:
            raise ValueError("this model has no vision input")
        local = {}
        if self.layout.local_layers:
            local = {io.LOCAL_POSITION_IDS: plan.local_position_ids.astype(index, copy=False),
                     io.LOCAL_CACHE_POSITION_IDS: plan.local_cache_position_ids.astype(index, copy=False),
                     io.LOCAL_ATTENTION_MASK: plan.local_attention_mask}  # fmt: skip
        if size != n:
            if local:
                _, local[io.LOCAL_POSITION_IDS], local[io.LOCAL_ATTENTION_MASK] = _pad(
                    ids, local[io.LOCAL_POSITION_IDS], local[io.LOCAL_ATTENTION_MASK], size, self.layout.local_slots)
            if cache_pos is not None:  # the pad tokens' positions continue the last token's, all three components
                pos = np.concatenate([pos, pos[:, -1:] + np.arange(1, size - n + 1, dtype=pos.dtype)], axis=1)
                ids, _, mask = _pad(ids, pos[0], mask, size, self.layout.slots)
            else:
                ids, pos, mask = _pad(ids, pos, mask, size, self.layout.slots)
        inputs.update(local)
        if binding.tokens is not None and binding.tokens > 1:  # static prefill: every row, then pick
            logit_rows = self._rows[:size]
        else:
            logit_rows = self._rows[:n] if all_logits and n > 1 else self._rows[n - 1 : n]
        inputs.update({io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.LOGIT_ROWS: logit_rows})
        inputs.update(self._positions(plan, pos, cache_pos, size))
        outs = binding.run(inputs)
        L = self.layout.layers
        logits = outs[0]
        if len(logits) != (n if all_logits and n > 1 else 1):  # a static graph's rows: keep the asked ones
            logits = logits[:n] if all_logits else logits[n - 1 : n]
        new = outs[1 : 1 + L], outs[1 + L : 1 + 2 * L], outs[1 + 2 * L :]
        if size != n:  # padded: the real tokens' K/V only
            new = tuple([x[:, :n] for x in xs] for xs in new)
        return StepOutput(logits, new)

    def commit(self, plan: StepPlan, out: StepOutput) -> None:
        """Per layer (kv_heads, tokens, head_dim) K/V and (kv_heads, tokens, 1) value scales into
        their slots; a contiguous run of slots (no wrap of the ring inside the chunk) is one slice."""
        lay = self.layout
        for name, news in zip(("keys", "values", "value_scales"), out.new):
            if name not in self.bufs:
                continue
            if not lay.local_layers:
                write_slots(self.bufs[name], news, plan.slots)
                continue
            write_slots(self.bufs[name], [news[i] for i in lay.global_layers], plan.slots)
            write_slots(self.bufs[f"local_{name}"], [news[i] for i in lay.local_layers], plan.local_slots)


def write_slots(buffer: np.ndarray, news: list[np.ndarray], slots: np.ndarray) -> None:
    """buffer (layers, kv_heads, slots, X)[:, :, slots] = news (per layer (kv_heads, tokens, X); the
    first len(slots) tokens), in place. A contiguous run of slots (no wrap of the ring) is one slice."""
    n = len(slots)
    lo, hi = int(slots[0]), int(slots[-1]) + 1
    where = (slice(None), slice(lo, hi)) if hi - lo == n else (slice(None), slots)
    for layer, x in enumerate(news):
        buffer[layer][where] = x if x.shape[1] == n else x[:, :n]  # more tokens ran than are kept


def _pad(ids, pos, mask, size: int, slots: int):
    """Pad a chunk to a static graph's token count. Pad tokens come after the real ones, so the
    causal mask hides them from the real tokens; their outputs are dropped."""
    n = len(ids)
    ids_p = np.zeros(size, dtype=ids.dtype)
    ids_p[:n] = ids
    pos_p = np.arange(pos[0], pos[0] + size, dtype=pos.dtype)
    mask_p = np.empty((size, slots + size), dtype=mask.dtype)
    mask_p[:n, :slots] = mask[:, :slots]  # rows differ in a local ring's mask (each token's own window)
    mask_p[n:, :slots] = mask[n - 1, :slots]
    mask_p[:, slots:] = np.where(np.tri(size, dtype=bool), np.float32(0), MASK_VALUE)
    return ids_p, pos_p, mask_p


def unavailable() -> str | None:
    """The exported graph runs wherever onnxruntime imports (its CPU provider is always there)."""
    return None


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> ExportedGraphBackend:
    return ExportedGraphBackend(load_graphs(folder, manifest, threads, session_config), table)
