"""What one benchmark run records, and the summary every engine (cabinlm and each baseline) is judged by.

A Trace is plain data (JSON-able): one entry per decoded token (its latency and the context length it
saw), one entry per prefill (tokens, seconds), and process-memory samples taken along the way. The
same `summarize` turns any trace into the figures `cabinlm bench --json` prints, so cabinlm and its
baselines are compared by one formula.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import numpy as np

# Keys of a summary, in print order (what `cabinlm bench --json` promises to print).
SUMMARY_KEYS = (
    "tokens",
    "decode_tok_s",
    "prefill_tok_s",
    "latency_ms_p50",
    "latency_ms_p99",
    "latency_ms_first_1k",
    "latency_ms_last_1k",
    "rss_mb_start",
    "rss_mb_end",
    "rss_mb_slope_per_1k",
    "evicted_tokens",
)


@dataclass
class Trace:
    engine: str  # "cabinlm", "hf", "llama.cpp", "ort-genai"
    config: dict = field(default_factory=dict)  # what ran: weights, KV type, context/window, threads ...
    decode_ms: list[float] = field(default_factory=list)  # one per decoded token
    decode_context: list[int] = field(default_factory=list)  # tokens attended by that step (cache fill)
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per prompt fed
    rss: list[tuple[int, float]] = field(default_factory=list)  # (tokens processed so far, RSS MiB)
    tokens: int = 0  # tokens processed in all (prompts + replies)
    evicted_tokens: int = 0
    turns: int = 0
    stopped: str = "done"  # "done", or why the run ended early (context full, memory/time limit, ...)
    load_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        d = dict(d)
        d["prefill"] = [tuple(x) for x in d.get("prefill", [])]
        d["rss"] = [tuple(x) for x in d.get("rss", [])]
        return cls(**d)


def _median(xs) -> float | None:
    return float(statistics.median(xs)) if len(xs) else None


def _round(x, nd=3):
    return None if x is None else round(float(x), nd)


def summarize(trace: Trace) -> dict:
    """The headline figures of a trace. Rates are medians of per-token latency (decode) and total
    tokens over total time (prefill); memory slope is a least-squares fit of RSS against tokens,
    after the first tenth of the run (allocator warm-up), in MiB per 1000 tokens."""
    ms = np.asarray(trace.decode_ms, dtype=np.float64)
    p50 = _median(ms)
    pf_tokens = sum(n for n, _ in trace.prefill)
    pf_secs = sum(s for _, s in trace.prefill)
    rss = np.asarray(trace.rss, dtype=np.float64).reshape(-1, 2)
    slope = None
    if len(rss) >= 3:
        keep = rss[rss[:, 0] >= rss[-1, 0] * 0.1]
        if len(keep) >= 2 and np.ptp(keep[:, 0]) > 0:
            slope = float(np.polyfit(keep[:, 0], keep[:, 1], 1)[0] * 1000)
    out = {
        "engine": trace.engine,
        "config": trace.config,
        "tokens": int(trace.tokens),
        "decoded_tokens": int(len(ms)),
        "decode_tok_s": _round(1000.0 / p50 if p50 else None, 2),
        # every decoded token over all decode time: where one call chooses several tokens
        # (speculative decoding), the median above and this can differ
        "decode_tok_s_overall": _round(1000.0 * len(ms) / ms.sum() if len(ms) and ms.sum() > 0 else None, 2),
        # the same over the last 1000 decoded tokens: the steady state of a long dialogue
        "decode_tok_s_last_1k_overall": _round(1000.0 * len(ms[-1000:]) / ms[-1000:].sum()
                                               if len(ms) and ms[-1000:].sum() > 0 else None, 2),  # fmt: skip
        "prefill_tok_s": _round(pf_tokens / pf_secs if pf_secs > 0 else None, 1),
        "latency_ms_p50": _round(p50),
        "latency_ms_p99": _round(np.percentile(ms, 99) if len(ms) else None),
        "latency_ms_first_1k": _round(_median(ms[:1000])),
        "latency_ms_last_1k": _round(_median(ms[-1000:])),
        "rss_mb_start": _round(rss[0, 1] if len(rss) else None, 1),
        "rss_mb_end": _round(rss[-1, 1] if len(rss) else None, 1),
        "rss_mb_slope_per_1k": _round(slope, 3),
        "evicted_tokens": int(trace.evicted_tokens),
        "turns": int(trace.turns),
        "stopped": trace.stopped,
    }
    return out


def truncate(trace: Trace, decoded: int, prefills: int) -> Trace:
    """The first `decoded` decode steps and `prefills` prompts of a trace: the part of a run that a
    shorter one (a peer whose context filled up) also went through, for a comparison over the same
    tokens and cache fill."""
    decoded, prefills = min(decoded, len(trace.decode_ms)), min(prefills, len(trace.prefill))
    tokens = sum(n for n, _ in trace.prefill[:prefills]) + decoded
    return Trace(engine=trace.engine, config=dict(trace.config, span=f"first {tokens} tokens"),
                 decode_ms=trace.decode_ms[:decoded], decode_context=trace.decode_context[:decoded],
                 prefill=trace.prefill[:prefills], rss=[r for r in trace.rss if r[0] <= tokens],
                 tokens=tokens, evicted_tokens=0, turns=0, stopped="cut")  # fmt: skip
