"""The reply loop: reply tokens chosen from the prompt's last logits until a stop id or the length
limit, each token but the last fed, with drafts from a drafting strategy (runtime/speculative.py)
verified in chunks. Plain decoding is the strategy that drafts nothing; the loop is the same.

    token = sampler(logits)
    loop:  stop id -> done (never fed)         max_new -> done (the last token is fed with the next prompt)
           drafts = drafting.propose(dec)
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

from cabinlm.runtime.decoder import Decoder
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
            drafts = drafting.propose(dec)
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
    drafts = drafting.propose(dec) if budget > 1 else ()
    if not drafts:
        return [sampler(dec.step(np.array([token], dtype=np.int64))[0])]
    r = Reply()
    nxt = _verify(dec, sampler, token, drafts, budget, stop_ids, lambda t: None, drafting, r)
    return [*r.ids, nxt]


def _verify(dec: Decoder, sampler: Sampler, token: int, drafts: Sequence[int], budget: int, stop_ids: set[int],
            on_token: Callable[[int], None], drafting: Drafting, r: Reply) -> int:
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
                drafting.push(t)
    accepted = fed - 1
    drafting.verified(len(drafts), accepted)
    r.drafted += len(drafts)
    r.accepted += accepted
    return chosen[fed - 1]
