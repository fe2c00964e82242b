"""TensorRT targets: the compatibility check runs anywhere; the engine needs TensorRT and a GPU."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Callable

from cabinlm.builders import BuildError
from cabinlm.builders.trt_compat import check_file, errors, format_report
from cabinlm.manifest import Manifest


class TensorRTUnavailable(BuildError):
    """TensorRT or an NVIDIA GPU is missing here; `details` holds the compatibility report."""

    def __init__(self, message: str, details: str):
        super().__init__(message)
        self.details = details


def gpu_present() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def build_tensorrt(artifact: Path, manifest: Manifest, profile, out: Path, log: Callable[[str], None]) -> Path:
    graph = artifact / manifest.files["graph"].path
    violations = check_file(graph, profile)
    report = format_report(violations, profile)
    bad = errors(violations)
    if bad:
        raise TensorRTUnavailable(
            f"{graph} does not pass the TensorRT {profile.engine_version} compatibility check for {profile.name} "
            f"({len(bad)} errors); re-export with --profile {profile.name}",
            report,
        )
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("the tensorrt Python package")
    if not gpu_present():
        missing.append("an NVIDIA GPU")
    if missing:
        raise TensorRTUnavailable(
            f"the graph passes the TensorRT {profile.engine_version} compatibility check, but this machine lacks "
            f"{' and '.join(missing)}: copy {artifact} to the {profile.chip.split(';')[0]} target (or a machine with "
            f"TensorRT {profile.engine_version} and an NVIDIA GPU) and run `cabinlm build {artifact} --profile {profile.name}` there",
            report,
        )
    raise TensorRTUnavailable(
        "TensorRT and a GPU are present, but building TensorRT engines is not part of this cabinlm version yet; "
        "the graph passed the compatibility check",
        report,
    )
