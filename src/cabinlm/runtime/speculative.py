"""Drafting strategies for the reply loop (runtime/reply.py): what to verify after the stream's last
token. Plain decoding is the strategy that drafts nothing; lossless speculative decoding by prompt
lookup drafts from the dialogue's own tokens.

    the stream so far:  ... the tire pressure is 2.4 bar ... what is the tire pressure | [token]
                                                    ^ the last n tokens, seen before: draft what followed
    Decoder.verify([token, d1 .. dk])  one chunk, logits of every row (the reply loop)

A draft costs one chunk step instead of a decode step; DraftLength adapts k to the acceptance and
stops drafting for a while after drafts keep failing, so turns where drafts fail are not slower.
How many drafts a verification may carry is the Decoder's to say (Decoder.draft_room: the chunk,
no eviction, and a backend whose chunk rows are its steps); whether drafting is on unless told is
the backend's (drafting_by_default: its properties, never its kind).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cabinlm.engines.backend import Backend
    from cabinlm.runtime.decoder import Decoder


class PromptLookup:
    """The continuation of the latest earlier occurrence of the stream's last n tokens (n from
    `longest` down to `shortest`), over the last `capacity` tokens of the stream (bounded memory)."""

    def __init__(self, capacity: int = 4096, longest: int = 3, shortest: int = 2):
        self.capacity = capacity
        self.longest = longest
        self.shortest = shortest
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        # n-gram -> (end index of its latest occurrence, end index of the one before it, or -1)
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}

    def observe(self, ids) -> None:
        """Tokens of the stream, in order (prompts as fed, reply tokens as chosen)."""
        for t in ids:
            self.tokens.append(int(t))
            self._index(len(self.tokens) - 1)
        if len(self.tokens) > 2 * self.capacity:  # keep the latest `capacity`, index them again
            self.tokens = self.tokens[-self.capacity :]
            self._ends = {}
            for i in range(len(self.tokens)):
                self._index(i)

    def _index(self, end: int) -> None:
        for n in range(1, min(self.longest, end + 1) + 1):
            key = tuple(self.tokens[end - n + 1 : end + 1])
            latest = self._ends.get(key)
            self._ends[key] = (end, latest[0] if latest else -1)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest matching suffix."""
        if k < 1 or not self.tokens:
            return []
        last = len(self.tokens) - 1
        for n in range(min(self.longest, len(self.tokens)), self.shortest - 1, -1):
            seen = self._ends.get(tuple(self.tokens[-n:]))
            if seen is not None and seen[1] >= 0:  # seen[0] is the suffix itself
                start = seen[1] + 1
                return self.tokens[start : min(start + k, last + 1)]
        return []


@dataclass
class DraftLength:
    """How many tokens to draft next: grows while drafts are accepted whole, falls to what was
    accepted, and pauses drafting (for longer each time, up to `longest_pause` steps) after
    `patience` verifications in a row accepted nothing."""

    longest: int = 8
    start: int = 4
    patience: int = 3
    longest_pause: int = 64
    k: int = field(init=False)
    _misses: int = field(init=False, default=0)
    _pause: int = field(init=False, default=0)
    _pause_len: int = field(init=False, default=8)

    def __post_init__(self) -> None:
        self.k = min(self.start, self.longest)

    def next(self) -> int:
        """0: do not draft this step."""
        if self._pause:
            self._pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.k = min(self.longest, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self._misses, self._pause_len = 0, 8
            return
        self._misses += 1
        if self._misses >= self.patience:
            self._misses, self._pause = 0, self._pause_len
            self._pause_len = min(self.longest_pause, 2 * self._pause_len)


class Drafting(abc.ABC):
    """A reply loop's drafting strategy. The loop tells it every token that joins the stream (the
    prompt as fed, each reply token as chosen, a client's reply fed by template), asks it for drafts
    after each chosen token, and reports each verification. Counts accumulate for reports."""

    drafts: bool  # False: the strategy never drafts (plain decoding)

    def __init__(self) -> None:
        self.drafted = 0  # tokens drafted, over the strategy's life
        self.accepted = 0  # and how many the model accepted
        self._paused = False

    def reset(self) -> None:
        """The stream starts over (a dialogue's reset)."""

    def observe(self, ids: Iterable[int]) -> None:
        """Tokens that joined the stream, in order."""

    def push(self, token: int) -> None:
        """One token that joined the stream (a reply token as chosen): observe([token]) without the list."""

    @abc.abstractmethod
    def propose(self, dec: Decoder) -> Sequence[int]:
        """The drafts to verify after the stream's last token on `dec` (at most dec.draft_room()):
        empty for a plain one-token step."""

    def verified(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts accepted the first `accepted` of them."""
        self.drafted += drafted
        self.accepted += accepted

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No drafts inside (a replayed exchange, whose recorded choices a verified draft could run
        past); the strategy still observes the stream."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


class PlainDecoding(Drafting):
    """Drafts nothing: every reply token is one decode step."""

    drafts = False

    def propose(self, dec: Decoder) -> Sequence[int]:
        return ()


class PromptLookupDrafting(Drafting):
    """Lossless speculative decoding by prompt lookup: drafts from the stream's own tokens, as many
    as the draft length and the decoder's room allow (none while paused, or where no n-gram matches)."""

    drafts = True

    def __init__(self, lookup: PromptLookup | None = None, length: DraftLength | None = None) -> None:
        super().__init__()
        self.lookup = lookup if lookup is not None else PromptLookup()
        self.length = length if length is not None else DraftLength()

    def reset(self) -> None:
        self.lookup.reset()

    def observe(self, ids: Iterable[int]) -> None:
        self.lookup.observe(ids)

    def push(self, token: int) -> None:
        self.lookup.observe((token,))

    def propose(self, dec: Decoder) -> Sequence[int]:
        if self._paused:
            return ()
        k = min(self.length.next(), dec.draft_room())
        return self.lookup.draft(k) if k > 0 else ()

    def verified(self, drafted: int, accepted: int) -> None:
        self.length.update(drafted, accepted)
        super().verified(drafted, accepted)


def drafting_by_default(backend: Backend) -> tuple[bool, str]:
    """Whether `cabinlm chat`, `bench` and `serve` draft unless told, and why not (for the notice):
    only where a draft check is cheap and its rows are bit for bit the plain steps' (Backend's
    properties: fixed_chunk, verifies_drafts, rows_match_steps)."""
    if backend.fixed_chunk:
        return False, (f"this build's prefill graph always runs {backend.layout.chunk} tokens, so checking a draft "
                       "costs a whole chunk")  # fmt: skip
    if not backend.verifies_drafts:
        return False, ("this build's chunks attend to their own keys and values at a precision the cache does not "
                       "keep, so a checked draft is not a plain step")  # fmt: skip
    if not backend.rows_match_steps:
        return False, ("this build's chunk rows match its one-token steps only to rounding, so a checked draft could "
                       "break a greedy near-tie differently from plain decoding (the fused cpu build drafts by default)")
    return True, ""
