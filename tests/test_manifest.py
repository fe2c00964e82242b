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
