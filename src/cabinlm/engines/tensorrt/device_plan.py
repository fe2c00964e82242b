"""Where the TensorRT backend's tensors live in device memory, and which copies a commit makes: pure
arithmetic over the cache layout and the graph contract (numpy and the standard library only),
unit-tested without CUDA. engines/tensorrt/backend.py allocates what this plans, once, at load.

Device memory of one dialogue (es = bytes per KV element, L layers, H KV heads, N slots, D head_dim,
C chunk, V vocab):

    keys    (L, H, N, D) kv dtype       key_cache.{l}   = keys   + l * H*N*D*es     the cache, on the device
    values  (L, H, N, D)                value_cache.{l} = values + l * H*N*D*es
    scales  (L, H, N, 1) float16        value_scale.{l}   (int8 / fp8 KV only)
    inputs  one block, each input at a 256-byte aligned offset, sized for C tokens:
            input_ids (C,) position_ids (C,) cache_position_ids (N,) attention_mask (C, N+C) f32
            logit_rows (C,) [image_embeds (C, E) f32, image_mask (C, 1) bool]
    logits  (C, V) float32
    new_k   L * H*C*D*es bytes: for a step of t tokens, new_key.{l} (H, t, D) lies at l * H*t*D*es,
    new_v   so that row (l, h) of every layer starts at (l*H + h) * t*D*es: one pitch for all
    new_s   L*H rows, and one cudaMemcpy2D per buffer moves a run of slots for every layer at once.

A host mirror of the inputs block (page-locked) is filled each step and copied up in one transfer.

Commit of n tokens (of the t that ran) into slots: split the slots into runs of consecutive slots
(the ring wraps at most once per chunk, so at most two runs unless the plan pins), then per run and
per buffer one 2D copy: height L*H rows, width count*D*es bytes,
    src = new + first_token*D*es, pitch t*D*es;   dst = cache + first_slot*D*es, pitch N*D*es.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cabinlm import io_spec as io
from cabinlm.io_spec import DecoderIO
from cabinlm.layout import CacheLayout

ALIGN = 256  # bytes: cudaMalloc's alignment, kept for every tensor inside a block
_DTYPES = {"float": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_,
           "int8": np.int8, "uint8": np.uint8, "float8e4m3fn": np.uint8}  # fmt: skip


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """One tensor inside a block: byte offset, numpy dtype, and its largest shape."""

    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


@dataclass(frozen=True)
class Copy2D:
    """cuMemcpy2D between two device buffers, offsets relative to their bases: `height` rows of
    `width` bytes, row r at src_offset + r*src_pitch and dst_offset + r*dst_pitch."""

    buffer: str  # "keys" | "values" | "scales": dst is that cache, src its new-token block
    dst_offset: int
    dst_pitch: int
    src_offset: int
    src_pitch: int
    width: int
    height: int


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(first_slot, first_token, count) for each run of consecutive slots, in token order."""
    runs: list[tuple[int, int, int]] = []
    for token, slot in enumerate(int(s) for s in slots):
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first_slot, first_token, count = runs[-1]
            runs[-1] = (first_slot, first_token, count + 1)
        else:
            runs.append((slot, token, 1))
    return runs


class DevicePlan:
    """The byte layout of one dialogue's device buffers for a cache layout and graph contract."""

    def __init__(self, layout: CacheLayout, contract: DecoderIO, vocab_size: int):
        self.layout, self.io, self.vocab = layout, contract, vocab_size
        L, H, N, D = layout.buffer_shape
        C = layout.chunk
        self.kv_dtype = np.dtype(_DTYPES[layout.kv_dtype.onnx_name])
        self.cache_shape = (L, H, N, D)  # keys, values
        self.scales_shape = (L, H, N, 1) if layout.quantized else None
        resolve = {"tokens": C, "total": N + C, "rows": C}
        self.inputs: dict[str, Slot] = {}
        offset = 0
        for t in contract.inputs:
            if t.name.startswith(("key_cache.", "value_cache.", "value_scale.")):
                continue
            shape = tuple(resolve[d] if isinstance(d, str) else d for d in t.shape)
            self.inputs[t.name] = Slot(t.name, offset, np.dtype(_DTYPES[t.dtype]), shape)
            offset = _align(offset + self.inputs[t.name].nbytes)
        self.inputs_bytes = offset
        self.logits_bytes = C * vocab_size * 4
        self.new_kv_bytes = L * H * C * D * self.kv_dtype.itemsize  # per block: new keys, new values
        self.new_scales_bytes = L * H * C * 2 if layout.quantized else 0

    # -- sizes ------------------------------------------------------------------------------------

    def cache_bytes(self) -> dict[str, int]:
        """The cache buffers by name (the names Backend.buffers() uses)."""
        L, H, N, D = self.cache_shape
        out = {"keys": L * H * N * D * self.kv_dtype.itemsize, "values": L * H * N * D * self.kv_dtype.itemsize}
        if self.scales_shape is not None:
            out["value_scales"] = L * H * N * 2
        return out

    def device_bytes(self) -> int:
        """Everything the backend allocates on the device per dialogue (the engine's own activation
        memory, per execution context, comes on top)."""
        return (sum(self.cache_bytes().values()) + self.inputs_bytes + self.logits_bytes + 2 * self.new_kv_bytes
                + self.new_scales_bytes)  # fmt: skip

    # -- bindings ---------------------------------------------------------------------------------

    def cache_addresses(self, keys: int, values: int, scales: int | None) -> dict[str, int]:
        """key_cache.{l}, value_cache.{l}, value_scale.{l}: per-layer views of the cache buffers."""
        L, H, N, D = self.cache_shape
        per_layer = H * N * D * self.kv_dtype.itemsize
        out = {}
        for layer in range(L):
            out[io.key_cache_name(layer)] = keys + layer * per_layer
            out[io.value_cache_name(layer)] = values + layer * per_layer
            if self.scales_shape is not None:
                if scales is None:
                    raise ValueError("int8 / fp8 KV needs the value-scale buffer")
                out[io.value_scale_name(layer)] = scales + layer * H * N * 2
        return out

    def input_addresses(self, inputs: int) -> dict[str, int]:
        return {name: inputs + s.offset for name, s in self.inputs.items()}

    def output_addresses(self, tokens: int, logits: int, new_keys: int, new_values: int,
                         new_scales: int | None) -> dict[str, int]:  # fmt: skip
        """Where a step of `tokens` tokens writes its outputs: per layer (H, tokens, D) packed at
        layer * H*tokens*D*es, so that every (layer, head) row has the pitch tokens*D*es."""
        L, H, _, D = self.cache_shape
        if not 1 <= tokens <= self.layout.chunk:
            raise ValueError(f"a step runs 1..{self.layout.chunk} tokens, got {tokens}")
        per_layer = H * tokens * D * self.kv_dtype.itemsize
        out = {io.LOGITS: logits}
        for layer in range(L):
            out[io.new_key_name(layer)] = new_keys + layer * per_layer
            out[io.new_value_name(layer)] = new_values + layer * per_layer
            if self.scales_shape is not None:
                if new_scales is None:
                    raise ValueError("int8 / fp8 KV needs the new value-scale buffer")
                out[io.new_value_scale_name(layer)] = new_scales + layer * H * tokens * 2
        return out

    # -- commit -----------------------------------------------------------------------------------

    def commit_copies(self, slots: np.ndarray, tokens: int) -> list[Copy2D]:
        """The 2D copies that write the first len(slots) of a step's `tokens` tokens into their slots."""
        L, H, N, D = self.cache_shape
        n = len(slots)
        if not 1 <= n <= tokens:
            raise ValueError(f"commit of {n} tokens from a step of {tokens}")
        if np.any(slots < 0) or np.any(slots >= N):
            raise ValueError(f"slots outside 0..{N - 1}")
        buffers = [("keys", D * self.kv_dtype.itemsize), ("values", D * self.kv_dtype.itemsize)]
        if self.scales_shape is not None:
            buffers.append(("scales", 2))
        out = []
        for first_slot, first_token, count in slot_runs(slots):
            for name, row in buffers:  # row: bytes of one token of one head
                out.append(Copy2D(name, first_slot * row, N * row, first_token * row, tokens * row, count * row, L * H))
        return out


def apply_copy(dst: np.ndarray, src: np.ndarray, c: Copy2D) -> None:
    """Carry out a Copy2D on host byte arrays (uint8): what cuMemcpy2D does on the device. Tests and
    the documentation of the layout use it; the backend never does."""
    for r in range(c.height):
        d, s = c.dst_offset + r * c.dst_pitch, c.src_offset + r * c.src_pitch
        dst[d : d + c.width] = src[s : s + c.width]
