"""TensorRT targets (orin-x, jetson-*, thor): the compatibility check and the target bundle run
anywhere; the engine is built where TensorRT and an NVIDIA GPU are present.

    cabinlm build ART --profile orin-x     check (compat.py) -> bundle (bundle.py) -> engine (engine.py),
                                           the last step only where TensorRT and a GPU are present
    cabinlm build BUNDLE                   on the target: bundle -> engine, in place (or rebuilt for
                                           another TensorRT / GPU)
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

from cabinlm.contract.files import FileRole
from cabinlm.contract.buildspec import BuildSpec
from cabinlm.engines.builder import Builder, BuildError, BuildRequest
from cabinlm.engines.output import BuildOutput, check_output
from cabinlm.contract.engines import BackendKind
from cabinlm.engines.tensorrt.bundle import write_bundle
from cabinlm.engines.tensorrt.compat import check_file, errors, format_report
from cabinlm.engines.tensorrt.engine import TensorRTUnavailable, build_engine
from cabinlm.contract.engines.tensorrt import EngineState, TensorRTSettings
from cabinlm.contract.manifest import MANIFEST_NAME, Manifest, load_manifest

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

__all__ = ["BUILDER", "TensorRTUnavailable", "gpu_present", "tensorrt_present"]


def gpu_present() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists() or Path("/dev/nvhost-gpu").exists()


def tensorrt_present() -> bool:
    """TensorRT's Python package, not just a folder named tensorrt: NVIDIA's type stubs
    (tensorrt-stubs, installed for the type check) make an importable namespace package of .pyi files."""
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin not in (None, "namespace") and not str(spec.origin).endswith(".pyi")


class TensorRTBuilder(Builder):
    kind: ClassVar[BackendKind] = BackendKind.TENSORRT

    def targets(self, profile: DeviceProfile) -> bool:
        return profile.engine.value == "tensorrt"

    def check(self, request: BuildRequest) -> str | None:
        vision = request.manifest.vision
        if vision is not None and vision.mrope:
            return ("multimodal RoPE (Qwen2-VL's three position components) is not written for TensorRT yet; the cpu "
                    "profile runs it (the exported graph)")  # fmt: skip
        return None

    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        """The compatibility check, then the bundle (the engine follows in after_save where it can)."""
        graph = request.artifact / request.manifest.files[FileRole.GRAPH].path
        profile = request.profile
        violations = check_file(graph, profile)
        report = format_report(violations, profile)
        bad = errors(violations)
        if bad:
            raise TensorRTUnavailable(
                f"{graph} does not pass the TensorRT {profile.engine_version} compatibility check for {profile.name} "
                f"({len(bad)} errors); re-export with --profile {profile.name}",
                report,
            )
        request.log(report.splitlines()[0])
        return write_bundle(request, output)

    def after_save(self, request: BuildRequest, output: BuildOutput, built: Manifest) -> None:
        missing = [what for what, ok in (("the tensorrt Python package", tensorrt_present()), ("an NVIDIA GPU", gpu_present()))
                   if not ok]  # fmt: skip
        if missing:
            request.log(f"this machine lacks {' and '.join(missing)}: no engine built here")
            return
        build_engine(output.folder, built, request.log)

    def finish(self, artifact: Path, manifest: Manifest, profile: DeviceProfile | None, out: Path | None,
               log: Callable[[str], None]) -> Path:
        """`cabinlm build BUNDLE`: build (or rebuild) the engine of a TensorRT bundle, in place (a bundle is
        an unfinished build: its engine is what it is for) or in a copy at `out`, outside the bundle."""
        spec = manifest.runtime_spec
        settings = spec.facts_as(TensorRTSettings)
        if settings is None:
            raise BuildError(f"{artifact} is not a TensorRT build")
        if profile is not None and profile.name != spec.profile:
            raise BuildError(f"{artifact} is a TensorRT bundle for profile {spec.profile}, not {profile.name}; build the export "
                             f"({manifest.target.built_from if manifest.target and manifest.target.built_from else 'its parent'}) "
                             f"with --profile {profile.name}")  # fmt: skip
        folder = artifact
        if out is not None and out.resolve() != artifact.resolve():
            check_output(artifact, out)
            if (out / MANIFEST_NAME).exists():
                raise BuildError(f"{out} already holds an artifact; pass an empty or new folder")
            shutil.copytree(artifact, out, dirs_exist_ok=True)
            folder = out
            manifest = load_manifest(folder)
        if settings.state is EngineState.ENGINE:
            log(f"{artifact} already holds an engine (TensorRT {settings.built_with} on "
                f"{settings.gpu.name if settings.gpu else '?'}); building it again here")  # fmt: skip
        build_engine(folder, manifest, log)
        return folder


BUILDER = TensorRTBuilder()
