"""The reply loop: reply tokens chosen from the prompt's last logits until a stop id or the length
limit, each token but the last fed, with drafts from a drafting strategy (runtime/speculative.py)
verified in chunks. Plain decoding is the strategy that drafts nothing; the loop is the same.

    token = sampler(logits)
    loop:  stop id -> done (never fed)         max_new -> done (the last token is fed with the next prompt)
           drafts = drafting.propose(dec), cut to what the sampler's constraint admits (runtime/grammar.py)
           none:   logits = dec.step([token]); token = sampler(logits)
           some:   dec.verify([token, d1 .. dk])  one chunk, logits of every row
                   row 0 decides d1, row i decides d(i+1) (Sampler.accept_draft: greedy = argmax;
                   sampling = the standard rule, so the output keeps the model's distribution); the
                   first rejection gives the corrected token, full acceptance a bonus token from row k
                   commit [token, d1 .. d(a)]: the graph returned the chunk's K/V without writing the
                   cache's slots, so a rejected draft needs no rollback

Invariant: Reply.unfed is exactly the reply's tokens that the cache does not hold (the last one
chosen, or none), whatever interrupts the loop (Ctrl-C, should_stop), so the dialogue closes the turn
by feeding them with the next prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cabinlm.runtime.decoder import Decoder, seats_together
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.speculative import Drafting


@dataclass
class Reply:
    ids: list[int] = field(default_factory=list)
    finish: str = "length"  # "stop", "length" or "interrupted"
    unfed: list[int] = field(default_factory=list)  # chosen but not yet in the cache: fed with the next prompt
    drafted: int = 0  # drafts verified in this reply
    accepted: int = 0  # and accepted


def decode_reply(dec: Decoder, sampler: Sampler, logits: np.ndarray, max_new: int, stop_ids: set[int],
                 on_token: Callable[[int], None], drafting: Drafting,
                 should_stop: Callable[[], bool] | None = None) -> Reply:  # fmt: skip
    """Choose reply tokens from `logits` (the prompt's last) until a stop id or max_new tokens; each
    token but the last is fed; `drafting` proposes drafts, verified in chunks. Ctrl-C, or
    should_stop() (asked before each token is chosen or drafts are verified), ends the reply with
    finish "interrupted", the cache holding exactly the tokens the reply says were fed."""
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
            drafting.push(token)
            if len(r.ids) == max_new:
                break  # the last token is fed with the next prompt
            if stopped():
                break
            drafts = sampler.admissible(drafting.propose(dec))  # a constraint's grammar-valid prefix
            if drafts:
                token = _verify(dec, sampler, token, drafts, max_new - len(r.ids), stop_ids, on_token, drafting, r)
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


def advance(dec: Decoder, sampler: Sampler, token: int, budget: int, stop_ids: set[int], drafting: Drafting) -> list[int]:
    """Feed `token` (chosen, not yet fed) and return what the stream chooses after it, at most
    `budget` tokens: with drafts, the accepted drafts (now fed) and then the next token (chosen, not
    fed); without, the one token a plain step chooses. A stop id is never fed. The strategy observes
    `token` and the accepted drafts. (The step decode_reply takes, for callers that own the reply
    loop and its output, such as `cabinlm bench`.)"""
    drafting.push(token)
    drafts = sampler.admissible(drafting.propose(dec)) if budget > 1 else ()
    if not drafts:
        return [sampler(dec.step(np.array([token], dtype=np.int64))[0])]
    r = Reply()
    nxt = _verify(dec, sampler, token, drafts, budget, stop_ids, lambda t: None, drafting, r)
    return [*r.ids, nxt]


def advance_seats(decs: Sequence[Decoder], samplers: Sequence[Sampler], tokens: Sequence[int], budgets: Sequence[int],
                  stop_ids: set[int], draftings: Sequence[Drafting],
                  prompts: Sequence[np.ndarray | None] | None = None) -> list[list[int]]:  # fmt: skip
    """advance() for several seats of one loaded model in one run (runtime.seats_together): each seat's
    token fed, with its own drafts verified where its strategy proposes some, the others' plain steps
    beside them. Returns each seat's tokens, what advance() on that seat alone returns (bit for bit on
    the fused cpu build: tests/test_batched_drafting.py). An interrupted run feeds no seat.

    prompts[i], where given: seat i feeds that piece of a prompt instead (at most the cache's chunk,
    unpinned; its strategy observes the prompt itself; tokens[i] and budgets[i] are not read) and gets
    [the token its last row chooses]: the prompt's next token once its last piece is fed, as
    Decoder.feed in pieces of a chunk gives it. A seat's prompt rides with the others' steps."""
    chunks, checks = [], []
    pieces = list(prompts) if prompts is not None else [None] * len(decs)
    for dec, sampler, token, budget, drafting, piece in zip(decs, samplers, tokens, budgets, draftings, pieces, strict=True):
        if piece is not None:
            chunks.append(np.ascontiguousarray(piece, dtype=np.int64))
            checks.append(None)
            continue
        drafting.push(token)
        drafts = sampler.admissible(drafting.propose(dec)) if budget > 1 else ()
        chunks.append(np.array([token, *drafts], dtype=np.int64))
        checks.append(_Check(sampler, drafts, budget, stop_ids) if drafts else None)
    got = seats_together(decs, chunks, accepts=checks)
    out = []
    for (logits, kept), check, sampler, drafting in zip(got, checks, samplers, draftings):
        if check is None:
            out.append([sampler(logits[-1])])
            continue
        r = Reply()
        check.take(kept, lambda t: None, drafting, r)
        out.append([*r.ids, check.tally(kept, drafting, r)])
    return out


class _Check:
    """One verification of [token, drafts]: its accept() (Decoder.verify, seats_together), then what
    follows the commit (take, tally)."""

    def __init__(self, sampler: Sampler, drafts: Sequence[int], budget: int, stop_ids: set[int]):
        self.sampler, self.drafts, self.budget, self.stop_ids = sampler, list(drafts), budget, stop_ids
        self.chosen: list[int] = []  # the token each row decided, in order

    def __call__(self, rows: np.ndarray) -> int:
        for i, d in enumerate(self.drafts):
            ok, t = self.sampler.accept_draft(rows[i], d)
            self.chosen.append(t)
            # a rejection, a stop id (never fed) or the reply's last token (fed with the next
            # prompt) ends the accepted run before this draft
            if not ok or t in self.stop_ids or len(self.chosen) >= self.budget:
                return 1 + i
        self.chosen.append(self.sampler(rows[len(self.drafts)]))
        return 1 + len(self.drafts)

    def take(self, fed: int, on_token: Callable[[int], None], drafting: Drafting, r: Reply) -> None:
        """`fed` tokens were committed (0: none; else 1 + the accepted drafts): the accepted drafts join
        the reply (also when the verification is interrupted right after its commit)."""
        if fed:
            r.unfed = []
            for t in self.chosen[: fed - 1]:
                r.ids.append(t)
                on_token(t)
                drafting.push(t)

    def tally(self, fed: int, drafting: Drafting, r: Reply) -> int:
        """The verification's counts; returns the next token (a correction, a bonus, a stop id or the
        draft that reaches max_new), chosen but not fed."""
        accepted = fed - 1
        drafting.verified(len(self.drafts), accepted)
        r.drafted += len(self.drafts)
        r.accepted += accepted
        return self.chosen[fed - 1]


def _verify(dec: Decoder, sampler: Sampler, token: int, drafts: Sequence[int], budget: int, stop_ids: set[int],
            on_token: Callable[[int], None], drafting: Drafting, r: Reply) -> int:
    """One verification: [token, drafts] as a chunk; returns the next token (a correction, a bonus,
    a stop id or the draft that reaches max_new), chosen but not fed."""
    check = _Check(sampler, drafts, budget, stop_ids)
    seen = dec.cache.seen
    try:
        dec.verify(np.array([token, *drafts], dtype=np.int64), check)
    finally:
        fed = dec.cache.seen - seen  # 0, or 1 + the accepted drafts (committed together)
        check.take(fed, on_token, drafting, r)
    return check.tally(fed, drafting, r)
