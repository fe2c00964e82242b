"""The decoder on ONNX Runtime: one session, the KV cache bound once, chunks in, logits out.

Per step only the small inputs (ids, positions, mask) are bound anew. The cache buffers are bound
as OrtValues over the KVCache's numpy memory at load, so the graph reads them in place; the chunk's
K/V come back as outputs (preallocated for single-token decode) and KVCache.commit writes them into
their slots. Nothing per step is proportional to the cache, except the graph's own attention.
A fused cpu build binds and steps through runtime/fused.py (a mixin of Decoder); what both share,
the I/O binding and the Ctrl-C guard, is runtime/binding.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cabinlm import manifest as mf
from cabinlm.errors import ManifestError
from cabinlm.manifest import Manifest, load_manifest
from cabinlm.runtime.binding import Binding, defer_sigint, ortvalue
from cabinlm.runtime.cache import MASK_VALUE, KVCache
from cabinlm.runtime.fused import FusedSteps

_ORT_TYPES = {
    "float": "tensor(float)",
    "float16": "tensor(float16)",
    "int64": "tensor(int64)",
    "int32": "tensor(int32)",
    "bool": "tensor(bool)",
    "int8": "tensor(int8)",
    "uint8": "tensor(uint8)",
    "float8e4m3fn": "tensor(float8e4m3fn)",
}


_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def read_build(folder: Path) -> dict:
    """build.json of a `cabinlm build` output ({} for a plain export)."""
    path = folder / "build.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: corrupt build record ({e}); run `cabinlm build` again") from e


def session_options(threads: int | None = None, build: dict | None = None) -> ort.SessionOptions:
    """Session settings: the build's (optimization level, threads, arena), then the caller's threads."""
    settings = (build or {}).get("session", {})
    so = ort.SessionOptions()
    so.graph_optimization_level = _LEVELS[settings.get("graph_optimization_level", "all")]
    threads = threads or settings.get("intra_op_num_threads")
    if threads:
        so.intra_op_num_threads = int(threads)
    so.enable_cpu_mem_arena = bool(settings.get("enable_cpu_mem_arena", True))
    if settings.get("denormal_as_zero"):
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


def shared_weights(folder: Path, build: dict) -> list[tuple[str, ort.OrtValue]]:
    """The weights a static graph pair shares, as OrtValues over one read-only memory map of the
    weights file: handed to both sessions, they are held in memory once."""
    table = build.get("shared_weights")
    if not table:
        return []
    data = np.memmap(folder / table["file"], dtype=np.uint8, mode="r")
    out = []
    for name, dtype, shape, offset, length in table["tensors"]:
        arr = data[offset : offset + length].view(np.dtype(dtype)).reshape(shape)
        out.append((name, ort.OrtValue.ortvalue_from_numpy(arr)))
    return out


class Decoder(FusedSteps):
    """Feeds token chunks through the exported graph and keeps the fixed-size cache up to date.

    A plain export or a dynamic build has one graph for every chunk size; a static-shape build has a
    prefill graph (tokens = chunk; the last chunk of a prompt is padded) and a decode graph (tokens = 1).
    """

    def __init__(self, folder: str | Path, manifest: Manifest | None = None, threads: int | None = None,
                 session_config: dict[str, str] | None = None):
        """session_config: extra ONNX Runtime session entries, e.g. {"session.qdq_matmulnbits_accuracy_level":
        "0"} to run block-quantized weights with float32 activations (default: int8, level 4)."""
        self.folder = Path(folder)
        self._session_config = dict(session_config or {})
        self.manifest = manifest if manifest is not None else load_manifest(self.folder)
        self.layout = self.manifest.cache
        self.build = read_build(self.folder)
        self.static = "graph_decode" in self.manifest.files
        self._weights = shared_weights(self.folder, self.build)  # kept alive with the sessions
        self.sessions = {"graph": self._session("graph", threads)}
        if self.static:
            self.sessions["graph_decode"] = self._session("graph_decode", threads)
        C = self.layout.chunk
        self._check_io(self.sessions["graph"], C if self.static else None)
        if self.static:
            self._check_io(self.sessions["graph_decode"], 1)
        self._index_dtype = np.dtype(self.manifest.index_dtype)
        vision = self.manifest.vision
        self.vision = None
        if vision is not None:  # text chunks of a vision-language model: no image rows
            from cabinlm.runtime.vision import VisionEncoder

            self.vision = VisionEncoder(self.folder / self.manifest.files["vision_graph"].path, vision,
                                        session_options(threads, self.build))  # fmt: skip
            self._no_embeds = np.zeros((self.layout.chunk, vision.embed_dim), dtype=np.float32)
            self._no_image = np.zeros((self.layout.chunk, 1), dtype=bool)
            self._all_image = np.ones((self.layout.chunk, 1), dtype=bool)
        self.fused = self.manifest.attention == "fused"
        self._fused = self.build.get("fused") if self.fused else None
        if self.fused and not self._fused:
            raise ManifestError(f"{self.folder}: a fused build without its build.json record; run `cabinlm build` again")
        self._new_cache()
        self._all_rows = np.arange(C, dtype=self._index_dtype)
        self._last_row = [self._all_rows[i : i + 1] for i in range(C)]
        self._bind()

    def _new_cache(self) -> None:
        if not self.fused:
            self.cache, self.rotated = KVCache(self.layout), None
            return
        from cabinlm.runtime.rotated import RotatedKeys

        self.cache = KVCache(self.layout, scratch=self.layout.chunk, value_scales=False, key_source=True)
        rec = self._fused
        if "rotate_graph" in self.manifest.files and "rotate" not in self.sessions:
            self.sessions["rotate"] = self._session("rotate_graph", 1)
        self.rotated = RotatedKeys(self.cache, rec["inv_freq"], rec["rope_scale"], rec.get("key_scales"),
                                   self.sessions.get("rotate"))  # fmt: skip

    def _session(self, role: str, threads: int | None) -> ort.InferenceSession:
        graph = self.folder / self.manifest.files[role].path
        so = session_options(threads, self.build)
        for key, value in self._session_config.items():
            so.add_session_config_entry(key, str(value))
        for name, ov in self._weights:
            so.add_initializer(name, ov)
        if self._weights:
            # Pre-packing would give each session its own re-laid-out copy of every weight matrix.
            so.add_session_config_entry("session.disable_prepacking", "1")
        try:
            return ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for unreadable graphs
            raise ManifestError(f"{graph}: onnxruntime cannot load the graph ({e}); re-export") from e

    def _check_io(self, session, tokens: int | None) -> None:
        """The graph must have exactly the I/O the manifest declares."""
        io = self.manifest.io if tokens is None else self.manifest.io.with_tokens(tokens, self.layout.slots)
        got = {i.name: i for i in session.get_inputs()}
        got.update({o.name: o for o in session.get_outputs()})
        for t in (*io.inputs, *io.outputs):
            arg = got.get(t.name)
            if arg is None:
                raise ManifestError(f"{self.folder}: the graph has no {t.name!r} that the manifest declares; re-export")
            if arg.type != _ORT_TYPES[t.dtype]:
                raise ManifestError(
                    f"{self.folder}: graph tensor {t.name!r} is {arg.type}, the manifest says {t.dtype}; re-export"
                )
            static = [d for d in t.shape if isinstance(d, int)]
            if static != [d for d in arg.shape if isinstance(d, int)]:
                raise ManifestError(
                    f"{self.folder}: graph tensor {t.name!r} has shape {arg.shape}, the manifest says "
                    f"{list(t.shape)}; the graph and the manifest come from different exports"
                    + ("" if not self.build else ", or an older cabinlm made this build: run `cabinlm build` again")
                )

    def _bind(self) -> None:
        if self.fused:
            return self._bind_fused()
        lay, V = self.layout, self.manifest.model.vocab_size
        kv, kv_onnx = np.dtype(lay.kv_dtype.numpy_name), lay.kv_dtype.onnx_name
        c = self.cache
        cache_values = []  # OrtValues over the cache's own buffers, shared by every binding
        for i in range(lay.layers):
            cache_values += [
                (mf.key_cache_name(i), ortvalue(c.keys[i], kv_onnx)),
                (mf.value_cache_name(i), ortvalue(c.values[i], kv_onnx)),
            ]
            if c.value_scales is not None:
                cache_values.append((mf.value_scale_name(i), ortvalue(c.value_scales[i], "float16")))
        self._cache_values = cache_values
        H, D = lay.kv_heads, lay.head_dim
        outs = [(mf.LOGITS, ("rows", V), np.dtype(np.float32), "float")]
        outs += [(mf.new_key_name(i), (H, "tokens", D), kv, kv_onnx) for i in range(lay.layers)]
        outs += [(mf.new_value_name(i), (H, "tokens", D), kv, kv_onnx) for i in range(lay.layers)]
        if lay.quantized:
            outs += [(mf.new_value_scale_name(i), (H, "tokens", 1), np.dtype(np.float16), "float16") for i in range(lay.layers)]
        decode_session = self.sessions["graph_decode" if self.static else "graph"]
        self._decode = Binding(decode_session, cache_values, outs, tokens=1, rows=1)
        # static graphs have every dimension fixed: the prefill graph returns a row per token
        size = lay.chunk if self.static else None
        self._prefill = Binding(self.sessions["graph"], cache_values, outs, tokens=size, rows=size)

    def seat(self) -> Decoder:
        """Another dialogue seat on the same loaded model: the sessions and weights are shared
        (held once), the cache buffers and bindings are the new seat's own."""
        other = object.__new__(Decoder)
        other.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("cache", "rotated", "_cache_values", "_decode", "_prefill")})
        other._new_cache()
        other._bind()
        return other

    def reset(self) -> None:
        self.cache.reset()
        if self.rotated is not None:
            self.rotated.forget()

    def step(self, ids: np.ndarray, pin: bool | str = False, embeds: np.ndarray | None = None, logits: str = "all") -> np.ndarray:
        """Run one chunk (1..chunk tokens) and commit its K/V. Returns logits (tokens, vocab), or
        with logits="last" only the last token's (1, vocab): the graph then computes just that row.

        embeds (tokens, embed_dim): a vision-language model's image-token embeddings for this chunk."""
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        mode = logits
        if self.fused:
            if embeds is not None:
                raise ValueError("this model has no vision input")
            return self._step_fused(ids, pin, mode)
        index = self._index_dtype
        n = len(ids)
        plan = self.cache.plan(n, pin)
        ids = np.ascontiguousarray(ids, dtype=index)
        pos, cache_pos, mask = plan.position_ids, plan.cache_position_ids, plan.attention_mask
        binding = self._decode if n == 1 else self._prefill
        size = binding.tokens if binding.tokens is not None else n
        extra = None
        if self.manifest.vision is not None:
            if embeds is None:
                extra = {mf.IMAGE_EMBEDS: self._no_embeds[:size], mf.IMAGE_MASK: self._no_image[:size]}
            else:
                rows = np.zeros((size, embeds.shape[1]), dtype=np.float32)
                rows[:n] = embeds
                extra = {mf.IMAGE_EMBEDS: rows, mf.IMAGE_MASK: self._all_image[:size]}
        elif embeds is not None:
            raise ValueError("this model has no vision input")
        if size != n:
            ids, pos, mask = self._pad(ids, pos, mask, size)
        if binding.tokens is not None and binding.tokens > 1:  # static prefill: every row, then pick
            logit_rows = self._all_rows[:size]
        else:
            logit_rows = self._last_row[n - 1] if mode == "last" or n == 1 else self._all_rows[:n]
        inputs = {mf.INPUT_IDS: ids, mf.POSITION_IDS: pos.astype(index, copy=False),
                  mf.CACHE_POSITION_IDS: cache_pos.astype(index, copy=False), mf.ATTENTION_MASK: mask,
                  mf.LOGIT_ROWS: logit_rows, **(extra or {})}  # fmt: skip
        outs = binding.run(inputs)
        L = self.layout.layers
        out = outs[0]
        if len(out) != (1 if mode == "last" or n == 1 else n):  # a static graph's rows: pick the asked ones
            out = out[n - 1 : n] if mode == "last" else out[:n]
        keys, values, scales = outs[1 : 1 + L], outs[1 + L : 1 + 2 * L], outs[1 + 2 * L :]
        if binding.tokens != n:  # padded: keep the real tokens' K/V only
            keys, values, scales = ([x[:, :n] for x in xs] for xs in (keys, values, scales))
        with defer_sigint():
            self.cache.commit(plan, keys, values, scales or None)
        return out

    def _pad(self, ids, pos, mask, size: int):
        """Pad a chunk to a static graph's token count. Pad tokens come after the real ones, so the
        causal mask hides them from the real tokens; their outputs are dropped."""
        n, slots = len(ids), self.layout.slots
        ids_p = np.zeros(size, dtype=ids.dtype)
        ids_p[:n] = ids
        pos_p = np.arange(pos[0], pos[0] + size, dtype=pos.dtype)
        mask_p = np.empty((size, slots + size), dtype=mask.dtype)
        mask_p[:, :slots] = mask[0, :slots]
        mask_p[:, slots:] = np.where(np.tri(size, dtype=bool), np.float32(0), MASK_VALUE)
        return ids_p, pos_p, mask_p

    def feed(self, ids, pin: bool | str = False, all_logits: bool = False, embeds: np.ndarray | None = None) -> np.ndarray:
        """Feed any number of tokens in chunks. Returns the last token's logits (vocab,), or all (n, vocab)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("feed() needs at least one token")
        C = self.layout.chunk
        parts = []
        for start in range(0, len(ids), C):
            rows = None if embeds is None else embeds[start : start + C]
            logits = self.step(ids[start : start + C], pin=pin, embeds=rows, logits="all" if all_logits else "last")
            if all_logits:
                parts.append(logits.copy())
        if all_logits:
            return np.concatenate(parts, axis=0)
        return logits[-1].copy()
