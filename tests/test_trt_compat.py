"""The TensorRT compatibility check: each kind of violation planted in a tiny graph is caught, a
clean graph passes, and the real exported decoder parses for orin-x (TensorRT 8.6)."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from cabinlm.engines.tensorrt.compat import (
    KINDS,
    Violation,
    check_file,
    check_model,
    errors,
    format_report,
    parse_version,
    supported_ops,
)
from cabinlm.contract.errors import CabinlmError

F = TensorProto.FLOAT


def model(nodes, inputs, outputs, initializers=(), opset=17, ir=8):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def vi(name, elem=F, shape=("tokens", 8)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def relu_model(**kw):
    """x (tokens, 8) -> Relu -> y: nothing TensorRT 8.6 would object to."""
    return model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x")], [vi("y")], **kw)


def kinds(violations, severity="error"):
    return {(v.kind, v.node_or_tensor) for v in violations if v.severity == severity}


def test_a_clean_graph_passes_everywhere():
    for target in ("8.6", "10.3", "10.x", "orin-x", "jetson-agx-orin-64gb", "jetson-orin-nx-16gb", "thor"):
        assert check_model(relu_model(), target) == []


# -- one planted violation per kind -----------------------------------------------------------


def test_an_op_outside_the_support_matrix_is_caught():
    m = model([helper.make_node("Unique", ["x"], ["y"], name="uniq")], [vi("x")], [vi("y")], opset=11)
    assert kinds(check_model(m, "orin-x")) == {("op", "uniq")}


def test_an_op_newer_than_the_version_is_caught_only_there():
    # Hardmax: imported from TensorRT 9.2 (onnx-tensorrt Changelog), so 8.6 refuses it and 10.3 takes it.
    m = model([helper.make_node("Hardmax", ["x"], ["y"], name="hm", axis=-1)], [vi("x")], [vi("y")], opset=13)
    found = check_model(m, "orin-x")
    assert kinds(found) == {("op", "hm")} and "9.2" in found[0].message
    assert check_model(m, "10.3") == []
    assert "Hardmax" not in supported_ops((8, 6)) and "Hardmax" in supported_ops((10, 3))


def test_a_custom_domain_op_is_caught():
    node = helper.make_node("GroupQueryAttention", ["x"], ["y"], name="gqa", domain="com.microsoft")
    m = model([node], [vi("x")], [vi("y")])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    found = check_model(m, "jetson-orin-nx-16gb")
    assert kinds(found) == {("op", "gqa")} and "plugin" in found[0].message


def test_a_double_tensor_is_caught():
    m = model([helper.make_node("Cast", ["x"], ["y"], name="to_double", to=TensorProto.DOUBLE)],
              [vi("x")], [vi("y", TensorProto.DOUBLE)])  # fmt: skip
    assert kinds(check_model(m, "thor")) == {("dtype", "to_double"), ("dtype", "y")}


def test_fp8_is_caught_on_orin_but_not_on_thor():
    scale = helper.make_tensor("scale", F, [], [0.5])
    dq = helper.make_node("DequantizeLinear", ["k", "scale"], ["y"], name="dq")
    m = model([dq], [vi("k", TensorProto.FLOAT8E4M3FN)], [vi("y")], [scale], opset=19, ir=9)
    on_orin = check_model(m, "orin-x")
    assert ("dtype", "k") in kinds(on_orin) and "9.0" in next(v.message for v in on_orin if v.node_or_tensor == "k")
    on_jetson = check_model(m, "jetson-agx-orin-64gb")  # TensorRT 10.3 has FP8, the SM 8.7 chip does not
    assert kinds(on_jetson) == {("dtype", "k")} and "no FP8" in on_jetson[0].message
    assert check_model(m, "thor") == []


def test_an_opset_above_the_profile_is_caught():
    found = check_model(relu_model(opset=18), "orin-x")
    assert kinds(found) == {("opset", "model")} and "--opset 17" in found[0].message
    assert check_model(relu_model(opset=18), "jetson-agx-orin-64gb") == []  # TensorRT 10: opset <= 20
    assert kinds(check_model(relu_model(opset=21, ir=10), "10.3")) == {("opset", "model")}


def test_a_newer_ir_version_only_warns():
    found = check_model(relu_model(ir=9), "orin-x")
    assert errors(found) == [] and kinds(found, "warning") == {("opset", "model")}


def test_an_undeclared_dynamic_dim_is_caught():
    m = model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
              [vi("x", shape=("batch", 8))], [vi("y", shape=("batch", 8))])  # fmt: skip
    found = check_model(m, "orin-x")
    assert kinds(found) == {("dynamic_dim", "x"), ("dynamic_dim", "y")} and "'batch'" in found[0].message
    unknown = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", shape=(None, 8))], [vi("y")])
    assert kinds(check_model(unknown, "10.3")) == {("dynamic_dim", "x")}


def test_the_local_rings_mask_dimension_is_a_declared_range():
    """"local_total" (a local layer's ring slots + tokens: Gemma 3's local_attention_mask) is covered
    by the optimization profiles (engines/tensorrt/api.resolve_dims), like "total"."""
    m = model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
              [vi("x", shape=("tokens", "local_total"))], [vi("y", shape=("tokens", "local_total"))])  # fmt: skip
    assert check_model(m, "orin-x") == []


def test_a_non_constant_slice_axis_is_caught_before_10_3():
    # Slice axes from a graph input: TensorRT 8.6 needs an initializer; 10.3 added tensor axes.
    ints = [helper.make_tensor(n, TensorProto.INT32, [1], [v]) for n, v in (("starts", 0), ("ends", 2))]
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"], name="slice")
    m = model([node], [vi("x"), vi("axes", TensorProto.INT32, (1,))], [vi("y")], ints)
    assert kinds(check_model(m, "orin-x")) == {("attribute", "slice")}
    assert check_model(m, "10.3") == []


def test_an_int8_cache_cast_to_float_warns_on_tensorrt_10():
    # An int8 KV cache read with Cast parses in 8.6; TensorRT 10 treats INT8 as a quantized type
    # reached through DequantizeLinear, so the same graph only gets a warning there.
    node = helper.make_node("Cast", ["k"], ["y"], name="k_f32", to=F)
    m = model([node], [vi("k", TensorProto.INT8, (2, 8, 4))], [vi("y", F, (2, 8, 4))])
    assert check_model(m, "orin-x") == []
    assert kinds(check_model(m, "10.3"), "warning") == {("attribute", "k_f32")}


def test_a_nonzero_zero_point_is_caught():
    inits = [helper.make_tensor("s", F, [], [0.1]), helper.make_tensor("zp", TensorProto.INT8, [], [3])]
    q = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="q")
    dq = helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="dq")
    found = check_model(model([q, dq], [vi("x")], [vi("y")], inits), "orin-x")
    assert kinds(found) == {("attribute", "q"), ("attribute", "dq")}


def test_int64_graph_inputs_warn_before_tensorrt_9():
    gather = helper.make_node("Gather", ["table", "ids"], ["y"], name="embed")
    table = helper.make_tensor("table", F, [4, 8], [0.0] * 32)
    m = model([gather], [vi("ids", TensorProto.INT64, ("tokens",))], [vi("y")], [table])
    found = check_model(m, "orin-x")
    assert errors(found) == [] and kinds(found, "warning") == {("dtype", "ids")}
    assert "INT32 indices where required" in found[0].message
    assert check_model(m, "10.3") == []


# -- targets and the report -------------------------------------------------------------------


def test_targets_are_profiles_or_tensorrt_versions():
    assert parse_version("8.6") == (8, 6) and parse_version("10.x") == (10, 0) and parse_version("10.3") == (10, 3)
    with pytest.raises(CabinlmError, match="not TensorRT"):
        check_model(relu_model(), "cpu")
    with pytest.raises(CabinlmError, match="8.5 to 10.x"):
        check_model(relu_model(), "7.1")
    with pytest.raises(CabinlmError, match="not a built-in profile"):
        check_model(relu_model(), "orin-z")


def test_the_report_lists_every_violation():
    found = check_model(relu_model(opset=18), "orin-x") + [Violation("op", "n", "m", "warning")]
    text = format_report(found, "orin-x")
    assert text.splitlines()[0] == "TensorRT 8.6 (profile orin-x): 1 error(s), 1 warning(s)"
    assert "[opset] model" in text and "[op] n: m" in text
    assert all(v.kind in KINDS for v in found)


# -- the real graph ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(load, tiny_llama_dir, export_to):
    folder = export_to(load(str(tiny_llama_dir)), sink=4, pinned=0, window=24, chunk=8)
    return folder / "decoder.onnx"


def test_the_exported_decoder_parses_for_orin_x(decoder):
    m = onnx.load(str(decoder), load_external_data=False)
    found = check_model(m, "orin-x")
    # No errors. The four int64 index inputs are cast to INT32 by TensorRT 8.6: the runtime must
    # bind INT32 buffers for them on that engine (TensorRT >= 9 takes INT64 natively).
    assert errors(found) == [], format_report(found, "orin-x")
    indices = ("input_ids", "position_ids", "cache_position_ids", "logit_rows")
    assert kinds(found, "warning") == {("dtype", n) for n in indices}
    assert check_file(decoder, "10.3") == []
    for profile in ("jetson-agx-orin-64gb", "jetson-orin-nx-16gb", "thor"):
        assert check_file(decoder, profile) == [], profile
