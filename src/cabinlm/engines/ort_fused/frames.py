"""Camera frames on the fused decoder's rotated cache (engines/ort_fused/backend.py; docs/vlm.md,
"Camera frames on the fused decoder"). fp32 KV only (graph.ineligible): the turns below rotate keys
already in the cache, which for int8 KV would rotate quantized keys.

The cache holds keys rotated at their positions + E (engines/onnxruntime/rotated.py). The frame's own keys are
re-written from their un-rotated copy before each step, as the pinned ones are (RotatedKeys.refresh).
What moves the window keys is a new frame (SlotTable.begin_frame): it takes the old frame's tokens in
the image region out of the cache with no eviction, so E stays while, in a layout without a recall
region,

  * ranks of one component (LLaVA-style, Idefics3): every window token fed after the old frame drops
    I ranks (I: the old frame's tokens in the image region); the tokens before it keep theirs;
  * multimodal RoPE (Qwen2-VL): the three positions of the window tokens after the old frame move by
    what both frames' grids make of them (the old frame's I tokens and its I - max(rows, cols) offset
    leave). Each window slot's positions + E as its key was rotated (`baked`) are compared with the
    rule's, and the keys that moved are turned by the difference, pair j by its component's.

In a layout with a recall region the frame ranks before the window, and O = E - r - I counts its
tokens as it counts the region's (RotatedKeys.offset, which under multimodal RoPE also gives back the
grid's offset): no window key moves, and `follow` turns none.

`frame` (frames started, the newest stream index and the count of the image region's tokens, as the
last commit left them) and `baked` are buffers a session file carries with the cache.

On cabinlm's attention kernel (FloatKVAttention: rows as steps, batched graphs) the kernel rotates
only the sink / pinned keys itself; the image region's rows are re-written in the cache from their
un-rotated copy at positions + E before a step whose positions moved (FrameKeys.refresh_image), as
RotatedKeys.refresh does for every one of those rows on GroupQueryAttention builds. A seat's steps
alone and in a batched run call it alike, so both read the same keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cabinlm.engines.onnxruntime.rotated import RotatedKeys, rotation_tables
from cabinlm.contract.layout import CacheLayout

if TYPE_CHECKING:
    from cabinlm.contract.slots import StepPlan


def turn(keys: np.ndarray, slots: np.ndarray, angles: np.ndarray, half: int) -> None:
    """Rotate keys[:, :, slots] (rotate-half layout) by `angles` ((head_dim / 2,) or (len(slots),
    head_dim / 2)) in float64, in place: a rotation keeps the RoPE type's factor the keys carry."""
    cos, sin = np.cos(angles), np.sin(angles)
    k = keys[:, :, slots].astype(np.float64)
    a, b = k[..., :half], k[..., half:]
    keys[:, :, slots] = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(keys.dtype)


class FrameKeys:
    """The window keys' turns when a frame replaces another (module docstring)."""

    def __init__(self, layout: CacheLayout, keys: np.ndarray, rotated: RotatedKeys):
        self.layout = layout
        self.keys = keys
        self.rotated = rotated
        self.frame = np.array([-1, -1, 0], dtype=np.int64)  # [-1, -1, 0]: no commit yet
        self.baked = np.full((layout.slots, 3), -1, dtype=np.int64) if rotated.mrope is not None else None
        self._image_at: np.ndarray | None = None  # refresh_image: the positions + E the image rows hold now

    def buffers(self) -> dict[str, np.ndarray]:
        return {"frame": self.frame} if self.baked is None else {"frame": self.frame, "baked": self.baked}

    def reset(self) -> None:
        self.frame[:] = (-1, -1, 0)
        if self.baked is not None:
            self.baked[:] = -1
        self._image_at = None

    def forget(self) -> None:
        """The image rows must be re-written before the next step (the buffers were restored)."""
        self._image_at = None

    def refresh_image(self, plan: StepPlan) -> None:
        """Before a step on cabinlm's kernel: the image region's keys in use rotated at their positions
        + E (ranks, or multimodal RoPE's three components) from key_source, written into their cache
        rows; nothing when those positions are the ones the rows hold. float32 arithmetic, the kernel's
        rotate(): x cos - y sin, y cos + x sin."""
        lay, rot = self.layout, self.rotated
        if not plan.image_fill:  # no frame's rows in use (a text seat): no positions to work out
            self._image_at = np.zeros(0, np.int64)
            return
        slots = lay.image_start + np.arange(plan.image_fill, dtype=np.int64)
        if rot.mrope is not None:
            at = rot.mrope_positions(plan)[1][:, slots] + rot.offset(plan)  # (3, n)
        else:
            at = plan.cache_position_ids[slots] + rot.offset(plan)  # (n,)
        key = np.concatenate([slots, at.reshape(-1)])
        if self._image_at is not None and np.array_equal(self._image_at, key):
            return
        cos, sin = rotation_tables(at, rot.inv_freq, rot.rope_scale, rot.owner)  # (n, head_dim / 2)
        cos, sin = cos.astype(np.float32), sin.astype(np.float32)
        half = lay.head_dim // 2
        src = rot.key_source[:, :, slots]  # (layers, kv_heads, n, head_dim) un-rotated
        x, y = src[..., :half], src[..., half:]
        self.keys[:, :, slots[0] : slots[-1] + 1] = np.concatenate([x * cos - y * sin, y * cos + x * sin], axis=-1)
        self._image_at = key  # recorded after the rows are written: an interrupt before it redoes them

    def follow(self, plan: StepPlan) -> None:
        """Before a step: if a frame was begun since the last commit, turn the window keys it moved."""
        frames, newest, count = (int(x) for x in self.frame)
        if frames < 0 or frames == plan.frames:
            return
        lay = self.layout
        if lay.recall:  # the frame ranks before the window there, and O counts it (RotatedKeys.offset): no turn
            self.frame[:] = (plan.frames, -1, 0)
            return
        window = lay.window_start + np.flatnonzero(plan.slot_token[lay.window_start : lay.slots] >= 0)
        half = lay.head_dim // 2
        if self.baked is None:  # ranks: the tokens after the old frame, back by its count
            after = window[plan.slot_token[window] > newest] if count else window[:0]
            if len(after):
                turn(self.keys, after, -count * self.rotated.inv_freq, half)
        elif len(window):
            want = self.rotated.mrope_positions(plan)[1][:, window].T + plan.evicted  # (n, 3)
            moved = np.flatnonzero((want != self.baked[window]).any(axis=1))
            if len(moved):
                slots = window[moved]
                delta = (want[moved] - self.baked[slots])[:, self.rotated.owner]  # (n, head_dim / 2)
                turn(self.keys, slots, delta * self.rotated.inv_freq[None, :], half)
                self.baked[slots] = want[moved]
        self.frame[:] = (plan.frames, -1, 0)

    def note(self, plan: StepPlan) -> None:
        """At commit: the image region as this chunk leaves it, and (multimodal RoPE) the positions + E
        its window keys were rotated at."""
        lay = self.layout
        region = plan.slot_token[lay.image_start : lay.window_start].copy()
        inside = (plan.slots >= lay.image_start) & (plan.slots < lay.window_start)
        region[plan.slots[inside] - lay.image_start] = plan.seen + np.flatnonzero(inside)
        held = region[region >= 0]
        self.frame[:] = (plan.frames, int(held.max()) if len(held) else -1, len(held))
        if inside.any():  # a frame's rows came in as the kernel rotated them: re-written from source next step
            self._image_at = None
        if self.baked is not None:
            window = plan.slots >= lay.window_start
            if window.any():
                self.baked[plan.slots[window]] = self.rotated.mrope_positions(plan)[0][:, window].T + plan.evicted
