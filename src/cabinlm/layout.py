"""Cache geometry: one object owns sink, pinned, image, window, chunk, heads, head_dim and KV dtype,
and derives the slot map and every byte count from them. Standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cabinlm.errors import LayoutError
from cabinlm.precision import KVDType  # also re-exported: manifest.py and the runtime import it from here


MAX_DIM = 1 << 24  # any one dimension of the cache (slots, layers, heads, head_dim)
MAX_CACHE_BYTES = 1 << 40


@dataclass(frozen=True)
class CacheLayout:
    """Geometry of the fixed-size KV cache.

    Slot map of one layer's (kv_heads, slots, head_dim) buffer, slots = S + P + I + W:

        | sink: S | pinned: P | image: I  | window ring: W |
          first S   spans the   the current   the most recent W
          tokens    runtime     camera        unpinned tokens,
          of the    pins        frame (VLMs;  oldest overwritten
          stream    (system)    replaced by   first
                                the next)

    A chunk of up to C tokens attends to every cached token and to itself causally, then joins the
    cache. Positions are ranks in stream order, so the largest position ever used is S + P + W + C - 1.
    """

    sink: int
    pinned: int
    window: int
    chunk: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: KVDType = KVDType.FP32
    image: int = 0  # slots of one camera frame's tokens (0: a text-only model)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", KVDType(self.kv_dtype))
        for name in ("sink", "pinned", "image", "window", "chunk", "layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value > MAX_DIM:
                raise LayoutError(f"{name} must be a whole number up to {MAX_DIM}, got {value!r}")
        for name in ("sink", "pinned", "image"):
            if getattr(self, name) < 0:
                raise LayoutError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "chunk", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk > self.window:
            # A chunk joins the ring after it has been processed; the ring must hold a whole chunk
            # so that no token of a chunk overwrites another token of the same chunk.
            raise LayoutError(
                f"--chunk {self.chunk} is larger than --window {self.window}: a prefill chunk must fit in "
                "the window; lower --chunk or raise --window"
            )
        if self.cache_bytes > MAX_CACHE_BYTES:
            raise LayoutError(f"a cache of {self.cache_bytes / 2**30:.0f} GiB is beyond any device cabinlm targets; "
                              "lower --window")  # fmt: skip

    @property
    def slots(self) -> int:
        """Cache slots per layer and KV head: sink + pinned + image + window."""
        return self.sink + self.pinned + self.image + self.window

    @property
    def max_position(self) -> int:
        """Exclusive upper bound of every RoPE position the graph will ever see."""
        return self.slots + self.chunk

    @property
    def image_start(self) -> int:
        return self.sink + self.pinned

    @property
    def window_start(self) -> int:
        return self.sink + self.pinned + self.image

    @property
    def quantized(self) -> bool:
        return self.kv_dtype.quantized

    @property
    def scale_bytes_per_token(self) -> int:
        """Per-token scale bytes: quantized values carry one fp16 scale per (layer, KV head, token).
        Keys use per-channel scales calibrated at export: constants of the graph, not per token."""
        return self.layers * self.kv_heads * 2 if self.quantized else 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies over all layers: K and V data plus their per-token scales."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize + self.scale_bytes_per_token

    @property
    def key_scale_bytes(self) -> int:
        """Per-channel key scales (float32), held once by the graph (0 for unquantized KV)."""
        return self.layers * self.kv_heads * self.head_dim * 4 if self.quantized else 0

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        # (layers, kv_heads, slots, head_dim)
        return (self.layers, self.kv_heads, self.slots, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Runtime cache buffers: every slot's K, V and per-token scales."""
        return self.bytes_per_token * self.slots

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kv_dtype"] = self.kv_dtype.value
        return d
