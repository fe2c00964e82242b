"""The manifest: stdlib-only, versioned, and strict about what it declares."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cabinlm.contract.errors import ManifestError
from cabinlm.contract.manifest import Manifest, decoder_io, load_manifest, verify_checksums


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
    code = "import sys; sys.modules['numpy'] = None; sys.modules['onnx'] = None; import cabinlm.contract.manifest"
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
    import dataclasses

    from cabinlm.contract.buildspec import BackendKind, BuildSpec
    from cabinlm.contract.engines.fused import FusedSettings

    d = dataclasses.replace(load_manifest(artifact), build=BuildSpec(backend=BackendKind.FUSED, facts=FusedSettings())).to_dict()
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


hostile = st.recursive(st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=10),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                       max_leaves=10)  # fmt: skip


def _paths(node, prefix=()):
    """Every key path of a JSON document (lists by index), the document's own leaves included."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_manifest_is_a_manifest_error_or_a_valid_manifest(built_manifest, data):
    """Any value of the manifest (the build's typed section, the KV scales and the files included)
    replaced by any JSON value, or removed: Manifest.from_dict raises ManifestError or returns a
    manifest that describes itself again (round trip), never another exception."""
    import copy

    d = copy.deepcopy(built_manifest)
    paths = [p for p in _paths(d) if p and len(p) <= 4]
    where = data.draw(st.sampled_from(paths))
    node = d
    for k in where[:-1]:
        node = node[k]
    if data.draw(st.booleans()) and isinstance(node, dict):
        del node[where[-1]]
    else:
        node[where[-1]] = data.draw(hostile)
    try:
        m = Manifest.from_dict(d)
    except ManifestError:
        return
    assert Manifest.from_dict(m.to_dict()).to_dict() == m.to_dict()


@pytest.fixture(scope="module")
def built_manifest(load, tiny_llama_dir, export_to, tmp_path_factory):
    """An int8-KV fused cpu build's manifest: every typed section present (build, rotary, kv_scales)."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    art = export_to(load(str(tiny_llama_dir)), sink=2, pinned=6, window=32, chunk=8, kv="int8")
    out = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("built") / "b")
    return json.loads((out / "manifest.json").read_text())


def test_files_that_are_not_what_they_claim_are_refused_in_one_line(artifact, tmp_path):
    import os
    import shutil

    bad = tmp_path / "a"
    shutil.copytree(artifact, bad)
    d = json.loads((bad / "manifest.json").read_text())
    for path in ("../../etc/passwd", "/etc/passwd", ""):
        (bad / "manifest.json").write_text(json.dumps({**d, "files": {**d["files"], "tokenizer": {**d["files"]["tokenizer"], "path": path}}}))
        with pytest.raises(ManifestError, match="inside the artifact folder"):
            load_manifest(bad)
    (bad / "manifest.json").write_text(json.dumps(d))
    tok = bad / d["files"]["tokenizer"]["path"]
    tok.unlink()
    tok.mkdir()  # a directory where a file belongs
    with pytest.raises(ManifestError, match="not a regular file"):
        load_manifest(bad)
    (bad / "manifest.json").unlink()
    os.symlink("/dev/zero", bad / "manifest.json")  # a device where the manifest belongs: never read
    with pytest.raises(ManifestError, match="not a manifest"):
        load_manifest(bad)
    (bad / "manifest.json").unlink()
    (bad / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # nesting deeper than the parser goes
    with pytest.raises(ManifestError, match="corrupt"):
        load_manifest(bad)
    (bad / "manifest.json").write_text(json.dumps({**d, "cache": {**d["cache"], "window": 10**15}}))
    with pytest.raises(ManifestError, match="window"):
        load_manifest(bad)
