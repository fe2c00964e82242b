"""The measurement record: one JSON object per measured run or round, one per line of a records file
(JSON lines), written by `cabinlm bench --records FILE` and by every tool in benchmarks/.

A record is three parts: provenance (who ran what on which machine: bench/provenance.py), the
parameters of the run (what was asked: tokens, threads, seats, drafting, ...) and the measured figures
(decode tok/s, RSS, ...). Two records measure the same thing when their `tool` and `params` are equal;
`cabinlm bench compare` (bench/compare.py) compares such records across two files, round by round.

FIELDS below is the schema: every key of a record, its JSON types and what it means. benchmarks/README.md
documents the same table, and a test checks that every record a real run writes follows it.

    {"schema": 1, "tool": "cabinlm bench", "utc_start": "...", "utc_end": "...", "round": 0,
     "cabinlm_version": "0.1.0", "git_commit": "...", "git_dirty": false,
     "artifact": "smollm2-build-cpu", "manifest_sha256": "...", "engine": "onnxruntime-fused",
     "kernels_sha256": "...", "matmul_isa": "avx2", "cpu_model": "...", "machine": "x86_64",
     "cores": 2, "threads": 2, "onnxruntime_version": "1.22.0", "python_version": "3.12.3",
     "loadavg_start": 0.4, "loadavg_end": 1.9,
     "params": {"runner": "cabinlm", "tokens": 2000, ...}, "figures": {"decode_tok_s": ..., ...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from cabinlm.bench import provenance
from cabinlm.contract.errors import CabinlmError

SCHEMA = 1  # raised when a field changes meaning or goes; new optional figures do not raise it

# A parameter or figure value: JSON scalars only, so that records group and compare by equality.
Scalar = (str, int, float, bool, type(None))

# key -> (JSON types a value may have, what it means). The order is the order records are written in.
FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "schema": ((int,), "version of this record format (SCHEMA)"),
    "tool": ((str,), 'what measured: "cabinlm bench", "cabinlm bench --seats", `cabinlm recall`, or a script, "benchmarks/serve_load.py"'),
    "utc_start": ((str,), "when the run started, UTC, ISO 8601"),
    "utc_end": ((str,), "when it ended"),
    "round": ((int,), "the round within one invocation (0, 1, ...): compare pairs equal rounds"),
    "cabinlm_version": ((str,), "cabinlm's version"),
    "git_commit": ((str, type(None)), "HEAD of the checkout cabinlm ran from; null outside a git checkout"),
    "git_dirty": ((bool, type(None)), "that checkout had uncommitted changes to tracked files; null as above"),
    "artifact": ((str, type(None)), "the artifact or build folder's name; null for a run without one"),
    "manifest_sha256": ((str, type(None)), "sha256 of its manifest.json: the build, exactly"),
    "engine": ((str, type(None)), "its engine (the manifest's backend), or the peer that ran: llama.cpp, hf, ort-genai"),
    "kernels_sha256": ((str, type(None)), "sha256 of the build's kernel library (build.fused.kernels), or of the library file a kernel benchmark ran; null without one"),
    "matmul_isa": ((str, type(None)), "the kernel library's block-matmul path: avx512-vnni, avx-vnni, avx2, neon-*, generic"),
    "cpu_model": ((str,), "the CPU's name (/proc/cpuinfo model name, or what the platform reports)"),
    "machine": ((str,), "the architecture: x86_64, aarch64"),
    "cores": ((int,), "CPUs the process could run on"),
    "threads": ((int, type(None)), "threads the run used (ONNX Runtime intra-op, or the peer's)"),
    "onnxruntime_version": ((str, type(None)), "onnxruntime's version; null where not installed"),
    "python_version": ((str,), "Python's version"),
    "loadavg_start": ((float, int, type(None)), "1-minute load average when the run started"),
    "loadavg_end": ((float, int, type(None)), "and when it ended: other work on the machine slows every figure"),
    "params": ((dict,), "what was asked, as scalars: runner, tokens, max_new, seed, seats, mode, drafting, ..."),
    "figures": ((dict,), "what was measured, as numbers (or null where not measurable): decode_tok_s, rss_mb_end, ..."),
}


class RecordsError(CabinlmError):
    """A records file that cannot be read, or a record that does not follow the schema."""


@dataclass
class Record:
    """One measured run or round (see FIELDS for each field's meaning)."""

    tool: str
    params: dict[str, Any]
    figures: dict[str, Any]
    utc_start: str
    utc_end: str
    round: int = 0
    threads: int | None = None
    loadavg_start: float | None = None
    loadavg_end: float | None = None
    cabinlm_version: str = ""
    git_commit: str | None = None
    git_dirty: bool | None = None
    artifact: str | None = None
    manifest_sha256: str | None = None
    engine: str | None = None
    kernels_sha256: str | None = None
    matmul_isa: str | None = None
    cpu_model: str = ""
    machine: str = ""
    cores: int = 0
    onnxruntime_version: str | None = None
    python_version: str = ""
    schema: int = SCHEMA
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # keys a newer writer added

    def __post_init__(self) -> None:
        check(self.to_dict())

    @property
    def key(self) -> tuple[str, str]:
        """What the record measured: its tool and parameters (records with equal keys compare)."""
        return self.tool, json.dumps(self.params, sort_keys=True)

    @property
    def build(self) -> str:
        """The build that ran, for a reader: its folder name and the start of its manifest's sha256."""
        name = self.artifact or self.engine or "?"
        return f"{name} ({self.manifest_sha256[:12]})" if self.manifest_sha256 else name

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        return {**{k: d[k] for k in FIELDS}, **extra}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "record") -> Record:
        if not isinstance(d, Mapping):
            raise RecordsError(f"{where}: expected a JSON object, got {type(d).__name__}")
        try:
            check(d)
        except RecordsError as e:
            raise RecordsError(f"{where}: {e}") from e
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in names}, extra={k: v for k, v in d.items() if k not in names})


def check(d: Mapping[str, Any]) -> None:
    """Raise RecordsError unless D has every field of the schema with a value of its type."""
    if d.get("schema") != SCHEMA:
        raise RecordsError(f"schema {d.get('schema')!r}: this cabinlm reads records of schema {SCHEMA}")
    for key, (types, _) in FIELDS.items():
        if key not in d:
            raise RecordsError(f"no {key!r} field")
        value = d[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise RecordsError(f"{key!r} must be {names}, got {value!r}")
    for part in ("params", "figures"):
        for k, v in d[part].items():
            if not isinstance(k, str) or not isinstance(v, Scalar):
                raise RecordsError(f"{part}[{k!r}] must be a JSON scalar, got {type(v).__name__}")
    for k, v in d["figures"].items():
        if isinstance(v, str) or (isinstance(v, float) and not math.isfinite(v)):
            raise RecordsError(f"figures[{k!r}] must be a finite number, true/false or null, got {v!r}")


def scalars(d: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-scalar entries of D (lists and objects left out), non-finite floats as null: what a
    summary dict becomes as a record's figures."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, Scalar):
            out[k] = v
    return out


def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects' scalars under dotted keys ({"ttft_ms": {"p50": 1}} -> {"ttft_ms.p50": 1});
    lists left out: how a tool's nested summary becomes a record's figures."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, Scalar):
            out[f"{prefix}{k}"] = v
    return out


class Recorder:
    """Records of one invocation: the machine's facts read once, each build's once, and each run's
    time and load average around it.

        rec = Recorder("benchmarks/serve_load.py")
        with rec.run(params={"clients": 4}, artifact=folder, threads=2) as figures:
            figures["errors"] = 0         # the run fills in what it measured
        rec.write(path)                   # JSON lines, appended
    """

    def __init__(self, tool: str):
        self.tool = tool
        self.machine = provenance.machine()
        self.records: list[Record] = []
        self._builds: dict[str, provenance.BuildFacts] = {}

    def facts(self, artifact: str | Path | None) -> dict[str, Any]:
        if artifact is None:
            return {}
        key = str(Path(artifact).resolve())
        if key not in self._builds:
            self._builds[key] = provenance.build_facts(artifact)
        return asdict(self._builds[key])

    def add(self, params: Mapping[str, Any], figures: Mapping[str, Any], *, utc_start: str, loadavg_start: float | None,
            artifact: str | Path | None = None, engine: str | None = None, threads: int | None = None,
            library: str | Path | None = None, round: int = 0) -> Record:  # fmt: skip
        """A record of a run that started at UTC_START (with that load average) and ends now: of
        ARTIFACT (a build folder), of a peer (ENGINE its name) or of a kernel LIBRARY file alone. Lists,
        objects and words among FIGURES are left out (a record's figures are numbers)."""
        build = self.facts(artifact)
        if engine is not None:  # a peer's run: its name stands where a build's engine would
            build["engine"] = engine
        if library is not None:
            build.update(provenance.library_facts(library))
        numbers = {k: v for k, v in scalars(figures).items() if not isinstance(v, str)}  # words belong in params
        record = Record(tool=self.tool, params=scalars(params), figures=numbers, utc_start=utc_start,
                        utc_end=provenance.utc_now(), round=round, threads=threads, loadavg_start=loadavg_start,
                        loadavg_end=provenance.load_average(), **asdict(self.machine), **build)  # fmt: skip
        self.records.append(record)
        return record

    def write_to(self, path: str | Path | None) -> Path | None:
        """write(PATH) where a path was given (a script's --records), else nothing."""
        return self.write(path) if path is not None else None

    def run(self, params: Mapping[str, Any], **kw: Any) -> _Run:
        """A context manager around one run: yields the figures dict to fill, adds the record on exit
        (not when the run raises)."""
        return _Run(self, params, kw)

    def write(self, path: str | Path) -> Path:
        """Append every record so far to PATH as JSON lines (a file many invocations add to)."""
        return append(path, self.records)


class _Run:
    def __init__(self, rec: Recorder, params: Mapping[str, Any], kw: dict[str, Any]):
        self.rec, self.params, self.kw = rec, params, kw
        self.figures: dict[str, Any] = {}

    def __enter__(self) -> dict[str, Any]:
        self.start, self.load = provenance.utc_now(), provenance.load_average()
        return self.figures

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.rec.add(self.params, self.figures, utc_start=self.start, loadavg_start=self.load, **self.kw)


def append(path: str | Path, records: list[Record]) -> Path:
    """Append RECORDS to PATH, one JSON object a line."""
    path = Path(path)
    try:
        with path.open("a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.to_dict(), sort_keys=False) + "\n")
    except OSError as e:
        raise RecordsError(f"{path}: cannot write records ({e.strerror or e})") from e
    return path


def read(path: str | Path) -> list[Record]:
    """Every record of a JSON-lines file (blank lines skipped); a line that is not a record of this
    schema is refused with its line number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise RecordsError(f"{path}: no such file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise RecordsError(f"{path}: cannot read records ({e})") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordsError(f"{path}:{n}: not JSON ({e.msg})") from e
        out.append(Record.from_dict(d, f"{path}:{n}"))
    return out
