"""A new engine is a folder and a registration, nothing else: tests/toy_engine/ (a builder.py and a
backend.py outside the cabinlm package) registers its kind and folder at run time, `cabinlm build`
picks its builder for the profile it targets, the manifest names it, the runtime opens it, and it
passes the engine conformance suite (tests/test_backends.py's stream against the streaming reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import toy_engine
from cabinlm.contract.engines import FACTS, BackendKind
from cabinlm.contract.manifest import load_manifest
from cabinlm.engines.build import build_artifact
from cabinlm.engines.registry import ENGINES
from cabinlm.profiles import builtin_profile_text, load_profile
from cabinlm.runtime import Decoder
from test_backends import LAYOUT, TOLERANCE, expected, stream, stream_errors  # noqa: F401 - fixtures

__all__ = ["expected", "stream"]


@pytest.fixture(scope="module")
def toy_kind():
    kind = toy_engine.register()
    yield kind
    toy_engine.unregister(BackendKind(toy_engine.NAME))  # the last test registers it again


@pytest.fixture(scope="module")
def toy_build(toy_kind, load, tiny_llama_dir, export_to, tmp_path_factory) -> Path:
    """The conformance export (tests/test_backends.py's layout, fp32 KV) built for the toy's profile:
    the built-in cpu profile under the name the toy's builder targets."""
    tmp = tmp_path_factory.mktemp("toy")
    text = builtin_profile_text("cpu").replace('name = "cpu"', f'name = "{toy_engine.PROFILE}"', 1)
    assert f'name = "{toy_engine.PROFILE}"' in text
    (tmp / "toy.toml").write_text(text)
    art = export_to(load(str(tiny_llama_dir)), kv="fp32", **LAYOUT)
    return build_artifact(art, load_profile(tmp / "toy.toml"), tmp / "build")


def test_registering_an_engine_adds_its_kind_and_folder_and_removing_it_restores_them():
    before = (list(BackendKind), dict(ENGINES))
    kind = toy_engine.register()
    try:
        assert BackendKind(toy_engine.NAME) is kind and kind in FACTS and ENGINES[kind].package == "toy_engine"
        with pytest.raises(ValueError, match="already registered"):
            toy_engine.register()
    finally:
        toy_engine.unregister(kind)
    assert (list(BackendKind), dict(ENGINES)) == before
    with pytest.raises(ValueError, match="not a backend kind"):
        BackendKind(toy_engine.NAME)
    with pytest.raises(ValueError, match="built-in"):
        toy_engine.unregister(BackendKind.FUSED)


def test_the_build_picks_the_toy_and_its_manifest_names_it(toy_kind, toy_build):
    m = load_manifest(toy_build)
    assert m.runtime_spec.backend is toy_kind and m.build.facts is None
    assert m.io == load_manifest(toy_build).io  # the exported graph's contract: no engine named anywhere


def test_the_toy_engine_passes_the_conformance_stream(toy_kind, toy_build, stream, expected):  # noqa: F811
    _, ids = stream
    dec = Decoder(toy_build)
    assert type(dec.backend).kind is toy_kind and type(dec.backend).__module__ == "toy_engine.backend"
    errors = stream_errors(dec, ids, expected)
    every, mean = TOLERANCE[dec.manifest.cache.kv_dtype]
    assert errors.max() < every and errors.mean() < mean, (errors.max(), errors.mean())


def test_a_manifest_naming_an_engine_that_is_not_registered_is_refused_in_one_line(toy_build, toy_kind):
    from cabinlm.contract.errors import ManifestError

    toy_engine.unregister(toy_kind)
    try:
        with pytest.raises(ManifestError) as e:
            load_manifest(toy_build)
        assert toy_engine.NAME in str(e.value) and "\n" not in str(e.value)
    finally:
        assert toy_engine.register() is not toy_kind  # registered again: a new kind object
