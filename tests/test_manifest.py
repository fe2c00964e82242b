"""The manifest: stdlib-only, versioned, and strict about what it declares."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cabinlm.errors import ManifestError
from cabinlm.manifest import Manifest, decoder_io, load_manifest, verify_checksums


@pytest.fixture(scope="module")
def artifact(load, tiny_llama_dir, export_to):
    return export_to(load(str(tiny_llama_dir)), sink=2, pinned=6, window=32, chunk=8)


def test_round_trip(artifact):
    m = load_manifest(artifact)
    again = Manifest.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again.to_dict() == m.to_dict()
    verify_checksums(artifact, m)


def test_io_is_declared_from_the_layout(artifact):
    m = load_manifest(artifact)
    io = decoder_io(m.cache, m.model.vocab_size)
    names = [t.name for t in io.inputs]
    assert names[:5] == ["input_ids", "position_ids", "cache_position_ids", "attention_mask", "logit_rows"]
    assert len(io.inputs) == 5 + 2 * m.cache.layers and len(io.outputs) == 1 + 2 * m.cache.layers
    assert io.outputs[0].shape == ("rows", m.model.vocab_size)
    k0 = next(t for t in io.inputs if t.name == "key_cache.0")
    assert k0.shape == (m.cache.kv_heads, 2 + 6 + 32, m.cache.head_dim)


def test_a_missing_field_is_named(artifact):
    d = json.loads((artifact / "manifest.json").read_text())
    del d["cache"]
    with pytest.raises(ManifestError, match="missing field 'cache'"):
        Manifest.from_dict(d)


def test_a_changed_checksum_is_caught(artifact, tmp_path):
    m = load_manifest(artifact)
    d = m.to_dict()
    d["files"]["tokenizer"]["sha256"] = "0" * 64
    with pytest.raises(ManifestError, match="sha256"):
        verify_checksums(artifact, Manifest.from_dict(d))


def test_the_manifest_module_needs_only_the_standard_library():
    code = "import sys; sys.modules['numpy'] = None; sys.modules['onnx'] = None; import cabinlm.manifest"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_fields_of_the_wrong_shape_are_a_manifest_error(artifact):
    d = json.loads((artifact / "manifest.json").read_text())
    for field, bad in (("files", []), ("cache", 5), ("chat", "x"), ("stop_ids", None)):
        with pytest.raises(ManifestError):
            Manifest.from_dict({**d, field: bad})


def test_an_artifact_of_an_older_format_is_refused_with_what_to_run(artifact):
    d = json.loads((artifact / "manifest.json").read_text())
    with pytest.raises(ManifestError, match=r"format_version 3 .*run `cabinlm export` again"):
        Manifest.from_dict({**d, "format_version": 3})
    built = {**d, "format_version": 3, "target": {"profile": "cpu", "built_from": "/x"}}
    with pytest.raises(ManifestError, match=r"run `cabinlm export` and then `cabinlm build` again"):
        Manifest.from_dict(built)


@pytest.mark.parametrize("field,bad", [
    ("backend", "tensorflow"), ("provider", {"name": "Cpu", "options": {}}), ("provider", {"name": "CPUExecutionProvider", "options": {"a": 1}}),
    ("session", {"graph_optimization_level": "max"}), ("session", {"intra_op_num_threads": True}),
    ("session", {"intra_op_num_threads": 10**9}), ("session", {"denormal_as_zero": "yes"}), ("fused", {"accuracy_level": 9}),
    ("shared_weights", {"file": "w", "tensors": [["a", "float64", [1], 0, 8]]}),
])  # fmt: skip
def test_the_build_section_is_typed_and_checked(artifact, field, bad):
    """The build is typed data: a wrong kind, provider, option type or table is one ManifestError."""
    from cabinlm.buildspec import BackendKind, BuildSpec, FusedSettings

    import dataclasses

    d = dataclasses.replace(load_manifest(artifact), build=BuildSpec(backend=BackendKind.FUSED, fused=FusedSettings())).to_dict()
    spec = d["build"]
    assert Manifest.from_dict(d).runtime_spec.backend == BackendKind.FUSED  # the well-formed spec loads
    if isinstance(bad, dict) and isinstance(spec.get(field), dict):
        bad = {**spec[field], **bad}
    with pytest.raises(ManifestError):
        Manifest.from_dict({**d, "build": {**spec, field: bad}})


def test_kv_scales_of_the_wrong_shape_or_sign_are_refused(load, tiny_llama_dir, export_to):
    art = export_to(load(str(tiny_llama_dir)), sink=2, pinned=6, window=32, chunk=8, kv="int8")
    d = json.loads((art / "manifest.json").read_text())
    Manifest.from_dict(d)
    keys = d["kv_scales"]["keys"]
    for bad in (keys[:1], [[[-1.0] * len(keys[0][0])] * len(keys[0])] * len(keys), [[["nan"]]]):
        with pytest.raises(ManifestError, match="kv_scales"):
            Manifest.from_dict({**d, "kv_scales": {**d["kv_scales"], "keys": bad}})
    with pytest.raises(ManifestError, match="without its calibrated scales"):
        Manifest.from_dict({**d, "kv_scales": None})
