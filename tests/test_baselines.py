"""Baseline engines for `cabinlm bench` (hf, llama.cpp, ort-genai): real runs on SmolLM2-135M, small.

llama.cpp and ort-genai need optional packages; their tests skip with the install command when absent.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cabinlm.bench import baselines as B
from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.bench.trace import SUMMARY_KEYS, Trace, summarize
from cabinlm.errors import ModelError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf():
    from cabinlm.export.models import fetch_alias

    return fetch_alias("smollm2-135m")


def _skip_unless(name: str) -> None:
    reason = B.available(name)
    if reason:
        print(f"skipping: {reason}")
        pytest.skip(f"{name}: {reason}")


def _check_consistent(trace: Trace) -> dict:
    """Invariants every dialogue trace keeps."""
    assert len(trace.decode_ms) == len(trace.decode_context) > 0
    assert all(ms > 0 for ms in trace.decode_ms)
    assert trace.tokens == sum(n for n, _ in trace.prefill) + len(trace.decode_ms)
    ctx = np.asarray(trace.decode_context)
    assert (np.diff(ctx) > 0).all(), "the history only grows: contexts increase, by 1 within a turn"
    assert ctx[-1] <= trace.tokens
    assert trace.rss and all(mb > 0 for _, mb in trace.rss)
    assert [t for t, _ in trace.rss] == sorted(t for t, _ in trace.rss)
    s = summarize(trace)
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["decode_tok_s"] > 0 and s["prefill_tok_s"] > 0
    assert s["latency_ms_p99"] >= s["latency_ms_p50"] > 0
    assert s["rss_mb_end"] > 50 and s["evicted_tokens"] == 0
    return s


def test_import_is_light_and_available_names():
    code = ("import sys, cabinlm.bench.baselines as b; "
            "print([m for m in ('torch', 'transformers', 'llama_cpp', 'onnxruntime_genai') if m in sys.modules])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert B.BASELINES == ("hf", "llama.cpp", "ort-genai")
    assert "unknown baseline" in B.available("vllm")
    for name in B.BASELINES:
        reason = B.available(name)
        assert reason is None or "pip install" in reason


def test_clear_errors(tmp_path, gguf, monkeypatch):
    with pytest.raises(ModelError, match="no such model file"):
        B.run_baseline("hf", tmp_path / "missing.gguf", tokens=10, threads=1)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="not a GGUF file"):
        B.run_fixed_context("llama.cpp", junk, context=8, threads=1)
    with pytest.raises(ValueError, match="unknown baseline"):
        B.run_baseline("vllm", gguf, tokens=10, threads=1)
    with pytest.raises(ValueError, match="no configuration"):
        B.run_baseline("ort-genai", gguf, tokens=10, threads=1, config="int2")
    # An optional package missing: a clear error with the install command, before any child starts.
    real = B.importlib.util.find_spec
    monkeypatch.setattr(B.importlib.util, "find_spec", lambda m, *a: None if m == "llama_cpp" else real(m, *a))
    assert "llama-cpp-python is not installed" in B.available("llama.cpp")
    with pytest.raises(B.BaselineUnavailable, match="pip install llama-cpp-python"):
        B.run_baseline("llama.cpp", gguf, tokens=10, threads=1)


def test_truncated_gguf_is_a_model_error(tmp_path, gguf, monkeypatch):
    """A file with the GGUF magic that no engine can read: a ModelError, not a traceback."""
    monkeypatch.setenv("CABINLM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf.read_bytes()[:4096])
    name = "llama.cpp" if B.available("llama.cpp") is None else "hf"
    with pytest.raises(ModelError):
        B.run_fixed_context(name, bad, context=8, decode=2, threads=1)


def test_hf_dialogue_matches_transformers_generate(gguf, smollm2):
    """Two turns and a bit (160 tokens) in this process: a consistent trace, and the first reply equals
    transformers' own greedy generate on the model loaded from the GGUF, prompt rendered by its template."""
    replies: list[str] = []
    trace = B.run_here("hf", gguf, threads=1, tokens=160, max_new=40, on_reply=lambda i, s: replies.append(s))
    s = _check_consistent(trace)
    assert trace.stopped == "done" and trace.tokens == 160 and trace.turns >= 2
    assert s["turns"] == trace.turns and len(replies) == trace.turns
    first_turn = trace.prefill[0][0]
    assert trace.decode_context[0] == first_turn + 1

    import torch

    tok, model = smollm2.tokenizer, smollm2.model
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": next(user_turns(0))}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert len(ids) == first_turn, "the baseline renders the turn as the chat template does"
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert replies[0] == want


def test_run_baseline_subprocess_fixed_context(gguf):
    """The child-process path: JSON round trip, progress lines, fixed-context mode."""
    lines: list[str] = []
    trace = B.run_fixed_context("hf", gguf, context=48, decode=6, threads=1, progress=lines.append)
    assert isinstance(trace, Trace) and trace.engine == "hf" and trace.stopped == "done"
    assert trace.prefill[0][0] == 48 and trace.decode_context == list(range(49, 55))
    assert trace.config["mode"] == "fixed_context" and trace.config["threads"] == 1
    assert trace.load_s > 0
    json.dumps(trace.to_dict())


def test_fastest_keeps_the_others():
    a = Trace(engine="ort-genai", config={"name": "int4"}, decode_ms=[2.0, 3.0], decode_context=[1, 2])
    b = Trace(engine="ort-genai", config={"name": "fp32"}, decode_ms=[5.0, 6.0], decode_context=[1, 2])
    best = B.fastest([b, a])
    assert best is a and best.config["fastest_of"] == ["fp32", "int4"]
    assert [o["config"]["name"] for o in best.config["others"]] == ["fp32"]


def test_llama_cpp_reports_a_full_context(gguf):
    _skip_unless("llama.cpp")
    trace = B.run_baseline("llama.cpp", gguf, tokens=400, threads=1, context=128, max_new=48, config="gguf")
    _check_consistent(trace)
    assert trace.stopped.startswith("context full at"), trace.stopped
    assert "llama_decode returned" in trace.stopped
    assert trace.tokens <= trace.config["n_ctx"] and max(trace.decode_context) <= trace.config["n_ctx"]


def test_ort_genai_reports_a_full_context(gguf):
    _skip_unless("ort-genai")
    trace = B.run_baseline("ort-genai", gguf, tokens=400, threads=1, context=128, max_new=48, config="int4")
    _check_consistent(trace)
    assert trace.stopped.startswith("context full at"), trace.stopped
    assert trace.tokens < 128 and max(trace.decode_context) < 128
