"""Positions for a cache that holds keys already rotated: the fused cpu build (engines/ort_fused/) and
the HTP's rotated-key uint8 cache (engines/qnn_htp/backend.py) share this bookkeeping.

The normative semantics give every cached token its rank as position. A fused attention kernel
rotates a key once, when it is written, so each token gets a *virtual* position v instead:

    a chunk token (rank L + i when written)   v = L + i + E      E = window evictions so far
    the query of that token                   rotated at the same v

Every eviction removes the oldest window token, so a window token's rank falls by one at every
later eviction and is always v - E_now; the query at L + E_now then sees it at distance L - rank,
exactly the rank semantics. Sink and pinned tokens keep their rank while E grows; their keys are
re-written before each step at rank + E_now from an un-rotated float32 copy (FusedBackend.key_source,
taken from the graph's q|k|v output when they are fed), so quantized keys are never rotated twice.

In a steady dialogue (window tokens, one at a time, each evicting the oldest) the next step's E is
known before this step runs: the decode graph then rotates the copy at rank + E_next on the side
(its refresh_* inputs and refresh_keys output) and the next refresh only copies those rows in. Any
other step (a prefill chunk, a pin, the window still filling, a pinned span younger than window
tokens) refreshes through the build's rotation graph, with the same arithmetic.
A camera frame's tokens (the image region) are refreshed as the pinned ones are, at their ranks in
stream order (a window token older than the frame lowers them when it is evicted, a younger one does
not), from their own un-rotated copy.
The recall region (docs/design.md, "The recall region") is kept as the pinned spans are: its keys'
un-rotated copies sit in key_source after the pinned ones, and they are re-written at rank + O. Its
length moves the window's ranks as evictions do, the other way: O = E - r (StepPlan.offset; r the
region's tokens) takes E's place everywhere above, so a window key written at rank + O keeps rank v - O.
In a layout with a region a camera frame ranks before the window too and counts with r (its positions
under multimodal RoPE: RotatedKeys.offset), so a new frame moves no window key either.
The rotation tables are computed here in float64 for the chunk's rows only, so positions may grow
without bound (hours of dialogue) with no loss of precision in the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cabinlm.contract.errors import InputError
from cabinlm.contract.layout import CacheLayout

if TYPE_CHECKING:  # the runtime's bookkeeping: annotations only
    from cabinlm.contract.slots import StepPlan


def rotation_tables(positions: np.ndarray, inv_freq: np.ndarray, scale: float,
                    owner: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """cos / sin (float64, times the RoPE type's factor) of `positions`: (n, head_dim / 2). positions
    (n,), or (3, n) under multimodal RoPE, where frequency pair j turns with component owner[j]."""
    if owner is None:
        angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    else:
        angles = positions[owner].astype(np.float64).T * inv_freq[None, :]
    return np.cos(angles) * scale, np.sin(angles) * scale


class RotatedKeys:
    """Rotation tables for each step and the sink / pinned keys' refresh."""

    AHEAD = 256  # positions of cos / sin computed at once for decode steps (see _run)

    def __init__(self, layout: CacheLayout, keys: np.ndarray, key_source: np.ndarray, inv_freq, rope_scale: float,
                 key_scales=None, session=None, mrope: tuple | None = None, zero_point: int = 0):
        """Every fact of the slot table a step needs comes with its plan (StepPlan: E, the fills, the
        slot table as it stood): this class holds no table.

        keys: the cache's (layers, kv_heads, slots + scratch, head_dim) key buffer, whose sink and
        pinned rows this class writes; key_source: (layers, kv_heads, sink + pinned, head_dim) float32
        un-rotated copies of those keys. session: the build's rotation graph
        (engines/ort_fused/graph.py's rotation model), an ONNX Runtime session; without one the refresh runs
        in numpy (the same arithmetic). mrope: (frame tokens, grid, mrope_section) of a multimodal-RoPE
        model (StepPlan.mrope_positions): every position then has three components. zero_point: added
        to the rounded codes (128: the HTP's uint8 cache, engines/qnn_htp/backend.py, whose key_scales
        are one per tensor, repeated over the channels); with key_scales only."""
        lay = layout
        self.mrope = mrope
        self.owner = None if mrope is None else np.repeat(np.arange(3), mrope[2])  # each pair's component
        self._positions_of: tuple | None = None  # (plan, its mrope_positions): computed once per plan
        self.layout = layout
        self.keys = keys
        self.key_source = key_source
        self.inv_freq = np.asarray(inv_freq, dtype=np.float64)
        if self.inv_freq.shape != (lay.head_dim // 2,):
            raise ValueError(f"{self.inv_freq.shape[0]} RoPE frequencies for head_dim {lay.head_dim}")
        self.rope_scale = float(rope_scale)
        # int8 KV: static per-channel key scales (layers, kv_heads, 1, head_dim); None for float KV.
        self.key_scales = None if key_scales is None else np.asarray(key_scales, np.float32)[:, :, None, :]
        self.session = session
        self.zero_point = zero_point
        rows = lay.slots + lay.chunk
        self.cos = np.zeros((rows, lay.head_dim // 2), dtype=np.float32)
        self.sin = np.zeros_like(self.cos)
        self._refreshed: tuple | None = None  # (evictions, sink fill, pinned fill) of the last refresh
        self._slots: np.ndarray | None = None  # the sink / pinned slots the working copy holds
        self._oldest: bool | None = None  # the sink / pinned tokens are the oldest cached (ranks 0..n-1)
        self._ahead: tuple | None = None  # the state whose keys the last decode step left in `ahead`
        self._pending: tuple | None = None  # the state the decode step in flight rotates them for
        self._runs: list[tuple | None] = [None, None]  # (first position, cos, sin): the query's, the refresh's
        self.ahead_version = 0  # bumped when the `ahead` arrays are replaced (the session rebinds)
        self._set_source(np.zeros((1, keys.shape[0] * lay.kv_heads, 0, lay.head_dim), np.float32))

    def _set_source(self, scaled: np.ndarray) -> None:
        """The working copy and the decode graph's side inputs / output over it (P = its rows)."""
        lay = self.layout
        rows = scaled.shape[2]
        self._scaled = scaled
        self._positions = np.arange(rows, dtype=np.int64)[None]
        self._ahead_cos = np.zeros((max(rows, 1), lay.head_dim // 2), np.float32)
        self._ahead_sin = np.zeros_like(self._ahead_cos)
        self._ahead_keys = np.zeros(scaled.shape, self.keys.dtype)
        self.ahead = {"refresh_source": self._scaled, "refresh_position_ids": self._positions,
                      "refresh_cos": self._ahead_cos, "refresh_sin": self._ahead_sin}  # fmt: skip
        self.ahead_out = self._ahead_keys
        self.ahead_version += 1
        self._ahead = None

    def forget(self) -> None:
        """The pinned rows must be re-written before the next step (after a reset or a restore)."""
        self._refreshed = None
        self._slots = None
        self._oldest = None
        self._ahead = None

    def _prepare(self, slots: np.ndarray) -> None:
        """A contiguous working copy of the sources of `slots`, divided by the key scales (one scale
        per rotation pair, so scaling commutes with rotating)."""
        src = self.key_source[:, :, slots]
        if self.key_scales is not None:
            src = src / self.key_scales
        L, H, n, D = src.shape
        self._set_source(np.ascontiguousarray(src, dtype=np.float32).reshape(1, L * H, n, D))
        self._slots = slots

    def _tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rotation_tables(positions, self.inv_freq, self.rope_scale, self.owner)

    def offset(self, plan: StepPlan) -> int:
        """O for this cache: StepPlan.offset, where under multimodal RoPE in a layout with a recall region
        a whole frame (before the window there) also lowers the window's positions below their ranks by
        d = I - max(rows, cols) (StepPlan.mrope_positions): O then takes d back, so a window key written
        at its positions + O keeps them, whatever frame and region come and go. A frame still being fed
        takes nothing off: the window, which its chunks do not see, is then never read."""
        if self.mrope is None or not self.layout.recall or plan.frame_start < 0:
            return plan.offset
        tokens, (rows, cols) = self.mrope[0], self.mrope[1]
        whole = plan.seen >= plan.frame_start + tokens
        return plan.offset + (tokens - max(rows, cols) if whole else 0)

    def mrope_positions(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """plan.mrope_positions (the chunk's (3, tokens), the slots' (3, slots)), once per plan."""
        if self._positions_of is None or self._positions_of[0] is not plan:
            self._positions_of = (plan, plan.mrope_positions(self.mrope[0], self.mrope[1]))
        return self._positions_of[1]

    def _run(self, which: int, start: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """cos / sin (float32) of positions start .. start + rows - 1, cut from a table of the next
        AHEAD positions that is computed again only when the run leaves it: a decode step's positions
        move by one per step, so this costs a copy instead of two transcendental passes."""
        table = self._runs[which]
        if table is None or not table[0] <= start <= start + rows <= table[0] + len(table[1]):
            cos, sin = self._tables(np.arange(start, start + rows + self.AHEAD))
            table = self._runs[which] = (start, cos.astype(np.float32), sin.astype(np.float32))
        o = start - table[0]
        return table[1][o : o + rows], table[2][o : o + rows]

    def chunk_tables(self, plan: StepPlan) -> None:
        """The chunk's virtual positions L + i + E into rows 0..n-1 of the cos / sin inputs (the rows
        the graph's position_ids name). Rows as steps: each row's rank and E at its step, the same sums."""
        n = len(plan.slots)
        if plan.pin is True and self.layout.recall and plan.cached > plan.sink_fill + plan.pinned_fill + plan.before_window:
            # the window ranks after every pinned token there: a span pinned now would raise the ranks of the
            # window keys already rotated, which O (counting the frame and the region, not late pins) leaves
            raise InputError("a span pinned after window tokens moves the window's ranks in a layout with a recall "
                             "region, which this build's rotated keys do not follow; pin spans before any window "
                             "token (the system prompt)")  # fmt: skip
        if self.mrope is not None:  # three components per token (GroupQueryAttention builds: no steps)
            cos, sin = self._tables(self.mrope_positions(plan)[0] + self.offset(plan))
        elif n == 1:
            cos, sin = self._run(0, int(plan.position_ids[0]) + plan.offset, 1)
        else:
            cos, sin = self._tables(plan.position_ids + (plan.row_offset if plan.steps else plan.offset))
        self.cos[:n] = cos
        self.sin[:n] = sin

    def source_tables(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """For cabinlm's attention kernel, which rotates the sink / pinned keys itself from key_source
        (kernels/int8_kv_attention.cc, io_spec.fused_decoder_io(steps=True)): their cos / sin at rank + E,
        (versions, K, head_dim / 2) float32 for the K = sink + pinned slots in use. One version for
        every row; a plan of rows as steps one per row, at the ranks and E of each row's step. A decode
        step whose sink / pinned tokens are the oldest cuts them from a table of the next positions
        (E moves by one per step), with the same float64 arithmetic as a computed table."""
        K = len(plan.pinned_slots)
        half = self.layout.head_dim // 2
        if K == 0:
            empty = np.zeros((1, 0, half), np.float32)
            return empty, empty
        if plan.steps and plan.tokens > 1:
            positions = plan.row_pinned_ranks + plan.row_offset[:, None]
            if (positions == positions[0]).all():  # no row's step evicts (the window has room): one version
                cos, sin = self._tables(positions[0])  # for every row, the same numbers as n copies
                return cos.astype(np.float32)[None], sin.astype(np.float32)[None]
            cos, sin = self._tables(positions.reshape(-1))
            shape = (plan.tokens, K, half)
            return cos.astype(np.float32).reshape(shape), sin.astype(np.float32).reshape(shape)
        ranks = self._ranks(plan, plan.pinned_slots)
        if self._oldest:  # ranks 0..K-1
            cos, sin = self._run(1, plan.offset, K)
            return cos[None], sin[None]
        cos, sin = self._tables(ranks + plan.offset)
        return cos.astype(np.float32)[None], sin.astype(np.float32)[None]

    def keep_sources(self, plan: StepPlan, qkv: list[np.ndarray], num_heads: int) -> None:
        """Keep the un-rotated keys of the chunk's tokens that go to sink or pinned slots (qkv: the
        q|k|v outputs of the layers this class refreshes, the global ones)."""
        H, Hkv, D = num_heads, self.layout.kv_heads, self.layout.head_dim
        if not plan.pin and plan.sink_fill >= self.layout.sink:  # a window chunk: nothing to keep (keep_keys')
            return
        # (1, tokens, (heads + 2 kv_heads) head_dim) -> (kv_heads, tokens, head_dim), views
        self.keep_keys(plan, [x[0, :, H * D : (H + Hkv) * D].reshape(-1, Hkv, D).transpose(1, 0, 2) for x in qkv])

    def keep_keys(self, plan: StepPlan, keys: list[np.ndarray]) -> None:
        """keep_sources from the chunk's un-rotated keys, (kv_heads, tokens, head_dim) per layer (the
        HTP build's new_key_source outputs)."""
        lay = self.layout
        if not plan.pin and plan.sink_fill >= lay.sink:  # a window chunk: nothing to keep
            return
        rows = np.flatnonzero(plan.slots < lay.window_start)  # sink, pinned, camera-frame and recall slots
        if not len(rows):
            return
        for layer, k in enumerate(keys):
            self.key_source[layer][:, plan.slots[rows]] = k[:, rows]
        self._slots = None

    def _ranks(self, plan: StepPlan, slots: np.ndarray) -> np.ndarray:
        """Ranks of the sink and pinned slots (sink first, then pinned, each in slot order). Sink
        tokens are the stream's first; pinned ones fill their slots in stream order; so unless a
        camera-frame or window token is older than a pinned one, the ranks are 0, 1, 2, ...
        With camera-frame slots among them, their ranks as the plan gives them."""
        lay = self.layout
        st = plan.slot_token
        if self.mrope is not None:  # (3, K): never the ranks 0..K-1 of one component, no side refresh
            self._oldest = False
            return self.mrope_positions(plan)[1][:, slots]
        if plan.image_fill or plan.recall_fill:
            ranks = plan.cache_position_ids[slots]
            self._oldest = bool(np.array_equal(ranks, np.arange(len(slots))))
            return ranks
        later = st[lay.sink + lay.pinned :]
        later = later[later >= 0]
        self._oldest = not len(later) or later.min() > st[slots].max()
        if self._oldest:
            return np.arange(len(slots), dtype=np.int64)
        return plan.cache_position_ids[slots]

    def refresh(self, plan: StepPlan) -> None:
        """Before a step: write the sink and pinned keys rotated at rank + E (only when E or the set
        of pinned tokens changed since the last refresh)."""
        c, lay = plan, self.layout  # the table's counters as the plan carries them
        state = _state(plan, self.offset(plan))
        if state == self._refreshed:
            return
        if state == self._ahead:  # the last decode step rotated them already
            self._write(self._ahead_keys)
            self._refreshed, self._ahead = state, None
            return
        self._ahead = None
        slots = np.concatenate([np.arange(c.sink_fill), lay.sink + np.arange(c.pinned_fill),
                                lay.image_start + np.arange(c.image_fill),
                                lay.recall_start + np.arange(c.recall_fill)]).astype(np.int64)  # fmt: skip
        if not len(slots):
            self._refreshed = state
            return
        if self._slots is None or not np.array_equal(self._slots, slots):
            self._prepare(slots)
        cos, sin = self._tables(self._ranks(plan, slots) + self.offset(plan))  # (rows, D/2)
        cos, sin = cos.astype(np.float32), sin.astype(np.float32)
        if self.session is not None:
            (rotated,) = self.session.run(None, {"source": self._scaled, "position_ids": self._positions, "cos": cos, "sin": sin})
        else:
            half = lay.head_dim // 2
            x1, x2 = self._scaled[..., :half], self._scaled[..., half:]
            rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
            if self.key_scales is not None:
                rotated = np.clip(np.rint(rotated), -127, 127) + self.zero_point
        self._write(rotated)
        self._refreshed = state  # recorded after the keys are written: an interrupt before it redoes them

    def _write(self, rotated: np.ndarray) -> None:
        """(1, layers * kv_heads, rows, head_dim) rotated keys into the sink / pinned slots."""
        lay, slots = self.layout, self._slots
        lo, hi = int(slots[0]), int(slots[-1]) + 1
        where = slice(lo, hi) if hi - lo == len(slots) else slots
        self.keys[:, :, where] = rotated.reshape(self.keys.shape[0], lay.kv_heads, len(slots), lay.head_dim)

    def plan_ahead(self, plan: StepPlan) -> None:
        """Before a single-token step: if it is a window token that evicts, with the sink full and the
        sink / pinned tokens the oldest (their ranks stay 0..n-1), fill the side tables for rank +
        E_next, so the step's graph run leaves the next step's keys in `ahead_out`. Otherwise the
        side output is left unused. Call `ahead_done()` after the run."""
        c, lay = plan, self.layout
        self._pending = None
        if (plan.pin or not plan.evicts or c.sink_fill < lay.sink or not self._oldest or self._slots is None
                or self._refreshed != _state(plan, self.offset(plan))):  # fmt: skip
            return
        rows = len(self._slots)
        cos, sin = self._run(1, c.offset + plan.evicts, rows)
        self._ahead_cos[:rows] = cos
        self._ahead_sin[:rows] = sin
        self._pending = (c.offset + plan.evicts, *_state(plan, c.offset)[1:])

    def ahead_done(self) -> None:
        """The graph run that carried the side tables finished: its keys stand for that state."""
        self._ahead, self._pending = self._pending, None


def _state(plan: StepPlan, offset: int) -> tuple:
    """What the sink / pinned / camera-frame / recall keys' rotation depends on: O (RotatedKeys.offset), the
    fills (and, once a frame was started, the image fill and the frame; once a recall region was, its fill
    and its count)."""
    text = (offset, plan.sink_fill, plan.pinned_fill)
    if plan.recalls:
        text = (*text, plan.recall_fill, plan.recalls)
    return (*text, plan.image_fill, plan.frames) if plan.frames else text


class RingTables:
    """The local layers' rotation (engines/ort_fused/graph.py, "Local layers"): a chunk's tokens are
    rotated at their stream indices with the local RoPE table, computed in float64 (positions grow
    without bound), into rows 0..n-1 of the (R + C, head_dim / 2) cos / sin inputs."""

    AHEAD = 256

    def __init__(self, layout: CacheLayout, inv_freq, rope_scale: float):
        self.inv_freq = np.asarray(inv_freq, dtype=np.float64)
        self.rope_scale = float(rope_scale)
        rows = layout.local_slots + layout.chunk
        self.cos = np.zeros((rows, layout.head_dim // 2), dtype=np.float32)
        self.sin = np.zeros_like(self.cos)
        self._run: tuple | None = None  # (first position, cos, sin) of the next AHEAD decode positions

    def _tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = rotation_tables(positions, self.inv_freq, self.rope_scale)
        return cos.astype(np.float32), sin.astype(np.float32)

    def fill(self, plan: StepPlan) -> None:
        n, start = plan.tokens, plan.seen
        if n == 1:  # decode: cut from a table of the next AHEAD positions (one copy per step)
            run = self._run
            if run is None or not run[0] <= start < run[0] + len(run[1]):
                run = self._run = (start, *self._tables(np.arange(start, start + self.AHEAD)))
            o = start - run[0]
            self.cos[0], self.sin[0] = run[1][o], run[2][o]
            return
        self.cos[:n], self.sin[:n] = self._tables(np.arange(start, start + n))
