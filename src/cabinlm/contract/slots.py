"""The sink / pinned / image / recall / rolling-window slot bookkeeping of one dialogue's cache, in numpy.

Every backend shares this: the graph is a pure function of (cache, chunk, positions, mask) that
returns the chunk's K/V; this table decides where those K/V go and what every slot's position is.
The buffers themselves belong to the backend (engines/<engine>/backend.py), in whatever memory its
engine reads; a backend reads a step's facts from its StepPlan, never from the table.

Invariants (tested property-wise in tests/test_cache.py):
  * sink slots hold the first S tokens of the stream and are never overwritten;
  * pinned slots hold the pinned spans and are never overwritten by unpinned tokens;
  * the image region holds the current camera frame's tokens (begin_frame empties it);
  * the recall region holds the text recalled before the current user turn (begin_recall empties it);
    its chunks attend to every cached token but the window's (docs/design.md, "The recall region");
    in a layout with a region a camera frame's chunks do too, and a new frame (begin_frame) empties
    the region as well: the region's tokens saw the frame, so it is refilled after each new one;
  * the window ring holds exactly the most recent min(W, unpinned seen) unpinned tokens;
  * positions are ranks in stream order: cached tokens 0..L-1, the chunk L..L+c-1; in a layout with
    a recall region (layout.recall > 0) the window's tokens rank after every other cached token (its
    rule 3: the window's ranks follow the region's length), a recall or frame chunk after the other
    non-window tokens (the layout order: sink | pinned | image | recall | window);
  * the counters below are a function of slot_token and the stream so far: restore() checks them.

Local layers (CacheLayout.local_layers) keep a ring of w slots that every token of the stream but
the recalled ones passes through, pinned or not: with `local_seen` such tokens counted so far, the
t-th sits in ring slot t mod w until the (t + w)-th overwrites it. The ring is therefore a function of
`local_seen` alone and needs no state of its own (StepPlan derives its slots, ranks and mask): it
holds local indices local_seen - min(local_seen, w) .. local_seen - 1, and chunk token i (local index
local_seen + i) may see those after local_seen + i - w, as the model's window says. A layout with a
recall region gives each local layer R more slots after the ring, w .. w + R - 1, where the region's
tokens go (docs/design.md, "The recall region"): a recalled chunk sees the region's earlier tokens and
itself only, a stream chunk the ring only, so a refresh moves no ring slot.
"""

from __future__ import annotations

import functools

import numpy as np

from cabinlm.contract.errors import InputError
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.slot_state import SlotState, check_state, restored_frame_start

MASK_VALUE = np.float32(-1e30)  # additive mask for slots a token must not see


class StepPlan:
    """Everything one graph call needs besides the token ids, and where its K/V go afterwards: the
    slot table as it stood when the plan was made, so a backend reads the plan and never the table.

    The table does not move between a plan and its commit (the Decoder advances it after), so every
    fact below is also the table's at commit time; a prefix plan of the same chunk (speculative
    decoding keeps the accepted tokens only) carries the same facts. The cached slots' positions and
    the mask are worked out on first use (a fused decode step needs neither most of the time)."""

    def __init__(self, position_ids: np.ndarray, slots: np.ndarray, evicts: int, pin: bool | str,
                 slot_token: np.ndarray, table: SlotTable, cached: int, steps: bool = False):  # fmt: skip
        self.position_ids = position_ids  # (tokens,) int64
        self.slots = slots  # (tokens,) int64: destination slot of each chunk token
        self.evicts = evicts  # how many cached window tokens this chunk overwrites
        self.pin = pin  # False: window; True: pinned region; "image": the camera-frame region; "recall": the recall region
        self.slot_token = slot_token  # (slots,) int64, a copy: the table moves on after the commit
        # The table's counters before this chunk (SlotTable's meanings):
        self.cached = cached  # L = table.length: tokens in the cache (the chunk's first rank)
        self.extent = table.extent  # F: 1 + the highest slot in use (every slot from F on is empty)
        self.evicted = table.evicted  # E: window tokens evicted so far
        self.sink_fill = table.sink_fill
        self.pinned_fill = table.pinned_fill
        self.image_fill = table.image_fill
        self.frames = table.frames
        self.recall_fill = table.recall_fill
        self.recalls = table.recalls
        self.layout = table.layout
        self.seen = table.seen  # the chunk's first stream index
        # the stream index of the current camera frame's first token (-1: none), this chunk's own
        # first token when it starts a frame (multimodal RoPE's grid offsets count from there)
        self.frame_start = seen_frame_start(table, pin)
        self.local_window = table.layout.local_window  # w (0: no local layers)
        self.local_seen = table.local_seen  # the chunk's first local index (stream tokens but recalled ones)
        self.sink = table.layout.sink
        # True: the rows are one-token steps (a verified draft): row i computes what the step after the
        # chunk's first i tokens would, the window's oldest tokens those steps overwrite included (the
        # row_* facts below); False: every row sees the cache as it was before the chunk (docs/design.md, "The cache").
        # A backend that cannot run a plan as steps never gets one (Backend.verifies_after_turnover).
        self.steps = steps
        if steps:  # each row's rank at its own step: a row after an eviction keeps the rank of the one before
            self.position_ids = position_ids - (self.row_evicted - self.evicted)

    @property
    def tokens(self) -> int:
        return len(self.slots)

    @property
    def sees_window(self) -> bool:
        """Whether the chunk attends to the window: not a recall chunk, nor, in a layout with a recall
        region, a camera frame's (both rank before the window, so neither sees it)."""
        return not (self.pin == "recall" or (self.pin == "image" and self.layout.recall))

    @property
    def before_window(self) -> int:
        """What ranks before the window besides the sink and pinned tokens: r, the recall region's
        tokens, and in a layout with a region the frame's too (it ranks before the window there; in
        stream order, as a window token, without one)."""
        return self.recall_fill + (self.image_fill if self.layout.recall else 0)

    @property
    def offset(self) -> int:
        """O = E - r: what a cache of keys rotated once at write time adds to a rank (engines/ort_fused/
        rotated.py). A window token's rank falls by one at each eviction and rises by one for each token
        the recall region gains, so its rank is always v - O, v its rank + O when it was written. In a
        layout with a region the frame's tokens count with r (before_window)."""
        return self.evicted - self.before_window

    @functools.cached_property
    def cache_position_ids(self) -> np.ndarray:
        """(slots,) int64: each cached slot's rank in stream order (0 for empty slots). Stream indices
        are unique and increasing, so a slot's rank is the number of cached tokens older than it. With
        a recall region in the layout the window's tokens count after every other cached token."""
        st = self.slot_token
        valid = st >= 0
        cached = int(valid.sum())
        cache_pos = np.zeros(len(st), dtype=np.int64)
        key = np.where(valid, st, np.iinfo(np.int64).max)
        if self.layout.recall:  # the window last: its keys above every stream index, below the empty slots'
            ws = self.layout.window_start
            key[ws:] = np.where(valid[ws:], st[ws:] + (1 << 62), key[ws:])
        order = np.argsort(key, kind="stable")
        cache_pos[order[:cached]] = np.arange(cached)
        return cache_pos

    # -- multimodal RoPE (Qwen2-VL; docs/vlm.md) ----------------------------------------------------

    def mrope_positions(self, frame_tokens: int, grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """((3, tokens), (3, slots)) int64: the (time, row, column) positions of the chunk's tokens and of
        every cached slot (0 for empty slots), by the rule of docs/design.md, "Multimodal RoPE": the cached
        tokens then the chunk's, in the order of their ranks, read as if they were the whole sequence.
        A text token at rank r has r + d in all three components, where d is what the frames before it
        took off: a frame of I tokens in a (rows, cols) grid spans max(rows, cols) positions, not I.
        Frame token k, the frame starting at rank f: (f + d, f + d + k // cols, f + d + k % cols).
        In a layout with a recall region the ranks put the frame and the region before the window
        (cache_position_ids), and a frame's or region's chunk before the window it does not see.
        While the stream fits the cache this is the model's own rule (get_rope_index); after evictions
        it is the same rule over the ranks, for all three components.

        frame_tokens: I, the tokens of one frame; grid: (rows, cols), rows * cols = I. The frame's
        tokens are the stream indices frame_start .. frame_start + I - 1 (sink, image region or chunk)."""
        rows, cols = grid
        st = self.slot_token
        valid = st >= 0
        stream = np.concatenate([st[valid], self.seen + np.arange(self.tokens, dtype=np.int64)])
        rank = np.concatenate([self.cache_position_ids[valid], self.position_ids])
        if not self.sees_window:  # the chunk ranks before the window (which it does not see)
            in_window = np.flatnonzero(valid) >= self.layout.window_start
            rank[: len(in_window)][in_window] += self.tokens
        order = np.argsort(rank, kind="stable")
        ranked = stream[order]  # every token in rank order: the cache's, then the chunk's
        pos = np.repeat(np.arange(len(ranked), dtype=np.int64)[None, :], 3, axis=0)
        f0 = self.frame_start
        if f0 >= 0:
            k = ranked - f0
            inside = (k >= 0) & (k < frame_tokens)
            if inside.any():
                first = int(np.argmax(inside))  # the frame's first rank
                kk = k[inside]
                pos[1, inside] += kk // cols - kk
                pos[2, inside] += kk % cols - kk
                pos[0, inside] -= kk
                pos[:, first + frame_tokens :] -= frame_tokens - max(rows, cols)  # text after the frame
        at = np.empty_like(pos)
        at[:, order] = pos  # back to (cached slots in slot order, then the chunk)
        cache = np.zeros((3, len(st)), dtype=np.int64)
        n_cached = int(valid.sum())
        cache[:, valid] = at[:, :n_cached]
        return at[:, n_cached:], cache

    # -- the rows as one-token steps (steps=True) -------------------------------------------------

    @functools.cached_property
    def pinned_slots(self) -> np.ndarray:
        """(K,) int64: the sink and pinned slots in use, sink first: 0..K-1 (K = sink_fill + pinned_fill;
        nothing is pinned before the sink is full). With recalled text cached: every slot before the
        region's end, 0..K-1 with K = recall_start + recall_fill (the free pinned slots among them are
        empty, masked), so that the keys re-rotated from their float copies stay the first K slots."""
        if self.recall_fill:
            return np.arange(self.layout.recall_start + self.recall_fill, dtype=np.int64)
        return np.concatenate([np.arange(self.sink_fill), self.sink + np.arange(self.pinned_fill)]).astype(np.int64)

    @functools.cached_property
    def overwritten(self) -> np.ndarray:
        """(tokens,) int64: the stream index each row's slot holds when that row's step runs (-1: an
        empty slot); a cached token overwritten is an eviction."""
        st = self.slot_token.copy()
        out = np.empty(self.tokens, dtype=np.int64)
        for m, slot in enumerate(self.slots):
            out[m] = st[slot]
            st[slot] = self.seen + m
        return out

    @functools.cached_property
    def row_evicted(self) -> np.ndarray:
        """(tokens,) int64: the window tokens evicted before each row's step (E for row 0)."""
        over = (self.overwritten >= 0).astype(np.int64)
        return self.evicted + np.concatenate([[0], np.cumsum(over[:-1])]).astype(np.int64)

    @property
    def row_offset(self) -> np.ndarray:
        """(tokens,) int64: each row's offset O (see offset) at its own step."""
        return self.row_evicted - self.before_window

    @functools.cached_property
    def row_pinned_ranks(self) -> np.ndarray:
        """(tokens, K) int64: the ranks of the sink / pinned slots (pinned_slots) before each row's
        step: a row that evicts a token older than one of them moves that one down a rank."""
        slots = self.pinned_slots
        ranks = self.cache_position_ids[slots]
        if self.layout.recall:  # the window ranks last: an eviction moves no other token's rank
            return np.repeat(ranks[None, :], self.tokens, axis=0)
        ev = self.overwritten
        older = (ev[:, None] >= 0) & (ev[:, None] < self.slot_token[slots][None, :])
        drop = np.concatenate([np.zeros((1, len(slots)), np.int64), np.cumsum(older, axis=0)[:-1]])
        return ranks[None, :] - drop

    # -- the local layers' ring and region (module docstring) ---------------------------------------

    @property
    def _ring(self) -> int:
        return self.local_window

    @property
    def _recalled(self) -> bool:
        """A recalled chunk: in a local layer its tokens go to the region's slots, never the ring."""
        return self.pin == "recall"

    @functools.cached_property
    def local_slots(self) -> np.ndarray:
        """(tokens,) int64: each chunk token's slot in the local layers' buffers (ring or region)."""
        i = np.arange(self.tokens, dtype=np.int64)
        if self._recalled:
            return self._ring + self.recall_fill + i
        return (self.local_seen + i) % self._ring

    @functools.cached_property
    def local_ring_token(self) -> np.ndarray:
        """(w,) int64: the local index each ring slot holds before this chunk (-1: empty)."""
        R, seen = self._ring, self.local_seen
        slot = np.arange(R, dtype=np.int64)
        newest = seen - 1 - ((seen - 1 - slot) % R)  # the largest t < local_seen with t = slot (mod w)
        return np.where(newest >= 0, newest, -1)

    @property
    def local_cached(self) -> int:
        """The chunk's first local rank: the tokens the ring holds before a stream chunk, the tokens the
        region holds before a recalled one."""
        return self.recall_fill if self._recalled else min(self.local_seen, self._ring)

    @property
    def local_extent(self) -> int:
        """1 + the highest local slot in use before this chunk, a recalled chunk's first slot at least
        (every slot from here on is empty): the ring's fill while no region is held, w + its fill then."""
        if self._recalled or self.recall_fill:
            return self._ring + self.recall_fill
        return min(self.local_seen, self._ring)

    @property
    def local_index(self) -> int:
        """The chunk's first token's index in its own run: its local index (the stream but recalled
        tokens) for a stream chunk, its place in the region for a recalled one. Rank differences inside
        either run are these differences (engines that rotate a local key once rotate it here)."""
        return self.recall_fill if self._recalled else self.local_seen

    @functools.cached_property
    def local_position_ids(self) -> np.ndarray:
        return np.arange(self.local_cached, self.local_cached + self.tokens, dtype=np.int64)

    @functools.cached_property
    def local_cache_position_ids(self) -> np.ndarray:
        """(w + R,) int64: each ring slot's rank (its tokens are consecutive in the stream), then each
        region slot's rank inside the region (0 when empty)."""
        t = self.local_ring_token
        ring = np.where(t >= 0, t - (self.local_seen - min(self.local_seen, self._ring)), 0)
        region = np.arange(self.layout.recall, dtype=np.int64)
        return np.concatenate([ring, np.where(region < self.recall_fill, region, 0)])

    @functools.cached_property
    def local_attention_mask(self) -> np.ndarray:
        """(tokens, w + R + tokens) float32: a stream chunk sees the ring slots within each token's window
        of w (itself included), a recalled chunk the region's earlier tokens; then the chunk causally (a
        chunk of at most w tokens is always inside the window)."""
        n, R, Rr = self.tokens, self._ring, self.layout.recall
        mask = np.full((n, R + Rr + n), MASK_VALUE, dtype=np.float32)
        if self._recalled:
            mask[:, R : R + self.recall_fill] = 0
        else:
            t = self.local_ring_token
            first = self.local_seen + np.arange(n)[:, None] - self.local_window + 1  # oldest local index token i sees
            mask[:, :R] = np.where((t[None, :] >= 0) & (t[None, :] >= first), np.float32(0), MASK_VALUE)
        mask[:, R + Rr :] = np.where(np.tri(n, dtype=bool), np.float32(0), MASK_VALUE)
        return mask

    @functools.cached_property
    def attention_mask(self) -> np.ndarray:
        """(tokens, slots + tokens) float32, additive: every cached slot, then the chunk causally."""
        n, N = len(self.slots), len(self.slot_token)
        mask = np.empty((n, N + n), dtype=np.float32)
        mask[:, :N] = np.where(self.slot_token >= 0, np.float32(0), MASK_VALUE)
        if not self.sees_window:  # the region (and a frame before it) never sees the window (docs/design.md,
            mask[:, self.layout.window_start : N] = MASK_VALUE  # "The recall region", rule 2)
        mask[:, N:] = np.where(np.tri(n, dtype=bool), np.float32(0), MASK_VALUE)
        return mask


class SlotTable:
    """Which stream token each cache slot holds, and where the next chunk goes."""

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        # (slots,) stream index of the token held by each slot, -1 while empty.
        self.slot_token = np.full(layout.slots, -1, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Forget every token (empty slots are masked; the backend's buffers keep their memory)."""
        self.slot_token.fill(-1)
        self.seen = 0  # tokens fed so far (the next token's stream index)
        self.evicted = 0  # window tokens overwritten so far
        self.sink_fill = 0
        self.pinned_fill = 0
        self.image_fill = 0
        self.frames = 0  # camera frames started (each replaces the previous one)
        self.window_fill = 0
        self.ring_next = 0  # index inside the window ring of the next slot to write (= the oldest)
        self.recall_fill = 0  # tokens in the recall region
        self.recalls = 0  # recall regions started (each replaces the previous one)
        self.local_seen = 0  # tokens fed but recalled ones: the local layers' rings count these (module docstring)
        # Multimodal RoPE: the stream index of the current frame's first token (-1: none yet), and
        # whether begin_frame() was called with no frame token fed since. Not part of SlotState:
        # restore() derives it (a frame's tokens are the last ones of the stream's frame-sized run
        # ending in the image region).
        self.frame_start = -1
        self.frame_open = False

    # -- state -------------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Tokens currently cached."""
        return self.sink_fill + self.pinned_fill + self.image_fill + self.recall_fill + self.window_fill

    @property
    def pinned_free(self) -> int:
        return self.layout.pinned - self.pinned_fill

    @property
    def extent(self) -> int:
        """1 + the highest slot in use (0 when empty): every slot from here on is empty. The ring
        fills its slots in order, so this is the slot count once the window has turned over."""
        lay = self.layout
        if self.window_fill:
            return lay.slots if self.window_fill == lay.window else lay.window_start + self.window_fill
        if self.recall_fill:
            return lay.recall_start + self.recall_fill
        if self.image_fill:
            return lay.image_start + self.image_fill
        if self.pinned_fill:
            return lay.sink + self.pinned_fill
        return self.sink_fill

    def begin_frame(self) -> None:
        """A new camera frame replaces the current one: its slots are emptied (masked) and the new
        frame's tokens, fed with pin="image", are written into them. In a layout with a recall region
        the region is emptied too: its tokens saw the old frame, and rank after the new one once
        refilled (begin_recall), so that the region depends only on what ranks before it."""
        lay = self.layout
        self.slot_token[lay.image_start : lay.window_start] = -1  # the frame's slots, and the region's (if any)
        self.image_fill = self.recall_fill = 0
        self.frames += 1
        self.frame_start, self.frame_open = -1, True

    def begin_recall(self) -> None:
        """New recalled text replaces the region's whole: its slots are emptied (masked) and the new
        text's tokens, fed with pin="recall", are written into them. No window token moves."""
        lay = self.layout
        if not lay.recall:
            raise ValueError("this layout has no recall region (export with --recall R)")
        self.slot_token[lay.recall_start : lay.window_start] = -1
        self.recall_fill = 0
        self.recalls += 1

    @property
    def recall_free(self) -> int:
        return self.layout.recall - self.recall_fill

    def cached_stream_indices(self) -> np.ndarray:
        """Stream indices of the cached tokens, in stream order."""
        idx = self.slot_token[self.slot_token >= 0]
        return np.sort(idx)

    def state(self) -> SlotState:
        return SlotState(self.slot_token.copy(), **{k: getattr(self, k) for k in SlotState.COUNTERS})

    def restore(self, state: SlotState) -> None:
        """Take a saved state, after checking it against this layout (check_state); nothing changes
        when it is refused."""
        check_state(state, self.layout)
        self.slot_token[:] = state.slot_token
        for k, v in state.counters().items():
            setattr(self, k, v)
        # begin_frame() with no frame token fed since: the region is empty after a frame began, and
        # the next image chunk starts the frame (a save inside a frame's feed is not restored: a
        # Dialogue feeds a frame whole, with Ctrl-C held)
        self.frame_start = restored_frame_start(state, self.layout)
        self.frame_open = state.frames > 0 and state.image_fill == 0

    # -- one step ----------------------------------------------------------------------------------

    def plan(self, n: int, pin: bool | str = False, steps: bool = False) -> StepPlan:
        """Positions, mask and destination slots for the next chunk of n tokens (nothing changes yet).
        steps: the rows are one-token steps (StepPlan.steps; window tokens only, the sink full)."""
        lay = self.layout
        if not 1 <= n <= lay.chunk:
            raise InputError(f"a chunk holds 1..{lay.chunk} tokens, got {n}")
        if steps and (pin or self.sink_fill < lay.sink):
            raise ValueError("a chunk planned as one-token steps holds window tokens after a full sink")
        if n == 1 and not pin and self.sink_fill == lay.sink:  # a decode step's window token
            cached = self.length
            slots = np.array([lay.window_start + self.ring_next], dtype=np.int64)
            evicts = 1 if self.window_fill == lay.window else 0
            return StepPlan(np.array([cached], dtype=np.int64), slots, evicts, pin, self.slot_token.copy(), self, cached, steps)
        sink_take = min(n, lay.sink - self.sink_fill)
        rest = n - sink_take
        slots = np.empty(n, dtype=np.int64)
        slots[:sink_take] = np.arange(self.sink_fill, self.sink_fill + sink_take)
        evicts = 0
        if pin == "recall":
            if sink_take or not lay.recall:
                raise ValueError("recalled text is fed after the sink is full, into a layout with a recall region")
            if rest > self.recall_free:
                raise InputError(f"the recall region has {self.recall_free} free slots of {lay.recall}; {rest} more "
                                 "recalled tokens do not fit (call begin_recall() before each region)")  # fmt: skip
            start = lay.recall_start + self.recall_fill
            slots[:] = np.arange(start, start + rest)
            first = self.sink_fill + self.pinned_fill + self.image_fill + self.recall_fill  # ranks after the region's own
            return StepPlan(np.arange(first, first + n, dtype=np.int64), slots, 0, pin, self.slot_token.copy(), self,
                            self.length, steps)  # fmt: skip
        if pin == "image":
            if rest > lay.image - self.image_fill:
                raise InputError(
                    f"the image region has {lay.image - self.image_fill} free slots of {lay.image}; a frame's "
                    f"{rest} more tokens do not fit (call begin_frame() before each frame)"
                )
            start = lay.image_start + self.image_fill
            slots[sink_take:] = np.arange(start, start + rest)
            if lay.recall:  # the frame ranks before the window, which it does not see (StepPlan.sees_window)
                first = self.length - self.window_fill
                position_ids = np.arange(first, first + n, dtype=np.int64)
                return StepPlan(position_ids, slots, 0, pin, self.slot_token.copy(), self, self.length, steps)
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
        return StepPlan(position_ids, slots, evicts, pin, self.slot_token.copy(), self, cached, steps)

    def advance(self, plan: StepPlan) -> None:
        """The chunk's K/V are in their slots: record it. Call only after the data is written."""
        lay = self.layout
        n = len(plan.slots)
        self.slot_token[plan.slots] = np.arange(self.seen, self.seen + n)
        self.seen += n
        if plan.pin != "recall":
            self.local_seen += n
        sink_take = min(n, lay.sink - self.sink_fill)
        self.sink_fill += sink_take
        rest = n - sink_take
        if plan.pin == "image":
            if self.frame_open:
                self.frame_start, self.frame_open = plan.seen, False
            self.image_fill += rest
        elif plan.pin == "recall":
            self.recall_fill += rest
        elif plan.pin:
            self.pinned_fill += rest
        else:
            self.ring_next = (self.ring_next + rest) % lay.window
            self.window_fill = min(lay.window, self.window_fill + rest)
            self.evicted += plan.evicts


def seen_frame_start(table: SlotTable, pin: bool | str) -> int:
    """The current frame's first stream index as a plan of a chunk with `pin` sees it."""
    if pin == "image" and table.frame_open:
        return table.seen
    return table.frame_start
