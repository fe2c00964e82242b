"""The TensorRT API differences that matter to cabinlm, as pure functions of a version: what the
engine builder (engine.py) and the runtime backend (engines/tensorrt/backend.py) do differently
on TensorRT 8.6 (DRIVE OS 6), 10.0-10.14 (JetPack 6, DRIVE OS 7) and 10.15+ / 11. No TensorRT
import: every switch here is unit-tested on any machine.

    era             network flags             precision                     I/O
    trt8  (8.5-9.x) 1 << EXPLICIT_BATCH       builder flags FP16 / INT8     int32 index bindings (no INT64
                                              (weakly typed)                before 9.0), execute_async_v3 (8.5+)
    trt10 (10.0-14) create_network(0)         builder flags FP16 / INT8 /   int32 or int64
                    (implicit batch removed)  FP8 (weakly typed)
    strongly-typed  1 << STRONGLY_TYPED       from the graph: no precision  int32 or int64
    (10.15+, 11)                              flags (TensorRT refuses them); the graph's Casts and
                                              types are obeyed, so fp32 regions stay fp32

Sources: NVIDIA's TensorRT release notes and migration guides (the eras above), NVIDIA's API as typed in tensorrt-stubs
10.13 (names checked by mypy in tests/test_tensorrt_types.py), onnx-tensorrt's changelog (compat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.io_spec import DecoderIO
from cabinlm.contract.layout import CacheLayout, KVDType
from cabinlm.contract.engines.tensorrt import ApiEra, TokenProfile

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

Version = tuple[int, int]
STRONGLY_TYPED_FROM: Version = (10, 15)  # the ONNX parser honours the graph's precision; weak typing deprecated
# The device profile's workspace limit when it names none: a policy, not a measurement.
DEFAULT_WORKSPACE_BYTES = 1 << 30


def parse_installed_version(text: str) -> Version:
    """tensorrt.__version__ ("8.6.11.4", "10.3.0.30", "11.0.0") -> (major, minor)."""
    parts = str(text).strip().split(".")
    try:
        major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError as e:
        raise CabinlmError(f"TensorRT version {text!r} is not MAJOR.MINOR[.PATCH...]") from e
    return major, minor


def api_era(version: Version) -> ApiEra:
    """Which builder API a TensorRT version speaks. 8.5 is the oldest with execute_async_v3 and
    name-based I/O (set_tensor_address), which the backend needs."""
    if version < (8, 5):
        raise CabinlmError(f"TensorRT {version[0]}.{version[1]} is too old: cabinlm needs 8.5 or newer "
                           "(name-based I/O, execute_async_v3); DRIVE OS 6 ships 8.6")  # fmt: skip
    if version < (10, 0):
        return ApiEra.TRT8
    if version < STRONGLY_TYPED_FROM:
        return ApiEra.TRT10
    return ApiEra.STRONGLY_TYPED


def network_flag_names(era: ApiEra) -> tuple[str, ...]:
    """NetworkDefinitionCreationFlag members to set (as bits: 1 << int(flag))."""
    if era is ApiEra.TRT8:
        return ("EXPLICIT_BATCH",)  # 8.x: without it the network is implicit-batch and the ONNX parser refuses it
    if era is ApiEra.STRONGLY_TYPED:
        return ("STRONGLY_TYPED",)
    return ()  # 10.x: explicit batch is the only kind; the flag is deprecated and ignored


def precision_flags(era: ApiEra, kv: KVDType, fp16: bool = True) -> tuple[str, ...]:
    """Builder precision flags (tensorrt/spec.PRECISIONS names). Weakly typed networks: FP16 lets
    TensorRT pick fp16 kernels anywhere (the bundle's graph is fp16-safe for that); explicit Q/DQ of
    int8 / fp8 KV needs the INT8 / FP8 flag. Strongly typed networks take no flags."""
    if era is ApiEra.STRONGLY_TYPED:
        return ()
    flags = ["fp16"] if fp16 else []
    if kv is KVDType.INT8:
        flags.append("int8")
    if kv is KVDType.FP8:
        if era is ApiEra.TRT8:
            raise CabinlmError("fp8 KV needs TensorRT >= 9.0 (FP8 Q/DQ); re-export with --kv int8 or fp16")
        flags.append("fp8")
    return tuple(flags)


def token_profiles(chunk: int) -> tuple[TokenProfile, ...]:
    """Optimization profiles over the chunk length. Decode (1 token) is the hot path of a dialogue
    and gets its own profile, tuned for exactly one token; prefill chunks (2..chunk) the other,
    tuned for a full chunk. One execution context per profile, both over the same buffers."""
    decode = TokenProfile("decode", 1, 1, 1)
    if chunk == 1:
        return (decode,)
    return decode, TokenProfile("prefill", 2, chunk, chunk)


@dataclass(frozen=True)
class InputShapes:
    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def resolve_dims(shape: tuple[int | str, ...], tokens: int, rows: int, layout: CacheLayout) -> tuple[int, ...]:
    """A graph I/O shape (io_spec.TensorSpec) at `tokens` tokens and `rows` logit rows: "total" is the
    slot map's slots + tokens, "local_total" a local layer's slots (its ring's w and the recall region's) + tokens."""
    dims = {"tokens": tokens, "total": layout.slots + tokens, "local_total": layout.local_slots + tokens, "rows": rows}
    out = []
    for d in shape:
        if isinstance(d, str):
            if d not in dims:
                raise CabinlmError(f"graph dimension {d!r} is not one the TensorRT profile covers ({', '.join(dims)})")
            out.append(dims[d])
        else:
            out.append(d)
    return tuple(out)


def profile_shapes(io: DecoderIO, layout: CacheLayout, profile: TokenProfile) -> tuple[InputShapes, ...]:
    """IOptimizationProfile.set_shape arguments for every input with a dynamic dimension: "tokens"
    spans the profile, "total" is slots + tokens, "local_total" a local layer's slots + tokens (the local
    layers' mask), and "rows" (logit rows) spans 1..max tokens, tuned for 1 (dialogue asks for the
    last token's logits; scoring and drafts for more)."""
    out = []
    for t in io.inputs:
        if all(isinstance(d, int) for d in t.shape):
            continue
        out.append(InputShapes(t.name, resolve_dims(t.shape, profile.min_tokens, 1, layout),
                               resolve_dims(t.shape, profile.opt_tokens, 1, layout),
                               resolve_dims(t.shape, profile.max_tokens, profile.max_tokens, layout)))  # fmt: skip
    return tuple(out)


def runtime_shapes(io: DecoderIO, layout: CacheLayout, tokens: int, rows: int) -> dict[str, tuple[int, ...]]:
    """set_input_shape arguments for one step: every dynamic input at `tokens` (logit rows: `rows`)."""
    if not 1 <= rows <= tokens:
        raise ValueError(f"logit rows {rows} outside 1..{tokens}")
    return {t.name: resolve_dims(t.shape, tokens, rows, layout) for t in io.inputs
            if not all(isinstance(d, int) for d in t.shape)}  # fmt: skip


def workspace_bytes(profile: DeviceProfile) -> int:
    """The MemoryPoolType.WORKSPACE limit: the device profile's tensorrt_workspace_mib, else 1 GiB,
    never above the assistant's budget."""
    mib = getattr(profile, "tensorrt_workspace_mib", None)
    if mib is None:
        value = DEFAULT_WORKSPACE_BYTES
    elif isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
        raise CabinlmError(f"{profile.source}: field 'tensorrt_workspace_mib' = {mib!r} is invalid: expected a whole "
                           "number of MiB >= 1; e.g. tensorrt_workspace_mib = 512")  # fmt: skip
    else:
        value = mib << 20
    return min(value, profile.budget_bytes)


def parser_error_line(index: int, code: str, desc: str, node: int, node_name: str = "", node_op: str = "") -> str:
    """One ONNX parser error as a line naming its node (TensorRT 10 reports the node's name and
    operator; 8.6 only its index, which the caller maps to a name from the graph file)."""
    where = f"node {node}" if node >= 0 else "the model"
    if node_name or node_op:
        where += f" ({node_op or '?'} {node_name!r})"
    return f"  error {index + 1}: {where}: {code}: {desc.strip()}"
