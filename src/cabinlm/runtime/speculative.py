"""Lossless speculative decoding by prompt lookup: drafts from the dialogue's own tokens, verified in
one chunk step, only the accepted tokens committed.

    the stream so far:  ... the tire pressure is 2.4 bar ... what is the tire pressure | [token]
                                                    ^ the last n tokens, seen before: draft what followed
    Decoder.verify([token, d1 .. dk])  one chunk, logits of every row
        row 0 decides d1, row i decides d(i+1) (Sampler.accept_draft: greedy = argmax; sampling =
        the standard rule, so the output keeps the model's distribution); the first rejection
        gives the corrected token, full acceptance a bonus token from row k
    commit [token, d1 .. d(a)]  the graph returned the chunk's K/V without writing the cache's
                                slots, so a rejected draft needs no rollback

A draft costs one chunk step instead of a decode step; DraftLength adapts k to the acceptance and
stops drafting for a while after drafts keep failing, so turns where drafts fail are not slower.
Drafting is exact only while a verified chunk evicts nothing (see _room): it runs while the window
fills, and a dialogue whose window has turned over decodes one token per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cabinlm.engines.backend import Backend
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.sampler import Sampler


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


@dataclass
class Speculation:
    """Prompt lookup and its draft length for one dialogue, with counts for reports."""

    lookup: PromptLookup = field(default_factory=PromptLookup)
    length: DraftLength = field(default_factory=DraftLength)
    drafted: int = 0
    accepted: int = 0
    paused: bool = False  # no drafts while set; the lookup still observes the stream

    def reset(self) -> None:
        self.lookup.reset()


@dataclass
class Reply:
    ids: list[int] = field(default_factory=list)
    finish: str = "length"  # "stop", "length" or "interrupted"
    unfed: list[int] = field(default_factory=list)  # chosen but not yet in the cache: fed with the next prompt
    drafted: int = 0
    accepted: int = 0


def decode_reply(dec: Decoder, sampler: Sampler, logits: np.ndarray, max_new: int, stop_ids: set[int],
                 on_token: Callable[[int], None], spec: Speculation | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Reply:
    """Choose reply tokens from `logits` (the prompt's last) until a stop id or max_new tokens; each
    token but the last is fed; with `spec`, drafts are verified in chunks. Ctrl-C, or should_stop()
    (asked before each token is chosen or drafts are verified), ends the reply with finish
    "interrupted", the cache holding exactly the tokens the reply says were fed."""
    r = Reply()

    def stopped() -> bool:
        if should_stop is not None and should_stop():
            r.finish = "interrupted"
            return True
        return False

    try:
        if stopped():
            return r
        token = sampler(logits)
        while True:
            if token in stop_ids:
                r.finish = "stop"
                break
            r.ids.append(token)
            on_token(token)
            r.unfed = [token]
            if spec is not None:
                spec.lookup.observe([token])
            if len(r.ids) == max_new:
                break  # the last token is fed with the next prompt
            if stopped():
                break
            drafts = next_drafts(dec, spec) if spec is not None else []
            if drafts:
                token = _verify(dec, sampler, token, drafts, max_new - len(r.ids), stop_ids, on_token, spec, r)
                continue
            seen = dec.cache.seen
            try:
                logits = dec.step(np.array([token], dtype=np.int64))[0]
            finally:
                if dec.cache.seen > seen:
                    r.unfed = []
            token = sampler(logits)
    except KeyboardInterrupt:
        r.finish = "interrupted"
    return r


def drafting_by_default(backend: Backend) -> tuple[bool, str]:
    """Whether `cabinlm chat`, `bench` and `serve` draft unless told, and why not (for the notice):
    only where a draft check is cheap and its rows are bit for bit the plain steps' (Backend)."""
    if backend.fixed_chunk:
        return False, (f"this build's prefill graph always runs {backend.layout.chunk} tokens, so checking a draft "
                       "costs a whole chunk")  # fmt: skip
    if not backend.rows_match_steps:
        return False, ("this build's chunk rows match its one-token steps only to rounding, so a checked draft could "
                       "break a greedy near-tie differently from plain decoding (the fused cpu build drafts by default)")
    return True, ""


def next_drafts(dec: Decoder, spec: Speculation) -> list[int]:
    """The drafts to verify after the stream's last token: as many as the draft length, the chunk and
    the room before eviction allow (none while drafting pauses, or where no n-gram matches)."""
    if spec.paused:
        return []
    k = min(spec.length.next(), dec.layout.chunk - 1, _room(dec))
    return spec.lookup.draft(k) if k > 0 else []


def advance(dec: Decoder, sampler: Sampler, token: int, budget: int, stop_ids: set[int],
            spec: Speculation) -> list[int]:
    """Feed `token` (chosen, not yet fed) and return what the stream chooses after it, at most
    `budget` tokens: with drafts, the accepted drafts (now fed) and then the next token (chosen, not
    fed); without, the one token a plain step chooses. A stop id is never fed. The lookup observes
    `token` and the accepted drafts. (The step decode_reply takes, for callers that own the reply
    loop and its output, such as `cabinlm bench`.)"""
    spec.lookup.observe([token])
    drafts = next_drafts(dec, spec) if budget > 1 else []
    if not drafts:
        return [sampler(dec.step(np.array([token], dtype=np.int64))[0])]
    r = Reply()
    nxt = _verify(dec, sampler, token, drafts, budget, stop_ids, lambda t: None, spec, r)
    return [*r.ids, nxt]


def _room(dec: Decoder) -> int:
    """How many drafts a verification may carry so that its chunk evicts nothing. A chunk's tokens
    all see the cache as it was before the chunk (DESIGN.md's semantics), so once the window is
    full, token i of a chunk would still see the i oldest window tokens that i one-token steps
    evict, and sit i positions further from the sink and pinned tokens than it would after them:
    no single graph run can give each row its own ranks. Drafting stops there, so a reply is token
    for token what plain decoding gives (greedy) or distributed as it (sampled)."""
    if dec.layout.kv_dtype.value == "fp8" and dec.manifest.runtime_spec.backend.value != "onnxruntime-fused":
        return 0  # the exported fp8-KV graph's chunk attends to its own K/V unquantized: not exact
    return dec.layout.window - dec.cache.window_fill - 1


def _verify(dec: Decoder, sampler: Sampler, token: int, drafts: list[int], budget: int, stop_ids: set[int],
            on_token: Callable[[int], None], spec: Speculation, r: Reply) -> int:
    """One verification: [token, drafts] as a chunk; returns the next token (a correction, a bonus,
    a stop id or the draft that reaches max_new), chosen but not fed."""
    chosen: list[int] = []  # the token each row decided, in order

    def accept(rows: np.ndarray) -> int:
        for i, d in enumerate(drafts):
            ok, t = sampler.accept_draft(rows[i], d)
            chosen.append(t)
            # a rejection, a stop id (never fed) or the reply's last token (fed with the next
            # prompt) ends the accepted run before this draft
            if not ok or t in stop_ids or len(chosen) >= budget:
                return 1 + i
        chosen.append(sampler(rows[len(drafts)]))
        return 1 + len(drafts)

    seen = dec.cache.seen
    try:
        dec.verify(np.array([token, *drafts], dtype=np.int64), accept)
    finally:
        fed = dec.cache.seen - seen  # 0, or 1 + the accepted drafts (committed together)
        if fed:
            r.unfed = []
            for t in chosen[: fed - 1]:
                r.ids.append(t)
                on_token(t)
                spec.lookup.observe([t])
    accepted = fed - 1
    spec.length.update(len(drafts), accepted)
    spec.drafted += len(drafts)
    spec.accepted += accepted
    r.drafted += len(drafts)
    r.accepted += accepted
    return chosen[fed - 1]
