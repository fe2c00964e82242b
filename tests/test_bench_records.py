"""`cabinlm bench --records`: every run's record carries its provenance in the documented schema, and
`cabinlm bench compare` / `--alternate` set two sets of real runs side by side (medians, ranges, B/A
per round); files with nothing in common are refused in one line."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cabinlm.bench.records import FIELDS, SCHEMA, Record, check

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--tokens", 160, "--max-new", 24, "--threads", 2]


def cabinlm(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "cabinlm", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_runs(smollm2_fused, tmp_path_factory):
    """Two invocations of `cabinlm bench --records` on one real build, a file each."""
    folder = tmp_path_factory.mktemp("records")
    files = []
    for name in ("a.jsonl", "b.jsonl"):
        p = cabinlm("bench", smollm2_fused, *SMALL, "--records", folder / name)
        assert p.returncode == 0, p.stderr
        files.append(folder / name)
    return smollm2_fused, files


def test_every_record_has_its_provenance_in_the_documented_schema(two_runs):
    """Each field is present with its documented type, and the build's facts are the build's own: the
    manifest's bytes, its engine, its kernel library's hash and path."""
    build, files = two_runs
    manifest = json.loads((build / "manifest.json").read_text())
    kernels = manifest["build"]["fused"]["kernels"]
    for f in files:
        (d,) = lines_of(f)
        check(d)  # every field, typed
        assert list(d)[: len(FIELDS)] == list(FIELDS)
        assert d["schema"] == SCHEMA and d["tool"] == "cabinlm bench" and d["round"] == 0
        assert d["manifest_sha256"] == hashlib.sha256((build / "manifest.json").read_bytes()).hexdigest()
        assert d["engine"] == manifest["build"]["backend"] == "onnxruntime-fused"
        assert d["kernels_sha256"] == kernels["sha256"] and d["matmul_isa"] == kernels["matmul_isa"]
        assert d["artifact"] == build.name and "/" not in d["artifact"]
        assert d["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", d["git_commit"])
        assert d["cpu_model"] and d["cores"] >= 1 and d["threads"] == 2 and d["onnxruntime_version"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", d["utc_start"]) and d["utc_end"] >= d["utc_start"]
        assert d["params"] == {"runner": "cabinlm", "seats": 1, "tokens": 160, "max_new": 24, "seed": 0,
                               "drafting": "default"}  # fmt: skip
        fig = d["figures"]
        assert fig["decode_tok_s"] > 0 and fig["prefill_tok_s"] > 0 and fig["rss_mb_end"] > 50
        assert fig["tokens"] >= 160 and fig["done"] is True and fig["drafting"] is True  # the fused build drafts
        assert Record.from_dict(d).to_dict() == d  # read back as written


def test_compare_sets_two_runs_side_by_side(two_runs):
    _, (a, b) = two_runs
    p = cabinlm("bench", "compare", a, b)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "cabinlm bench: runner=cabinlm seats=1 tokens=160" in out
    assert "B/A per round" in out and "median B/A" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["decode_tok_s"])
    # A median (min-max), B median (min-max), one paired ratio, its median
    cells = re.fullmatch(r"\s*decode_tok_s\s+(\S+) \((\S+)-(\S+)\)\s+(\S+) \((\S+)-(\S+)\)\s+(\S+)\s+(\S+)", row)
    assert cells, row
    (fig_a,), (fig_b,) = lines_of(a), lines_of(b)
    ratio = fig_b["figures"]["decode_tok_s"] / fig_a["figures"]["decode_tok_s"]
    assert float(cells[7]) == pytest.approx(ratio, abs=1e-3) and cells[7] == cells[8]


def test_files_with_nothing_in_common_are_refused_in_one_line(two_runs, tmp_path):
    """A run with other parameters shares no group with the first: one line, exit 2. So does a file
    with no records, and a line that is not a record."""
    build, (a, _) = two_runs
    other = tmp_path / "other.jsonl"
    p = cabinlm("bench", build, "--tokens", 100, "--max-new", 24, "--records", other)
    assert p.returncode == 0, p.stderr
    p = cabinlm("bench", "compare", a, other)
    assert p.returncode == 2 and p.stdout == "", p.stdout
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "no records with the same tool and parameters" in p.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    p = cabinlm("bench", "compare", a, empty)
    assert p.returncode == 2 and p.stderr == f"error: {empty}: no records to compare\n"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(a.read_text() + '{"schema": 1}\n')
    p = cabinlm("bench", "compare", a, broken)
    assert p.returncode == 2 and p.stderr.startswith(f"error: {broken}:2: ") and p.stderr.count("\n") == 1
    p = cabinlm("bench", "compare", a)  # one file of one build
    assert p.returncode == 2 and "holds records of 1 builds" in p.stderr


def test_alternate_takes_turns_and_compares(two_runs, smollm2, export_to, tmp_path):
    """Two builds (the fused build and its plain export) in turns: A, B, A, B; the records of both in
    one file, which `compare` splits by build; the comparison pairs the rounds."""
    build, _ = two_runs
    export = export_to(smollm2, kv="int8", sink=4, pinned=60, window=252, chunk=32, weights="int4")
    out = tmp_path / "ab.jsonl"
    p = cabinlm("bench", "--alternate", build, export, "--rounds", 2, *SMALL, "--no-speculative", "--records", out)
    assert p.returncode == 0, p.stderr
    recs = lines_of(out)
    assert [r["artifact"] for r in recs] == [build.name, export.name] * 2 and [r["round"] for r in recs] == [0, 0, 1, 1]
    assert [r["engine"] for r in recs[:2]] == ["onnxruntime-fused", "onnxruntime-graph"] and recs[1]["kernels_sha256"] is None
    assert "B/A per round" in p.stdout and "decode_tok_s" in p.stdout
    again = cabinlm("bench", "compare", out)
    assert again.returncode == 0, again.stderr
    assert "2 rounds" in again.stdout and "B/A per round" in again.stdout


def test_the_schema_is_the_one_benchmarks_readme_documents():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    for key in FIELDS:
        assert f"| `{key}` |" in text, key
