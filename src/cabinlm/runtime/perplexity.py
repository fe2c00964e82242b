"""Streaming perplexity: a text's tokens through the graph one per step, with eviction active."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from cabinlm.runtime.decoder import Decoder


@dataclass
class PerplexityResult:
    tokens: int
    ppl: float
    nll_mean: float
    nll: np.ndarray  # (tokens - 1,) float64: NLL of tokens 2..N given everything before (as cached)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "ppl": self.ppl, "nll_mean": self.nll_mean}


def token_nll(logits: np.ndarray, target: int) -> float:
    z = logits.astype(np.float64)
    m = z.max()
    return float(m + np.log(np.exp(z - m).sum()) - z[target])


def stream_perplexity(
    decoder: Decoder, ids: list[int] | np.ndarray, progress: Callable[[int], None] | None = None
) -> PerplexityResult:
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    decoder.reset()
    nll = np.empty(ids.size - 1, dtype=np.float64)
    for i in range(ids.size - 1):
        logits = decoder.step(ids[i : i + 1])[0]
        nll[i] = token_nll(logits, int(ids[i + 1]))
        if progress is not None:
            progress(i + 1)
    mean = float(nll.mean())
    return PerplexityResult(tokens=int(ids.size), ppl=float(np.exp(mean)), nll_mean=mean, nll=nll)


def chunked_perplexity(decoder: Decoder, ids: list[int] | np.ndarray) -> PerplexityResult:
    """The same measure with prefill-sized chunks (C tokens per step): faster, the same semantics."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    decoder.reset()
    logits = decoder.feed(ids[:-1], all_logits=True)
    nll = np.array([token_nll(logits[i], int(ids[i + 1])) for i in range(ids.size - 1)])
    mean = float(nll.mean())
    return PerplexityResult(tokens=int(ids.size), ppl=float(np.exp(mean)), nll_mean=mean, nll=nll)
