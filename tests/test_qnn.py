"""Qualcomm HTP builds, compiled by Qualcomm's compiler (the onnxruntime-qnn plugin) and run in its
x86 HTP simulator: context binaries for both chips, the simulated logits against the CPU through
prefill, decode, eviction and pins, and a node the HTP rejects failing the build by name.

Tolerance: the HTP computes a float graph in fp16 (a relative rounding step of 2^-11 per operation,
over ~20 operations per layer, amplified by this tiny model's deliberately peaked attention). Measured
over the stream below: the step's largest logit error is a median 1% and at most ~4% of that step's
largest |logit|. The tests allow 6% at any step, 2% in the median, and require the same next token
at >= 97% of steps; the same HTP build fed a wrong cache (the pinned spans not pinned) fails them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from cabinlm.engines.build import build_artifact
from cabinlm.contract.manifest import FileEntry, load_manifest
from cabinlm.profiles import load_profile
from cabinlm.contract.engines import BackendKind
from cabinlm.runtime import Decoder
from test_cli import assert_clean_error, cabinlm
from test_backends import LAYOUT, STREAM, reference_logits

try:
    import onnxruntime_qnn  # noqa: F401
except ImportError:
    # `make test` installs the qnn extra: in CI a missing plugin is a failure, never a silent skip
    if os.environ.get("CI"):
        raise
    pytest.skip("onnxruntime-qnn (the `qnn` extra) is not installed: `pip install 'cabinlm[qnn]'`", allow_module_level=True)

WORST, MEDIAN, TOP1 = 0.06, 0.02, 0.97


def agreement(got: list[np.ndarray], ref: list[np.ndarray]) -> tuple[float, float, float]:
    """(worst, median) of each step's max |logit error| / max |logit|, and the top-1 agreement."""
    rel = [float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref)]
    top1 = float(np.mean([g[-1].argmax() == r[-1].argmax() for g, r in zip(got, ref)]))
    return max(rel), float(np.median(rel)), top1


def close(got: list[np.ndarray], ref: list[np.ndarray]) -> bool:
    worst, median, top1 = agreement(got, ref)
    return worst <= WORST and median <= MEDIAN and top1 >= TOP1
EXACT = {"session.qdq_matmulnbits_accuracy_level": "0"}  # the CPU reference with float32 activations


@pytest.fixture(scope="module")
def int4_artifact(load, tiny_llama_dir, export_to) -> Path:
    """What `cabinlm export --profile sa8775p` writes for the tiny model: int4 weight blocks, fp16 KV."""
    return export_to(load(str(tiny_llama_dir)), kv="fp16", weights="int4", **LAYOUT)


@pytest.fixture(scope="module")
def builds(int4_artifact, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("qnn")
    return {p: build_artifact(int4_artifact, load_profile(p), tmp / p) for p in ("sa8295p", "sa8775p")}


def run_stream(folder: Path, ids: np.ndarray, pins: bool = True, **kw) -> list[np.ndarray]:
    dec = Decoder(folder, **kw)
    if type(dec.backend).kind is BackendKind.QNN_HTP:  # the sessions say what really runs: the HTP, CPU fallback off
        for session in (dec.backend.graphs.prefill, dec.backend.graphs.decode):
            assert session.get_providers()[0] == "QNNExecutionProvider", session.get_providers()
            assert session.get_session_options().get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    got, pos = [], 0
    for n, pin in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            got.append(dec.step(ids[start : min(start + LAYOUT["chunk"], pos + n)], pin=pin and pins).copy())
        pos += n
    assert dec.cache.evicted > 8 * LAYOUT["window"] and dec.cache.pinned_fill == (6 if pins else 0)
    return got


def stream_ids() -> np.ndarray:
    return np.random.default_rng(7).integers(3, 300, sum(n for n, _ in STREAM))


def test_both_chips_get_context_binaries_and_the_manifest_records_them(builds):
    for profile, arch, soc in (("sa8295p", 68, 39), ("sa8775p", 73, 52)):
        folder = builds[profile]
        m = load_manifest(folder)  # checks every listed file's checksum
        spec = m.build
        assert spec.backend.value == "qnn-htp" and spec.engine == "qnn"
        assert spec.provider.name == "QNNExecutionProvider"
        assert spec.provider.options == {"backend_type": "htp", "htp_arch": str(arch), "soc_model": str(soc)}
        q = spec.facts
        assert (q.htp_arch, q.soc_model, q.activations, q.weights) == (arch, soc, "fp16", "int4")
        assert q.qairt_version.startswith("2.") and spec.engine_version == q.qairt_version
        assert q.rewrites["rms_norms"] == 5 and q.rewrites["matmul_4bit"] == 8  # 2 layers x 4 + final norm
        assert q.check["same_top1"] and q.check["correlation"] > 0.999
        sizes = m.quality.build["binary_bytes"]
        for role, entry in m.files.items():
            if role.startswith("context_binary"):
                assert entry.bytes == (folder / entry.path).stat().st_size == sizes[entry.path] > 10_000
                assert len(entry.sha256) == 64
        for role in ("graph", "graph_decode"):  # EPContext nodes only: nothing left for a CPU
            ctx = onnx.load(str(folder / m.files[role].path), load_external_data=False)
            assert {n.op_type for n in ctx.graph.node} == {"EPContext"}
    v68, v73 = load_manifest(builds["sa8295p"]), load_manifest(builds["sa8775p"])
    assert not v68.build.facts.weight_sharing and len(v68.build.facts.binaries) == 2
    # v73: prefill and decode share one binary (one weights copy); the unshared twin is the simulator's
    assert v73.build.facts.weight_sharing
    car = [e.path for r, e in v73.files.items() if r.startswith("context_binary") and not r.endswith("_simulator")]
    assert len(car) == 1 and {"graph_simulator", "graph_decode_simulator", "context_binary_simulator"} <= set(v73.files)


@pytest.mark.parametrize("profile", ["sa8295p", "sa8775p"])
def test_simulated_htp_follows_the_cpu_through_prefill_decode_eviction_and_pins(profile, builds, int4_artifact):
    ids = stream_ids()
    cpu = run_stream(int4_artifact, ids, session_config=EXACT)
    got = run_stream(builds[profile], ids)
    assert close(got, cpu), (profile, agreement(got, cpu))
    if profile == "sa8295p":  # the tolerance has teeth: a cache that lost its pinned spans fails it
        wrong = run_stream(builds[profile], ids, pins=False)
        assert not close(wrong, cpu), agreement(wrong, cpu)


def test_simulated_htp_follows_the_float_reference_on_an_fp32_export(load, tiny_llama_dir, export_to, tmp_path):
    """fp32 weights, fp16 KV: the HTP (fp16 inside) against the PyTorch streaming reference."""
    loaded = load(str(tiny_llama_dir))
    art = export_to(loaded, kv="fp16", **LAYOUT)
    folder = build_artifact(art, load_profile("sa8295p"), tmp_path / "htp")
    assert load_manifest(folder).build.facts.weights == "fp16"
    ids = stream_ids()
    expected = reference_logits(loaded.model, ids)
    got = run_stream(folder, ids)
    assert close(got, expected), agreement(got, expected)


@pytest.mark.parametrize("profile", ["sa8295p", "sa8775p"])
def test_a_node_the_htp_rejects_fails_the_build_with_its_name(profile, int4_artifact, tmp_path):
    """Trilu has no HTP form: with CPU fallback off the build stops and names the node (on v73
    before any shared-weight context is opened: the process ends cleanly, exit 2)."""
    import shutil

    art = tmp_path / "art"
    shutil.copytree(int4_artifact, art)
    m = load_manifest(art)
    path = art / m.files["graph"].path
    g = onnx.load(str(path), load_external_data=False)
    last = next(n for n in g.graph.node if "logits" in n.output)
    last.output[0] = "logits/raw"
    g.graph.node.append(onnx.helper.make_node("Trilu", ["logits/raw"], ["logits"], name="n/odd_trilu", upper=1))
    onnx.save_model(g, str(path))
    m.files["graph"] = FileEntry.of(art, m.files["graph"].path)
    m.save(art)
    p = cabinlm("build", art, "--profile", profile, "-o", tmp_path / "out")
    assert_clean_error(p, "n/odd_trilu (Trilu)", "CPU fallback is off")
    assert p.returncode == 2 and not (tmp_path / "out" / "manifest.json").exists()


def test_fp8_kv_is_refused_before_compiling(load, tiny_llama_dir, export_to, tmp_path):
    """int8 KV builds (tests/test_qnn_kv8.py); fp8 is not among the HTP profiles' KV types."""
    art = export_to(load(str(tiny_llama_dir)), kv="fp8", weights="int4", **LAYOUT)
    assert_clean_error(cabinlm("build", art, "--profile", "sa8775p", "-o", tmp_path / "x"), "fp8 KV", "cannot run (int8, fp16)")


def test_chat_perplexity_and_bench_run_the_sa8775p_build_in_the_simulator(load, tiny_llama_dir, export_to,
                                                                                 tmp_path):
    art = export_to(load(str(tiny_llama_dir)), kv="fp16", weights="int4", sink=4, pinned=60, window=64, chunk=16)
    build = build_artifact(art, load_profile("sa8775p"), tmp_path / "sa8775p")
    p = cabinlm("chat", build, "--json", "--max-new-tokens", 6, stdin="hello there\nand again\n")
    assert p.returncode == 0, p.stderr
    turns = [json.loads(line) for line in p.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and all(t["backend"] == "qnn-htp" for t in turns)
    assert all(t["new_tokens"] == 6 for t in turns)
    text = tmp_path / "t.txt"
    text.write_text("the driver asked for the route to the airport and the tunnel. " * 4)
    p = cabinlm("perplexity", build, "--text", text, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["backend"] == "qnn-htp"
    p = cabinlm("bench", build, "--tokens", 120, "--json")  # the scripted dialogue, through the eviction
    assert p.returncode == 0, p.stderr
    bench = json.loads(p.stdout)
    assert bench["config"]["backend"] == "qnn-htp" and bench["tokens"] >= 120


def test_without_the_plugin_the_build_says_what_to_install(int4_artifact, tmp_path):
    """A machine without onnxruntime-qnn: a package of that name that fails to import shadows it."""
    import os
    import subprocess
    import sys

    shadow = tmp_path / "shadow" / "onnxruntime_qnn"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('onnxruntime_qnn is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-m", "cabinlm", "build", str(int4_artifact), "--profile", "sa8775p", "-o",
                        str(tmp_path / "x")], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert_clean_error(p, "pip install 'cabinlm[qnn]'")
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_plan_counts_the_context_binaries_and_the_htp_process_limit(tiny_llama_dir, tmp_path):
    """v68 holds a weights copy per graph (two binaries), v73 one shared binary; the NPU process
    limit is checked beside the budget."""
    from cabinlm.source.config import spec_from_config
    from cabinlm.profiles.planner import format_plan, plan

    spec = spec_from_config(tiny_llama_dir)
    v68 = plan(spec, load_profile("sa8295p"), window=32, sink=4, pinned=12, chunk=16)
    v73 = plan(spec, load_profile("sa8775p"), window=32, sink=4, pinned=12, chunk=16)
    assert (v68.htp_binaries, v73.htp_binaries) == (2, 1)
    assert v68.htp_binary_bytes == 2 * v73.htp_binary_bytes > 0  # same int4 weights, one copy more
    assert v73.htp_process_bytes == v73.htp_binary_bytes + v73.kv_bytes + v73.activation_bytes
    assert "HTP context binaries (2: prefill, decode: a weights copy each" in format_plan(v68)
    assert "of 3584.0 MiB a 32-bit NPU process maps" in format_plan(v73)
    text = (Path(load_profile.__code__.co_filename).parent / "builtin" / "sa8775p.toml").read_text()
    small = tmp_path / "small-npu.toml"
    small.write_text(text.replace('name = "sa8775p"', 'name = "small-npu"')
                     .replace('htp_process_limit_bytes = "3584 MiB"', "htp_process_limit_bytes = 4096"))  # fmt: skip
    tight = plan(spec, load_profile(str(small)), window=32, sink=4, pinned=12, chunk=16)
    assert tight.total_bytes < tight.budget_bytes and not tight.fits  # within the budget, beyond the NPU process


def test_a_context_model_with_anything_but_htp_nodes_is_refused(builds, int4_artifact, tmp_path):
    """No silent CPU: a build whose decode model holds a plain graph (which ONNX Runtime would run on
    its CPU provider) is refused before it loads."""
    import shutil

    from cabinlm.runtime import BackendError

    folder = tmp_path / "edited"
    shutil.copytree(builds["sa8295p"], folder)
    m = load_manifest(folder)
    plain = onnx.load(str(int4_artifact / "decoder.onnx"))
    onnx.save_model(plain, str(folder / m.files["graph_decode"].path))
    m.files["graph_decode"] = FileEntry.of(folder, m.files["graph_decode"].path)
    m.save(folder)
    with pytest.raises(BackendError, match="is not compiled for the HTP"):
        Decoder(folder)


def test_the_runtime_reads_context_models_as_onnx_does_without_onnx(builds, int4_artifact):
    """The runtime checks a context model's nodes with its own protobuf reader (a car carries no
    onnx package): it names the same nodes, op types and sources as onnx does, on a compiled model
    and on a plain graph; a truncated file is a clear error, not a crash."""
    from cabinlm.engines.qnn_htp.plugin import context_nodes

    for path in (builds["sa8775p"] / "decoder.decode.ctx.onnx", int4_artifact / "decoder.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        want = [(n.name, n.op_type, next((a.s.decode() for a in n.attribute if a.name == "source"), "")) for n in model.graph.node]
        assert context_nodes(path.read_bytes()) == want
    data = (builds["sa8775p"] / "decoder.decode.ctx.onnx").read_bytes()
    with pytest.raises(ValueError, match="truncated"):
        context_nodes(data[: len(data) // 2])
