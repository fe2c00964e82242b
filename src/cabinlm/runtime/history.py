"""A seat's history: every chunk it committed since its reset, in order, kept compactly so that a
switch of its LoRA adapter can run them again (Decoder.set_adapter) and a session file can keep them.

    runs  (entries, 2) int32   per entry: its kind (Kind), its token count
    ids   (tokens,)    int32   the entries' token ids, one after another

An entry is one committed step, as the Decoder planned it:

    WINDOW        a chunk of window tokens (a prompt's chunk, one decoded token)
    PINNED        a chunk of the pinned region (the system prompt)
    RECALL        a chunk of the recall region (recalled text)
    VERIFIED      window tokens a verification kept (speculative decoding): planned as the
                  verification planned them (Decoder.plan_chunk(verify=True)), one-token steps where
                  the backend runs a chunk's rows so
    BEGIN_RECALL  the recall region emptied before new recalled text (no tokens)

Running the entries again in order, each planned as it was, on a reset seat makes the slot table
what it was, and the cache what a seat with the new adapter fed the same steps holds. A camera frame
(its image embeddings are not kept) cannot be run again: the history is then unknown (None).

Size: 4 bytes per token fed plus 8 per step; a dialogue's decoded tokens are one step each, so about
12 bytes per token of the stream, against the cache's fixed size (e.g. 12.8 MiB of int8 K/V for
SmolLM2-135M with 1148 slots): an hour of a stream at 10 tokens a second is 36,000 tokens, 0.4 MiB.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum

import numpy as np

from cabinlm.contract.errors import InputError
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.slot_state import SlotState
from cabinlm.contract.slots import SlotTable

PINS = {False: 0, True: 1, "recall": 2}


class Kind(IntEnum):
    WINDOW = 0
    PINNED = 1
    RECALL = 2
    VERIFIED = 3
    BEGIN_RECALL = 4

    @property
    def pin(self) -> bool | str:
        """The pin a step of this kind was fed with (Decoder.step's pin)."""
        return {Kind.PINNED: True, Kind.RECALL: "recall"}.get(self, False)


class HistoryError(ValueError):
    """Arrays that are not a history (a session file's, checked before use)."""


class History:
    """The entries, in two growable int32 arrays (doubling: appending a step is amortised O(its tokens))."""

    def __init__(self) -> None:
        self._runs = np.zeros((16, 2), dtype=np.int32)
        self._ids = np.zeros(256, dtype=np.int32)
        self.entries = 0
        self.tokens = 0

    def add(self, ids: np.ndarray, pin: bool | str, verified: bool = False) -> None:
        """A committed step of len(ids) tokens (pin: Decoder.step's; verified: kept by a verification)."""
        kind = Kind.VERIFIED if verified else Kind(PINS[pin])
        n = len(ids)
        self._grow(1, n)
        self._runs[self.entries] = (kind, n)
        self._ids[self.tokens : self.tokens + n] = ids
        self.entries += 1
        self.tokens += n

    def begin_recall(self) -> None:
        self._grow(1, 0)
        self._runs[self.entries] = (Kind.BEGIN_RECALL, 0)
        self.entries += 1

    def _grow(self, entries: int, tokens: int) -> None:
        if self.entries + entries > len(self._runs):
            more = max(len(self._runs), entries, 16)
            self._runs = np.concatenate([self._runs, np.zeros((more, 2), dtype=np.int32)])
        if self.tokens + tokens > len(self._ids):
            more = max(len(self._ids), tokens, 256)
            self._ids = np.concatenate([self._ids, np.zeros(more, dtype=np.int32)])

    def __iter__(self) -> Iterator[tuple[Kind, np.ndarray]]:
        """(kind, ids int64) per entry, in order (views of the ids would not survive a later add)."""
        start = 0
        for kind, n in self._runs[: self.entries].tolist():
            yield Kind(kind), self._ids[start : start + n].astype(np.int64)
            start += n

    def __len__(self) -> int:
        return self.entries

    @property
    def recalls(self) -> int:
        """BEGIN_RECALL entries: the slot table's recalls counter after these steps."""
        return int(np.count_nonzero(self._runs[: self.entries, 0] == Kind.BEGIN_RECALL))

    @property
    def nbytes(self) -> int:
        """What arrays() holds (a session file's bytes for it)."""
        return byte_count(self.entries, self.tokens)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(runs (entries, 2) int32, ids (tokens,) int32): the module docstring's layout."""
        return self._runs[: self.entries], self._ids[: self.tokens]

    @classmethod
    def from_arrays(cls, runs: np.ndarray, ids: np.ndarray, vocab: int, chunk: int) -> History:
        """A history from arrays() (a session file's), every field checked: HistoryError when an entry's
        kind, its length (1..chunk tokens, none for BEGIN_RECALL), the lengths' sum or an id (0..vocab-1)
        is not one a seat could have committed."""
        runs = np.asarray(runs, dtype=np.int32).reshape(-1, 2)
        ids = np.asarray(ids, dtype=np.int32)
        kinds, lengths = runs[:, 0], runs[:, 1]
        if len(kinds) and (kinds.min() < 0 or kinds.max() > max(Kind)):
            raise HistoryError(f"a history entry of kind {int(kinds.min() if kinds.min() < 0 else kinds.max())}, "
                               f"not 0..{int(max(Kind))}")  # fmt: skip
        marks = kinds == Kind.BEGIN_RECALL
        if (lengths[marks] != 0).any() or ((lengths[~marks] < 1) | (lengths[~marks] > chunk)).any():
            raise HistoryError(f"a history entry's length is outside 1..{chunk} tokens (0 for a recall region's start)")
        held = int(lengths.sum(dtype=np.int64))
        if held != len(ids):
            raise HistoryError(f"the history's entries hold {held} tokens, its ids {len(ids)}")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise HistoryError(f"a history token id outside 0..{vocab - 1}")
        h = cls()
        h._runs, h._ids = runs.copy(), ids.copy()
        h.entries, h.tokens = len(runs), len(ids)
        return h


def check_replay(history: History, layout: CacheLayout, state: SlotState) -> None:
    """The slot table's bookkeeping of the history's steps, from a reset table (no graph runs): every
    step must be one the table can plan, and the table must end as `state` (a session file's), so
    that running the history again (a switch) cannot fail halfway and rebuilds this cache's slots.
    HistoryError otherwise."""
    table = SlotTable(layout)
    for i, (kind, ids) in enumerate(history):
        try:
            if kind is Kind.BEGIN_RECALL:
                table.begin_recall()
            else:
                table.advance(table.plan(len(ids), kind.pin))
        except (InputError, ValueError) as e:
            raise HistoryError(f"step {i} ({kind.name.lower()}, {len(ids)} tokens) cannot follow the ones before it "
                               f"({e})") from e  # fmt: skip
    if not np.array_equal(table.slot_token, state.slot_token) or table.state().counters() != state.counters():
        raise HistoryError("its steps do not lead to the saved slot table")


def byte_count(entries: int, tokens: int) -> int:
    return 8 * entries + 4 * tokens
