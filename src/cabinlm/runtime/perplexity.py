"""Streaming perplexity: a text's tokens through the graph one per step, with eviction active.

With a recall region (an artifact exported with --recall R) and a TextRecall, the region is refilled
every `every` text tokens from the text that has left the window (runtime/recall.py, TextRecall): one
prefill of at most R tokens that never touches the window's K/V (docs/design.md, "The recall region"),
skipped when the chosen text is the region's already. Without one the region stays empty, which is
StreamingLLM bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.recall import TextRecall


@dataclass
class PerplexityResult:
    tokens: int
    ppl: float
    nll_mean: float
    nll: np.ndarray  # (tokens - 1,) float64: NLL of tokens 2..N given everything before (as cached)
    refreshes: int = 0  # recall-region prefills (0 without a TextRecall)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "ppl": self.ppl, "nll_mean": self.nll_mean, "recall_refreshes": self.refreshes}


def token_nll(logits: np.ndarray, target: int) -> float:
    z = logits.astype(np.float64)
    m = z.max()
    return float(m + np.log(np.exp(z - m).sum()) - z[target])


def stream_perplexity(
    decoder: Decoder, ids: list[int] | np.ndarray, progress: Callable[[int], None] | None = None,
    frame: np.ndarray | None = None, recall: TextRecall | None = None,
) -> PerplexityResult:
    """frame: a camera frame's image-token embeddings (image_tokens, embed_dim), fed first, as the
    model's processor expands one image placeholder (VisionSpec.image_prefix, the image tokens in the
    pinned image region, image_suffix); the NLL is then the text's tokens 2..N given the frame and
    the text before each. recall: the region refilled as the module docstring says (a layout with a
    recall region; `refreshes` in the result counts the prefills)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    decoder.reset()
    if frame is not None:
        feed_frame(decoder, frame)
    if recall is not None and not decoder.layout.recall:
        raise ValueError("this artifact has no recall region (export it with --recall R)")
    nll = np.empty(ids.size - 1, dtype=np.float64)
    region: tuple[int, ...] = ()
    refreshes = 0
    for i in range(ids.size - 1):
        if recall is not None and i and i % recall.every == 0:
            c = decoder.cache  # the text fed so far: ids[:i], of which the sink and the window are cached
            evicted = ids[c.sink_fill : i - c.window_fill]
            if len(evicted):
                chosen = recall.choose(evicted, ids[i - c.window_fill : i])
                if chosen != region:
                    decoder.begin_recall()
                    region = ()
                    if chosen:
                        decoder.feed(np.asarray(chosen, dtype=np.int64), pin="recall")
                    region, refreshes = chosen, refreshes + 1
        logits = decoder.step(ids[i : i + 1])[0]
        nll[i] = token_nll(logits, int(ids[i + 1]))
        if progress is not None:
            progress(i + 1)
    mean = float(nll.mean())
    return PerplexityResult(tokens=int(ids.size), ppl=float(np.exp(mean)), nll_mean=mean, nll=nll, refreshes=refreshes)


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


def feed_frame(decoder: Decoder, embeds: np.ndarray) -> None:
    """A camera frame's tokens as the model's processor lays out one image: the tokens before the
    image (Qwen2-VL: <|vision_start|>), the image tokens into the pinned image region (replacing any
    frame there), the tokens after it (<|vision_end|>)."""
    vision = decoder.manifest.vision
    if vision is None:
        raise ValueError("this model has no vision input")
    if vision.image_prefix:
        decoder.feed(np.asarray(vision.image_prefix, dtype=np.int64))
    decoder.cache.begin_frame()
    decoder.feed(np.full(len(embeds), vision.image_token_id, dtype=np.int64), pin="image", embeds=embeds)
    if vision.image_suffix:
        decoder.feed(np.asarray(vision.image_suffix, dtype=np.int64))
