"""`cabinlm bench`: the summary formulas against numpy on known traces, and real runs of the command
(SmolLM2 through the runtime; transformers as the baseline) whose JSON must be consistent."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from cabinlm.bench.trace import SUMMARY_KEYS, Trace, summarize


def cabinlm(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "cabinlm", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_summary_of_a_known_trace():
    rng = np.random.default_rng(3)
    ms = rng.uniform(10, 20, size=3000)
    ms[:1000] += 5  # a slower start
    t = Trace(engine="x", decode_ms=list(ms), decode_context=list(range(3000)), prefill=[(100, 0.5), (300, 0.5)],
              rss=[(k, 300.0 + 2.5 * k / 1000) for k in range(0, 5000, 64)], tokens=5000, evicted_tokens=7)  # fmt: skip
    s = summarize(t)
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["latency_ms_p50"] == pytest.approx(np.median(ms), abs=1e-3)
    assert s["decode_tok_s"] == pytest.approx(1000 / np.median(ms), abs=0.01)
    assert s["latency_ms_p99"] == pytest.approx(np.percentile(ms, 99), abs=1e-3)
    assert s["latency_ms_first_1k"] == pytest.approx(np.median(ms[:1000]), abs=1e-3)
    assert s["latency_ms_last_1k"] == pytest.approx(np.median(ms[-1000:]), abs=1e-3)
    assert s["prefill_tok_s"] == pytest.approx(400.0)
    assert s["rss_mb_slope_per_1k"] == pytest.approx(2.5, abs=1e-6)
    assert s["rss_mb_start"] == 300.0 and s["evicted_tokens"] == 7
    empty = summarize(Trace(engine="y"))
    assert empty["decode_tok_s"] is None and empty["rss_mb_slope_per_1k"] is None


def test_cabinlm_is_also_summarized_over_a_shorter_baselines_span():
    """A peer whose context filled up stops early: cabinlm is then also judged over the same prompts
    and replies (the same cache fill), next to its whole run."""
    from cabinlm.bench.runner import summaries

    ms = list(np.r_[np.full(500, 10.0), np.full(1500, 20.0)])  # faster while the cache fills
    cab = Trace(engine="cabinlm", decode_ms=ms, decode_context=list(range(2000)), prefill=[(100, 0.25)] * 30,
                rss=[(k, 300.0) for k in range(0, 5000, 100)], tokens=5000)  # fmt: skip
    peer = Trace(engine="llama.cpp", decode_ms=[12.0] * 500, prefill=[(100, 0.5)] * 8, tokens=1300)
    out = summaries(cab, [peer])
    same = out["same_span"]["llama.cpp"]
    assert same["decoded_tokens"] == 500 and same["tokens"] == 8 * 100 + 500
    assert same["decode_tok_s"] == pytest.approx(100.0) and out["decode_tok_s"] == pytest.approx(50.0)
    assert same["prefill_tok_s"] == pytest.approx(400.0)
    assert "same_span" not in summaries(cab, [Trace(engine="hf", decode_ms=ms, tokens=5000)]) or \
        summaries(cab, [Trace(engine="hf", decode_ms=ms, tokens=5000)])["same_span"] == {}


@pytest.fixture(scope="module")
def small_artifact(smollm2, export_to):
    return export_to(smollm2, sink=4, pinned=60, window=124, chunk=32, weights="int4")


def test_bench_json_through_the_runtime(small_artifact, tmp_path):
    p = cabinlm("bench", small_artifact, "--tokens", 700, "--max-new", 48, "--json", "--trace", tmp_path / "t.json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert set(SUMMARY_KEYS) <= set(s) and s["engine"] == "cabinlm"
    assert s["tokens"] >= 700 and s["decoded_tokens"] > 100 and s["turns"] >= 3
    assert s["evicted_tokens"] > 0  # 700 tokens through 188 slots
    assert 0 < s["latency_ms_p50"] <= s["latency_ms_p99"]
    assert s["decode_tok_s"] == pytest.approx(1000 / s["latency_ms_p50"], rel=1e-3)
    assert s["rss_mb_start"] > 50 and s["rss_mb_end"] > 50
    assert s["config"]["weights"] == "int4" and s["config"]["window"] == 124
    trace = json.loads((tmp_path / "t.json").read_text())["cabinlm"]
    assert len(trace["decode_ms"]) == s["decoded_tokens"] == len(trace["decode_context"])
    assert max(trace["decode_context"]) <= 188  # the cache never grows past its slots
    assert trace["tokens"] == sum(n for n, _ in trace["prefill"]) + len(trace["decode_ms"])


def test_bench_with_speculation_gives_the_plain_replies_and_counts_every_token(smollm2_fused):
    """`cabinlm bench` drafts by prompt lookup as chat does: the greedy replies of the scripted
    dialogue are the plain ones on the demo's kind of build, turn for turn (through eviction: 600
    tokens in 316 slots), and a verification that keeps n tokens records n decoded tokens."""
    from cabinlm.bench.runner import run_cabinlm

    replies: dict[bool, list[str]] = {True: [], False: []}
    traces = {}
    for spec in (False, True):
        traces[spec] = run_cabinlm(smollm2_fused, tokens=600, threads=2, max_new=48, speculative=spec,
                                   on_reply=lambda turn, text, spec=spec: replies[spec].append(text))  # fmt: skip
    plain, fast = traces[False], traces[True]
    assert replies[True] == replies[False] and len(replies[True]) >= 3, (fast.config, replies)
    assert plain.config["speculative"] is False and "drafted" not in plain.config
    assert fast.config["accepted"] > 0 and fast.config["drafted"] >= fast.config["accepted"]
    assert len(fast.decode_ms) == len(plain.decode_ms) == len(fast.decode_context)
    assert fast.tokens == plain.tokens == sum(n for n, _ in fast.prefill) + len(fast.decode_ms)
    assert fast.evicted_tokens == plain.evicted_tokens > 0
    # tokens chosen in one call share its time: runs of equal latencies, one run per verification
    ms = np.asarray(fast.decode_ms)
    assert np.sum(ms[1:] == ms[:-1]) >= fast.config["accepted"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_bench_plot_with_the_transformers_baseline(small_artifact, tmp_path):
    png = tmp_path / "bench.png"
    p = cabinlm("bench", small_artifact, "--tokens", 300, "--max-new", 32, "--json", "--baseline", "hf", "--plot", png)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    b = s["baseline"]
    assert b["engine"] == "hf" and set(SUMMARY_KEYS) <= set(b)
    assert b["tokens"] >= 300 and b["evicted_tokens"] == 0  # transformers' cache only grows
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_errors_are_one_line(tmp_path, small_artifact):
    p = cabinlm("bench", tmp_path / "nope")
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "no such folder" in p.stderr
    p = cabinlm("bench", small_artifact, "--tokens", 0)
    assert p.returncode == 2 and "--tokens" in p.stderr
    # A peer that cannot run here is refused before any run, on one line that names what is missing
    # and the command that installs it.
    from cabinlm.bench.catalog import available

    for peer in ("llama.cpp", "ort-genai"):
        reason = available(peer)
        if reason is None:
            continue
        p = cabinlm("bench", small_artifact, "--baseline", peer)
        assert p.returncode == 2 and p.stderr.startswith("error: ") and reason in p.stderr, p.stderr
        assert "not installed" in p.stderr and "pip install" in p.stderr
