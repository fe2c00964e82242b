"""Fixed KV-cache buffers and the sink / pinned / rolling-window bookkeeping, in numpy.

Every backend shares this: the graph is a pure function of (cache, chunk, positions, mask) that
returns the chunk's K/V; this class decides where those K/V go and what every slot's position is.

Invariants (tested property-wise in tests/test_cache.py):
  * the buffers are allocated once; `commit` writes in place and never reallocates;
  * sink slots hold the first S tokens of the stream and are never overwritten;
  * pinned slots hold the pinned spans and are never overwritten by unpinned tokens;
  * the window ring holds exactly the most recent min(W, unpinned seen) unpinned tokens;
  * positions are ranks in stream order: cached tokens 0..L-1, the chunk L..L+c-1.
"""

from __future__ import annotations

import functools

import numpy as np

from cabinlm.errors import InputError
from cabinlm.manifest import CacheLayout

MASK_VALUE = np.float32(-1e30)  # additive mask for slots a token must not see


class StepPlan:
    """Everything one graph call needs besides the token ids, and where its K/V go afterwards.

    The cached slots' positions and the mask are worked out on first use (a fused decode step needs
    neither most of the time), from the slot table as it stood when the plan was made."""

    def __init__(self, position_ids: np.ndarray, slots: np.ndarray, evicts: int, pin: bool | str, slot_token: np.ndarray):
        self.position_ids = position_ids  # (tokens,) int64
        self.slots = slots  # (tokens,) int64: destination slot of each chunk token
        self.evicts = evicts  # how many cached window tokens this chunk overwrites
        self.pin = pin  # False: window; True: pinned region; "image": the camera-frame region
        self._slot_token = slot_token  # a copy: the cache moves on after commit

    @functools.cached_property
    def cache_position_ids(self) -> np.ndarray:
        """(slots,) int64: each cached slot's rank in stream order (0 for empty slots). Stream indices
        are unique and increasing, so a slot's rank is the number of cached tokens older than it."""
        st = self._slot_token
        valid = st >= 0
        cached = int(valid.sum())
        cache_pos = np.zeros(len(st), dtype=np.int64)
        order = np.argsort(np.where(valid, st, np.iinfo(np.int64).max), kind="stable")
        cache_pos[order[:cached]] = np.arange(cached)
        return cache_pos

    @functools.cached_property
    def attention_mask(self) -> np.ndarray:
        """(tokens, slots + tokens) float32, additive: every cached slot, then the chunk causally."""
        n, N = len(self.slots), len(self._slot_token)
        mask = np.empty((n, N + n), dtype=np.float32)
        mask[:, :N] = np.where(self._slot_token >= 0, np.float32(0), MASK_VALUE)
        mask[:, N:] = np.where(np.tri(n, dtype=bool), np.float32(0), MASK_VALUE)
        return mask


class KVCache:
    """Owns the (layers, kv_heads, slots, head_dim) key and value buffers of one dialogue."""

    def __init__(self, layout: CacheLayout, scratch: int = 0, value_scales: bool = True, key_source: bool = False):
        """scratch: extra rows after the slots where a fused kernel writes the chunk's K/V before
        commit() moves them into their slots (fused cpu builds: the chunk size; else 0).
        value_scales: per-token value scales (the exported graph's int8 / fp8 KV; a fused build's
        scales are static). key_source: an un-rotated float32 copy of the sink and pinned tokens'
        keys, for caches that hold keys rotated (runtime/rotated.py)."""
        self.layout = layout
        self.scratch = scratch
        dtype = np.dtype(layout.kv_dtype.numpy_name)
        L, H, N, D = layout.buffer_shape
        # (layers, kv_heads, slots + scratch, head_dim); allocated once, written in place by commit().
        self.keys = np.zeros((L, H, N + scratch, D), dtype=dtype)
        self.values = np.zeros((L, H, N + scratch, D), dtype=dtype)
        # (layers, kv_heads, slots, 1) fp16 per-token value scales, for int8 / fp8 KV only.
        self.value_scales = (
            np.zeros(layout.buffer_shape[:3] + (1,), dtype=np.float16) if layout.quantized and value_scales else None
        )
        self.key_source = np.zeros((L, H, layout.sink + layout.pinned, D), dtype=np.float32) if key_source else None
        # (slots,) stream index of the token held by each slot, -1 while empty.
        self.slot_token = np.full(layout.slots, -1, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Forget every token (the buffers keep their memory; empty slots are masked)."""
        self.slot_token.fill(-1)
        self.seen = 0  # tokens fed so far (the next token's stream index)
        self.evicted = 0  # window tokens overwritten so far
        self.sink_fill = 0
        self.pinned_fill = 0
        self.image_fill = 0
        self.frames = 0  # camera frames started (each replaces the previous one)
        self.window_fill = 0
        self.ring_next = 0  # index inside the window ring of the next slot to write (= the oldest)

    # -- state -------------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Tokens currently cached."""
        return self.sink_fill + self.pinned_fill + self.image_fill + self.window_fill

    @property
    def pinned_free(self) -> int:
        return self.layout.pinned - self.pinned_fill

    def begin_frame(self) -> None:
        """A new camera frame replaces the current one: its slots are emptied (masked) and the new
        frame's tokens, fed with pin="image", are written into them."""
        lay = self.layout
        self.slot_token[lay.image_start : lay.window_start] = -1
        self.image_fill = 0
        self.frames += 1

    def cached_stream_indices(self) -> np.ndarray:
        """Stream indices of the cached tokens, in stream order."""
        idx = self.slot_token[self.slot_token >= 0]
        return np.sort(idx)

    # -- one step ----------------------------------------------------------------------------------

    def plan(self, n: int, pin: bool | str = False) -> StepPlan:
        """Positions, mask and destination slots for the next chunk of n tokens (nothing changes yet)."""
        lay = self.layout
        if not 1 <= n <= lay.chunk:
            raise InputError(f"a chunk holds 1..{lay.chunk} tokens, got {n}")
        if n == 1 and not pin and self.sink_fill == lay.sink:  # a decode step's window token
            cached = self.length
            slots = np.array([lay.window_start + self.ring_next], dtype=np.int64)
            evicts = 1 if self.window_fill == lay.window else 0
            return StepPlan(np.array([cached], dtype=np.int64), slots, evicts, pin, self.slot_token.copy())
        sink_take = min(n, lay.sink - self.sink_fill)
        rest = n - sink_take
        slots = np.empty(n, dtype=np.int64)
        slots[:sink_take] = np.arange(self.sink_fill, self.sink_fill + sink_take)
        evicts = 0
        if pin == "image":
            if rest > lay.image - self.image_fill:
                raise InputError(
                    f"the image region has {lay.image - self.image_fill} free slots of {lay.image}; a frame's "
                    f"{rest} more tokens do not fit (call begin_frame() before each frame)"
                )
            start = lay.image_start + self.image_fill
            slots[sink_take:] = np.arange(start, start + rest)
        elif pin:
            if rest > self.pinned_free:
                raise InputError(
                    f"the pinned region has {self.pinned_free} free slots of {lay.pinned}; "
                    f"{rest} more tokens cannot be pinned (re-export with a larger --pinned)"
                )
            start = lay.sink + self.pinned_fill
            slots[sink_take:] = np.arange(start, start + rest)
        else:
            ring = (self.ring_next + np.arange(rest)) % lay.window
            slots[sink_take:] = lay.window_start + ring
            evicts = max(0, self.window_fill + rest - lay.window)

        cached = self.length
        position_ids = np.arange(cached, cached + n, dtype=np.int64)
        return StepPlan(position_ids, slots, evicts, pin, self.slot_token.copy())

    def commit(
        self,
        plan: StepPlan,
        new_keys: list[np.ndarray],
        new_values: list[np.ndarray],
        new_value_scales: list[np.ndarray] | None = None,
    ) -> None:
        """Write the chunk's K/V (per layer: (kv_heads, tokens, head_dim)) and, for quantized KV, the
        value scales (per layer: (kv_heads, tokens, 1)) into their slots, in place.

        The caller must not interrupt this half-way (see runtime.session: SIGINT is deferred).
        """
        slots = plan.slots
        n = len(slots)
        lo, hi = int(slots[0]), int(slots[-1]) + 1
        # The usual case is a contiguous run of slots (no wrap of the ring inside this chunk).
        where = (slice(None), slice(lo, hi)) if hi - lo == n else (slice(None), slots)
        targets = [(self.keys, new_keys), (self.values, new_values)]
        if self.value_scales is not None:
            if new_value_scales is None:
                raise ValueError("a quantized cache needs the chunk's value scales")
            targets.append((self.value_scales, new_value_scales))
        for buf, news in targets:
            for layer, x in enumerate(news):
                buf[layer][where] = x
        self._advance(plan)

    def _advance(self, plan: StepPlan) -> None:
        lay = self.layout
        n = len(plan.slots)
        self.slot_token[plan.slots] = np.arange(self.seen, self.seen + n)
        self.seen += n
        sink_take = min(n, lay.sink - self.sink_fill)
        self.sink_fill += sink_take
        rest = n - sink_take
        if plan.pin == "image":
            self.image_fill += rest
        elif plan.pin:
            self.pinned_fill += rest
        else:
            self.ring_next = (self.ring_next + rest) % lay.window
            self.window_fill = min(lay.window, self.window_fill + rest)
            self.evicted += plan.evicts

    def nbytes(self) -> int:
        """Bytes held by the cache buffers, read from the arrays themselves."""
        scales = 0 if self.value_scales is None else self.value_scales.nbytes
        source = 0 if self.key_source is None else self.key_source.nbytes
        return int(self.keys.nbytes + self.values.nbytes + scales + source)

    @property
    def extent(self) -> int:
        """1 + the highest slot in use (0 when empty): every slot from here on is empty. The ring
        fills its slots in order, so this is the slot count once the window has turned over."""
        lay = self.layout
        if self.window_fill:
            return lay.slots if self.window_fill == lay.window else lay.window_start + self.window_fill
        if self.image_fill:
            return lay.image_start + self.image_fill
        if self.pinned_fill:
            return lay.sink + self.pinned_fill
        return self.sink_fill

    def commit_rows(self, plan: StepPlan, start: int) -> None:
        """A fused kernel wrote the chunk's K/V into rows start.. (empty slots, or the scratch rows
        after the last slot): move them into their slots (often the same rows: then nothing moves)."""
        slots = plan.slots
        n = len(slots)
        lo, hi = int(slots[0]), int(slots[-1]) + 1
        if n == 1:  # a decode step: one row per layer and head
            if lo != start:
                self.keys[:, :, lo] = self.keys[:, :, start]
                self.values[:, :, lo] = self.values[:, :, start]
        elif not (lo == start and hi - lo == n):
            where = slice(lo, hi) if hi - lo == n else slots
            for buf in (self.keys, self.values):
                # through a small copy: the rows never overlap, but numpy would prove it the slow way
                buf[:, :, where] = buf[:, :, start : start + n].copy()
        self._advance(plan)
