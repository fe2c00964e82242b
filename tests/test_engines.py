"""The engines' layout and contracts: the runtime side never reaches the build side, a build is one
engine's typed facts, and a build never writes into (or over) its input.

What the conformance suite (tests/test_backends.py) cannot see: an import from the runtime into a
builder works as long as onnx is installed, and only breaks a car that does not carry onnx; a build
that deletes its input's manifest still produces a perfectly good build.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest
from cabinlm.contract.buildspec import BuildSpec
from cabinlm.contract.errors import BuildError
from cabinlm.engines.build import build_artifact, default_output
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.engines.static import SharedWeights
from cabinlm.contract.engines import FACTS
from cabinlm.engines.registry import ENGINES, BackendKind
from cabinlm.contract.manifest import Manifest, load_manifest
from cabinlm.profiles import load_profile
from test_cli import assert_clean_error, cabinlm

SRC = Path(__file__).resolve().parents[1] / "src" / "cabinlm"
ENGINE_DIRS = sorted(p for p in (SRC / "engines").iterdir() if p.is_dir() and p.name != "__pycache__")
# The build side of an engine folder: what may import onnx and run compilers. Everything else in an
# engine folder (backend.py and what it uses) is the runtime side, which a car carries.
BUILD_SIDE = {"builder", "build", "output", "graph", "offline", "bundle", "engine", "compat", "doctor", "block_layouts", "head_graph", "node_builder",
              "vision_build", "compile", "adapter_graph", "qdq", "a16_feeds", "a16_weights", "a16_kv_io", "rotated_graph",
              "gen_ort_api", "single_op"}  # fmt: skip


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}"))  # `from pkg import module`
    return names


def is_module(name: str) -> bool:
    """A module or package of cabinlm (not an attribute of one)."""
    rel = Path(*name.split(".")[1:]) if name.startswith("cabinlm.") else None
    return rel is not None and ((SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file())


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts)


def is_build_side(module: str) -> bool:
    parts = module.split(".")
    return parts[:2] == ["cabinlm", "engines"] and (parts[-1] in BUILD_SIDE or "kernels" in parts and parts[-1] != "kernels")


def test_every_engine_folder_is_registered_and_has_its_two_parts():
    registered = {e.package.rsplit(".", 1)[1] for e in ENGINES.values()}
    engine_dirs = {p.name for p in ENGINE_DIRS} - {"onnxruntime"}  # onnxruntime/: what the ORT engines share
    assert engine_dirs == registered
    for name in registered:
        for part in ("builder.py", "backend.py"):
            assert (SRC / "engines" / name / part).is_file(), (name, part)
    for entry in ENGINES.values():  # its typed facts: the contract's (contract/engines/), by kind
        assert entry.facts is FACTS[entry.kind]
        assert entry.facts is None or entry.facts.__module__.startswith("cabinlm.contract.engines.")
    for entry in ENGINES.values():
        assert hasattr(entry.backend_module(), "open_backend") and hasattr(entry.backend_module(), "unavailable")
        assert entry.builder().kind is entry.kind


def test_the_runtime_never_imports_the_build_side():
    """cabinlm.runtime and every engine's runtime side import no builder, graph rewrite or exporter."""
    runtime_side = [p for p in SRC.rglob("*.py") if p.parts[-2] == "runtime" or
                    (p.is_relative_to(SRC / "engines") and not is_build_side(module_name(p)) and p.name != "registry.py")]
    assert len(runtime_side) > 20
    bad = []
    for path in runtime_side:
        for name in imports_of(path):
            if is_build_side(name) or name.startswith(("cabinlm.export", "cabinlm.cli", "onnx.", "torch", "transformers")) \
                    or name == "onnx":
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert bad == []


def test_builders_reach_the_runtime_only_through_its_public_face_or_their_own_folder():
    """A builder may run the build it made (cabinlm.runtime's Decoder) and use its own engine's
    runtime side; it never reaches into another part of the runtime."""
    bad = []
    for path in (SRC / "engines").rglob("*.py"):
        if not is_build_side(module_name(path)):
            continue
        own = module_name(path).rsplit(".", 1)[0]
        for name in imports_of(path):
            other_engine = name.count(".") == 3 and name.endswith(".backend") and not name.startswith(own)
            if name.startswith("cabinlm.runtime.") or (name.startswith("cabinlm.engines.") and other_engine):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert bad == []


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_build_spec_holds_exactly_its_engines_facts(kind):
    facts_cls = ENGINES[kind].facts
    other = next(e.facts for e in ENGINES.values() if e.facts is not None and e.facts is not facts_cls)
    wrong = FusedSettings() if other is FusedSettings else SharedWeights("w.data", ())
    with pytest.raises(ValueError, match=kind.value):
        BuildSpec(backend=kind, facts=wrong)
    if facts_cls is not None:
        with pytest.raises(ValueError, match=facts_cls.__name__):
            BuildSpec(backend=kind)  # an engine with facts must record them


def test_the_manifest_refuses_another_engines_facts_in_a_build():
    d = BuildSpec(backend=BackendKind.FUSED, facts=FusedSettings()).to_dict()
    assert BuildSpec.from_dict(json.loads(json.dumps(d))) == BuildSpec(backend=BackendKind.FUSED, facts=FusedSettings())
    d["shared_weights"] = {"file": "w.data", "tensors": []}
    with pytest.raises(ValueError, match="cannot hold build.shared_weights"):
        BuildSpec.from_dict(d)


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under a folder: files by content hash, folders by name."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.fixture(scope="module")
def export(load, tiny_llama_dir, export_to) -> Path:
    return export_to(load(str(tiny_llama_dir)), kv="int8", sink=2, pinned=8, window=16, chunk=4)


@pytest.mark.parametrize("where", ["itself", "inside", "a file", "its parent"])
def test_a_build_into_or_over_its_input_is_refused_and_the_input_is_untouched(export, tmp_path, where):
    before = snapshot(export)
    target = {"itself": export, "inside": export / "sub", "a file": export / "tokenizer.json",
              "its parent": export.parent}[where]  # fmt: skip
    p = cabinlm("build", export, "--profile", "cpu", "-o", target)
    assert_clean_error(p, "-o", "build")
    assert snapshot(export) == before
    if where != "a file":  # a file outside the export is refused the same way
        outside = tmp_path / "plain-file"
        outside.write_text("keep me")
        assert_clean_error(cabinlm("build", export, "--profile", "cpu", "-o", outside), "is a file")
        assert outside.read_text() == "keep me"


def test_a_build_over_another_export_is_refused(export, load, tiny_llama_dir, export_to):
    other = export_to(load(str(tiny_llama_dir)), kv="fp32", sink=2, pinned=8, window=16, chunk=4)
    before = snapshot(other)
    with pytest.raises(BuildError, match="holds an export"):
        build_artifact(export, load_profile("cpu"), other)
    assert snapshot(other) == before


def test_the_default_build_goes_beside_the_export_and_its_manifest_validates(export):
    before = snapshot(export)
    out = build_artifact(export, load_profile("cpu"), attention="graph")
    assert out == default_output(export, "cpu") == export.parent / f"{export.name}-build-cpu"
    assert snapshot(export) == before
    text = (out / "manifest.json").read_text()
    built = Manifest.from_dict(json.loads(text))
    assert built.build is not None and built.build.backend is BackendKind.EXPORTED_GRAPH
    assert built.target.built_from == str(export.resolve()) and load_manifest(out).files.keys() >= {"graph", "tokenizer"}
    again = build_artifact(export, load_profile("cpu"), out, attention="graph")  # an earlier build may be replaced
    assert again == out


def test_a_build_whose_manifest_would_not_validate_writes_none(export, tmp_path):
    """The built manifest is derived through Manifest.from_dict, with every check a load makes: a
    build that lists no graph is a BuildError, and no manifest.json is left to look finished."""
    from cabinlm.engines.output import BuildOutput

    out = BuildOutput.prepare(export, load_manifest(export), tmp_path / "b")
    out.copy("tokenizer")
    with pytest.raises(BuildError, match="no 'graph' file listed"):
        out.finish(BuildSpec(backend=BackendKind.EXPORTED_GRAPH), "cpu")
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_the_mask_value_of_the_graph_contract_is_the_runtimes():
    """Builders check graphs with io_spec.MASK_VALUE; the runtime plans masks with its own float32 copy."""
    import numpy as np

    from cabinlm.contract import io_spec
    from cabinlm.contract.slots import MASK_VALUE

    assert np.float32(io_spec.MASK_VALUE) == MASK_VALUE
