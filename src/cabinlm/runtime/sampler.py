"""Next-token choice: greedy, or temperature with top-k / top-p (nucleus), seeded; and, where asked,
each chosen token's log probability with the likeliest alternatives (OpenAI's logprobs)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cabinlm.contract.errors import OptionError

if TYPE_CHECKING:
    from cabinlm.runtime.grammar import Constraint


@dataclass
class Sampler:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    # What the reply must follow (runtime/grammar.py): every choice is made from the masked logits
    # and consumed by it, draft checks included. None: unconstrained.
    constraint: Constraint | None = None
    # OpenAI's logprobs: None records nothing; k (0..20) records, for every token chosen (a plain
    # step's, or a draft check's row by row), its log probability and the k likeliest tokens', from
    # the model's raw logits of that position: before the grammar's mask, temperature or top-p.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # OptionErrors named as the command line spells them; NaN fails every comparison, so each
        # check asks for what is allowed rather than refusing what is not.
        if not (_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise OptionError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise OptionError(f"--top-p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise OptionError(f"--top-k must be a whole number >= 0, got {self.top_k!r}")
        try:
            self.rng = np.random.default_rng(self.seed)
        except (TypeError, ValueError) as e:
            raise OptionError(f"--seed must be a whole number >= 0, got {self.seed!r}") from e
        # Invariant: scores[i] is the i-th token chosen (the stop id that ends a reply included).
        self.scores: list[TokenScore] = []

    def __call__(self, logits: np.ndarray) -> int:
        raw = logits
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if self.temperature == 0:
            token = int(np.argmax(logits))
        else:
            p = self.probs(logits)
            token = int(self.rng.choice(p.size, p=p))
        if self.constraint is not None:
            self.constraint.consume(token)
        self._score(raw, token)
        return token

    def _score(self, logits: np.ndarray, token: int) -> None:
        if self.logprobs is not None:
            self.scores.append(score(logits, token, self.logprobs))

    def admissible(self, drafts):
        """The drafts the constraint lets follow the reply so far (all of them without one): the
        reply loop verifies only these."""
        if self.constraint is None:
            return drafts
        return drafts[: self.constraint.admissible(drafts)]

    def accept_draft(self, logits: np.ndarray, draft: int) -> tuple[bool, int]:
        """Speculative decoding's acceptance rule for a drafted token (a draft that is one token for
        sure, as prompt lookup drafts): greedy accepts it when it is the argmax; sampling accepts it
        with probability p(draft) and otherwise samples from p with the draft removed (renormalized),
        which is max(0, p - q) for a point-mass draft q: the token that comes out is distributed as p
        exactly. Returns (accepted, the token). With a constraint, p is that of the masked logits
        and the token that comes out joins the constraint's reply."""
        if self.constraint is not None:
            ok, token = self._accept_draft(self.constraint.mask(logits), draft)
            self.constraint.consume(token)
        else:
            ok, token = self._accept_draft(logits, draft)
        self._score(logits, token)
        return ok, token

    def _accept_draft(self, logits: np.ndarray, draft: int) -> tuple[bool, int]:
        if self.temperature == 0:
            token = int(np.argmax(logits))
            return token == draft, token
        p = self.probs(logits)
        if self.rng.random() < p[draft]:
            return True, int(draft)
        rest = p.copy()
        rest[draft] = 0.0
        total = rest.sum()
        if total <= 0:  # p is all on the draft (then the draft was accepted above, save for rounding)
            return True, int(draft)
        return False, int(self.rng.choice(rest.size, p=rest / total))

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a sampled token is drawn from (temperature > 0): float64, sums to 1."""
        z = logits.astype(np.float64) / self.temperature
        if self.top_k:
            k = min(self.top_k, z.size)
            cut = np.partition(z, -k)[-k]
            z = np.where(z >= cut, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p)
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return p


@dataclass(frozen=True)
class TokenScore:
    """A chosen token's log probability under the model, and the `top` likeliest tokens' (id, log
    probability), likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The model's log probabilities of one position (float64)."""
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def score(logits: np.ndarray, token: int, top: int) -> TokenScore:
    lp = log_softmax(logits)
    best: list[tuple[int, float]] = []
    if top:
        k = min(top, lp.size)
        ids = np.argpartition(-lp, k - 1)[:k]
        ids = ids[np.lexsort((ids, -lp[ids]))]  # likeliest first; ties by id
        best = [(int(i), float(lp[i])) for i in ids]
    return TokenScore(int(token), float(lp[token]), tuple(best))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
