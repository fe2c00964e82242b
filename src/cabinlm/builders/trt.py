"""TensorRT targets (orin-x, jetson-*, thor): the compatibility check and the target bundle run
anywhere; the engine is built where TensorRT and an NVIDIA GPU are present.

    cabinlm build ART --profile orin-x     check (trt_compat) -> bundle (trt_bundle) -> engine (trt_engine),
                                           the last step only where TensorRT and a GPU are present
    cabinlm build BUNDLE                   on the target: bundle -> engine, in place (or rebuilt for
                                           another TensorRT / GPU)
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Callable

from cabinlm.builders import BuildError
from cabinlm.builders.trt_bundle import write_bundle
from cabinlm.builders.trt_compat import check_file, errors, format_report
from cabinlm.builders.trt_engine import TensorRTUnavailable, build_engine
from cabinlm.manifest import MANIFEST_NAME, Manifest, load_manifest
from cabinlm.tensorrt_spec import EngineState

__all__ = ["TensorRTUnavailable", "build_tensorrt", "finish_bundle", "gpu_present", "tensorrt_present"]


def gpu_present() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists() or Path("/dev/nvhost-gpu").exists()


def tensorrt_present() -> bool:
    """TensorRT's Python package, not just a folder named tensorrt: NVIDIA's type stubs
    (tensorrt-stubs, installed for the type check) make an importable namespace package of .pyi files."""
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin not in (None, "namespace") and not str(spec.origin).endswith(".pyi")


def build_tensorrt(artifact: Path, manifest: Manifest, profile, out: Path, log: Callable[[str], None]) -> Path:
    """An export -> the bundle for `profile` in `out`, then the engine if this machine can build it."""
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
    log(report.splitlines()[0])
    bundle = write_bundle(artifact, manifest, profile, out, log)
    settings = bundle.runtime_spec.tensorrt
    assert settings is not None
    missing = [what for what, ok in (("the tensorrt Python package", tensorrt_present()), ("an NVIDIA GPU", gpu_present()))
               if not ok]  # fmt: skip
    if missing:
        log(f"this machine lacks {' and '.join(missing)}: no engine built here")
        return out
    build_engine(out, bundle, log)
    return out


def finish_bundle(bundle: Path, manifest: Manifest, profile, out: Path | None, log: Callable[[str], None]) -> Path:
    """`cabinlm build BUNDLE`: build (or rebuild) the engine of a TensorRT bundle, in place or in a copy."""
    spec = manifest.runtime_spec
    settings = spec.tensorrt
    if settings is None:
        raise BuildError(f"{bundle} is not a TensorRT build")
    if profile is not None and profile.name != spec.profile:
        raise BuildError(f"{bundle} is a TensorRT bundle for profile {spec.profile}, not {profile.name}; build the export "
                         f"({(manifest.target or {}).get('built_from', 'its parent')}) with --profile {profile.name}")  # fmt: skip
    folder = bundle
    if out is not None and out.resolve() != bundle.resolve():
        if (out / MANIFEST_NAME).exists():
            raise BuildError(f"{out} already holds an artifact; pass an empty or new folder")
        shutil.copytree(bundle, out, dirs_exist_ok=True)
        folder = out
        manifest = load_manifest(folder)
    if settings.state is EngineState.ENGINE:
        log(f"{bundle} already holds an engine (TensorRT {settings.built_with} on {settings.gpu.name if settings.gpu else '?'}); "
            "building it again here")  # fmt: skip
    build_engine(folder, manifest, log)
    return folder
