"""Device profiles: every built-in loads, a user's file loads, and every bad field is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.manifest import KVDType
from cabinlm.profiles import DeviceProfile, Engine, ProfileError, builtin_profile_text, list_profiles, load_profile

BUILTINS = ["cpu", "jetson-agx-orin-64gb", "jetson-orin-nx-16gb", "orin-x", "sa8295p", "sa8775p", "thor"]
GIB = 1 << 30

USER_PROFILE = """
name = "my-board"
chip = "ACME SoC"
description = "a board on the bench"
memory_total_bytes = "8 GiB"
budget_bytes = "25%"
bandwidth_gbs = 34.1
engine = "onnxruntime"
execution_provider = "CPUExecutionProvider"
max_opset = 17
kv_dtypes = ["int8", "fp16"]
default_kv = "int8"
weight_dtype = "int8"
static_shapes = false
default_sink = 4
default_chunk = 32
runtime_overhead_bytes = 134217728
threads = 4
"""


def write(tmp_path: Path, text: str, name: str = "board.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def replace_line(key: str, line: str | None) -> str:
    """USER_PROFILE with the `key = ...` line replaced (or removed when line is None)."""
    out = [ln for ln in USER_PROFILE.splitlines() if not ln.startswith(f"{key} =")]
    if line is not None:
        out.append(line)
    return "\n".join(out) + "\n"


def test_the_builtins_are_the_seven_targets():
    assert list_profiles() == sorted(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_profile_loads_and_is_consistent(name):
    p = load_profile(name)
    assert p.name == name
    assert 0 < p.budget_bytes <= p.memory_total_bytes
    assert p.default_kv in p.kv_dtypes
    assert p.default_chunk >= 1 and p.default_sink == 4
    if p.engine is Engine.TENSORRT:
        assert p.engine_version and p.execution_provider is None
    else:
        assert p.execution_provider in ("CPUExecutionProvider", "QNNExecutionProvider")
    # every field of a built-in carries a source or a [D]/[?] tag in its comments
    text = builtin_profile_text(name)
    assert "[V]" in text or "[D]" in text


def test_the_facts_the_design_fixes():
    orin = load_profile("orin-x")
    assert orin.engine_version == "8.6" and orin.max_opset == 17
    assert KVDType.FP8 not in orin.kv_dtypes and set(orin.kv_dtypes) == {KVDType.INT8, KVDType.FP16}
    for jetson in ("jetson-agx-orin-64gb", "jetson-orin-nx-16gb"):
        assert load_profile(jetson).engine_version == "10.3"
    assert KVDType.FP8 in load_profile("thor").kv_dtypes
    for qc in ("sa8295p", "sa8775p"):
        p = load_profile(qc)
        assert p.static_shapes and p.execution_provider == "QNNExecutionProvider"
        assert set(p.kv_dtypes) == {KVDType.INT8, KVDType.FP16}
    assert "v68" in load_profile("sa8295p").chip and "v73" in load_profile("sa8775p").chip


def test_the_cpu_profile_measures_the_host():
    p = load_profile("cpu")
    assert p.memory_total_bytes > 256 << 20
    assert p.budget_bytes == p.memory_total_bytes // 2


def test_a_user_toml_loads_with_sizes_and_percentages(tmp_path):
    p = load_profile(write(tmp_path, USER_PROFILE))
    assert isinstance(p, DeviceProfile)
    assert p.memory_total_bytes == 8 * GIB and p.budget_bytes == 2 * GIB
    assert p.kv_dtypes == (KVDType.INT8, KVDType.FP16) and p.threads == 4
    assert p.source.endswith("board.toml")
    assert p.to_dict()["kv_dtypes"] == ["int8", "fp16"]


def test_an_unknown_name_lists_the_builtins():
    with pytest.raises(ProfileError) as e:
        load_profile("orin-y")
    for name in BUILTINS:
        assert name in str(e.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "nope.toml")


# Each invalid file breaks exactly one field; the error must name that field (and the file).
INVALID = [
    ("memory_total_bytes", 'memory_total_bytes = "8 parsecs"'),
    ("memory_total_bytes", "memory_total_bytes = -5"),
    ("budget_bytes", 'budget_bytes = "16 GiB"'),  # more than the 8 GiB total
    ("budget_bytes", 'budget_bytes = "auto"'),
    ("bandwidth_gbs", "bandwidth_gbs = 0"),
    ("engine", 'engine = "tflite"'),
    ("execution_provider", 'execution_provider = "CUDAExecutionProvider"'),
    ("engine_version", 'engine_version = "ten"'),
    ("max_opset", "max_opset = 99"),
    ("kv_dtypes", 'kv_dtypes = ["int8", "bf16"]'),
    ("kv_dtypes", "kv_dtypes = []"),
    ("default_kv", 'default_kv = "fp32"'),  # not in kv_dtypes
    ("weight_dtype", 'weight_dtype = "int3"'),
    ("static_shapes", 'static_shapes = "yes"'),
    ("default_chunk", "default_chunk = 0"),
    ("default_sink", "default_sink = -1"),
    ("threads", "threads = 0"),
    ("name", 'name = "my board!"'),
    ("runtime_overhead_bytes", "runtime_overhead_bytes = true"),
]


@pytest.mark.parametrize("field,line", INVALID, ids=[f"{f}:{ln.split('=', 1)[1].strip()}" for f, ln in INVALID])
def test_an_invalid_field_is_named(tmp_path, field, line):
    path = write(tmp_path, replace_line(field, line))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    message = str(e.value)
    assert f"'{field}'" in message and str(path) in message
    assert isinstance(e.value, CabinlmError)


def test_a_missing_field_is_named(tmp_path):
    with pytest.raises(ProfileError, match="missing field 'chip'"):
        load_profile(write(tmp_path, replace_line("chip", None)))


def test_an_unknown_field_is_named(tmp_path):
    with pytest.raises(ProfileError, match="unknown field 'budget_gb'"):
        load_profile(write(tmp_path, USER_PROFILE + "budget_gb = 3\n"))


def test_a_toml_syntax_error_is_reported(tmp_path):
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(write(tmp_path, USER_PROFILE + "kv_dtypes = [\n"))


def test_tensorrt_profiles_refuse_what_their_version_cannot_run(tmp_path):
    trt = replace_line("engine", 'engine = "tensorrt"\nengine_version = "8.6"')
    trt = "\n".join(ln for ln in trt.splitlines() if not ln.startswith("execution_provider"))
    load_profile(write(tmp_path, trt))  # the base file is valid
    with pytest.raises(ProfileError, match="'kv_dtypes'.*TensorRT >= 9"):
        fp8 = trt.replace('kv_dtypes = ["int8", "fp16"]', 'kv_dtypes = ["int8", "fp16", "fp8"]')
        load_profile(write(tmp_path, fp8, "fp8.toml"))
    with pytest.raises(ProfileError, match="'weight_dtype'.*TensorRT >= 10"):
        load_profile(write(tmp_path, trt.replace('weight_dtype = "int8"', 'weight_dtype = "int4"'), "int4.toml"))
    with pytest.raises(ProfileError, match="'engine_version'"):
        no_version = "\n".join(ln for ln in trt.splitlines() if not ln.startswith("engine_version"))
        load_profile(write(tmp_path, no_version, "noversion.toml"))


def test_profiles_need_only_the_standard_library():
    config = Path(__file__).parent / "data" / "configs" / "smollm2-135m.json"
    blocked = ("numpy", "onnx", "onnxruntime", "torch", "transformers")
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r}))\n"
        "from cabinlm.profiles import load_profile, list_profiles\n"
        "from cabinlm.source.config import spec_from_config\n"
        "from cabinlm.profiles.planner import plan\n"
        "[load_profile(n) for n in list_profiles()]\n"
        f"assert plan(spec_from_config({str(config)!r}), load_profile('cpu')).fits"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
