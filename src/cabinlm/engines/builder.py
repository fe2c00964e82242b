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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, TypeVar

from cabinlm.contract.engines import BackendKind
from cabinlm.contract.errors import BuildError

if TYPE_CHECKING:
    from cabinlm.contract.buildspec import BuildSpec
    from cabinlm.engines.output import BuildOutput
    from cabinlm.contract.manifest import Manifest
    from cabinlm.profiles import DeviceProfile


T = TypeVar("T")


class Attention(str, enum.Enum):
    """cpu builds: which attention the built decoder runs (which ONNX Runtime engine builds it)."""

    AUTO = "auto"  # fused where the artifact allows it, the exported graph otherwise
    FUSED = "fused"  # the onnxruntime-fused engine; refuse if it does not apply
    GRAPH = "graph"  # the onnxruntime-graph engine: the exported graph's own attention


@dataclass(frozen=True)
class BuildRequest:
    """One build: the export, the profile, the user's choices. Each engine's own choices are a typed
    options object of its builder's (Builder.options_type), read with options_for; build.py routes
    `cabinlm build`'s flags to them by name and checks each once."""

    artifact: Path  # the folder `cabinlm export` wrote (read only)
    manifest: Manifest  # its manifest, validated
    profile: DeviceProfile
    attention: Attention = Attention.AUTO  # cpu profiles: which of their engines builds (build.choose_builder)
    options: tuple[object, ...] = ()  # the engines' typed options, one object per options_type given
    log: Callable[[str], None] = lambda s: None

    def options_for(self, cls: type[T]) -> T:
        """The request's options of type `cls` (an engine's options_type), or its defaults."""
        for o in self.options:
            if isinstance(o, cls):
                return o
        return cls()


class Builder(abc.ABC):
    """One engine's build: check, then build into a prepared output folder."""

    kind: ClassVar[BackendKind]
    preference: ClassVar[int] = 0  # among engines that target one profile, the higher is tried first
    # The engine's own build choices: a frozen dataclass whose fields are `cabinlm build` options by
    # name, checked in __post_init__, with REFUSED_ELSEWHERE (True: given to another engine's build,
    # they are refused with refused(profile); False: ignored there). None: no choices of its own.
    options_type: ClassVar[type | None] = None

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
        built_from = manifest.target.built_from if manifest.target and manifest.target.built_from else "its parent"
        raise BuildError(f"{artifact} is already a build (for {manifest.runtime_spec.profile}); pass the folder "
                         f"`cabinlm export` wrote: {built_from}")
