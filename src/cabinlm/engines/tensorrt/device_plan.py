"""Where the TensorRT backend's tensors live in device memory, and which copies a commit makes: pure
arithmetic over the cache layout and the graph contract (numpy and the standard library only),
unit-tested without CUDA. engines/tensorrt/backend.py allocates what this plans, once, at load.

Device memory of one dialogue (es = bytes per KV element, L layers of which G global (the slot map)
and Q local (CacheLayout.local_layers, R = CacheLayout.local_slots slots each: a ring of w, then a recall
region's; Q = 0 without them), H KV heads, N slots, D head_dim, C chunk, V vocab; layer l is the j-th of
its kind, j = layout.buffer_index(l)):

    keys          (G, H, N, D) kv dtype   key_cache.{l}   = keys + j * H*N*D*es        global layer l
    values        (G, H, N, D)            value_cache.{l} = values + j * H*N*D*es
    value_scales  (G, H, N, 1) float16    value_scale.{l} = value_scales + j * H*N*2   (int8 / fp8 KV only)
    local_keys    (Q, H, R, D) kv dtype   key_cache.{l}   = local_keys + j * H*R*D*es  local layer l
    local_values  (Q, H, R, D)            value_cache.{l} = local_values + j * H*R*D*es
    local_value_scales (Q, H, R, 1) f16   value_scale.{l} = local_value_scales + j * H*R*2
                  (the names and order of the ONNX Runtime backend's buffers: session files hold the same)
    inputs  one block, each input at a 256-byte aligned offset, sized for C tokens:
            input_ids (C,) position_ids (C,) cache_position_ids (N,) attention_mask (C, N+C) f32
            logit_rows (C,) [local_position_ids (C,) local_cache_position_ids (R,)
            local_attention_mask (C, R+C) f32] [image_embeds (C, E) f32, image_mask (C, 1) bool]
    logits  (C, V) float32
    new_k   L * H*C*D*es bytes, packed by kind, global layers first: for a step of t tokens,
    new_v   new_key.{l} (H, t, D) lies at b * H*t*D*es with b = j (global) or G + j (local), so
    new_s   that row (b, h) starts at (b*H + h) * t*D*es: the global layers' G*H rows, then the
            local layers' Q*H rows, each kind consecutive with the one pitch t*D*es (scales: t*2).
            (Packed by layer index instead, Gemma 3's local-global-local would interleave the
            kinds and a commit would need a copy per layer.)

A host mirror of the inputs block (page-locked) is filled each step and copied up in one transfer.

Commit of n tokens (of the t that ran): the global slots (plan.slots) and the local ones (plan.local_slots:
(local_seen + i) mod w in the ring, or a recalled chunk's places in the region after it) each split into runs
of consecutive slots (a ring wraps at most once per chunk, so at most two runs per kind unless the plan pins),
then per run and per buffer one 2D copy, row = one token of one head (D*es bytes; scales 2):

    kind    height   dst                                          src (new block)
    global  G*H      cache + first_slot*row, pitch N*row          new + first_token*row, pitch t*row
    local   Q*H      local cache + first_slot*row, pitch R*row    new + G*H*t*row + first_token*row, pitch t*row

width count*row. A decode step: 2 copies per kind (keys, values), 3 with value scales.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cabinlm.contract import io_spec as io
from cabinlm.engines.tensorrt.api import resolve_dims
from cabinlm.contract.io_spec import DecoderIO
from cabinlm.contract.layout import CacheLayout

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

    cache: str  # dst: a cache buffer, by its name in DevicePlan.cache_bytes() ("keys", "local_values", ...)
    block: str  # src: the new-token block "keys" | "values" | "scales"
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
        G, H, N, D = layout.buffer_shape
        C = layout.chunk
        self.kv_dtype = np.dtype(_DTYPES[layout.kv_dtype.onnx_name])
        self.cache_shape = (G, H, N, D)  # keys, values: the global layers
        self.scales_shape = (G, H, N, 1) if layout.quantized else None
        # local_keys, local_values: the local layers' rings (None without local layers)
        self.local_shape = layout.local_buffer_shape if layout.local_layers else None
        self.inputs: dict[str, Slot] = {}
        offset = 0
        for t in contract.inputs:
            if t.name.startswith(("key_cache.", "value_cache.", "value_scale.")):
                continue
            shape = resolve_dims(t.shape, C, C, layout)  # "local_total": R + C
            self.inputs[t.name] = Slot(t.name, offset, np.dtype(_DTYPES[t.dtype]), shape)
            offset = _align(offset + self.inputs[t.name].nbytes)
        self.inputs_bytes = offset
        self.logits_bytes = C * vocab_size * 4
        L = layout.layers
        self.new_kv_bytes = L * H * C * D * self.kv_dtype.itemsize  # per block: new keys, new values
        self.new_scales_bytes = L * H * C * 2 if layout.quantized else 0

    # -- sizes ------------------------------------------------------------------------------------

    def cache_buffers(self) -> dict[str, tuple[np.dtype, tuple[int, int, int, int]]]:
        """The cache buffers by name (the names and order of Backend.buffers(), as the ONNX Runtime
        backend's): dtype and shape."""
        f16 = np.dtype(np.float16)
        kinds = [("", self.cache_shape)] + ([("local_", self.local_shape)] if self.local_shape is not None else [])
        out: dict[str, tuple[np.dtype, tuple[int, int, int, int]]] = {}
        for prefix, (n, h, slots, d) in kinds:
            out[f"{prefix}keys"] = (self.kv_dtype, (n, h, slots, d))
            out[f"{prefix}values"] = (self.kv_dtype, (n, h, slots, d))
            if self.layout.quantized:
                out[f"{prefix}value_scales"] = (f16, (n, h, slots, 1))
        return out

    def cache_bytes(self) -> dict[str, int]:
        """The cache buffers' sizes by name (cache_buffers)."""
        return {name: int(np.prod(shape)) * dtype.itemsize for name, (dtype, shape) in self.cache_buffers().items()}

    def device_bytes(self) -> int:
        """Everything the backend allocates on the device per dialogue (the engine's own activation
        memory, per execution context, comes on top)."""
        return (sum(self.cache_bytes().values()) + self.inputs_bytes + self.logits_bytes + 2 * self.new_kv_bytes
                + self.new_scales_bytes)  # fmt: skip

    # -- bindings ---------------------------------------------------------------------------------

    def cache_addresses(self, bases: Mapping[str, int]) -> dict[str, int]:
        """key_cache.{l}, value_cache.{l}, value_scale.{l}: per-layer views of the cache buffers whose
        device addresses `bases` gives by name (cache_buffers): a global layer's into keys / values /
        value_scales, a local layer's into local_keys / local_values / local_value_scales."""
        buffers = self.cache_buffers()
        missing = sorted(set(buffers) - set(bases))
        if missing:
            raise ValueError(f"no device address for the cache buffers {', '.join(missing)}")
        out = {}
        for layer in range(self.layout.layers):
            local, j = self.layout.buffer_index(layer)
            prefix = "local_" if local else ""
            for name, buffer in ((io.key_cache_name(layer), "keys"), (io.value_cache_name(layer), "values"),
                                 (io.value_scale_name(layer), "value_scales")):  # fmt: skip
                if f"{prefix}{buffer}" not in buffers:
                    continue  # value scales: int8 / fp8 KV only
                dtype, (_, h, slots, d) = buffers[f"{prefix}{buffer}"]
                out[name] = bases[f"{prefix}{buffer}"] + j * h * slots * d * dtype.itemsize
        return out

    def input_addresses(self, inputs: int) -> dict[str, int]:
        return {name: inputs + s.offset for name, s in self.inputs.items()}

    def block_index(self, layer: int) -> int:
        """A layer's place in the new-token blocks: the global layers first, then the local ones."""
        local, j = self.layout.buffer_index(layer)
        return self.cache_shape[0] + j if local else j

    def output_addresses(self, tokens: int, logits: int, new_keys: int, new_values: int,
                         new_scales: int | None) -> dict[str, int]:  # fmt: skip
        """Where a step of `tokens` tokens writes its outputs: per layer (H, tokens, D) packed at
        block_index(layer) * H*tokens*D*es, so that the rows (layer, head) of each kind of layer
        follow one another with the one pitch tokens*D*es (module docstring)."""
        _, H, _, D = self.cache_shape
        if not 1 <= tokens <= self.layout.chunk:
            raise ValueError(f"a step runs 1..{self.layout.chunk} tokens, got {tokens}")
        per_layer = H * tokens * D * self.kv_dtype.itemsize
        out = {io.LOGITS: logits}
        for layer in range(self.layout.layers):
            b = self.block_index(layer)
            out[io.new_key_name(layer)] = new_keys + b * per_layer
            out[io.new_value_name(layer)] = new_values + b * per_layer
            if self.scales_shape is not None:
                if new_scales is None:
                    raise ValueError("int8 / fp8 KV needs the new value-scale buffer")
                out[io.new_value_scale_name(layer)] = new_scales + b * H * tokens * 2
        return out

    def unaligned_bindings(self, tokens: int) -> list[str]:
        """The tensors of a step of `tokens` tokens whose bound address is not on ALIGN bytes, given
        ALIGN-aligned allocations. TensorRT's header asks for 256-byte aligned tensor addresses; the
        per-layer views and the packed output blocks start wherever the arithmetic of the module
        docstring puts them (a layer's view is aligned when H*N*D*es, H*N*2, H*R*D*es, H*R*2 and, for
        the outputs, H*tokens*D*es and H*tokens*2 are multiples of ALIGN). Whether TensorRT takes the
        others was never tried (docs/tensorrt.md)."""
        bases = {name: 0 for name in self.cache_buffers()}
        out = {**self.cache_addresses(bases), **self.output_addresses(tokens, 0, 0, 0, 0 if self.scales_shape else None)}
        return [name for name, address in out.items() if address % ALIGN]

    # -- commit -----------------------------------------------------------------------------------

    def commit_copies(self, slots: np.ndarray, tokens: int, local_slots: np.ndarray | None = None) -> list[Copy2D]:
        """The 2D copies that write the first len(slots) of a step's `tokens` tokens into their slots:
        `slots` in the global layers' slot map, `local_slots` (StepPlan.local_slots, as many) in the
        local layers' rings (given exactly when the layout has local layers)."""
        G, H, N, D = self.cache_shape
        n = len(slots)
        if not 1 <= n <= tokens:
            raise ValueError(f"commit of {n} tokens from a step of {tokens}")
        kinds = [("", slots, N, 0, G)]
        if self.local_shape is not None:
            if local_slots is None or len(local_slots) != n:
                raise ValueError(f"a layout with local layers commits {n} ring slots too, got "
                                 f"{None if local_slots is None else len(local_slots)}")  # fmt: skip
            Q, _, R, _ = self.local_shape
            kinds.append(("local_", local_slots, R, G, Q))
        elif local_slots is not None:
            raise ValueError("ring slots given for a layout without local layers")
        blocks = [("keys", "keys", D * self.kv_dtype.itemsize), ("values", "values", D * self.kv_dtype.itemsize)]
        if self.scales_shape is not None:
            blocks.append(("value_scales", "scales", 2))
        out = []
        for prefix, where, size, first_layer, layers in kinds:
            if np.any(where < 0) or np.any(where >= size):
                raise ValueError(f"{prefix}slots outside 0..{size - 1}")
            for first_slot, first_token, count in slot_runs(where):
                for cache, block, row in blocks:  # row: bytes of one token of one head
                    src = first_layer * H * tokens * row + first_token * row  # the kind's first row (block_index)
                    out.append(Copy2D(f"{prefix}{cache}", block, first_slot * row, size * row, src, tokens * row,
                                      count * row, layers * H))  # fmt: skip
        return out


def apply_copy(dst: np.ndarray, src: np.ndarray, c: Copy2D) -> None:
    """Carry out a Copy2D on host byte arrays (uint8): what cuMemcpy2D does on the device. Tests and
    the documentation of the layout use it; the backend never does."""
    for r in range(c.height):
        d, s = c.dst_offset + r * c.dst_pitch, c.src_offset + r * c.src_pitch
        dst[d : d + c.width] = src[s : s + c.width]
