"""Baseline engines for `cabinlm bench` (hf, llama.cpp, ort-genai): real runs on SmolLM2-135M, small;
the structure of the bench package (imports one way), the errors a failing child process gives, and
the `bench` extra against what the peers import.

llama.cpp and ort-genai need optional packages; their tests skip with the install command when absent.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from cabinlm.bench import baselines as B
from cabinlm.bench import catalog, child
from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.bench.trace import SUMMARY_KEYS, Trace, summarize
from cabinlm.contract.errors import ModelError

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "src" / "cabinlm" / "bench"


@pytest.fixture(scope="module")
def gguf():
    from cabinlm.export.models import fetch_alias

    return fetch_alias("smollm2-135m")


def _skip_unless(name: str) -> None:
    reason = B.available(name)
    if reason:
        print(f"skipping: {reason}")
        pytest.skip(f"{name}: {reason}")


def _check_consistent(trace: Trace, speculative: bool = False) -> dict:
    """Invariants every dialogue trace keeps. speculative: one call may choose several tokens, each
    recorded with the context after the call, so contexts repeat within a call."""
    assert len(trace.decode_ms) == len(trace.decode_context) > 0
    assert all(ms > 0 for ms in trace.decode_ms)
    assert trace.tokens == sum(n for n, _ in trace.prefill) + len(trace.decode_ms)
    ctx = np.asarray(trace.decode_context)
    if speculative:
        assert (np.diff(ctx) >= 0).all() and len(set(ctx.tolist())) < len(ctx), "contexts never fall; some repeat"
    else:
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


@pytest.mark.slow
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
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "llama_cpp" else real(m, *a))
    assert "llama-cpp-python is not installed" in B.available("llama.cpp")
    with pytest.raises(B.BaselineUnavailable, match="pip install llama-cpp-python"):
        B.run_baseline("llama.cpp", gguf, tokens=10, threads=1)


@pytest.mark.slow
def test_truncated_gguf_is_a_model_error(tmp_path, gguf, monkeypatch):
    """A file with the GGUF magic that no engine can read: a ModelError, not a traceback."""
    monkeypatch.setenv("CABINLM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf.read_bytes()[:4096])
    name = "llama.cpp" if B.available("llama.cpp") is None else "hf"
    with pytest.raises(ModelError):
        B.run_fixed_context(name, bad, context=8, decode=2, threads=1)


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_fastest_counts_every_call_of_a_speculative_configuration():
    """Speculative decoding splits a call's time over the tokens it chose: three calls choosing 3 tokens
    in 15 ms each and three choosing 1 in 18 ms give a median of 5 ms a token, yet 12 tokens take 99 ms
    against 96 in plain 8 ms steps. The fastest is the one that decodes the most tokens a second."""
    plain = Trace(engine="llama.cpp", config={"name": "gguf"}, decode_ms=[8.0] * 12, decode_context=list(range(12)))
    spec_ms = [5.0] * 9 + [18.0] * 3
    spec = Trace(engine="llama.cpp", config={"name": "gguf-lookup"}, decode_ms=spec_ms, decode_context=list(range(12)))
    assert summarize(spec)["decode_tok_s"] > summarize(plain)["decode_tok_s"]
    assert summarize(spec)["decode_tok_s_overall"] < summarize(plain)["decode_tok_s_overall"]
    assert B.fastest([spec, plain]) is plain


@pytest.mark.slow
@pytest.mark.parametrize("config", ["gguf", "gguf-lookup"])
def test_llama_cpp_reports_a_full_context(gguf, config):
    _skip_unless("llama.cpp")
    trace = B.run_baseline("llama.cpp", gguf, tokens=400, threads=1, context=128, max_new=48, config=config)
    _check_consistent(trace, speculative=config == "gguf-lookup")
    assert trace.stopped.startswith("context full at"), trace.stopped
    assert "llama_decode returned" in trace.stopped
    assert trace.tokens <= trace.config["n_ctx"] and max(trace.decode_context) <= trace.config["n_ctx"]


@pytest.mark.slow
def test_llama_cpp_prompt_lookup_decodes_as_plain_greedy(gguf):
    """gguf-lookup (llama-cpp-python's prompt-lookup drafts, verified in one batch) chooses the tokens
    plain gguf does, over a dialogue of a few hundred tokens, with drafts accepted; llama.cpp's KV cache
    then holds exactly the tokens the engine says it holds.

    One thread: llama.cpp's CPU flash attention splits a single query's keys across threads once its
    KV view reaches 512 cells (past 256 tokens), and a batch of queries does not, so with more
    threads a verified row and a plain step can round differently and flip a near tie."""
    _skip_unless("llama.cpp")
    from cabinlm.bench.peers import open_engine
    from cabinlm.bench.prepare import prepare
    from cabinlm.bench.protocol import Script, dialogue

    folder = prepare(gguf)
    script = Script.load(folder)
    got = {}
    for config in ("gguf", "gguf-lookup"):
        engine = open_engine("llama.cpp", gguf, script, folder, 1, config, 1024)
        replies: list[str] = []
        try:
            trace = dialogue(engine, script, tokens=400, max_new=48, on_reply=lambda i, s, out=replies: out.append(s))
            L = engine.L
            mem = L.llama_get_memory(engine.ctx)
            assert L.llama_memory_seq_pos_min(mem, 0) == 0
            assert L.llama_memory_seq_pos_max(mem, 0) == engine.context - 1, "rejected drafts left in the cache"
            got[config] = (trace, replies, engine.history[: engine.context].tolist())
        finally:
            engine.close()
    (plain, want, fed), (spec, replies, fed_spec) = got["gguf"], got["gguf-lookup"]
    _check_consistent(plain)
    _check_consistent(spec, speculative=True)
    assert plain.stopped == spec.stopped == "done" and plain.turns >= 3
    # The same token stream; the last reply, cut by the token budget, may run a few accepted drafts on.
    assert fed_spec[: len(fed)] == fed
    assert replies[:-1] == want[:-1] and len(replies) == len(want) and replies[-1].startswith(want[-1])
    counts = spec.config["speculative"]
    assert counts["num_pred_tokens"] >= 1 and counts["max_ngram_size"] >= 1
    assert counts["drafted"] >= counts["accepted"] > 20 and counts["verified"] > 0
    assert len(spec.decode_ms) > len(set(spec.decode_context)), "some calls chose several tokens"
    assert "speculative" not in plain.config


@pytest.mark.slow
def test_ort_genai_reports_a_full_context(gguf):
    _skip_unless("ort-genai")
    trace = B.run_baseline("ort-genai", gguf, tokens=400, threads=1, context=128, max_new=48, config="int4")
    _check_consistent(trace)
    assert trace.stopped.startswith("context full at"), trace.stopped
    assert trace.tokens < 128 and max(trace.decode_context) < 128


# --------------------------------------------------------------------------------------------------
# The package's structure: one concept a module, imports one way. (baselines.py and peers.py once
# imported each other; importing peers.py first then loaded half of baselines.py.)


def _bench_imports(path: Path) -> set[str]:
    """The cabinlm.bench modules a file imports, anywhere in it (a lazy import in a function counts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "cabinlm.bench":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cabinlm.bench."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("cabinlm.bench.")}
    return found - {path.stem}


def test_bench_modules_import_each_other_one_way():
    graph = {p.stem: _bench_imports(p) for p in BENCH.glob("*.py") if p.stem != "__init__"}
    assert {"baselines", "peers", "catalog", "child", "prepare", "protocol"} <= set(graph)
    # Depth-first search for a cycle; report it as a path.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            assert state.get(n) != 1, f"import cycle: {' -> '.join([*path, m, n])}"
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    # The layering the modules' docstrings describe.
    assert graph["catalog"] == set() and graph["child"] == {"catalog"}
    assert "baselines" not in graph["peers"] and not {"peers", "baselines"} & graph["prepare"]
    # the seats bench: cabinlm's modes, the llama.cpp peer on top of them, the child process on top of both
    assert not {"llama_seats", "seats_child"} & graph["seats"] and "seats_child" not in graph["llama_seats"]
    assert {"seats", "llama_seats"} <= graph["seats_child"]


@pytest.mark.parametrize("module", ["catalog", "child", "prepare", "peers", "baselines", "seats", "llama_seats", "seats_child"])
def test_each_bench_module_imports_alone_and_light(module):
    """Each module first, in a fresh interpreter (a cycle shows as an ImportError or a half-made module
    only when the import starts from one side of it); none loads a peer's heavy package."""
    heavy = ("torch", "transformers", "llama_cpp", "onnxruntime_genai", "onnx_ir")
    code = (f"import sys, cabinlm.bench.{module} as m; "
            f"print([h for h in {heavy!r} if h in sys.modules])")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_the_callers_names_stay_on_baselines():
    """cli.py and benchmarks/ use these through `from cabinlm.bench import baselines as bl`."""
    for name in ("available", "run_baseline", "run_fixed_context", "fastest", "run_here", "BaselineError",
                 "BaselineUnavailable", "BASELINES", "CONFIGS", "INSTALL", "main"):  # fmt: skip
        assert hasattr(B, name), name
    assert B.BaselineError is catalog.BaselineError and issubclass(B.BaselineUnavailable, B.BaselineError)


# --------------------------------------------------------------------------------------------------
# A failing child says why in its own words: real child processes, nothing mocked.

_FAILS_ON_IMPORT = """
import sys
print("progress: loading the model")
for i in range(60):
    print(f"GroupQueryAttention is used in this model ({i})")  # the builder's chatter, more than the tail keeps
try:
    import onnx_ir_is_not_installed_anywhere
except ModuleNotFoundError as e:
    raise RuntimeError("the builder could not start") from e
"""


def test_a_failing_child_s_error_starts_with_its_own_error_line():
    relayed: list[str] = []
    with pytest.raises(catalog.BaselineError) as info:
        child.check([sys.executable, "-c", _FAILS_ON_IMPORT], "ort-genai int4: the model builder",
                    progress=relayed.append)  # fmt: skip
    first, *rest = str(info.value).splitlines()
    # The exception that ended the child (the last of a chained traceback), on the line callers show.
    assert first == "ort-genai int4: the model builder failed (exit 1): RuntimeError: the builder could not start"
    assert any("No module named 'onnx_ir_is_not_installed_anywhere'" in line for line in rest)
    assert relayed == ["loading the model"] and not any("progress:" in line for line in rest)


def test_a_child_killed_by_a_signal_says_so():
    code = "import os, signal; print('decoding', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(catalog.BaselineError, match=r"^llama.cpp \(gguf\) failed \(killed by SIGKILL\): decoding"):
        child.check([sys.executable, "-c", code], "llama.cpp (gguf)")


def test_a_child_s_own_cabinlm_error_comes_back_as_the_same_class(tmp_path):
    """`python -m cabinlm.bench.prepare` on a file that is no model: the child's ModelError, raised here."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        child.check([sys.executable, "-m", "cabinlm.bench.prepare", "--model", str(junk)], "preparing junk.gguf")


@pytest.mark.parametrize(
    "lines, want",
    [
        (["usage: builder.py [-h] -o OUTPUT", "builder.py: error: argument -p: invalid choice: 'int2'"],
         "builder.py: error: argument -p: invalid choice: 'int2'"),
        (["Traceback (most recent call last):", '  File "b.py", line 1, in <module>', "    import onnx_ir",
          "ModuleNotFoundError: No module named 'onnx_ir'", "Note: installed packages were not searched"],
         "ModuleNotFoundError: No module named 'onnx_ir'"),
        (["loading", "llama_model_load: error loading model: tensor 'output.weight' has wrong shape", "done"],
         "llama_model_load: error loading model: tensor 'output.weight' has wrong shape"),
        (["just the last words"], "just the last words"),
        ([], "(no output)"),
    ],
)  # fmt: skip
def test_the_error_line_of_known_outputs(lines, want):
    assert child.error_line(lines) == want


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed")
def test_a_model_builder_failure_carries_the_builder_s_message(tmp_path, monkeypatch):
    """The real model builder on a model folder it cannot build: the raised error's first line is the
    builder's own complaint, not only its exit status."""
    from cabinlm.bench.peers import build_ort_genai

    monkeypatch.setenv("CABINLM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(60))  # only named and hashed here
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "no-such-architecture", "architectures": ["Nope"]}))
    with pytest.raises(catalog.BaselineError) as info:
        build_ort_genai(source, hf, "fp32")
    first = str(info.value).splitlines()[0]
    print(first)
    assert first.startswith("ort-genai fp32: the model builder failed (exit 1): ")
    detail = first.split("): ", 1)[1]
    assert detail and "Traceback" not in detail and "no-such-architecture" in str(info.value)


# --------------------------------------------------------------------------------------------------
# The `bench` extra installs what the peers import.


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _extra(name: str) -> set[str]:
    """Distribution names an extra of pyproject.toml installs, its cabinlm[...] references followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: set[str] = set()
    for req in project["optional-dependencies"][name]:
        dist = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if _norm(dist) == "cabinlm":
            for sub in re.search(r"\[(.*)\]", req).group(1).split(","):
                out |= _extra(sub.strip())
        else:
            out.add(_norm(dist))
    return out


def _base() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in project["dependencies"]}


def test_the_bench_extra_installs_every_module_a_peer_needs():
    installs = _extra("bench") | _base()
    for name, modules in catalog.MODULES.items():
        for m in modules:
            assert _norm(catalog.PACKAGES[m]) in installs, f"{name} needs {m} ({catalog.PACKAGES[m]}), not in [bench]"
    assert {"onnx-ir", "onnxruntime-genai", "llama-cpp-python", "torch", "transformers", "gguf"} <= installs


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names a file imports when it is loaded (its module body and try blocks; not functions,
    not `if` branches such as TYPE_CHECKING, not relative imports)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Try):
            body += node.body
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed")
def test_the_bench_extra_covers_the_installed_model_builder_s_imports():
    """Every third-party package the builder's files import at load time is declared: by the
    onnxruntime-genai wheel itself, or in our `bench` extra (and in catalog.ORT_GENAI_BUILDER_MODULES)."""
    models = Path(importlib.util.find_spec("onnxruntime_genai").origin).parent / "models"
    own = {p.stem for p in models.rglob("*.py")} | {p.name for p in models.rglob("*") if p.is_dir()}
    imported: set[str] = set()
    for f in models.rglob("*.py"):
        imported |= _module_level_imports(f)
    third_party = imported - set(sys.stdlib_module_names) - own - {"__future__", "onnxruntime_genai"}
    declared_by_wheel = {_norm(r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip())
                         for r in importlib.metadata.requires("onnxruntime-genai") or []}  # fmt: skip
    dists = importlib.metadata.packages_distributions()
    installs = _extra("bench") | _base()
    for m in sorted(third_party):
        dist = _norm((dists.get(m) or [catalog.PACKAGES.get(m, m)])[0])
        assert dist in installs | declared_by_wheel, f"the model builder imports {m} ({dist}); [bench] lacks it"
        if dist not in declared_by_wheel:
            assert m in catalog.ORT_GENAI_BUILDER_MODULES, f"{m}: add it to catalog.ORT_GENAI_BUILDER_MODULES"


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed")
@pytest.mark.parametrize("tool", ["onnxruntime_genai.models.builder",
                                  "onnxruntime_genai.models.quantization.kv_cache_calibration"])  # fmt: skip
def test_the_ort_genai_tools_import(tool):
    """The modules bench/peers.py runs with `python -m` load here, with all they import, in a fresh
    interpreter. (Not `--help`: the 0.18 builder's help text itself fails to format on Python 3.11.)"""
    p = subprocess.run([sys.executable, "-c", f"import {tool}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, child.error_line(p.stderr.splitlines())


def test_ort_genai_is_unavailable_without_its_builder_s_imports(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "onnx_ir" else real(m, *a))
    reason = catalog.available("ort-genai")
    assert reason is not None and "not installed" in reason and "pip install" in reason
    assert "onnx-ir" in reason.split("not installed")[0]


def test_ort_genai_builder_gets_gemma3_rope_in_the_flat_form_it_reads():
    """onnxruntime-genai 0.18's builder reads rope_parameters["rope_type"], rope_theta and
    rope_local_base_freq; transformers 5 nests Gemma 3's per layer kind. The shim gives it the same
    values flat, and leaves any other configuration as it is."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from cabinlm.bench.ort_genai_builder import flat_rope

    c = flat_rope(Gemma3TextConfig())
    assert c.rope_parameters["rope_type"] == "default" and c.rope_parameters["rope_theta"] == c.rope_theta == 1e6
    assert c.rope_local_base_freq == 1e4
    llama = LlamaConfig()
    before = dict(llama.rope_parameters)
    assert flat_rope(llama).rope_parameters == before
