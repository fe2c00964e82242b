"""What a build is, as typed data: the backend that runs it, the execution provider and its options,
the session settings, and the tables a backend needs. Written into the manifest by `cabinlm build`,
read by the runtime to choose its backend. Standard library only.

    manifest.json
      "build": {
        "backend":  "onnxruntime-fused"          BackendKind: which runtime/backends/ class runs it
        "provider": {"name": "CPUExecutionProvider", "options": {}}
        "session":  {"graph_optimization_level": "basic", "intra_op_num_threads": null, ...}
        "shared_weights": null | {"file": ..., "tensors": [[name, dtype, shape, offset, length], ...]}
        "fused":    null | {"accuracy_level": 4, "minimums": "int8", "attention_kernel": "cabinlm"}
        "profile", "engine", "engine_version"
      }

A plain export has no "build": it runs as `BuildSpec.for_export()` says (the exported graph on
ONNX Runtime's CPU provider with default settings).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from cabinlm.qnn_spec import QnnSettings
from cabinlm.tensorrt_spec import TensorRTSettings


class BackendKind(str, enum.Enum):
    """How the decoder graph(s) of an artifact are run (one class each under runtime/backends/)."""

    EXPORTED_GRAPH = "onnxruntime-graph"  # the exported graph (dynamic tokens), as exported or optimized
    STATIC_PAIR = "onnxruntime-static"  # a prefill graph (tokens = chunk) and a decode graph (tokens = 1)
    FUSED = "onnxruntime-fused"  # the cpu build's fused decoder over a rotated cache
    QNN_HTP = "qnn-htp"  # QNN HTP context binaries (prefill + decode) through ONNX Runtime's QNN plugin
    TENSORRT = "tensorrt"  # a TensorRT engine (or, before it is built on the target, its bundle)


class OptimizationLevel(str, enum.Enum):
    """ONNX Runtime's graph optimization level at load."""

    DISABLE = "disable"
    BASIC = "basic"
    EXTENDED = "extended"
    ALL = "all"


CPU_PROVIDER = "CPUExecutionProvider"


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


_WEIGHT_DTYPES = frozenset({"float32", "float16", "int64", "int32", "int8", "uint8"})


@dataclass(frozen=True)
class SharedWeight:
    """One weight of a static graph pair, where it lies in the shared weights file."""

    name: str
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    offset: int
    length: int  # bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"shared weight {self.name!r}: unsupported dtype {self.dtype!r}")
        if self.offset < 0 or self.length < 0 or any(d < 0 for d in self.shape):
            raise ValueError(f"shared weight {self.name!r}: negative offset, length or dimension")


@dataclass(frozen=True)
class SharedWeights:
    """The weights two graphs of a build share, held in memory once (one map of `file`)."""

    file: str
    tensors: tuple[SharedWeight, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.length] for t in self.tensors]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SharedWeights:
        return cls(file=str(d["file"]), tensors=tuple(SharedWeight(*row) for row in d["tensors"]))


@dataclass(frozen=True)
class FusedSettings:
    """The fused cpu decoder's choices (builders/ort_fused.py)."""

    accuracy_level: int = 4  # MatMulNBits activations: 4 = int8, 0 = float32
    minimums: str = "int8"  # builders.Minimums: how GGUF Q4_1 block minimums run
    # builders.AttentionKernel: "onnxruntime" (GroupQueryAttention, writing the cache through its
    # present outputs) or "cabinlm" (kernels/int8_kv_attention.cc, int8 KV only: registered from the
    # cabinlm.kernels library at load, writing the cache in place). Builds before it: "onnxruntime".
    attention_kernel: str = "onnxruntime"
    # builders.MatmulKernel: "onnxruntime" (MatMulNBits for every quantized matrix) or "cabinlm"
    # (kernels/block_q4_matmul.cc for the Q4_1 matrices, from the same library). Builds before it: "onnxruntime".
    matmul_kernel: str = "onnxruntime"

    @property
    def own_kernels(self) -> bool:
        """The graph holds cabinlm's own operators (ai.cabinlm): the session registers cabinlm.kernels."""
        return self.attention_kernel == "cabinlm" or self.matmul_kernel == "cabinlm"

    def __post_init__(self) -> None:
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level!r}")
        if self.minimums not in ("int8", "exact"):
            raise ValueError(f"minimums must be int8 or exact, got {self.minimums!r}")
        if self.attention_kernel not in ("onnxruntime", "cabinlm"):
            raise ValueError(f"attention_kernel must be onnxruntime or cabinlm, got {self.attention_kernel!r}")
        if self.matmul_kernel not in ("onnxruntime", "cabinlm"):
            raise ValueError(f"matmul_kernel must be onnxruntime or cabinlm, got {self.matmul_kernel!r}")


@dataclass(frozen=True)
class BuildSpec:
    """A built artifact's engine facts: everything the runtime needs to load it, nothing guessed."""

    backend: BackendKind
    provider: ExecutionProvider = ExecutionProvider()
    session: SessionSettings = SessionSettings()
    profile: str = ""
    engine: str = "onnxruntime"
    engine_version: str = ""
    shared_weights: SharedWeights | None = None  # STATIC_PAIR only
    fused: FusedSettings | None = None  # FUSED only
    qnn: QnnSettings | None = None  # QNN_HTP only
    tensorrt: TensorRTSettings | None = None  # TENSORRT only

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", BackendKind(self.backend))
        if (self.backend == BackendKind.QNN_HTP) != (self.qnn is not None):
            raise ValueError("a QNN HTP build records its QNN facts, and only a QNN HTP build does")
        if (self.backend == BackendKind.TENSORRT) != (self.tensorrt is not None):
            raise ValueError("a TensorRT build records its TensorRT facts, and only a TensorRT build does")
        if (self.backend == BackendKind.FUSED) != (self.fused is not None):
            raise ValueError("a fused build records its fused settings, and only a fused build does")
        if self.shared_weights is not None and self.backend != BackendKind.STATIC_PAIR:
            raise ValueError("shared weights belong to a static graph pair")

    @classmethod
    def for_export(cls) -> BuildSpec:
        """How a plain export runs: its graph on ONNX Runtime's CPU provider, default settings."""
        return cls(backend=BackendKind.EXPORTED_GRAPH)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend.value,
            "provider": dataclasses.asdict(self.provider),
            "session": {**dataclasses.asdict(self.session), "graph_optimization_level": self.session.graph_optimization_level.value},
            "profile": self.profile,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "shared_weights": self.shared_weights.to_dict() if self.shared_weights else None,
            "fused": dataclasses.asdict(self.fused) if self.fused else None,
            "qnn": self.qnn.to_dict() if self.qnn else None,
            "tensorrt": self.tensorrt.to_dict() if self.tensorrt else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildSpec:
        """Raises KeyError / TypeError / ValueError on malformed data (the manifest turns them into one line)."""
        if not isinstance(d, dict):
            raise TypeError(f"expected an object, got {type(d).__name__}")
        shared, fused = d["shared_weights"], d["fused"]
        qnn, trt = d.get("qnn"), d.get("tensorrt")  # absent in builds of cabinlm before these backends
        return cls(
            backend=BackendKind(d["backend"]),
            provider=ExecutionProvider(**d["provider"]),
            session=SessionSettings(**d["session"]),
            profile=str(d["profile"]),
            engine=str(d["engine"]),
            engine_version=str(d["engine_version"]),
            shared_weights=SharedWeights.from_dict(shared) if shared is not None else None,
            fused=FusedSettings(**fused) if fused is not None else None,
            qnn=QnnSettings.from_dict(qnn) if qnn is not None else None,
            tensorrt=TensorRTSettings.from_dict(trt) if trt is not None else None,
        )
