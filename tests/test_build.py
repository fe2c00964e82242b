"""`cabinlm build` and the profile-aware commands, run as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from cabinlm.engines.tensorrt.compat import check_file
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import chunked_perplexity
from test_cli import assert_clean_error, cabinlm

PLAN_KEYS = {"profile", "budget_bytes", "weights_bytes", "kv_bytes", "kv_bytes_per_token", "activation_bytes",
             "total_bytes", "window", "fits"}  # fmt: skip


@pytest.fixture(scope="module")
def fp16_artifact(load, tiny_qwen2_dir, export_to) -> Path:
    return export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=48, chunk=16, kv="fp16")


def ppl(folder: Path, ids) -> float:
    return chunked_perplexity(Decoder(folder), ids).ppl


def ids_for(folder: Path, text: str, n: int = 300) -> list[int]:
    return Tokenizer(folder / "tokenizer.json").encode(text, add_special_tokens=True)[:n]


def test_cpu_build_is_an_optimized_runnable_artifact(fp16_artifact, tmp_path, long_text):
    out = tmp_path / "cpu"
    p = cabinlm("build", fp16_artifact, "--profile", "cpu", "-o", out)
    assert p.returncode == 0, p.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["build"]  # the build as typed data, in the manifest (no build.json)
    assert not (out / "build.json").exists()
    assert record["profile"] == "cpu" and record["engine"] == "onnxruntime"
    assert record["backend"] == "onnxruntime-graph" and record["provider"]["name"] == "CPUExecutionProvider"
    assert record["session"]["graph_optimization_level"] == "basic"
    assert manifest["files"]["graph"]["path"] == "decoder.opt.onnx"
    ids = ids_for(out, long_text)  # 300 tokens through 64 slots: eviction active
    assert ppl(out, ids) == pytest.approx(ppl(fp16_artifact, ids), rel=1e-4)
    chat = cabinlm("chat", out, "--json", "--max-new-tokens", 4, stdin="hello\n")
    assert chat.returncode == 0 and json.loads(chat.stdout)["turn"] == 1
    assert json.loads(chat.stdout)["backend"] == "onnxruntime-cpu"  # what the build ran on, from its manifest


def test_static_build_has_only_static_shapes_and_shares_its_weights(fp16_artifact, tmp_path, long_text):
    """A static-shape profile on the host's CPU provider (a user's own profile file): the static pair
    with one weights file. (The Snapdragon profiles compile it for the HTP: tests/test_qnn.py.)"""
    from test_backends import static_profile

    profile = static_profile(tmp_path)
    profile.write_text(profile.read_text().replace('kv_dtypes = ["fp32", "fp16"]', 'kv_dtypes = ["fp16", "fp32"]')
                       .replace("default_chunk = 4", "default_chunk = 16"))  # fmt: skip
    out = tmp_path / "qc"
    p = cabinlm("build", fp16_artifact, "--profile", profile, "-o", out)
    assert p.returncode == 0, p.stderr
    for name, tokens in (("decoder.prefill.onnx", 16), ("decoder.decode.onnx", 1)):
        m = onnx.load(str(out / name), load_external_data=False)
        for vi in (*m.graph.input, *m.graph.output):
            dims = vi.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") for d in dims), (name, vi.name)
        assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [tokens]
    # one weights file on disk, bound once in memory by both sessions
    assert len(list(out.glob("*.data"))) == 1
    dec = Decoder(out)
    table = json.loads((out / "manifest.json").read_text())["build"]["shared_weights"]["tensors"]
    assert dec.manifest.build.backend.value == "onnxruntime-static"
    assert dec.backend.graphs.static and len(dec.backend.graphs.weights) == len(table) > 0
    ids = ids_for(out, long_text)
    # a padded last chunk, single-token decode and eviction: the same numbers as the dynamic graph
    assert ppl(out, ids) == pytest.approx(ppl(fp16_artifact, ids), rel=1e-3)
    single = np.stack([dec.step(np.array([t]))[0].copy() for t in ids[:80]])
    ref = Decoder(fp16_artifact)
    expected = np.stack([ref.step(np.array([t]))[0].copy() for t in ids[:80]])
    np.testing.assert_allclose(single, expected, atol=2e-3)


def test_build_refuses_a_kv_precision_the_profile_cannot_run(load, tiny_qwen2_dir, export_to, tmp_path):
    fp32 = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=48, chunk=16)
    assert_clean_error(cabinlm("build", fp32, "--profile", "sa8295p", "-o", tmp_path / "x"), "fp32 KV", "--profile sa8295p")


def test_tensorrt_profiles_check_compatibility_then_write_the_target_bundle(tiny_qwen2_dir, tmp_path):
    art = tmp_path / "orin"
    p = cabinlm("export", tiny_qwen2_dir, "-o", art, "--profile", "orin-x", "--chunk", 16, "--window", 64,
                "--pinned", 12, "--no-verify")  # fmt: skip
    assert p.returncode == 0, p.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["index_dtype"] == "int32" and manifest["cache"]["kv_dtype"] == "fp16"
    assert manifest["target"]["profile"] == "orin-x" and PLAN_KEYS <= set(manifest["target"]["plan"])
    assert check_file(art / "decoder.onnx", "8.6") == []  # no errors, no warnings
    b = cabinlm("build", art, "--profile", "orin-x")  # no TensorRT here: the bundle, and how to finish on the car
    assert b.returncode == 0, b.stderr
    assert "0 error(s)" in b.stderr and "wrote the TensorRT bundle" in b.stdout and "cabinlm build orin-build-orin-x" in b.stdout
    assert json.loads((tmp_path / "orin-build-orin-x" / "manifest.json").read_text())["build"]["tensorrt"]["state"] == "bundle"
    chat = cabinlm("chat", art, "--json", "--max-new-tokens", 3, stdin="hi\n")  # int32 indices run on ORT too
    assert chat.returncode == 0, chat.stderr


def test_export_and_plan_refuse_fp8_on_orin(tiny_qwen2_dir, tmp_path):
    p = cabinlm("export", tiny_qwen2_dir, "-o", tmp_path / "x", "--profile", "orin-x", "--kv", "fp8")
    assert_clean_error(p, "fp8", "orin-x", "no FP8")
    assert not (tmp_path / "x" / "manifest.json").exists()
    assert_clean_error(cabinlm("plan", tiny_qwen2_dir, "--profile", "orin-x", "--kv", "fp8"), "fp8")


def test_plan_json_and_a_budget_too_small(tmp_path):
    cfg = Path(__file__).parent / "data" / "configs" / "qwen2.5-1.5b.json"
    p = cabinlm("plan", cfg, "--profile", "sa8775p", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert PLAN_KEYS <= set(plan) and plan["fits"] and plan["window"] % plan["chunk"] == 0
    assert plan["kv_bytes_per_token"] == 2 * 28 * 2 * 128 * 2  # fp16 K and V, 28 layers, 2 KV heads, head_dim 128
    tiny = tmp_path / "tiny.toml"
    text = (Path(__file__).parents[1] / "src/cabinlm/profiles/builtin/sa8775p.toml").read_text()
    tiny.write_text(text.replace('name = "sa8775p"', 'name = "tiny"').replace(
        next(line for line in text.splitlines() if line.startswith("budget_bytes")), 'budget_bytes = "512 MiB"'))
    assert_clean_error(cabinlm("plan", cfg, "--profile", tiny), "MiB")


def test_profiles_lists_every_target():
    p = cabinlm("profiles", "--json")
    assert p.returncode == 0
    names = {d["name"] for d in json.loads(p.stdout)}
    assert {"cpu", "orin-x", "jetson-agx-orin-64gb", "jetson-orin-nx-16gb", "thor", "sa8295p", "sa8775p"} <= names


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_cpu_build_fuses_the_cached_keys_rotary_embedding_exactly(kv, load, tiny_llama_dir, export_to, tmp_path):
    """The build rewrites the cache keys' RoPE into ONNX Runtime's RotaryEmbedding kernel: one node per
    layer instead of five, and the same logits, step by step, with eviction running."""
    art = export_to(load(str(tiny_llama_dir)), sink=4, pinned=4, window=40, chunk=8, kv=kv)
    out = tmp_path / "cpu"
    assert cabinlm("build", art, "--profile", "cpu", "-o", out, "--attention", "graph").returncode == 0
    m = onnx.load(str(out / "decoder.opt.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("RotaryEmbedding") == 2  # one per layer (the tiny model has 2)
    assert not any(n.name.endswith(("rope_kc/rot", "rope_kc/xcos")) for n in m.graph.node)
    a, b = Decoder(art), Decoder(out)
    ids = np.arange(3, 150) % 300
    # int8: a chunk attends to its own keys re-quantized, as the cache holds them; float rounding of the
    # optimized graph can move a key across an int8 step (a few 1e-3 in the logits), never more
    atol = 1e-4 if kv == "fp32" else 1e-2
    np.testing.assert_allclose(b.feed(ids[:50], all_logits=True), a.feed(ids[:50], all_logits=True), atol=atol)
    for t in ids[50:]:  # one token per step, 100 steps past the 48-slot cache
        np.testing.assert_allclose(b.step(np.array([t]))[0], a.step(np.array([t]))[0], atol=atol)
