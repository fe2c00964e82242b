"""Cache geometry: one object owns sink, pinned, image, recall, window, chunk, heads, head_dim and KV dtype,
and derives the slot map and every byte count from them. Standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cabinlm.contract.errors import LayoutError
from cabinlm.contract.precision import KVDType  # also re-exported: contract/manifest.py and the runtime import it from here


MAX_DIM = 1 << 24  # any one dimension of the cache (slots, layers, heads, head_dim)
MAX_CACHE_BYTES = 1 << 40
RECALL_MULTIPLE = 16  # the recall region's size is a multiple of this (CacheLayout._check_recall)


@dataclass(frozen=True)
class CacheLayout:
    """Geometry of the fixed-size KV cache.

    Slot map of one layer's (kv_heads, slots, head_dim) buffer, slots = S + P + I + R + W:

        | sink: S | pinned: P | image: I  | recall: R     | window ring: W |
          first S   spans the   the current   text recalled   the most recent W
          tokens    runtime     camera        from the        unpinned tokens,
          of the    pins        frame (VLMs;  dialogue's      oldest overwritten
          stream    (system)    replaced by   past, replaced  first
                                the next)     whole per turn

    A chunk of up to C tokens attends to every cached token and to itself causally, then joins the
    cache. Positions are ranks in stream order, so the largest position ever used is S + P + I + R + W + C - 1.
    The recall region (docs/design.md, "The recall region") ranks after the sink, the pinned spans and
    the frame, and before the window; its chunk attends to everything but the window (and so, in a
    layout with a region, does a frame's, which then ranks before the window too).

    Per-layer geometry (docs/design.md, "Layers with their own sliding window"). A layer listed in
    `local_layers` is one whose model attends only within a sliding window of `local_window` = w
    tokens, itself included (Gemma 3's local layers). Such a layer caches no sinks, pinned spans or
    frame: it keeps a ring of w slots holding the stream's last w tokens, whatever region the global
    layers put them in; a query sees those within w of itself (all but the oldest, for the next token):
    exactly what the model lets it see (w, not w - 1: a chunk of up to w tokens then fits the ring).
    Its positions are its own ranks in stream order (the ring holds a contiguous run of
    the stream, so rank differences are the model's position differences). The other layers
    ("global") use the slot map above. Buffers are per kind of layer:

        global  (layers - len(local_layers), kv_heads, slots, head_dim)
        local   (len(local_layers), kv_heads, local_slots, head_dim)
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
    local_window: int = 0  # w: a local layer's query sees its last w tokens, itself included (0: no local layers)
    local_layers: tuple[int, ...] = ()  # the layers with their own sliding window, ascending
    recall: int = 0  # R: slots of the recall region (0: none; an artifact made before it existed)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", KVDType(self.kv_dtype))
        if isinstance(self.local_layers, list):  # from JSON
            object.__setattr__(self, "local_layers", tuple(self.local_layers))
        for name in ("sink", "pinned", "image", "recall", "window", "chunk", "layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value > MAX_DIM:
                raise LayoutError(f"{name} must be a whole number up to {MAX_DIM}, got {value!r}")
        for name in ("sink", "pinned", "image", "recall"):
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
        self._check_local()
        self._check_recall()
        if self.cache_bytes > MAX_CACHE_BYTES:
            raise LayoutError(f"a cache of {self.cache_bytes / 2**30:.0f} GiB is beyond any device cabinlm targets; "
                              "lower --window")  # fmt: skip

    def _check_local(self) -> None:
        local, w = self.local_layers, self.local_window
        if not isinstance(local, tuple) or any(type(i) is not int for i in local):
            raise LayoutError(f"local_layers must be a list of layer indices, got {local!r}")
        if type(w) is not int or w < 0 or w > MAX_DIM:
            raise LayoutError(f"local_window must be a whole number up to {MAX_DIM}, got {w!r}")
        if list(local) != sorted(set(local)) or any(not 0 <= i < self.layers for i in local):
            raise LayoutError(f"local_layers must be distinct ascending layer indices below {self.layers}, got {list(local)}")
        if bool(local) != bool(w):
            raise LayoutError("local_window and local_layers go together: both set (a model with sliding-window "
                              "layers) or neither")  # fmt: skip
        if local and len(local) == self.layers:
            raise LayoutError("every layer is local: cabinlm needs at least one layer with the sink + window layout")
        if local and w < self.chunk:
            # the ring must hold a whole chunk, as the window must (no token of a chunk overwrites another)
            raise LayoutError(f"--chunk {self.chunk} is longer than the model's sliding window {w}, which its local "
                              f"layers' rings hold; lower --chunk to at most {w}")  # fmt: skip

    def _check_recall(self) -> None:
        """The recall region's tokens never pass through a local layer's ring (a ring holds the stream's
        last w tokens, and the region is not part of that run): that combination is refused. A camera
        frame goes with a region: both rank before the window, the frame first (contract/slots.py)."""
        if not self.recall:
            return
        if self.recall % RECALL_MULTIPLE:
            # an empty region then shifts the window's slots by whole 16-lane blocks: every sum over the
            # slots runs in the order an artifact without a region runs it (--no-recall bit for bit)
            raise LayoutError(f"--recall {self.recall} must be a multiple of {RECALL_MULTIPLE}; give --recall "
                              f"{-(-self.recall // RECALL_MULTIPLE) * RECALL_MULTIPLE}")  # fmt: skip
        if self.local_layers:
            raise LayoutError("--recall: a model with sliding-window (local) layers takes no recall region yet; "
                              "export it with --recall 0")  # fmt: skip
        if self.sink < 1:
            raise LayoutError("--recall needs at least one sink token (--sink 1 or more): the region is fed "
                              "after the sink is full")  # fmt: skip

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers with the sink + pinned + image + window slot map (all of them without local layers)."""
        local = set(self.local_layers)
        return tuple(i for i in range(self.layers) if i not in local)

    @property
    def local_slots(self) -> int:
        """Slots of a local layer's ring: w (0 without local layers)."""
        return self.local_window

    def buffer_index(self, layer: int) -> tuple[bool, int]:
        """(is local, index in its kind's buffer) of a layer."""
        if layer in self.local_layers:
            return True, self.local_layers.index(layer)
        return False, self.global_layers.index(layer)

    def layer_slots(self, layer: int) -> int:
        """Cache slots of one layer: the ring of a local layer, the slot map of any other."""
        return self.local_slots if layer in self.local_layers else self.slots

    @property
    def slots(self) -> int:
        """Cache slots per layer and KV head: sink + pinned + image + recall + window."""
        return self.sink + self.pinned + self.image + self.recall + self.window

    @property
    def max_position(self) -> int:
        """Exclusive upper bound of every RoPE position the graph will ever see."""
        return self.slots + self.chunk

    @property
    def image_start(self) -> int:
        return self.sink + self.pinned

    @property
    def recall_start(self) -> int:
        return self.sink + self.pinned + self.image

    @property
    def window_start(self) -> int:
        return self.sink + self.pinned + self.image + self.recall

    @property
    def quantized(self) -> bool:
        return self.kv_dtype.quantized

    @property
    def layer_bytes_per_token(self) -> int:
        """Bytes one cached token occupies in one layer: K and V data, plus for quantized values one
        fp16 value scale per KV head. Keys use per-channel scales calibrated at export: constants of
        the graph, not per token."""
        return 2 * self.kv_heads * self.head_dim * self.kv_dtype.itemsize + (self.kv_heads * 2 if self.quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of the slot map occupies over the global layers (all layers without local ones)."""
        return len(self.global_layers) * self.layer_bytes_per_token

    @property
    def local_ring_bytes(self) -> int:
        """The local layers' rings (0 without local layers): a constant, whatever the window."""
        return len(self.local_layers) * self.local_slots * self.layer_bytes_per_token

    @property
    def key_scale_bytes(self) -> int:
        """Per-channel key scales (float32), held once by the graph (0 for unquantized KV)."""
        return self.layers * self.kv_heads * self.head_dim * 4 if self.quantized else 0

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        """The global layers' buffer: (global layers, kv_heads, slots, head_dim)."""
        return (len(self.global_layers), self.kv_heads, self.slots, self.head_dim)

    @property
    def local_buffer_shape(self) -> tuple[int, int, int, int]:
        """The local layers' rings: (local layers, kv_heads, local_slots, head_dim)."""
        return (len(self.local_layers), self.kv_heads, self.local_slots, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Runtime cache buffers: every slot's K, V and per-token scales, the local rings included."""
        return self.bytes_per_token * self.slots + self.local_ring_bytes

    def uniform(self) -> CacheLayout:
        """The same cache with every layer on the slot map (what the cache would be without per-layer geometry)."""
        return dataclasses.replace(self, local_window=0, local_layers=())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kv_dtype"] = self.kv_dtype.value
        d["local_layers"] = list(self.local_layers)
        return d
