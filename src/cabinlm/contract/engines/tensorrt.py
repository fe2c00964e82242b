"""What a TensorRT build is, as typed data (manifest "build.tensorrt"): the target bundle or the
engine, its exact build settings, and the TensorRT and GPU that made it. Standard library only;
written by engines/tensorrt/bundle.py and engines/tensorrt/engine.py, read by engines/tensorrt/backend.py.

    "tensorrt": {
      "state": "bundle" | "engine"      bundle: the TensorRT-ready graph and these settings, no engine yet
      "engine_file": "decoder.engine"   written by `cabinlm build BUNDLE` on the target
      "target_version": "8.6"           the profile's TensorRT: the graph passed its compatibility check
      "api_era": "trt8"                 which builder API the settings are for (ApiEra)
      "strongly_typed": false           precision from the graph (10.15+) or from builder flags
      "precision": ["fp16"]             builder precision flags (empty when strongly typed)
      "profiles": [{"name": "decode", "min_tokens": 1, "opt_tokens": 1, "max_tokens": 1}, ...]
      "workspace_bytes": 536870912      MemoryPoolType.WORKSPACE limit, from the device profile
      "timing_cache": "timing.cache"    kept next to the engine, reused by later builds
      "fp16_safe_norms": 61             RMSNorms rewritten so that no intermediate overflows fp16
      engine state only:
      "built_with": "10.3.0.30"         TensorRT that built the engine (the engine runs only there)
      "gpu": {"name": "Orin", "compute_capability": "8.7"}
      "graph_sha256": "..."             the graph the engine was built from (files["graph"])
    }
The engine file's own size and sha256 are in the manifest's files["engine"].
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from cabinlm.contract.io_spec import DecoderIO, DecoderShape

ENGINE_FILE = "decoder.engine"
TIMING_CACHE_FILE = "timing.cache"
PRECISIONS = ("fp16", "bf16", "int8", "fp8", "tf32")  # builder flags cabinlm may set
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRT_VERSION = re.compile(r"^\d+\.(\d+|x)(\.\d+)*$")  # "8.6", "10.x", "10.3.0.30"
_CAPABILITY = re.compile(r"^\d+\.\d+$")  # "8.7"


class EngineState(str, enum.Enum):
    BUNDLE = "bundle"  # graph + settings, built into an engine on the target
    ENGINE = "engine"  # the serialized engine is there, for the TensorRT and GPU recorded


class ApiEra(str, enum.Enum):
    """The TensorRT Python API generations whose differences the builder handles (api.py)."""

    TRT8 = "trt8"  # 8.5 / 8.6 (DRIVE OS 6): EXPLICIT_BATCH network flag, weakly typed, precision flags
    TRT10 = "trt10"  # 10.0 .. 10.14 (JetPack 6, DRIVE OS 7): create_network(0), weakly typed, precision flags
    STRONGLY_TYPED = "strongly-typed"  # 10.15+ / 11: STRONGLY_TYPED network, precision from the graph


def _text(owner: str, name: str, value: Any, pattern: re.Pattern[str] | None = None, empty: bool = False) -> None:
    if not isinstance(value, str) or (not value and not empty):
        raise TypeError(f"{owner}.{name} must be a non-empty string, got {value!r}")
    if value and pattern is not None and not pattern.match(value):
        raise ValueError(f"{owner}.{name} = {value!r} is not of the form {pattern.pattern}")


def _count(owner: str, name: str, value: Any, minimum: int) -> None:
    if type(value) is not int:
        raise TypeError(f"{owner}.{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _file(owner: str, name: str, value: Any) -> None:
    _text(owner, name, value)
    if "/" in value or "\\" in value or value in (".", "..") or not _NAME.match(value):
        raise ValueError(f"{owner}.{name} = {value!r} must be a plain file name inside the build folder")


@dataclass(frozen=True)
class TokenProfile:
    """One TensorRT optimization profile over the chunk length ("tokens"); every dynamic input's
    min / opt / max shape follows from it (engines/tensorrt/api.profile_shapes)."""

    name: str
    min_tokens: int
    opt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        owner = f"tensorrt.profiles[{self.name!r}]"
        _text(owner, "name", self.name, _NAME)
        for field_name in ("min_tokens", "opt_tokens", "max_tokens"):
            _count(owner, field_name, getattr(self, field_name), 1)
        if not self.min_tokens <= self.opt_tokens <= self.max_tokens:
            raise ValueError(f"{owner}: needs min_tokens <= opt_tokens <= max_tokens, got "
                             f"{self.min_tokens}, {self.opt_tokens}, {self.max_tokens}")  # fmt: skip

    def covers(self, tokens: int) -> bool:
        return self.min_tokens <= tokens <= self.max_tokens


@dataclass(frozen=True)
class GpuInfo:
    name: str  # as CUDA reports it, e.g. "Orin" or "NVIDIA H100 80GB HBM3"
    compute_capability: str  # "8.7"

    def __post_init__(self) -> None:
        _text("tensorrt.gpu", "name", self.name)
        _text("tensorrt.gpu", "compute_capability", self.compute_capability, _CAPABILITY)


@dataclass(frozen=True)
class TensorRTSettings:
    """A TensorRT build: the settings the engine is (or will be) built with, and what built it."""

    KEY: ClassVar[str] = "tensorrt"  # where a build's manifest holds these facts ("build.tensorrt")

    state: EngineState
    target_version: str  # the profile's TensorRT ("8.6", "10.3", "10.x")
    api_era: ApiEra
    strongly_typed: bool
    precision: tuple[str, ...]  # subset of PRECISIONS, in that order
    profiles: tuple[TokenProfile, ...]  # decode first (tokens = 1), then prefill, if the chunk is > 1
    workspace_bytes: int
    fp16_safe_norms: int  # RMSNorm blocks rewritten in the bundle's graph (engines/tensorrt/graph.py)
    engine_file: str = ENGINE_FILE
    timing_cache: str = TIMING_CACHE_FILE
    built_with: str = ""  # engine state: the TensorRT version that built it
    gpu: GpuInfo | None = None  # engine state: the GPU it was built on (engines are per GPU model)
    graph_sha256: str = ""  # engine state: sha256 of the graph it was built from

    def __post_init__(self) -> None:
        owner = "tensorrt"
        object.__setattr__(self, "state", EngineState(self.state))
        object.__setattr__(self, "api_era", ApiEra(self.api_era))
        _text(owner, "target_version", self.target_version, _TRT_VERSION)
        if not isinstance(self.strongly_typed, bool):
            raise TypeError(f"{owner}.strongly_typed must be true or false, got {self.strongly_typed!r}")
        if self.strongly_typed != (self.api_era is ApiEra.STRONGLY_TYPED):
            raise ValueError(f"{owner}.strongly_typed = {self.strongly_typed} contradicts api_era {self.api_era.value}")
        precision = tuple(self.precision)
        if any(p not in PRECISIONS for p in precision) or len(set(precision)) != len(precision):
            raise ValueError(f"{owner}.precision = {list(precision)!r}: each of {', '.join(PRECISIONS)} at most once")
        object.__setattr__(self, "precision", tuple(p for p in PRECISIONS if p in precision))
        if self.strongly_typed and precision:
            raise ValueError(f"{owner}.precision must be empty for a strongly typed network (the graph holds the "
                             f"precision), got {list(precision)!r}")  # fmt: skip
        profiles = tuple(self.profiles)
        if not profiles or not all(isinstance(p, TokenProfile) for p in profiles):
            raise TypeError(f"{owner}.profiles must be a non-empty list of token profiles")
        if len({p.name for p in profiles}) != len(profiles):
            raise ValueError(f"{owner}.profiles: two profiles share a name")
        object.__setattr__(self, "profiles", profiles)
        _count(owner, "workspace_bytes", self.workspace_bytes, 1 << 20)
        _count(owner, "fp16_safe_norms", self.fp16_safe_norms, 0)
        _file(owner, "engine_file", self.engine_file)
        _file(owner, "timing_cache", self.timing_cache)
        if self.state is EngineState.ENGINE:
            _text(owner, "built_with", self.built_with, _TRT_VERSION)
            if not isinstance(self.gpu, GpuInfo):
                raise TypeError(f"{owner}.gpu: an engine records the GPU it was built on, got {self.gpu!r}")
            _text(owner, "graph_sha256", self.graph_sha256)
            if not re.fullmatch(r"[0-9a-f]{64}", self.graph_sha256):
                raise ValueError(f"{owner}.graph_sha256 must be 64 hex digits")
        elif self.built_with or self.gpu is not None or self.graph_sha256:
            raise ValueError(f"{owner}: a bundle has no engine yet, so no built_with, gpu or graph_sha256")

    @property
    def max_tokens(self) -> int:
        return max(p.max_tokens for p in self.profiles)

    def profile_for(self, tokens: int) -> int:
        """Index of the optimization profile that runs a chunk of `tokens` (the first that covers it)."""
        for i, p in enumerate(self.profiles):
            if p.covers(tokens):
                return i
        raise ValueError(f"no optimization profile covers {tokens} tokens (1..{self.max_tokens})")

    def decoder_io(self, shape: DecoderShape) -> DecoderIO:
        """The exported contract (index tensors as the export's index_dtype says)."""
        return shape.exported()

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "target_version": self.target_version,
            "api_era": self.api_era.value,
            "strongly_typed": self.strongly_typed,
            "precision": list(self.precision),
            "profiles": [{"name": p.name, "min_tokens": p.min_tokens, "opt_tokens": p.opt_tokens,
                          "max_tokens": p.max_tokens} for p in self.profiles],  # fmt: skip
            "workspace_bytes": self.workspace_bytes,
            "fp16_safe_norms": self.fp16_safe_norms,
            "engine_file": self.engine_file,
            "timing_cache": self.timing_cache,
            "built_with": self.built_with,
            "gpu": {"name": self.gpu.name, "compute_capability": self.gpu.compute_capability} if self.gpu else None,
            "graph_sha256": self.graph_sha256,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorRTSettings:
        """Raises KeyError / TypeError / ValueError naming the field (the manifest makes them one line)."""
        if not isinstance(d, dict):
            raise TypeError(f"build.tensorrt: expected an object, got {type(d).__name__}")
        profiles = d["profiles"]
        if not isinstance(profiles, list) or not all(isinstance(p, dict) for p in profiles):
            raise TypeError("tensorrt.profiles must be a list of objects")
        gpu = d.get("gpu")
        if gpu is not None and not isinstance(gpu, dict):
            raise TypeError(f"tensorrt.gpu must be an object or null, got {gpu!r}")
        precision = d["precision"]
        if not isinstance(precision, list):
            raise TypeError(f"tensorrt.precision must be a list, got {precision!r}")
        return cls(
            state=EngineState(d["state"]),
            target_version=d["target_version"],
            api_era=ApiEra(d["api_era"]),
            strongly_typed=d["strongly_typed"],
            precision=tuple(precision),
            profiles=tuple(TokenProfile(**p) for p in profiles),
            workspace_bytes=d["workspace_bytes"],
            fp16_safe_norms=d["fp16_safe_norms"],
            engine_file=d["engine_file"],
            timing_cache=d["timing_cache"],
            built_with=d.get("built_with", ""),
            gpu=GpuInfo(**gpu) if gpu is not None else None,
            graph_sha256=d.get("graph_sha256", ""),
        )
