"""Export options: typed (enums, not strings), checked once as they are made, with messages that name
the option and the value; what the user set explicitly is kept apart from what a profile plans."""

from __future__ import annotations

from pathlib import Path

import pytest

from cabinlm.contract.errors import CabinlmError
from cabinlm.export import ExportOptions, ExportRequest, options_for_profile
from cabinlm.source.config import spec_from_config
from cabinlm.contract.precision import KVDType, WeightFormat
from cabinlm.profiles import load_profile
from cabinlm.profiles.planner import PlanError

SMOLLM2 = spec_from_config(Path(__file__).parent / "data" / "configs" / "smollm2-135m.json")


def test_values_given_as_strings_are_held_as_enums():
    o = ExportOptions(kv="int8", weights="int4", head="int4", calib=__file__)
    assert o.kv is KVDType.INT8 and o.weights is WeightFormat.INT4 and o.head is WeightFormat.INT4
    assert o.calib == Path(__file__)
    r = ExportRequest(kv="fp8", weights="int8")
    assert r.kv is KVDType.FP8 and r.weights is WeightFormat.INT8 and r.head is None


BAD = [
    (dict(sink=-1), ["--sink", "-1"]),
    (dict(pinned=-4), ["--pinned", "-4"]),
    (dict(window=0), ["--window", "0"]),
    (dict(chunk=0), ["--chunk", "0"]),
    (dict(window=64, chunk=128), ["--chunk 128", "--window 64"]),
    (dict(sink="4"), ["--sink", "'4'"]),
    (dict(kv="int4"), ["--kv", "'int4'", "fp32, fp16, int8, fp8"]),
    (dict(weights="fp16"), ["--weights fp16", "fp32, int8 or int4", "builds"]),
    (dict(weights="int8", head="fp32"), ["--head fp32", "int8 or int4"]),
    (dict(weights="fp32", head="int4"), ["--head int4", "fp32", "--weights int8 or int4"]),
    (dict(max_ppl_increase=0.0), ["--max-ppl-increase", "0.0"]),
    (dict(max_ppl_increase=-50.0), ["--max-ppl-increase", "-50.0"]),
    (dict(max_ppl_increase=float("inf")), ["--max-ppl-increase", "inf"]),
    (dict(calib="no-such-calibration.txt"), ["--calib no-such-calibration.txt", "no such file"]),
]


@pytest.mark.parametrize("kind", [ExportOptions, ExportRequest])
@pytest.mark.parametrize("values, needles", BAD, ids=[str(v) for v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_option_and_the_value(kind, values, needles):
    with pytest.raises(CabinlmError) as e:
        kind(**values)
    for needle in needles:
        assert needle in str(e.value)


def test_the_opset_is_checked_against_what_the_kv_and_weights_need():
    assert ExportOptions().resolved_opset == 17
    assert ExportOptions(kv="fp8").resolved_opset == 19
    assert ExportOptions(weights="int4", kv="fp8").resolved_opset == 21
    with pytest.raises(CabinlmError, match="opset 17 is too old: fp8 KV needs ONNX opset 19"):
        ExportOptions(kv="fp8", opset=17)
    with pytest.raises(CabinlmError, match="opset 19 is too old: int8 weights need ONNX opset 21"):
        ExportOptions(weights="int8", opset=19)


def test_without_a_profile_a_request_takes_the_defaults_for_what_it_leaves_out():
    assert ExportRequest().options() == ExportOptions()
    o = ExportRequest(window=64, chunk=16, kv="int8", force=True).options()
    assert (o.sink, o.pinned, o.window, o.chunk, o.kv, o.force) == (4, 124, 64, 16, KVDType.INT8, True)
    # a chunk larger than the default window is refused once the default fills the window in
    with pytest.raises(CabinlmError, match="--chunk 2048 is larger than --window 1020"):
        ExportRequest(chunk=2048).options()


def test_with_a_profile_what_the_request_leaves_out_comes_from_the_plan():
    # thor plans a window of several 512-token chunks; a 2048-token chunk is fine there, though not
    # with the default window: the request must not be completed with defaults before planning
    o = options_for_profile(SMOLLM2, load_profile("thor"), ExportRequest(chunk=2048))
    assert o.chunk == 2048 and o.window >= 2048 and o.window % 2048 == 0
    assert o.kv is KVDType.FP16 and o.profile == "thor" and o.plan["window"] == o.window
    assert o.index_dtype == "int32"  # TensorRT
    kept = options_for_profile(SMOLLM2, load_profile("cpu"), ExportRequest(sink=2, kv="fp32", window=256))
    assert (kept.sink, kept.kv, kept.window) == (2, KVDType.FP32, 256)


def test_a_head_width_needs_quantized_weights_from_the_request_or_the_plan():
    cpu = options_for_profile(SMOLLM2, load_profile("cpu"), ExportRequest(head="int4"))
    assert cpu.weights is WeightFormat.INT4 and cpu.head is WeightFormat.INT4  # the cpu plan quantizes
    with pytest.raises(CabinlmError, match="--head int4 .* fp32: give --weights int8 or int4"):
        options_for_profile(SMOLLM2, load_profile("thor"), ExportRequest(head="int4"))  # TensorRT: fp32 graph


def test_a_profile_holding_fp16_weights_gets_an_fp32_graph(tmp_path):
    """fp16 is an engine's build-time weight precision: a profile may name it, the graph stays fp32
    (and the planner counts 2 bytes per parameter, the tied token table twice: an ONNX Runtime CPU
    build gathers from it and prepacks it again as the output projection)."""
    toml = tmp_path / "fp16.toml"
    toml.write_text(
        'name = "fp16-board"\nchip = "c"\ndescription = "d"\nmemory_total_bytes = "8 GiB"\nbudget_bytes = "4 GiB"\n'
        'bandwidth_gbs = 50\nengine = "onnxruntime"\nexecution_provider = "CPUExecutionProvider"\nmax_opset = 21\n'
        'kv_dtypes = ["fp16"]\ndefault_kv = "fp16"\nweight_dtype = "fp16"\nstatic_shapes = false\n'
        "default_sink = 4\ndefault_chunk = 64\nruntime_overhead_bytes = 0\n"
    )
    profile = load_profile(toml)
    assert profile.weight_dtype is WeightFormat.FP16
    o = options_for_profile(SMOLLM2, profile, ExportRequest())
    assert o.weights is WeightFormat.FP32
    table = SMOLLM2.vocab_size * SMOLLM2.hidden_size
    norms = SMOLLM2.num_layers * 2 * SMOLLM2.hidden_size + SMOLLM2.hidden_size  # float32, 2 more bytes each
    assert o.plan["weights_bytes"] == (o.plan["parameters"] + table + norms) * 2


def test_a_kv_precision_the_profile_cannot_run_is_refused():
    with pytest.raises(PlanError, match="fp8 is not available on profile orin-x"):
        options_for_profile(SMOLLM2, load_profile("orin-x"), ExportRequest(kv="fp8"))
