"""The decoder on ONNX Runtime: one session, the KV cache bound once, chunks in, logits out.

Per step only the small inputs (ids, positions, mask) are bound anew. The cache buffers are bound
as OrtValues over the KVCache's numpy memory at load, so the graph reads them in place; the chunk's
K/V come back as outputs (preallocated for single-token decode) and KVCache.commit writes them into
their slots. Nothing per step is proportional to the cache, except the graph's own attention.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cabinlm import manifest as mf
from cabinlm.errors import ManifestError
from cabinlm.manifest import Manifest, load_manifest
from cabinlm.runtime.cache import KVCache

_FLOAT8E4M3FN = 17  # onnx.TensorProto.FLOAT8E4M3FN (the runtime does not import onnx)
_ORT_TYPES = {
    "float": "tensor(float)",
    "float16": "tensor(float16)",
    "int64": "tensor(int64)",
    "int8": "tensor(int8)",
    "uint8": "tensor(uint8)",
    "float8e4m3fn": "tensor(float8e4m3fn)",
}


@contextlib.contextmanager
def defer_sigint():
    """Hold Ctrl-C until the block ends, so a half-written cache never survives an interrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


class Decoder:
    """Feeds token chunks through the exported graph and keeps the fixed-size cache up to date."""

    def __init__(self, folder: str | Path, manifest: Manifest | None = None, threads: int | None = None):
        self.folder = Path(folder)
        self.manifest = manifest if manifest is not None else load_manifest(self.folder)
        self.layout = self.manifest.cache
        graph = self.folder / self.manifest.files["graph"].path
        try:
            self.session = ort.InferenceSession(str(graph), session_options(threads), providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for unreadable graphs
            raise ManifestError(f"{graph}: onnxruntime cannot load the graph ({e}); re-export") from e
        self._check_io()
        self.cache = KVCache(self.layout)
        L = self.layout.layers
        self._new_keys = [mf.new_key_name(i) for i in range(L)]
        self._new_values = [mf.new_value_name(i) for i in range(L)]
        self._bind_static()

    def _check_io(self) -> None:
        """The graph must have exactly the I/O the manifest declares."""
        io = self.manifest.io
        got = {i.name: i for i in self.session.get_inputs()}
        got.update({o.name: o for o in self.session.get_outputs()})
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
                )

    def _ortvalue(self, array: np.ndarray, dtype: str) -> ort.OrtValue:
        """An OrtValue over `array`'s own memory (CPU: no copy). fp8 tensors live in uint8 arrays."""
        if dtype == "float8e4m3fn":
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, _FLOAT8E4M3FN)
        return ort.OrtValue.ortvalue_from_numpy(array)

    def _bind_static(self) -> None:
        lay, V = self.layout, self.manifest.model.vocab_size
        kv_onnx = lay.kv_dtype.onnx_name
        self.binding = self.session.io_binding()
        self._cache_values = []  # keep the OrtValues (and so the views) alive
        c = self.cache
        for i in range(lay.layers):
            pairs = [(mf.key_cache_name(i), c.keys[i], kv_onnx), (mf.value_cache_name(i), c.values[i], kv_onnx)]
            if c.value_scales is not None:
                pairs.append((mf.value_scale_name(i), c.value_scales[i], "float16"))
            for name, buf, dtype in pairs:
                ov = self._ortvalue(buf, dtype)
                self.binding.bind_ortvalue_input(name, ov)
                self._cache_values.append(ov)
        # Single-token decode outputs, allocated once.
        kv = np.dtype(lay.kv_dtype.numpy_name)
        shape1 = (lay.kv_heads, 1, lay.head_dim)
        self._logits1 = np.empty((1, V), dtype=np.float32)
        self._k1 = [np.empty(shape1, dtype=kv) for _ in range(lay.layers)]
        self._v1 = [np.empty(shape1, dtype=kv) for _ in range(lay.layers)]
        self._s1 = [np.empty((lay.kv_heads, 1, 1), dtype=np.float16) for _ in range(lay.layers)] if lay.quantized else []
        self._out1 = [self._ortvalue(self._logits1, "float")]
        self._out1 += [self._ortvalue(a, kv_onnx) for a in (*self._k1, *self._v1)]
        self._out1 += [self._ortvalue(a, "float16") for a in self._s1]
        self._out_names = [mf.LOGITS, *self._new_keys, *self._new_values]
        if lay.quantized:
            self._out_names += [mf.new_value_scale_name(i) for i in range(lay.layers)]
        self._bound_single: bool | None = None

    def _bind_outputs(self, single: bool) -> None:
        # Multi-token outputs are rebound every step: a binding keeps the OrtValues ORT allocated
        # for the previous run, whose shapes differ when the chunk size changes.
        if single and self._bound_single:
            return
        if single:
            for name, ov in zip(self._out_names, self._out1):
                self.binding.bind_ortvalue_output(name, ov)
        else:
            for name in self._out_names:
                self.binding.bind_output(name, "cpu")
        self._bound_single = single

    def reset(self) -> None:
        self.cache.reset()

    def step(self, ids: np.ndarray, pin: bool = False) -> np.ndarray:
        """Run one chunk (1..chunk tokens) and commit its K/V. Returns logits (tokens, vocab)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        plan = self.cache.plan(len(ids), pin)
        b = self.binding
        b.bind_cpu_input(mf.INPUT_IDS, ids)
        b.bind_cpu_input(mf.POSITION_IDS, plan.position_ids)
        b.bind_cpu_input(mf.CACHE_POSITION_IDS, plan.cache_position_ids)
        b.bind_cpu_input(mf.ATTENTION_MASK, plan.attention_mask)
        single = len(ids) == 1
        self._bind_outputs(single)
        self.session.run_with_iobinding(b)
        L = self.layout.layers
        if single:
            logits, keys, values, scales = self._logits1, self._k1, self._v1, self._s1
        else:
            outs = [o.numpy() for o in b.get_outputs()]  # fp8 comes back as its uint8 bytes
            logits, keys, values, scales = outs[0], outs[1 : 1 + L], outs[1 + L : 1 + 2 * L], outs[1 + 2 * L :]
        with defer_sigint():
            self.cache.commit(plan, keys, values, scales or None)
        return logits

    def feed(self, ids, pin: bool = False, all_logits: bool = False) -> np.ndarray:
        """Feed any number of tokens in chunks. Returns the last token's logits (vocab,), or all (n, vocab)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("feed() needs at least one token")
        C = self.layout.chunk
        parts = []
        for start in range(0, len(ids), C):
            logits = self.step(ids[start : start + C], pin=pin)
            if all_logits:
                parts.append(logits.copy())
        if all_logits:
            return np.concatenate(parts, axis=0)
        return logits[-1].copy()
