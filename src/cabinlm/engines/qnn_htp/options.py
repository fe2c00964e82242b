"""The Snapdragon HTP build's own choices (`cabinlm build` flags), typed and checked once: what its
builder (builder.py) reads from a BuildRequest (request.options_for(HtpBuildOptions))."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from cabinlm.contract.errors import BuildError

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile


@dataclass(frozen=True)
class HtpBuildOptions:
    """activations: what the HTP computes in, "fp16" or "a16" (16-bit integer QDQ, calibrated on
    calib: None = the built-in calibration mix, contract/calibration.py); a16_weights: the a16 build's
    weight matrices, "int8" or "int4" symmetric blocks of 32."""

    REFUSED_ELSEWHERE: ClassVar[bool] = True  # set for any other engine's build: refused, never ignored

    activations: str = "fp16"
    calib: Path | None = None
    a16_weights: str = "int8"

    def __post_init__(self) -> None:
        if self.activations not in ("fp16", "a16"):
            raise BuildError(f"--activations must be fp16 or a16, got {self.activations!r}")
        if self.calib is not None:
            object.__setattr__(self, "calib", Path(self.calib))
        if self.a16_weights not in ("int8", "int4"):
            raise BuildError(f"--a16-weights must be int8 or int4, got {self.a16_weights!r}")
        if self.a16_weights != "int8" and self.activations != "a16":
            raise BuildError(f"--a16-weights {self.a16_weights} is for --activations a16 builds (this build: "
                             f"--activations {self.activations})")  # fmt: skip

    def refused(self, profile: DeviceProfile) -> str:
        """Why these options cannot go to `profile`'s build, which is not the HTP's."""
        return (f"--activations a16 and --calib are for the Snapdragon HTP builds (sa8775p); {profile.name} "
                "computes in float")
