"""TensorRT targets without TensorRT: the typed settings, the version switches, the fp16-safe graph,
the target bundle, `cabinlm doctor` on a machine without TensorRT, and (marked gpu) the engine."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cabinlm.engines.build import build_artifact
from cabinlm.engines.tensorrt.builder import tensorrt_present
from cabinlm.engines.tensorrt.api import (api_era, network_flag_names, parse_installed_version, parser_error_line, precision_flags,
                                      profile_shapes, runtime_shapes, token_profiles, workspace_bytes)  # fmt: skip
from cabinlm.engines.tensorrt.compat import check_file
from cabinlm.engines.tensorrt.engine import effective_era
from cabinlm.engines.tensorrt.graph import fp16_matmuls, fp16_safe_norms
from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.io_spec import decoder_io
from cabinlm.contract.layout import CacheLayout, KVDType
from cabinlm.contract.manifest import Manifest, load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.contract.engines.tensorrt import ApiEra, EngineState, GpuInfo, TensorRTSettings, TokenProfile
from test_cli import assert_clean_error, cabinlm


def settings(**kw) -> TensorRTSettings:
    base = dict(state="bundle", target_version="8.6", api_era="trt8", strongly_typed=False, precision=("fp16",),
                profiles=token_profiles(16), workspace_bytes=512 << 20, fp16_safe_norms=5)  # fmt: skip
    return TensorRTSettings(**{**base, **kw})


# -- typed settings --------------------------------------------------------------------------------


def test_settings_round_trip_and_bad_fields_are_named():
    s = settings()
    assert TensorRTSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    engine = dataclasses.replace(s, state=EngineState.ENGINE, built_with="8.6.11.4", gpu=GpuInfo("Orin", "8.7"), graph_sha256="a" * 64)
    assert TensorRTSettings.from_dict(engine.to_dict()) == engine and engine.profile_for(1) == 0 and engine.profile_for(9) == 1
    for kw, field in [(dict(precision=("fp17",)), "precision"), (dict(workspace_bytes=10), "workspace_bytes"),
                      (dict(strongly_typed=True), "strongly_typed"), (dict(engine_file="../x"), "engine_file"),
                      (dict(built_with="10.3"), "a bundle has no engine"), (dict(target_version="ten"), "target_version"),
                      (dict(api_era="strongly-typed", strongly_typed=True), "precision must be empty"),
                      (dict(state="engine"), "built_with")]:  # fmt: skip
        with pytest.raises((TypeError, ValueError), match=field):
            settings(**kw)
    with pytest.raises(ValueError, match=r"profiles\['p'\].*min_tokens <= opt_tokens"):
        TokenProfile("p", 4, 2, 8)


def test_a_corrupt_tensorrt_record_is_one_manifest_line(tmp_path, trt_bundle):
    _, bundle = trt_bundle
    d = json.loads((bundle / "manifest.json").read_text())
    d["build"]["tensorrt"]["workspace_bytes"] = "lots"
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(CabinlmError, match="invalid content.*tensorrt.workspace_bytes"):
        Manifest.from_dict(d)


# -- version switches ------------------------------------------------------------------------------


def test_api_eras_flags_and_precision_by_version():
    assert [api_era(v) for v in [(8, 5), (8, 6), (9, 3), (10, 0), (10, 3), (10, 14), (10, 15), (11, 0)]] == [
        ApiEra.TRT8, ApiEra.TRT8, ApiEra.TRT8, ApiEra.TRT10, ApiEra.TRT10, ApiEra.TRT10, ApiEra.STRONGLY_TYPED,
        ApiEra.STRONGLY_TYPED]  # fmt: skip
    with pytest.raises(CabinlmError, match="8.5 or newer"):
        api_era((8, 4))
    assert network_flag_names(ApiEra.TRT8) == ("EXPLICIT_BATCH",) and network_flag_names(ApiEra.TRT10) == ()
    assert network_flag_names(ApiEra.STRONGLY_TYPED) == ("STRONGLY_TYPED",)
    assert precision_flags(ApiEra.TRT8, KVDType.INT8) == ("fp16", "int8")
    assert precision_flags(ApiEra.TRT10, KVDType.FP8) == ("fp16", "fp8")
    assert precision_flags(ApiEra.STRONGLY_TYPED, KVDType.INT8) == ()
    with pytest.raises(CabinlmError, match="fp8 KV needs TensorRT >= 9.0"):
        precision_flags(ApiEra.TRT8, KVDType.FP8)
    assert parse_installed_version("8.6.11.4") == (8, 6) and parse_installed_version("10.15.1") == (10, 15)


def test_a_bundle_adapts_to_the_installed_tensorrt_or_says_why_not():
    assert effective_era(ApiEra.TRT8, (8, 6)) is ApiEra.TRT8
    assert effective_era(ApiEra.TRT8, (10, 3)) is ApiEra.TRT10  # no explicit-batch flag on 10
    assert effective_era(ApiEra.TRT10, (10, 15)) is ApiEra.TRT10  # weak typing: deprecated, still there
    assert effective_era(ApiEra.STRONGLY_TYPED, (10, 15)) is ApiEra.STRONGLY_TYPED
    with pytest.raises(CabinlmError, match="strongly typed networks only"):
        effective_era(ApiEra.TRT10, (11, 0))
    with pytest.raises(CabinlmError, match="cannot build it"):
        effective_era(ApiEra.STRONGLY_TYPED, (8, 6))


def test_optimization_profiles_cover_decode_and_prefill_shapes():
    lay = CacheLayout(sink=4, pinned=12, window=64, chunk=16, layers=2, kv_heads=2, head_dim=16, kv_dtype="fp16")
    contract = decoder_io(lay, 320, "int32")
    decode, prefill = token_profiles(16)
    shapes = {s.name: s for s in profile_shapes(contract, lay, prefill)}
    assert set(shapes) == {"input_ids", "position_ids", "attention_mask", "logit_rows"}  # the cache is static
    assert (shapes["attention_mask"].min, shapes["attention_mask"].opt, shapes["attention_mask"].max) == ((2, 82), (16, 96), (16, 96))
    assert (shapes["logit_rows"].min, shapes["logit_rows"].opt, shapes["logit_rows"].max) == ((1,), (1,), (16,))
    assert {s.name: s.max for s in profile_shapes(contract, lay, decode)}["attention_mask"] == (1, 81)
    assert runtime_shapes(contract, lay, 5, 5)["attention_mask"] == (5, 85) and runtime_shapes(contract, lay, 5, 1)["logit_rows"] == (1,)
    assert token_profiles(1) == (decode,)


def test_workspace_comes_from_the_profile_and_bad_values_name_the_field():
    assert workspace_bytes(load_profile("orin-x")) == 512 << 20 and workspace_bytes(load_profile("thor")) == 2 << 30
    bad = dataclasses.replace(load_profile("orin-x"), tensorrt_workspace_mib=0)
    with pytest.raises(CabinlmError, match="'tensorrt_workspace_mib' = 0"):
        workspace_bytes(bad)
    assert workspace_bytes(dataclasses.replace(load_profile("orin-x"), tensorrt_workspace_mib=None)) == 1 << 30


def test_parser_errors_name_their_node():
    line = parser_error_line(0, "ErrorCode.UNSUPPORTED_NODE", "No importer for Foo\n", 12, "n/layers.0/foo", "Foo")
    assert line == "  error 1: node 12 (Foo 'n/layers.0/foo'): ErrorCode.UNSUPPORTED_NODE: No importer for Foo"


# -- the fp16-safe graph ---------------------------------------------------------------------------


def rms_block(eps: float, d: int) -> onnx.ModelProto:
    """The export's decomposed RMSNorm alone, named as the exporter names the final norm."""
    c = [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(np.array(eps, np.float32), "eps"),
         numpy_helper.from_array(np.linspace(0.5, 1.5, d).astype(np.float32), "final_norm.weight")]  # fmt: skip
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"], name="n/final_norm/sq"),
             helper.make_node("ReduceMean", ["sq"], ["var"], name="n/final_norm/var", axes=[-1], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="n/final_norm/eps"),
             helper.make_node("Sqrt", ["ve"], ["rms"], name="n/final_norm/rms"),
             helper.make_node("Div", ["x", "rms"], ["div"], name="n/final_norm/div"),
             helper.make_node("Mul", ["div", "final_norm.weight"], ["y"], name="n/final_norm")]  # fmt: skip
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", d])], c)  # fmt: skip
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


_NUMPY_OPS = {"Pow": np.power, "Add": np.add, "Div": np.divide, "Mul": np.multiply, "Max": np.maximum, "Sqrt": np.sqrt,
              "Abs": np.abs, "ReduceMean": lambda x: x.mean(-1, keepdims=True), "ReduceMax": lambda x: x.max(-1, keepdims=True)}


def eval_fp16(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Run the block's nodes as written, every tensor rounded to float16 after every node (what an
    fp16 engine stores between layers). ONNX Runtime's CPU provider is not used here: its fp16
    kernels of these ops compute partly in fp32 and hide the overflow."""
    values = {i.name: numpy_helper.to_array(i).astype(np.float16) for i in model.graph.initializer}
    values["x"] = x.astype(np.float16)
    with np.errstate(all="ignore"):
        for node in model.graph.node:
            args = [values[i] for i in node.input]
            values[node.output[0]] = np.asarray(_NUMPY_OPS[node.op_type](*args)).astype(np.float16)
    return values[model.graph.output[0].name]


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Each node as written: ONNX Runtime's optimizer would otherwise fuse the export's pattern into
    SimplifiedLayerNormalization, which computes in fp32 inside (an fp16 engine need not)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_the_rewritten_rmsnorm_survives_fp16_where_the_export_overflows():
    """A residual row like SmolLM2's (values up to ~2.2e4): in fp16 the export's x^2 overflows (inf,
    so the row normalizes to 0), the rewrite stays within fp16 rounding of the float64 result. Small
    rows and an all-zero row too. fp32: ONNX Runtime; fp16: each node in numpy float16 (eval_fp16)."""
    d, eps = 576, 1e-5
    rng = np.random.default_rng(0)
    x = rng.normal(0, 30, (4, d))
    x[0, 7], x[0, 100] = 22500.0, -21000.0  # the outlier channels
    x[1] *= 1e-3
    x[2] = 0.0
    w = np.linspace(0.5, 1.5, d)
    exact = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w
    original, safe = rms_block(eps, d), rms_block(eps, d)
    assert fp16_safe_norms(safe, 0, eps) == 1
    np.testing.assert_allclose(run(safe, x.astype(np.float32)), exact, rtol=1e-4, atol=1e-5)  # the same function in fp32
    np.testing.assert_allclose(run(original, x.astype(np.float32)), exact, rtol=1e-4, atol=1e-5)
    bad = eval_fp16(original, x).astype(np.float64)
    assert np.all(bad[0] == 0)  # the export in fp16: x^2 = inf, so row 0 becomes x / inf = 0
    np.testing.assert_allclose(bad[3], exact[3], rtol=2e-2, atol=2e-2)  # (a row without outliers is fine)
    good = eval_fp16(safe, x).astype(np.float64)
    assert np.isfinite(good).all()
    np.testing.assert_allclose(good, exact, rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def trt_bundle(load, tiny_qwen2_dir, export_to, tmp_path_factory):
    """(export, bundle) for orin-x, made here without TensorRT."""
    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=48, chunk=16, kv="fp16", index_dtype="int32")
    return art, build_artifact(art, load_profile("orin-x"), tmp_path_factory.mktemp("bundle") / "b")


def reference(folder):
    m = load_manifest(folder)
    m.build = None  # the graph file on ONNX Runtime's CPU provider
    return Decoder(folder, m)


def test_the_bundle_graph_is_the_export_in_fp32(trt_bundle, long_text):
    art, bundle = trt_bundle
    ids = np.asarray(Tokenizer(bundle / "tokenizer.json").encode(long_text, add_special_tokens=True)[:120])
    np.testing.assert_allclose(reference(bundle).feed(ids, all_logits=True), Decoder(art).feed(ids, all_logits=True), atol=2e-4)


def test_strongly_typed_graph_runs_its_weight_products_in_fp16(trt_bundle, long_text):
    art, bundle = trt_bundle
    model = onnx.load(str(bundle / "decoder.trt.onnx"))
    n = fp16_matmuls(model)
    assert n == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied LM head
    fp16 = {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT16}
    assert "embed_tokens" in fp16 and "layers.0.qkv" in fp16
    out = bundle.parent / "strong"
    out.mkdir()
    onnx.save_model(model, str(out / "g.onnx"), save_as_external_data=True, location="g.data")
    assert [v for v in check_file(out / "g.onnx", "10.x") if v.severity == "error"] == []
    m = load_manifest(bundle)
    m.build = None
    m.files = {**m.files, "graph": dataclasses.replace(m.files["graph"], path="g.onnx")}
    import shutil

    shutil.copy2(bundle / "tokenizer.json", out / "tokenizer.json")
    ids = np.asarray(Tokenizer(bundle / "tokenizer.json").encode(long_text, add_special_tokens=True)[:60])
    got = Decoder(out, m).feed(ids, all_logits=True)
    ref = Decoder(art).feed(ids, all_logits=True)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.95 and np.abs(got - ref).max() < 0.1


# -- the bundle ------------------------------------------------------------------------------------


def test_build_without_tensorrt_writes_the_bundle(trt_bundle):
    art, bundle = trt_bundle
    m = load_manifest(bundle)
    s = m.runtime_spec.facts
    assert m.runtime_spec.backend.value == "tensorrt" and m.runtime_spec.profile == "orin-x"
    assert s.state is EngineState.BUNDLE and s.api_era is ApiEra.TRT8 and s.precision == ("fp16",)
    assert s.workspace_bytes == 512 << 20 and [p.name for p in s.profiles] == ["decode", "prefill"]
    assert s.fp16_safe_norms == 2 * 2 + 1 and not (bundle / s.engine_file).exists()
    assert set(m.files) == {"graph", "graph_data", "tokenizer"}
    assert check_file(bundle / "decoder.trt.onnx", "8.6") == []
    ops = {n.op_type for n in onnx.load(str(bundle / "decoder.trt.onnx"), load_external_data=False).graph.node}
    assert "Pow" not in ops and {"ReduceMax", "Abs", "Max"} <= ops
    readme = (bundle / "README.txt").read_text()
    assert "cabinlm build b" in readme and "attention_mask: min (2, 66) opt (16, 80) max (16, 80)" in readme
    assert "nothing of it has run under TensorRT" in readme


@pytest.mark.parametrize("name,era,precision", [("jetson-orin-nx-16gb", ApiEra.TRT10, ("fp16", "int8")),
                                                ("thor", ApiEra.TRT10, ("fp16", "int8"))])  # fmt: skip
def test_bundles_for_tensorrt_10_profiles(name, era, precision, load, tiny_qwen2_dir, export_to, tmp_path):
    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=48, chunk=16, kv="int8", index_dtype="int32")
    s = load_manifest(build_artifact(art, load_profile(name), tmp_path / name)).runtime_spec.facts
    assert s.api_era is era and s.precision == precision and s.target_version == load_profile(name).engine_version


@pytest.mark.skipif(tensorrt_present(), reason="this machine has TensorRT: the bundle is built into an engine")
def test_cli_bundle_chat_build_and_doctor_without_tensorrt(trt_bundle, tmp_path):
    art, bundle = trt_bundle
    b = cabinlm("build", art, "--profile", "orin-x", "-o", tmp_path / "x")
    assert b.returncode == 0, b.stderr
    assert "wrote the TensorRT bundle" in b.stdout and "run `cabinlm build x` there" in b.stdout
    assert_clean_error(cabinlm("chat", bundle, "--max-new-tokens", 2, stdin="hi\n"), "TensorRT bundle without its engine",
                       "cabinlm build")  # fmt: skip
    assert_clean_error(cabinlm("build", bundle), "no TensorRT", "on the target")
    assert_clean_error(cabinlm("build", bundle, "--profile", "thor"), "bundle for profile orin-x, not thor")
    d = cabinlm("doctor", bundle)
    assert d.returncode == 1 and "Traceback" not in d.stderr
    assert "FAIL  tensorrt" in d.stderr and "OK    bundle" in d.stderr and "SKIP  logits" in d.stderr
    import shutil

    broken = shutil.copytree(bundle, tmp_path / "broken")
    (broken / "decoder.trt.onnx.data").write_bytes(b"x" * (broken / "decoder.trt.onnx.data").stat().st_size)  # same size
    d = cabinlm("doctor", broken)
    assert d.returncode == 1 and "FAIL  bundle" in d.stderr and "sha256" in d.stderr


# -- the GPU half ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not tensorrt_present(), reason="needs TensorRT and an NVIDIA GPU: no machine of this project has "
                    "TensorRT (docs/tensorrt.md); run on a DRIVE / Jetson / Thor board or a GPU host with TensorRT")
def test_engine_on_a_gpu_matches_onnxruntime(load, tiny_qwen2_dir, export_to, tmp_path):
    from cabinlm.engines.tensorrt.doctor import diagnose

    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=48, chunk=16, kv="fp16", index_dtype="int32")
    out = build_artifact(art, load_profile("jetson-agx-orin-64gb"), tmp_path / "engine")
    assert load_manifest(out).runtime_spec.facts.state is EngineState.ENGINE
    checks = diagnose(out)
    assert all(c.status == "ok" for c in checks), [c.line() for c in checks]


@pytest.mark.gpu
@pytest.mark.skipif(not tensorrt_present(), reason="needs TensorRT and an NVIDIA GPU: no machine of this project has "
                    "TensorRT (docs/tensorrt.md); run on a DRIVE / Jetson / Thor board or a GPU host with TensorRT")
def test_a_gemma_engine_on_a_gpu_runs_the_rings(load, export_to, tmp_path):
    """The local layers' rings on a real engine (never run: written for the first board). The tiny
    Gemma 3's rings hold 20 slots, so doctor's 64 tokens turn them over; a longer stream then goes
    on past the window against ONNX Runtime on the same graph, by doctor's policy."""
    from conftest import make_tiny_model

    from cabinlm.engines.tensorrt.doctor import MAX_DIFF, MIN_AGREEMENT, diagnose

    gemma = load(str(make_tiny_model(tmp_path / "gemma", "gemma3")))
    art = export_to(gemma, sink=4, pinned=12, window=48, chunk=8, kv="fp16", index_dtype="int32")
    out = build_artifact(art, load_profile("jetson-agx-orin-64gb"), tmp_path / "engine")
    assert load_manifest(out).cache.local_layers == (0, 2)
    checks = diagnose(out)
    assert all(c.status == "ok" for c in checks), [c.line() for c in checks]
    reference = load_manifest(out)
    reference.build = None
    engine, cpu = Decoder(out), Decoder(out, reference)
    ids = np.random.default_rng(0).integers(3, 300, 200)
    # a step's logits are a view into the backend's buffer, valid until its next run: copies
    got = [engine.feed(ids[:24], all_logits=True)] + [engine.step(ids[i : i + 1]).copy() for i in range(24, 200)]
    want = [cpu.feed(ids[:24], all_logits=True)] + [cpu.step(ids[i : i + 1]).copy() for i in range(24, 200)]
    got_all, want_all = np.concatenate([g.reshape(-1, g.shape[-1]) for g in got]), np.concatenate(
        [w.reshape(-1, w.shape[-1]) for w in want])  # fmt: skip
    assert engine.cache.evicted > 0 and float(np.abs(got_all - want_all).max()) <= MAX_DIFF
    assert float((got_all.argmax(-1) == want_all.argmax(-1)).mean()) >= MIN_AGREEMENT
