"""The build side of an engine: what `cabinlm build` asks of it.

    builder = ENGINES[kind].builder()          engines/<folder>/builder.py: BUILDER
    why = builder.check(request)               None, or why this artifact cannot be built this way
    spec = builder.build(request, output)      writes its files into `output` (engines/output.py) and
                                               returns the typed BuildSpec; output.finish(spec) then
                                               derives and validates the built manifest

A builder never touches its input folder: the output folder is checked before anything is written
(engines/output.py refuses the input itself, a folder inside it, and a file).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

from cabinlm.contract.engines.fused import AttentionKernel, MatmulKernel, Minimums
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.errors import BuildError, OptionError

if TYPE_CHECKING:
    from cabinlm.contract.buildspec import BuildSpec
    from cabinlm.engines.output import BuildOutput
    from cabinlm.contract.manifest import Manifest
    from cabinlm.profiles import DeviceProfile


class Attention(str, enum.Enum):
    """cpu builds: which attention the built decoder runs (which ONNX Runtime engine builds it)."""

    AUTO = "auto"  # fused where the artifact allows it, the exported graph otherwise
    FUSED = "fused"  # the onnxruntime-fused engine; refuse if it does not apply
    GRAPH = "graph"  # the onnxruntime-graph engine: the exported graph's own attention


@dataclass(frozen=True)
class CpuBuildOptions:
    """The choices of a cpu build (`cabinlm build` flags), validated once."""

    attention: Attention = Attention.AUTO
    accuracy_level: int = 4  # the fused build's quantized matmuls: 4 = int8 activations, 0 = float32
    minimums: Minimums = Minimums.INT8
    attention_kernel: AttentionKernel = AttentionKernel.AUTO
    matmul_kernel: MatmulKernel = MatmulKernel.AUTO

    def __post_init__(self) -> None:
        try:
            for name, cls in (("attention", Attention), ("minimums", Minimums), ("attention_kernel", AttentionKernel),
                              ("matmul_kernel", MatmulKernel)):  # fmt: skip
                object.__setattr__(self, name, cls(getattr(self, name)))
        except ValueError as e:
            raise BuildError(str(e)) from e
        if isinstance(self.accuracy_level, bool) or self.accuracy_level not in (0, 1, 2, 3, 4):  # MatMulNBits' levels
            raise OptionError(f"--accuracy-level must be 0..4 (4 = int8 activations, 0 = float32), got {self.accuracy_level!r}")


@dataclass(frozen=True)
class BuildRequest:
    """One build: the export, the profile, the user's choices."""

    artifact: Path  # the folder `cabinlm export` wrote (read only)
    manifest: Manifest  # its manifest, validated
    profile: DeviceProfile
    options: CpuBuildOptions = field(default_factory=CpuBuildOptions)
    log: Callable[[str], None] = lambda s: None
    activations: str = "fp16"  # HTP builds (--activations): fp16, or a16 (16-bit integer QDQ, engines/qnn_htp/qdq.py)
    calib: Path | None = None  # a16: the calibration text (None: contract/calibration.py's built-in mix)
    a16_weights: str = "int8"  # a16 (--a16-weights): the matrices' symmetric blocks, int8 or int4 (qnn_htp/a16_weights.py)


class Builder(abc.ABC):
    """One engine's build: check, then build into a prepared output folder."""

    kind: ClassVar[BackendKind]
    preference: ClassVar[int] = 0  # among engines that target one profile, the higher is tried first

    @abc.abstractmethod
    def targets(self, profile: DeviceProfile) -> bool:
        """The profile's engine is this one (an ONNX Runtime profile may have several: build.py picks)."""

    def check(self, request: BuildRequest) -> str | None:
        """Why this artifact cannot be built by this engine for the request's profile (None: it can)."""
        return None

    @abc.abstractmethod
    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        """Write the build's files into `output` (recording each role) and return its BuildSpec.
        The quality figures it measured go into output.quality."""

    def after_save(self, request: BuildRequest, output: BuildOutput, built: Manifest) -> None:
        """Checks that need the finished build on disk (e.g. running it); may add to output.quality."""

    def finish(self, artifact: Path, manifest: Manifest, profile: DeviceProfile | None, out: Path | None,
               log: Callable[[str], None]) -> Path:
        """`cabinlm build` given a build of this engine: only an unfinished one (a TensorRT bundle) has more to do."""
        built_from = (manifest.target or {}).get("built_from", "its parent")
        raise BuildError(f"{artifact} is already a build (for {manifest.runtime_spec.profile}); pass the folder "
                         f"`cabinlm export` wrote: {built_from}")
