"""`cabinlm build` never destroys its input: real folders, compared byte for byte before and
after, through the command line as a user runs it.

test_engines.py covers an export given as input. What it does not: a finished build given as input
(`cabinlm build BUILD -o BUILD` is the command a user retrying a build types), and every refusal
being one line with exit 2 and no traceback for both kinds of input. The refusals come from
engines/output.check_output (an export) and Builder.finish (a build, which is not built again):
already in place before these cases were written, so they pass on that code too; they pin the
behaviour: a build never writes into, over or inside its own input.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under a folder: files by content hash, folders by name."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.fixture(scope="module")
def inputs(load, tiny_qwen2_dir, export_to, tmp_path_factory) -> dict[str, Path]:
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    export = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")
    built = build_artifact(export, load_profile("cpu"), tmp_path_factory.mktemp("built") / "b", attention="graph")
    return {"export": export, "build": built}


@pytest.mark.parametrize("kind", ["export", "build"])
@pytest.mark.parametrize("where", ["itself", "inside", "a file inside", "its manifest", "its parent"])
def test_an_output_that_is_the_input_inside_it_or_a_file_is_refused_in_one_line_and_nothing_changes(
        inputs, kind, where):  # fmt: skip
    folder = inputs[kind]
    before = snapshot(folder)
    parent_before = sorted(p.name for p in folder.parent.iterdir())
    target = {"itself": folder, "inside": folder / "sub", "a file inside": folder / "tokenizer.json",
              "its manifest": folder / "manifest.json", "its parent": folder.parent}[where]  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "cabinlm", "build", str(folder), "--profile", "cpu", "-o", str(target)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr
    assert snapshot(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir()) == parent_before  # nothing written beside it either
