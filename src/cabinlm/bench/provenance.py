"""Where a measured figure came from: the code (cabinlm's version and git commit), the machine (CPU
model, cores, onnxruntime, load average) and the build (its manifest's sha256, its engine, the kernel
library's sha256 and matmul path). Every record of `cabinlm bench` and of the scripts in benchmarks/
carries these facts (bench/records.py), so two figures can be told apart by what ran them, not by a
folder name.

Standard library only, plus the manifest reader for a build's facts: no onnxruntime session, no torch.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import cabinlm


@dataclass(frozen=True)
class Machine:
    """The code and the machine a run happens on (the same for every record of one process)."""

    cabinlm_version: str
    git_commit: str | None  # the checkout's HEAD; None when cabinlm is not run from a git checkout
    git_dirty: bool | None  # uncommitted changes to tracked files in that checkout; None as above
    cpu_model: str  # /proc/cpuinfo's "model name" (x86), else what platform reports
    machine: str  # platform.machine(): x86_64, aarch64
    cores: int  # CPUs this process may run on (its affinity mask)
    onnxruntime_version: str | None  # None: onnxruntime not installed (a peer-only tool)
    python_version: str


@dataclass(frozen=True)
class BuildFacts:
    """What identifies an artifact or build: its manifest's bytes, its engine and, where the engine
    runs cabinlm's compiled kernels, that library's hash and the block matmuls' instruction path."""

    artifact: str  # the folder's name (not its path: records travel between machines)
    manifest_sha256: str
    engine: str  # the manifest's backend: onnxruntime-graph, onnxruntime-fused, qnn-htp, tensorrt, ...
    kernels_sha256: str | None  # build.fused.kernels.sha256; None for builds without cabinlm's kernels
    matmul_isa: str | None  # build.fused.kernels.matmul_isa: avx512-vnni, avx2, neon-dotprod, generic, ...


def utc_now() -> str:
    """The time in UTC, ISO 8601 to the second: 2025-01-31T12:00:00Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_average() -> float | None:
    """The 1-minute load average; None where the OS has none (Windows). Read at a run's start and end:
    a busy machine's figures are slower, and the record says so."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_model() -> str:
    """The CPU's marketing name: /proc/cpuinfo's "model name" on x86 Linux; on Arm Linux its
    "Hardware" or "Model" line, else the CPU implementer and part; elsewhere platform's answer."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Hardware", "Model"):
        if key in fields:
            return fields[key]
    if "CPU implementer" in fields:
        return f"implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _git(*args: str) -> str | None:
    """A git command's output in the folder cabinlm is imported from; None outside a checkout or
    without git."""
    where = Path(cabinlm.__file__).resolve().parent
    try:
        p = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def _onnxruntime_version() -> str | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    return str(onnxruntime.__version__)


def machine() -> Machine:
    """This process's code and machine."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return Machine(
        cabinlm_version=cabinlm.__version__,
        git_commit=commit.strip() if commit else None,
        git_dirty=bool(status.strip()) if status is not None else None,
        cpu_model=cpu_model(),
        machine=platform.machine(),
        cores=usable_cores(),
        onnxruntime_version=_onnxruntime_version(),
        python_version=platform.python_version() or sys.version.split()[0],
    )


def build_facts(folder: str | Path) -> BuildFacts:
    """The facts of the artifact or build in FOLDER, from its manifest (a missing or broken one raises
    the manifest's own ManifestError)."""
    from cabinlm.contract.engines.fused import FusedSettings
    from cabinlm.contract.manifest import MANIFEST_NAME, load_manifest

    folder = Path(folder)
    m = load_manifest(folder, check_files=False)
    spec = m.runtime_spec
    fused = spec.facts_as(FusedSettings)
    kernels = fused.kernels if fused is not None else None
    return BuildFacts(
        artifact=folder.resolve().name,
        manifest_sha256=hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest(),
        engine=spec.backend.value,
        kernels_sha256=kernels.sha256 if kernels is not None else None,
        matmul_isa=kernels.matmul_isa if kernels is not None else None,
    )


def library_facts(path: str | Path) -> dict[str, str | None]:
    """A kernel library file measured on its own (the kernel micro-benchmarks): its sha256 and the
    block matmuls' path compiled into it (None where the file carries no tag)."""
    from cabinlm.engines.ort_fused.kernels.compiler import isa_of

    data = Path(path).read_bytes()
    return {"kernels_sha256": hashlib.sha256(data).hexdigest(), "matmul_isa": isa_of(data)}
