"""What a build is, as typed data: the backend that runs it, the execution provider and its options,
the session settings, and the engine's own facts. Written into the manifest by `cabinlm build`, read
by the runtime to choose its engine. Standard library only.

    manifest.json
      "build": {
        "backend":  "onnxruntime-fused"          BackendKind (contract/engines/): which engines/<folder> runs it
        "provider": {"name": "CPUExecutionProvider", "options": {}}
        "session":  {"graph_optimization_level": "basic", "intra_op_num_threads": null, ...}
        "profile", "engine", "engine_version"
        "<KEY>":    the engine's facts (contract/engines/): "fused", "shared_weights", "qnn" or "tensorrt";
                    the other engines' keys are written as null
      }

A plain export has no "build": it runs as `BuildSpec.for_export()` says (the exported graph on
ONNX Runtime's CPU provider with default settings).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cabinlm.contract.engines import FACTS, BackendKind, EngineFacts


class OptimizationLevel(str, enum.Enum):
    """ONNX Runtime's graph optimization level at load."""

    DISABLE = "disable"
    BASIC = "basic"
    EXTENDED = "extended"
    ALL = "all"


CPU_PROVIDER = "CPUExecutionProvider"
# Threads per core a session may ask for: beyond this, intra-op threads only wait for each other (and a
# typo like 800 is caught). The runtime's --threads and a build's own thread count are held to it.
THREADS_PER_CORE = 4


@dataclass(frozen=True)
class ExecutionProvider:
    """An ONNX Runtime execution provider and its provider options (string to string)."""

    name: str = CPU_PROVIDER
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.endswith("ExecutionProvider"):
            raise ValueError(f"provider name must be an ONNX Runtime execution provider, got {self.name!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.options.items()):
            raise ValueError(f"provider options must map strings to strings, got {self.options!r}")


@dataclass(frozen=True)
class SessionSettings:
    """What the runtime applies to every session of the build at load."""

    graph_optimization_level: OptimizationLevel = OptimizationLevel.ALL
    intra_op_num_threads: int | None = None  # None: ONNX Runtime's default (all cores); --threads overrides
    enable_cpu_mem_arena: bool = True
    # Flush denormal floats to zero in the kernels (ONNX Runtime also sets the flag on the thread
    # that calls run): 0.2-0.45 ms less per SmolLM2 decode step on 2 cores, the same logits.
    denormal_as_zero: bool = False
    config: dict[str, str] = field(default_factory=dict)  # further session config entries

    def __post_init__(self) -> None:
        object.__setattr__(self, "graph_optimization_level", OptimizationLevel(self.graph_optimization_level))
        t = self.intra_op_num_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 1024):
            raise ValueError(f"intra_op_num_threads must be 1..1024 or null, got {t!r}")
        for name in ("enable_cpu_mem_arena", "denormal_as_zero"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.config.items()):
            raise ValueError(f"session config entries must map strings to strings, got {self.config!r}")


T = TypeVar("T")


@dataclass(frozen=True)
class BuildSpec:
    """A built artifact's engine facts: everything the runtime needs to load it, nothing guessed.

    facts: the engine's own typed facts, of the class its registry line names (engines/registry.py),
    or None for an engine that records none. Written under build.<facts.KEY> in the manifest."""

    backend: BackendKind
    provider: ExecutionProvider = ExecutionProvider()
    session: SessionSettings = SessionSettings()
    profile: str = ""
    engine: str = "onnxruntime"
    engine_version: str = ""
    facts: EngineFacts | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", BackendKind(self.backend))
        want = FACTS[self.backend]
        if want is None and self.facts is not None:
            raise ValueError(f"a {self.backend.value} build records no engine facts, got {type(self.facts).__name__}")
        if want is not None and not isinstance(self.facts, want):
            raise ValueError(f"a {self.backend.value} build records its {want.__name__} (build.{want.KEY}), got "
                             f"{type(self.facts).__name__ if self.facts is not None else 'none'}")

    def facts_as(self, cls: type[T]) -> T | None:
        """This build's engine facts if they are a `cls` (the engine that asks knows its own class), else None."""
        return self.facts if isinstance(self.facts, cls) else None

    @classmethod
    def for_export(cls) -> BuildSpec:
        """How a plain export runs: its graph on ONNX Runtime's CPU provider, default settings."""
        return cls(backend=BackendKind.EXPORTED_GRAPH)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "backend": self.backend.value,
            "provider": dataclasses.asdict(self.provider),
            "session": {**dataclasses.asdict(self.session), "graph_optimization_level": self.session.graph_optimization_level.value},
            "profile": self.profile,
            "engine": self.engine,
            "engine_version": self.engine_version,
        }
        for facts in FACTS.values():  # every engine's key, null but the build's own (the format readers know)
            if facts is not None:
                d[facts.KEY] = None
        if self.facts is not None:
            d[self.facts.KEY] = self.facts.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildSpec:
        """Raises KeyError / TypeError / ValueError on malformed data (the manifest turns them into one line)."""
        if not isinstance(d, dict):
            raise TypeError(f"expected an object, got {type(d).__name__}")
        backend = BackendKind(d["backend"])
        want = FACTS[backend]
        for kind, other in FACTS.items():
            if other is not None and other is not want and d.get(other.KEY) is not None:
                raise ValueError(f"a {backend.value} build cannot hold build.{other.KEY} (the facts of {kind.value})")
        raw = d.get(want.KEY) if want is not None else None  # absent in builds of cabinlm before that engine
        return cls(
            backend=backend,
            provider=ExecutionProvider(**d["provider"]),
            session=SessionSettings(**d["session"]),
            profile=str(d["profile"]),
            engine=str(d["engine"]),
            engine_version=str(d["engine_version"]),
            facts=want.from_dict(raw) if want is not None and raw is not None else None,  # type: ignore[attr-defined]
        )
