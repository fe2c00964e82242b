"""DeviceProfile: what cabinlm knows about a target chip, read from one TOML file and validated once.

Standard library only (tomllib), so that the planner and `cabinlm profiles` run anywhere.

A profile file is flat TOML, one key per DeviceProfile field. Byte sizes may be written as integers
or as strings with a unit ("32 GiB", "512 MiB", "16 GB"); `memory_total_bytes = "auto"` means the
memory of the machine cabinlm runs on, and `budget_bytes = "50%"` a share of memory_total_bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.precision import KVDType, WeightFormat

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 needs the tomli backport
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


class ProfileError(CabinlmError):
    """A device profile is missing, unreadable, or has an invalid field."""


class Engine(str, enum.Enum):
    ONNXRUNTIME = "onnxruntime"
    TENSORRT = "tensorrt"


# execution providers cabinlm drives through ONNX Runtime
EXECUTION_PROVIDERS = ("CPUExecutionProvider", "QNNExecutionProvider")
_VERSION = re.compile(r"^\d+\.(\d+|x)$")  # "8.6", "10.3", "10.x"
_UNITS = {
    "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_MARCH = re.compile(r"[a-z0-9][a-z0-9_.+-]{0,63}")  # a compiler -march: native, x86-64-v3, armv8.2-a+dotprod
CPU_ARCHS = ("x86_64", "aarch64")  # cpu_arch: CPU architectures as Linux names them (platform.machine())
# What a profile's CPU engine (`cabinlm build --engine cpu`, DeviceProfile.cpu_engine) takes from the
# built-in cpu profile: ONNX Runtime's CPU provider and what it runs. The rest is the chip's own.
CPU_ENGINE_FIELDS = ("engine", "execution_provider", "engine_version", "max_opset", "kv_dtypes", "default_kv",
                      "weight_dtype", "static_shapes", "default_sink", "default_chunk", "runtime_overhead_bytes",
                      "seat_batches")  # fmt: skip


def _fail(source: str, name: str, value: Any, why: str, fix: str) -> ProfileError:
    if isinstance(value, enum.Enum):
        value = value.value
    elif isinstance(value, tuple):
        value = [v.value if isinstance(v, enum.Enum) else v for v in value]
    return ProfileError(f"{source}: field {name!r} = {value!r} is invalid: {why}; {fix}")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    chip: str
    description: str
    memory_total_bytes: int  # all DRAM of the SoC (shared with the OS, cluster, cameras, ...)
    budget_bytes: int  # what the assistant may use: weights + KV + activations + vision + runtime
    bandwidth_gbs: float  # peak DRAM bandwidth, GB/s: an upper bound on decode speed only
    engine: Engine
    max_opset: int  # highest ONNX opset the engine accepts
    kv_dtypes: tuple[KVDType, ...]  # KV precisions the device runs
    default_kv: KVDType
    weight_dtype: WeightFormat  # what the engine holds; fp16 where it converts the fp32 graph when it builds
    static_shapes: bool  # every graph dimension fixed (QNN HTP); no "tokens"/"total" ranges
    default_sink: int
    default_chunk: int
    runtime_overhead_bytes: int  # engine libraries, CUDA/QNN context, tokenizer, Python
    execution_provider: str | None = None  # onnxruntime only: CPUExecutionProvider / QNNExecutionProvider
    # tensorrt: the TensorRT the graph must parse in ("8.6", "10.3", "10.x" = every 10.x);
    # onnxruntime: the oldest ONNX Runtime it must run in (optional)
    engine_version: str | None = None
    threads: int | None = None  # None: the engine's default
    precision_notes: str = ""  # why some precisions are missing; quoted in error messages
    # Qualcomm HTP (QNNExecutionProvider profiles): what the QNN compiler targets. Both are needed:
    # without soc_model the HTP runs a float graph in fp32, which the chip does not.
    htp_arch: int | None = None  # Hexagon HTP architecture, e.g. 68 (v68), 73 (v73)
    soc_model: int | None = None  # QNN's SoC id, e.g. 39 (SA8295P), 52 (SA8255 / SA8775P family)
    htp_process_limit_bytes: int | None = None  # what one NPU process maps: context binaries + KV + activations
    # TensorRT (tensorrt profiles): the builder's MemoryPoolType.WORKSPACE limit in MiB (scratch for
    # tactics at build and run time); None: 1 GiB. Checked by builders/trt_api.workspace_bytes.
    tensorrt_workspace_mib: int | None = None
    # The chip's application CPU, which cabinlm's own kernels are compiled for by `cabinlm build` (a
    # CPUExecutionProvider profile, or any profile's CPU engine: `--engine cpu`). cpu: in words (cores,
    # cores' design); cpu_arch: its architecture as Linux names it ("aarch64", "x86_64"; None: the
    # build machine's own, for the host cpu profile); cpu_march: its ISA as the compiler's -march names
    # it: "native" (the build machine's own CPU, only where cpu_arch is None), or e.g. "x86-64-v3",
    # "armv8.2-a+dotprod". None: "native". For the build machine's architecture the build runs what
    # it compiled, so it must be a CPU the build machine can run; for another the kernels are
    # cross-compiled (engines/ort_fused/kernels/compiler.py) and checked under emulation or on the car.
    cpu: str = ""
    cpu_arch: str | None = None
    cpu_march: str | None = None
    # Seats decoding together: the batch sizes (2 or more) of the batched graphs a build for this
    # profile carries (engines/ort_fused: the fused cpu build, the only engine with batched graphs
    # today); empty: none, each seat's step runs alone. Each batch size is one more graph file (the
    # weights shared); a profile for a build without them says so with seat_batches = [].
    seat_batches: tuple[int, ...] = (2, 4)
    source: str = "<memory>"  # the file it was read from, for messages

    def __post_init__(self) -> None:
        src = self.source

        def bad(name: str, why: str, fix: str) -> ProfileError:
            return _fail(src, name, getattr(self, name), why, fix)

        for name in ("name", "chip", "description"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise bad(name, "expected a non-empty string", f'write {name} = "..."')
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise bad("name", "use letters, digits, '.', '_' and '-' only", 'e.g. name = "my-board"')
        for name in ("memory_total_bytes", "budget_bytes", "runtime_overhead_bytes", "default_chunk",
                     "max_opset", "default_sink"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "expected an integer", f"write {name} as a whole number")
        for name in ("memory_total_bytes", "budget_bytes", "default_chunk"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1", "give a positive value")
        for name in ("runtime_overhead_bytes", "default_sink"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0", "give 0 or a positive value")
        if self.budget_bytes > self.memory_total_bytes:
            raise bad(
                "budget_bytes",
                f"larger than memory_total_bytes ({self.memory_total_bytes})",
                "the assistant cannot use more than the chip has; lower budget_bytes",
            )
        if isinstance(self.bandwidth_gbs, bool) or not isinstance(self.bandwidth_gbs, (int, float)) or not (
            self.bandwidth_gbs > 0
        ):
            raise bad("bandwidth_gbs", "expected a positive number (GB/s)", "e.g. bandwidth_gbs = 204.8")
        batches = self.seat_batches
        if not isinstance(batches, tuple) or any(isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 64
                                                 for b in batches) or list(batches) != sorted(set(batches)):  # fmt: skip
            raise bad("seat_batches", "expected increasing batch sizes from 2 to 64, or none",
                      "e.g. seat_batches = [2, 4], or [] for no batched graphs")  # fmt: skip
        if not 7 <= self.max_opset <= 30:
            raise bad("max_opset", "outside the ONNX opsets 7..30", "e.g. max_opset = 17")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):  # fmt: skip
            raise bad("threads", "expected an integer >= 1", "remove the key to use the engine's default")
        if not isinstance(self.static_shapes, bool):
            raise bad("static_shapes", "expected true or false", "write static_shapes = true or false")

        self._coerce_enum("engine", Engine)
        self._coerce_enum("weight_dtype", WeightFormat)
        self._coerce_enum("default_kv", KVDType)
        kvs = self.kv_dtypes
        if isinstance(kvs, (str, bytes)) or not isinstance(kvs, (list, tuple)) or not kvs:
            raise bad("kv_dtypes", "expected a non-empty list", 'e.g. kv_dtypes = ["int8", "fp16"]')
        try:
            kv_tuple = tuple(KVDType(k) for k in kvs)
        except ValueError as e:
            raise bad("kv_dtypes", str(e), f"use a subset of {[k.value for k in KVDType]}") from e
        if len(set(kv_tuple)) != len(kv_tuple):
            raise bad("kv_dtypes", "lists a precision twice", "list each precision once")
        object.__setattr__(self, "kv_dtypes", kv_tuple)
        if self.default_kv not in kv_tuple:
            raise bad("default_kv", f"not one of kv_dtypes {[k.value for k in kv_tuple]}", "add it there or pick one")

        if self.engine is Engine.ONNXRUNTIME:
            if self.execution_provider not in EXECUTION_PROVIDERS:
                raise bad(
                    "execution_provider",
                    "an onnxruntime profile needs an execution provider cabinlm drives",
                    f"use one of {', '.join(EXECUTION_PROVIDERS)}",
                )
        elif self.execution_provider is not None:
            raise bad("execution_provider", "only onnxruntime profiles have one", "remove the key")
        if self.engine_version is not None and (
            not isinstance(self.engine_version, str) or not _VERSION.match(self.engine_version)
        ):
            raise bad("engine_version", 'expected "MAJOR.MINOR" or "MAJOR.x"', 'e.g. engine_version = "8.6"')
        if self.engine is Engine.TENSORRT:
            if self.engine_version is None:
                raise bad("engine_version", "a tensorrt profile must name its TensorRT", 'e.g. engine_version = "10.3"')
            major = int(self.engine_version.split(".")[0])
            # Changelog of onnx/onnx-tensorrt: FP8 arrives in 9.0, INT4 in 10.0; hardware.md: "No INT4 in TRT 8.6".
            if major < 9 and KVDType.FP8 in kv_tuple:
                raise bad("kv_dtypes", f"fp8 needs TensorRT >= 9, this profile has {self.engine_version}", "remove fp8")
            if major < 10 and self.weight_dtype is WeightFormat.INT4:
                raise bad("weight_dtype", f"int4 needs TensorRT >= 10, this profile has {self.engine_version}",
                          "use int8 or fp16")  # fmt: skip
        qnn = self.execution_provider == "QNNExecutionProvider"
        lim = self.htp_process_limit_bytes
        if lim is not None and (not qnn or isinstance(lim, bool) or not isinstance(lim, int) or lim < 1):
            raise bad("htp_process_limit_bytes", "a positive size, on QNNExecutionProvider profiles only",
                      'e.g. htp_process_limit_bytes = "3584 MiB"')  # fmt: skip
        for name in ("htp_arch", "soc_model"):
            v = getattr(self, name)
            if v is None:
                if qnn:
                    raise bad(name, "a QNNExecutionProvider profile must name its HTP target",
                              "e.g. htp_arch = 73 and soc_model = 52 (see the built-in sa8775p profile)")  # fmt: skip
            elif not qnn:
                raise bad(name, "only QNNExecutionProvider profiles have one", "remove the key")
            elif isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1000:
                raise bad(name, "expected a positive integer", f"e.g. {name} = {73 if name == 'htp_arch' else 52}")
        if self.cpu_march is not None and (not isinstance(self.cpu_march, str) or not _MARCH.fullmatch(self.cpu_march)):
            raise bad("cpu_march", "expected a compiler -march value (lowercase letters, digits, '.', '_', '+', '-')",
                      'e.g. cpu_march = "native" or "x86-64-v3"')  # fmt: skip
        if not isinstance(self.cpu, str):
            raise bad("cpu", "expected a string", 'e.g. cpu = "8 x Cortex-A78AE"')
        if self.cpu_arch is not None:
            if self.cpu_arch not in CPU_ARCHS:
                raise bad("cpu_arch", f"not one of {', '.join(CPU_ARCHS)}", 'e.g. cpu_arch = "aarch64"')
            if self.cpu_march in (None, "native"):
                raise bad("cpu_march", f"a profile whose cpu_arch is {self.cpu_arch} must name that CPU's ISA (\"native\" "
                          "is the build machine's)", 'e.g. cpu_march = "armv8.2-a+dotprod"')  # fmt: skip
        for name in ("precision_notes", "source"):
            if not isinstance(getattr(self, name), str):
                raise bad(name, "expected a string", f'write {name} = "..."')

    def _coerce_enum(self, name: str, kind: type[enum.Enum]) -> None:
        value = getattr(self, name)
        try:
            object.__setattr__(self, name, kind(value))
        except ValueError as e:
            raise _fail(self.source, name, value, "unknown value", f"use one of {[k.value for k in kind]}") from e

    @property
    def kernels_march(self) -> str:
        """The -march cabinlm's kernels are compiled with for this profile (cpu_march, default "native")."""
        return self.cpu_march or "native"

    @property
    def tensorrt(self) -> bool:
        return self.engine is Engine.TENSORRT

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["engine"] = self.engine.value
        d["weight_dtype"] = self.weight_dtype.value
        d["default_kv"] = self.default_kv.value
        d["kv_dtypes"] = [k.value for k in self.kv_dtypes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<memory>") -> DeviceProfile:
        """Build from the TOML table: unknown keys, missing keys and sizes are resolved here."""
        known = {f.name for f in fields(cls)} - {"source"}
        required = {f.name for f in fields(cls) if f.default is dataclasses.MISSING}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(
                f"{source}: unknown field {unknown[0]!r}; a profile has the fields {', '.join(sorted(known))}"
            )
        missing = sorted(required - set(d))
        if missing:
            raise ProfileError(f"{source}: missing field {missing[0]!r}; add `{missing[0]} = ...` to the file")
        values = dict(d)
        for name in ("memory_total_bytes", "budget_bytes", "runtime_overhead_bytes"):  # in this order
            total = values["memory_total_bytes"] if name == "budget_bytes" else None
            values[name] = _size(values[name], name, source, total)
        if values.get("htp_process_limit_bytes") is not None:
            values["htp_process_limit_bytes"] = _size(values["htp_process_limit_bytes"], "htp_process_limit_bytes", source,
                                                      values["memory_total_bytes"])  # fmt: skip
        for name in ("kv_dtypes", "seat_batches"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        return cls(**values, source=source)


def _size(value: Any, name: str, source: str, total: int | None) -> Any:
    """A byte count from an int, "12 GiB", "auto" (host memory) or "50%" (of memory_total_bytes)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return value  # __post_init__ names the field
    if isinstance(value, int):
        return value
    if value.strip().lower() == "auto":
        if name != "memory_total_bytes":
            raise _fail(source, name, value, '"auto" is only for memory_total_bytes', 'write e.g. "50%" or "4 GiB"')
        return host_memory_bytes(source)
    m = _PERCENT.match(value)
    if m:
        if not isinstance(total, int) or isinstance(total, bool):
            raise _fail(source, name, value, "a percentage needs a total", 'write e.g. "4 GiB"')
        share = float(m.group(1))
        if not 0 < share <= 100:
            raise _fail(source, name, value, "must be in (0, 100] %", 'e.g. "50%"')
        return int(total * share / 100)
    m = _SIZE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise _fail(source, name, value, "not a byte size", 'write an integer or e.g. "512 MiB", "4 GiB", "16 GB"')
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def host_memory_bytes(source: str = "<host>") -> int:
    """Physical memory of this machine (os.sysconf), or the cgroup limit of its container when lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError) as e:
        raise _fail(source, "memory_total_bytes", "auto", "this OS does not report its memory through sysconf",
                    'write the size, e.g. "16 GiB"') from e  # fmt: skip
    # cgroup v2, then v1: "max" or a huge number means no limit.
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
        break
    return total


def read_profile_file(path: str | Path) -> DeviceProfile:
    """Load and validate one profile TOML file."""
    path = Path(path)
    if tomllib is None:  # pragma: no cover
        raise ProfileError(f"{path}: reading TOML needs Python >= 3.11 (tomllib) or the tomli package")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile ({e.strerror or e})") from e
    return parse_profile(data.decode("utf-8", errors="replace"), str(path))


def parse_profile(text: str, source: str) -> DeviceProfile:
    if tomllib is None:  # pragma: no cover
        raise ProfileError(f"{source}: reading TOML needs Python >= 3.11 (tomllib) or the tomli package")
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{source}: not valid TOML ({e}); fix the syntax") from e
    return DeviceProfile.from_dict(d, source=source)
