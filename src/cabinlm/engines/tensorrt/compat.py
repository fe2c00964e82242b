"""Will TensorRT's ONNX parser take this graph? A static check that needs only `onnx`, no TensorRT
and no GPU, so it runs on the export workstation and in CPU CI before a device ever sees the file.

    violations = check_model(onnx.load("decoder.onnx", load_external_data=False), "orin-x")
    print(format_report(violations, "orin-x"))

Kinds of violation:
    op           an operator (or a custom domain) the TensorRT version does not import
    dtype        a tensor type it does not take (DOUBLE, FP8 before 9.0 or on a chip without FP8, ...)
    opset        an opset above the profile's / version's ceiling (and the IR version, as a warning)
    dynamic_dim  a graph I/O dimension that is neither fixed nor a declared token range
    attribute    an attribute or input the version restricts (e.g. Slice axes must be constant in 8.6)
Severity "error": the parse or build fails. "warning": it parses, but the runtime must adapt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper

from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.manifest import KVDType
from cabinlm.profiles import DeviceProfile, load_profile

Version = tuple[int, int]
KINDS = ("op", "dtype", "opset", "dynamic_dim", "attribute")
# Symbolic dims the graph contract declares (io_spec.TensorSpec): the chunk length, slots + chunk,
# a local layer's ring slots + chunk (models with their own sliding-window layers), and the number
# of logit rows.
DECLARED_DIMS = ("tokens", "total", "local_total", "rows")

# -- TensorRT's ONNX operator support ------------------------------------------------------------
# Source: onnx/onnx-tensorrt docs/operators.md, the "Operator Support Matrix" (rows marked Y), read at
# the 8.5 GA version ("TensorRT 8.5 supports operators up to Opset 17"), 9.2 and 10.15; the versions
# in between come from onnx-tensorrt docs/Changelog.md ("Added support for ..." per release).
_OPS_TRT_8_5 = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil
Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual
GridSample GRU HardSigmoid HardSwish Identity If ImageScaler InstanceNormalization IsNaN LeakyRelu
Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN
RoiAlign Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin
Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())
# Operators added after 8.5 -> the first TensorRT that imports them.
_OPS_ADDED: dict[str, Version] = {
    "GroupNormalization": (8, 6), "LayerNormalization": (8, 6), "IsInf": (8, 6),  # Changelog 8.6 EA
    "CastLike": (9, 2),  # first in operators.md @9.2 (absent from 8.5's)
    "Hardmax": (9, 2),  # Changelog 9.2
    "DeformConv": (10, 1),  # Changelog 10.1
    "BlackmanWindow": (10, 4), "HammingWindow": (10, 4), "HannWindow": (10, 4),  # Changelog 10.4
    "STFT": (10, 5),  # Changelog 10.5
    "Attention": (10, 14),  # Changelog 10.14
    "RotaryEmbedding": (10, 15), "RMSNormalization": (10, 15), "TensorScatter": (10, 15),  # Changelog 10.15
    # Y in operators.md @10.15 with no Changelog entry; earlier 10.x matrices were not read: assume 10.15.
    "Gelu": (10, 15), "Mish": (10, 15),
}  # fmt: skip
# The table covers 8.5 .. 10.15; "10.x" means every 10.x, so it is checked as 10.0.
OLDEST, NEWEST = (8, 5), (10, 15)


def supported_ops(version: Version) -> frozenset[str]:
    return _OPS_TRT_8_5 | {op for op, since in _OPS_ADDED.items() if since <= version}


def max_opset(version: Version) -> int:
    # operators.md headers: 8.5/8.6 "up to Opset 17", 9.2 "up to Opset 19", 10.15 "opset 9 to opset 24";
    # hardware.md: "TensorRT 10.0 supports ... opset 9 to opset 20".
    if version < (9, 0):
        return 17
    if version < (10, 0):
        return 19
    return 24 if version >= (10, 15) else 20


def parser_ir_version(version: Version) -> int:
    # IR version of the ONNX submodule the parser is built with (Changelog: 8.6 -> onnx 1.13.1 = IR 8,
    # 9.0 -> 1.14 = IR 9, 10.6 -> 1.17 = IR 10, 10.11 -> 1.18 = IR 11). A newer model IR only warns.
    if version < (9, 0):
        return 8
    if version < (10, 6):
        return 9
    return 10 if version < (10, 11) else 11


# Inputs that must be build-time constants (initializer or Constant), until the version that lifted it.
_CONSTANT_INPUTS: dict[tuple[str, int], tuple[str, Version | None]] = {
    ("Slice", 3): ("axes", (10, 3)),  # Changelog 10.3: "tensor axes inputs for Slice"
    ("Squeeze", 1): ("axes", (10, 7)),  # Changelog 10.7: dynamic axes for Squeeze/Unsqueeze
    ("Unsqueeze", 1): ("axes", (10, 7)),
    ("CumSum", 1): ("axis", (10, 8)),  # Changelog 10.8: dynamic axes for CumSum
    ("TopK", 1): ("K", (8, 6)),  # Changelog 8.6 EA: dynamic K
    ("Pad", 3): ("axes", (10, 4)),  # Changelog 10.4: tensor axes for Pad
    **{(op, 1): ("axes", None) for op in (  # operators.md @10.15: "`axes` must be an initializer"
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSum", "ReduceSumSquare")},
}  # fmt: skip
_TYPE_ATTRS = {"Cast": "to", "RandomNormal": "dtype", "RandomUniform": "dtype", "EyeLike": "dtype"}
_RESIZE_MODES = {"nearest", "linear"}  # operators.md: "Supported resize modes: nearest, linear"
_RESIZE_COORDS = {"half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn", "asymmetric", "align_corners"}

_FLOAT8 = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ}
_INT4 = {getattr(TensorProto, n) for n in ("INT4", "UINT4") if hasattr(TensorProto, n)}
_FLOAT4 = {getattr(TensorProto, n) for n in ("FLOAT4E2M1",) if hasattr(TensorProto, n)}
# Never a TensorRT tensor type (operators.md data-type lists, 8.5 .. 10.15).
_NEVER = {TensorProto.STRING, TensorProto.COMPLEX64, TensorProto.COMPLEX128, TensorProto.INT16,
          TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}  # fmt: skip


@dataclass(frozen=True)
class Violation:
    kind: str  # one of KINDS
    node_or_tensor: str
    message: str
    severity: str = "error"  # "error" | "warning"

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.severity not in ("error", "warning"):
            raise ValueError(f"Violation kind {self.kind!r} / severity {self.severity!r}: kind must be one of {KINDS}")


@dataclass(frozen=True)
class Target:
    """What the graph is checked against: a TensorRT version, optionally narrowed by a profile."""

    version: Version
    label: str  # e.g. "TensorRT 8.6 (profile orin-x)"
    max_opset: int
    fp8: bool  # FP8 tensors allowed
    static_shapes: bool


def parse_version(text: str) -> Version:
    """TensorRT version text -> (major, minor): "8.6" -> (8, 6); "10.x" -> (10, 0), since a graph for
    "10.x" must parse in every 10.x. Minors past the table's newest (10.15) are checked as 10.15."""
    parts = str(text).strip().split(".")
    try:
        major = int(parts[0])
        minor = 0 if len(parts) < 2 or parts[1] == "x" else int(parts[1])
    except ValueError as e:
        raise CabinlmError(f"TensorRT version {text!r} is not MAJOR.MINOR or MAJOR.x (e.g. 8.6, 10.3, 10.x)") from e
    version = (major, minor)
    if not OLDEST <= version < (11, 0):
        raise CabinlmError(
            f"TensorRT {text}: the operator table covers {OLDEST[0]}.{OLDEST[1]} to 10.x; "
            "check against one of those (DRIVE OS 6 ships 8.6, JetPack 6 ships 10.3)"
        )
    return min(version, NEWEST)


def resolve_target(target: DeviceProfile | str) -> Target:
    """A profile (object or name) or a TensorRT version string."""
    if isinstance(target, str) and target[:1].isdigit():
        v = parse_version(target)
        return Target(v, f"TensorRT {target}", max_opset(v), fp8=v >= (9, 0), static_shapes=False)
    profile = load_profile(target)
    if not profile.tensorrt:
        raise CabinlmError(
            f"profile {profile.name} runs {profile.engine.value}, not TensorRT; check a tensorrt profile "
            "(orin-x, jetson-*, thor) or pass a TensorRT version such as '8.6'"
        )
    v = parse_version(profile.engine_version or "")
    return Target(
        v,
        f"TensorRT {profile.engine_version} (profile {profile.name})",
        min(max_opset(v), profile.max_opset),
        fp8=v >= (9, 0) and KVDType.FP8 in profile.kv_dtypes,
        static_shapes=profile.static_shapes,
    )


def check_model(model: onnx.ModelProto, target: DeviceProfile | str) -> list[Violation]:
    """Every violation of `model` against the target, errors and warnings, in graph order."""
    t = resolve_target(target)
    out: list[Violation] = []
    _check_opset(model, t, out)
    _check_io(model.graph, t, out)
    _check_graph(model.graph, t, out)
    return out


def check_file(path: str | Path, target: DeviceProfile | str) -> list[Violation]:
    """check_model on a file, without reading its external weights."""
    return check_model(onnx.load(str(path), load_external_data=False), target)


def errors(violations: list[Violation]) -> list[Violation]:
    return [v for v in violations if v.severity == "error"]


def format_report(violations: list[Violation], target: DeviceProfile | str | None = None) -> str:
    """Plain text: a summary line, then one line per violation."""
    label = resolve_target(target).label if target is not None else "TensorRT"
    n_err = len(errors(violations))
    head = f"{label}: {n_err} error(s), {len(violations) - n_err} warning(s)"
    lines = [head] + [f"  {v.severity:<7} [{v.kind}] {v.node_or_tensor}: {v.message}" for v in violations]
    if not violations:
        lines.append("  the graph uses only what this TensorRT parses")
    return "\n".join(lines)


# -- the checks ----------------------------------------------------------------------------------


def _vstr(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def _check_opset(model: onnx.ModelProto, t: Target, out: list[Violation]) -> None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            if imp.version > t.max_opset:
                out.append(Violation("opset", "model", f"opset {imp.version} is above {t.label}'s ceiling of "
                                     f"{t.max_opset}; export with --opset {t.max_opset}"))  # fmt: skip
            elif t.version >= (10, 0) and imp.version < 9:
                out.append(Violation("opset", "model", f"opset {imp.version} is below TensorRT 10's minimum of 9"))
    ir = parser_ir_version(t.version)
    if model.ir_version > ir:
        out.append(Violation("opset", "model", f"IR version {model.ir_version} is newer than the parser's ({ir}); "
                             "TensorRT only warns, but an older opset export avoids it", "warning"))  # fmt: skip


def _dtype_problem(elem: int, t: Target, graph_io: bool) -> tuple[str, str] | None:
    """(severity, reason) when TensorRT cannot hold a tensor of this element type, else None."""
    name = TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else str(elem)
    if elem == TensorProto.DOUBLE:
        # operators.md: "TensorRT will attempt to cast DOUBLE down to FLOAT, clamping values to +-FLT_MAX":
        # it may parse, but the graph silently changes. An error: export float32.
        return "error", "DOUBLE: TensorRT has no float64, the parser casts it to FLOAT (clamping); export float32"
    if elem in _FLOAT8:
        if t.version < (9, 0):
            return "error", f"{name} needs TensorRT >= 9.0 (FP8 added in 9.0), this is {_vstr(t.version)}"
        if not t.fp8:
            return "error", f"{name}: {t.label} has no FP8 (see the profile's kv_dtypes); use int8 or fp16 KV"
        if elem != TensorProto.FLOAT8E4M3FN:
            # Not from the sources above: TensorRT's DataType.kFP8 is E4M3; other variants are unlikely to import.
            return "warning", f"{name}: TensorRT's FP8 type is E4M3 (FLOAT8E4M3FN); this variant may not import"
    if elem in _INT4 and t.version < (10, 0):
        return "error", f"{name} needs TensorRT >= 10.0 (INT4 added in 10.0)"
    if elem in _FLOAT4 and t.version < (10, 8):
        return "error", f"{name} needs TensorRT >= 10.8 (FP4 added in 10.8)"
    if elem == TensorProto.BFLOAT16 and t.version < (9, 0):
        return "error", "BFLOAT16 needs TensorRT >= 9.0; export float16 or float32"
    if elem == TensorProto.UINT8 and not graph_io:
        return "error", "UINT8 is only supported as a network input or output type"
    if elem in _NEVER:
        return "error", f"{name} is not a TensorRT tensor type"
    return None


def _check_io(graph: onnx.GraphProto, t: Target, out: list[Violation]) -> None:
    allowed = () if t.static_shapes else DECLARED_DIMS
    for role, values in (("input", graph.input), ("output", graph.output)):
        for vi in values:
            tt = vi.type.tensor_type
            problem = _dtype_problem(tt.elem_type, t, graph_io=True)
            if problem:
                out.append(Violation("dtype", vi.name, problem[1], problem[0]))
            elif tt.elem_type == TensorProto.INT64 and t.version < (9, 0):
                # Changelog 9.0 EA: before 9.0 "ONNX models with INT64 I/O require INT32 bindings".
                out.append(Violation("dtype", vi.name, f"INT64 graph {role}: TensorRT < 9.0 casts it to INT32, so "
                                     "the runtime must bind INT32 buffers here (INT32 indices where required)",
                                     "warning"))  # fmt: skip
            for axis, dim in enumerate(tt.shape.dim):
                if dim.HasField("dim_value") and dim.dim_value > 0:
                    continue
                if dim.HasField("dim_param") and dim.dim_param in allowed:
                    continue
                what = f"symbolic dim {dim.dim_param!r}" if dim.HasField("dim_param") else "an unknown dim"
                ok = f"only {', '.join(repr(a) for a in allowed)} are declared ranges" if allowed else "static shapes"
                out.append(Violation("dynamic_dim", vi.name, f"{role} axis {axis} is {what}; {ok} "
                                     "(the optimization profile covers those); fix the shape at export"))  # fmt: skip


def _subgraphs(node: onnx.NodeProto):
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _check_graph(graph: onnx.GraphProto, t: Target, out: list[Violation], outer_consts: frozenset = frozenset()):
    ops = supported_ops(t.version)
    consts = set(outer_consts) | {init.name for init in graph.initializer}
    inits = {init.name: init for init in graph.initializer}
    # element type of every tensor whose type the file declares: name -> TensorProto.DataType
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*graph.input, *graph.value_info)}
    types.update({init.name: init.data_type for init in graph.initializer})
    for init in graph.initializer:
        problem = _dtype_problem(init.data_type, t, graph_io=False)
        if problem:
            out.append(Violation("dtype", init.name, f"initializer: {problem[1]}", problem[0]))
    for vi in graph.value_info:
        problem = _dtype_problem(vi.type.tensor_type.elem_type, t, graph_io=False)
        if problem:
            out.append(Violation("dtype", vi.name, problem[1], problem[0]))
    for node in graph.node:
        where = node.name or f"{node.op_type}({', '.join(node.output)})"
        if node.domain not in ("", "ai.onnx"):
            out.append(Violation("op", where, f"{node.domain}::{node.op_type} is a custom-domain op: TensorRT needs "
                                 "a plugin for it; export standard ONNX ops only"))  # fmt: skip
        elif node.op_type not in ops:
            since = _OPS_ADDED.get(node.op_type)
            hint = f" (imported from TensorRT {_vstr(since)})" if since else ""
            out.append(Violation("op", where, f"{node.op_type} is not in {t.label}'s ONNX operator support matrix"
                                 f"{hint}; rewrite it with supported ops"))  # fmt: skip
        _check_node(node, where, t, consts, inits, types, out)
        if node.op_type == "Constant":
            consts.update(node.output)
        for sub in _subgraphs(node):
            _check_graph(sub, t, out, frozenset(consts))


def _check_node(
    node: onnx.NodeProto, where: str, t: Target, consts: set, inits: dict, types: dict, out: list[Violation]
) -> None:
    op = node.op_type
    # Type-changing attributes: the tensors they create do not appear in value_info.
    if op in _TYPE_ATTRS and _attr(node, _TYPE_ATTRS[op]) is not None:
        problem = _dtype_problem(_attr(node, _TYPE_ATTRS[op]), t, graph_io=False)
        if problem:
            out.append(Violation("dtype", where, f"{op} to {problem[1]}", problem[0]))
    if op in ("Constant", "ConstantOfShape"):
        value = _attr(node, "value")
        problem = _dtype_problem(value.data_type, t, graph_io=False) if isinstance(value, TensorProto) else None
        if problem:
            out.append(Violation("dtype", where, f"{op} value: {problem[1]}", problem[0]))
    quantized = {TensorProto.INT8, *_FLOAT8}
    casts_quantized = op == "Cast" and (_attr(node, "to") in quantized or types.get(node.input[0]) in quantized)
    if casts_quantized and t.version >= (10, 0):
        # operators.md @10.15: Cast types are FP32, FP16, BF16, INT32, INT64, UINT8, BOOL, and "INT8, INT4,
        # FP8 and FP4 are treated as Quantized Types ... available only through quantization". (The 9.2
        # matrix still listed INT8/FP8 for Cast, and the 10.3 one was not read: hence a warning.)
        out.append(Violation("attribute", where, "Cast from/to INT8/FP8: TensorRT 10 reaches quantized types only "
                             "through QuantizeLinear/DequantizeLinear; use Q/DQ with a scale", "warning"))  # fmt: skip

    rule = {i: _CONSTANT_INPUTS[(op, i)] for i in range(len(node.input)) if (op, i) in _CONSTANT_INPUTS}
    for i, (what, lifted) in rule.items():
        name = node.input[i]
        if name and name not in consts and (lifted is None or t.version < lifted):
            since = f" before TensorRT {_vstr(lifted)}" if lifted else ""
            out.append(Violation("attribute", where, f"{op} input {what!r} ({name}) must be a build-time constant"
                                 f"{since}; make it an initializer"))  # fmt: skip
    if op in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2] in inits:
        zero_point = inits[node.input[2]]
        # operators.md: "`x_zero_point` / `y_zero_point` must be zero" (8.5 .. 10.15). External data is not
        # loaded here, but zero points are small and stay inside the graph file.
        if zero_point.data_location != TensorProto.EXTERNAL and numpy_helper.to_array(zero_point).any():
            out.append(Violation("attribute", where, f"{op} zero point ({node.input[2]}) must be 0: TensorRT "
                                 "quantization is symmetric"))  # fmt: skip
    if op == "ScatterND" and _attr(node, "reduction", b"none") not in (b"none", "none"):
        out.append(Violation("attribute", where, "ScatterND reduction other than 'none' is not supported"))
    if op == "ScatterElements" and t.version < (10, 0) and _attr(node, "reduction", b"none") not in (b"none", "none"):
        out.append(Violation("attribute", where, "ScatterElements reduction needs TensorRT >= 10.0"))
    if op == "Einsum" and t.version < (10, 12) and b"..." in (_attr(node, "equation", b"") or b""):
        out.append(Violation("attribute", where, "Einsum ellipsis needs TensorRT >= 10.12; spell the axes out"))
    if op == "Pad" and t.version < (10, 0) and _attr(node, "mode", b"constant") == b"wrap":
        out.append(Violation("attribute", where, "Pad mode 'wrap' needs TensorRT >= 10.0"))
    if op == "Resize":
        mode = (_attr(node, "mode", b"nearest") or b"").decode()
        coords = (_attr(node, "coordinate_transformation_mode", b"half_pixel") or b"").decode()
        if mode not in _RESIZE_MODES or coords not in _RESIZE_COORDS:
            supported = f"modes {sorted(_RESIZE_MODES)}, transformations {sorted(_RESIZE_COORDS)}"
            message = f"Resize mode {mode!r} / {coords!r} is not supported ({supported})"
            out.append(Violation("attribute", where, message))
