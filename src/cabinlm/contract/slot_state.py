"""A slot table's whole state, as session files keep it (SlotState), and the check a saved state
passes before a table takes it back (check_state): every counter against the layout and against the
slots' contents, so a damaged or forged file is refused before anything changes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cabinlm.contract.layout import CacheLayout


@dataclass(frozen=True)
class SlotState:
    """The table's whole state, for session files: plain ints and one int64 array."""

    slot_token: np.ndarray  # (slots,) int64
    seen: int
    evicted: int
    sink_fill: int
    pinned_fill: int
    image_fill: int
    frames: int
    window_fill: int
    ring_next: int
    recall_fill: int = 0  # 0 in a session file written before the recall region existed
    recalls: int = 0
    local_seen: int = -1  # -1: a session file written before it existed (counters() says seen - recall_fill then)

    COUNTERS = ("seen", "evicted", "sink_fill", "pinned_fill", "image_fill", "frames", "window_fill", "ring_next",
                "recall_fill", "recalls", "local_seen")
    OPTIONAL = ("recall_fill", "recalls", "local_seen")  # counters an older session file may lack

    def counters(self) -> dict[str, int]:
        c = {k: int(getattr(self, k)) for k in self.COUNTERS}
        if c["local_seen"] == -1:  # no local layer took a region before the count existed: every token but the region's
            c["local_seen"] = c["seen"] - c["recall_fill"]
        return c


def restored_frame_start(state: SlotState, layout: CacheLayout) -> int:
    """The current frame's first stream index from a saved state: the frame is the layout.image
    tokens ending with the newest token of the image region (the sink took the first ones when the
    frame came before the sink was full). -1 when the region is empty."""
    region = state.slot_token[layout.image_start : layout.recall_start]
    held = region[region >= 0]
    if not len(held):
        return -1
    return int(held.max()) - layout.image + 1


class StateError(ValueError):
    """A saved slot state that does not describe a cache of this layout."""


def check_state(state: SlotState, layout: CacheLayout) -> None:
    """Every field of a saved state against the layout, and against each other: the fills are the
    counts of tokens in each region, the sink is the stream's first tokens, the ring's next slot
    follows its fill, and no stream index repeats or reaches `seen`. Raises StateError."""
    st = state.slot_token
    if not isinstance(st, np.ndarray) or st.dtype != np.int64 or st.shape != (layout.slots,):
        raise StateError(f"slot table: expected ({layout.slots},) int64")
    c = state.counters()
    for k, v in c.items():
        if isinstance(getattr(state, k), bool) or not 0 <= v < 2**62:
            raise StateError(f"{k} = {v} is out of range")
    lay = layout
    regions = {"sink_fill": (0, lay.sink), "pinned_fill": (lay.sink, lay.image_start),
               "image_fill": (lay.image_start, lay.recall_start), "recall_fill": (lay.recall_start, lay.window_start),
               "window_fill": (lay.window_start, lay.slots)}  # fmt: skip
    for k, (lo, hi) in regions.items():
        used = st[lo:hi] >= 0
        if c[k] != int(used.sum()):
            raise StateError(f"{k} = {c[k]} but {int(used.sum())} slots of that region hold tokens")
        if k != "image_fill" and k != "window_fill" and used.any() and not used[: c[k]].all():
            raise StateError(f"{k}: the region's slots are not filled in order")
    valid = st[st >= 0]
    if len(np.unique(valid)) != len(valid) or (len(valid) and valid.max() >= c["seen"]):
        raise StateError("the slot table repeats a stream index or holds one not yet seen")
    if not np.array_equal(st[: c["sink_fill"]], np.arange(c["sink_fill"])):
        raise StateError("the sink slots must hold the stream's first tokens")
    if c["sink_fill"] < lay.sink and c["seen"] != c["sink_fill"]:
        raise StateError(f"{c['seen']} tokens seen but the sink, which takes the first ones, holds {c['sink_fill']}")
    if c["ring_next"] >= lay.window:
        raise StateError(f"ring_next = {c['ring_next']} is beyond the window of {lay.window}")
    if c["window_fill"] < lay.window and c["ring_next"] != c["window_fill"]:
        raise StateError(f"ring_next = {c['ring_next']} but the window holds {c['window_fill']} of {lay.window}")
    if c["window_fill"] == lay.window and c["ring_next"] != int(np.argmin(st[lay.window_start :])):
        raise StateError(f"ring_next = {c['ring_next']} is not the window's oldest slot")
    if c["seen"] < len(valid) + c["evicted"]:
        raise StateError(f"{len(valid)} tokens cached and {c['evicted']} evicted, but only {c['seen']} seen")
    recalled = c["seen"] - c["local_seen"]  # tokens fed into recall regions so far
    if recalled < c["recall_fill"] or (c["recalls"] == 0 and recalled):
        raise StateError(f"local_seen = {c['local_seen']} of {c['seen']} seen leaves {recalled} recalled tokens, "
                         f"but {c['recalls']} regions began and the current one holds {c['recall_fill']}")  # fmt: skip
    if c["local_seen"] < len(valid) - c["recall_fill"] + c["evicted"]:
        raise StateError(f"{len(valid) - c['recall_fill']} stream tokens cached and {c['evicted']} evicted, but only "
                         f"{c['local_seen']} passed the local rings")  # fmt: skip
