"""The manifest's and the model config's values checked for range, not only type.

What the earlier hostile-manifest test (test_manifest.py) could not catch: it asked only that a
replaced value give a ManifestError or a manifest that describes itself again. A stop id of 10**30, a
NaN frequency or a KV scale of 1e30 did describe itself again, and the replies ran on into a made-up
user turn or came back empty. Here the loaded manifest's values must also be ones the runtime can use.
The config cases go through `cabinlm plan` as a user runs it (a subprocess: one line, exit 2, no
traceback) and, generated, through the functions it calls.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cabinlm.contract.buildspec import BuildSpec, SessionSettings
from cabinlm.contract.errors import CabinlmError, ManifestError
from cabinlm.contract.manifest import Manifest, load_manifest

# Stated here, not imported: a KV scale is stored as an fp16 and floored at its smallest subnormal
# (export/kvquant.py); a RoPE table's cos / sin factor is near 1 (YaRN's attention factor).
KV_SCALES = (2.0**-24, 65504.0)
ROPE_SCALE_MAX = 16.0
# Session entries that make ONNX Runtime write or read files or load another format: never accepted.
DANGEROUS = {"session.load_model_format", "session.optimized_model_external_initializers_file_name", "ep.context_enable",
             "ep.context_file_path", "session.use_ort_model_bytes_directly"}  # fmt: skip


@pytest.fixture(scope="module")
def artifact(load, tiny_qwen2_dir, export_to) -> Path:
    return export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")


@pytest.fixture(scope="module")
def manifest_dict(artifact) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def cabinlm(*args, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cabinlm", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def one_error_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), p.stderr[-3000:]
    return errors[0]


# -- the manifest's values, by range ---------------------------------------------------------------

numbers = (st.integers(-(10**40), 10**40) | st.floats() | st.sampled_from([10**30, -5, 0, 1e30, 1e-40, -0.0, 2**63])
           | st.text(max_size=4) | st.none() | st.booleans())  # fmt: skip


def usable(m: Manifest) -> None:
    """What the runtime needs of the values it reads (the checks' contract, stated independently)."""
    vocab = m.model.vocab_size
    assert m.stop_ids and all(type(i) is int and 0 <= i < vocab for i in m.stop_ids), m.stop_ids
    for table in (m.rotary.inv_freq, m.rotary.local_inv_freq):
        assert all(math.isfinite(f) and 0 < f <= 1 for f in table)
    assert all(math.isfinite(s) and 0 < s <= ROPE_SCALE_MAX for s in (m.rotary.scale, m.rotary.local_scale))
    low, high = KV_SCALES
    for name in ("keys", "rotated_keys", "values"):
        assert all(low <= x <= high for layer in getattr(m.kv_scales, name) for head in layer for x in head)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_values_give_a_manifest_error_or_values_the_runtime_can_use(manifest_dict, data):
    d = copy.deepcopy(manifest_dict)
    where = data.draw(st.sampled_from(["stop_ids", "stop_id", "inv_freq", "scale", "local_scale", "kv_scale"]))
    if where == "stop_ids":
        d["stop_ids"] = data.draw(st.lists(numbers, max_size=3) | numbers)
    elif where == "stop_id":  # one id among good ones
        d["stop_ids"] = [*d["stop_ids"], data.draw(numbers)]
    elif where == "inv_freq":
        i = data.draw(st.integers(0, len(d["rotary"]["inv_freq"]) - 1))
        d["rotary"]["inv_freq"][i] = data.draw(numbers)
    elif where in ("scale", "local_scale"):
        d["rotary"][where] = data.draw(numbers)
    else:
        table = data.draw(st.sampled_from(["keys", "rotated_keys", "values"]))
        layer = data.draw(st.integers(0, len(d["kv_scales"][table]) - 1))
        d["kv_scales"][table][layer][0][0] = data.draw(numbers)
    try:
        m = Manifest.from_dict(json.loads(json.dumps(d)))  # as a file would hand it over (NaN and inf included)
    except ManifestError:
        return
    usable(m)


@pytest.mark.parametrize("field, value, needle", [
    ("stop_ids", [10**30], "stop_ids"), ("stop_ids", [-5], "stop_ids"), ("stop_ids", [], "stop_ids"),
    ("stop_ids", [2.0], "stop_ids"), ("stop_ids", ["2"], "stop_ids"),
    ("inv_freq", float("nan"), "inv_freq"), ("inv_freq", 1e30, "inv_freq"), ("inv_freq", -1.0, "inv_freq"),
    ("scale", float("inf"), "scale"), ("scale", 1e30, "scale"), ("scale", 0, "scale"),
    ("kv_scale", 1e30, "kv_scales"), ("kv_scale", float("inf"), "kv_scales"), ("kv_scale", 1e-40, "kv_scales"),
])  # fmt: skip
def test_each_hostile_value_of_the_issue_is_named(manifest_dict, field, value, needle):
    d = copy.deepcopy(manifest_dict)
    if field == "stop_ids":
        d["stop_ids"] = value
    elif field == "inv_freq":
        d["rotary"]["inv_freq"][1] = value
    elif field == "scale":
        d["rotary"]["scale"] = value
    else:
        d["kv_scales"]["values"][0][0][0] = value
    with pytest.raises(ManifestError, match=needle):
        Manifest.from_dict(d)


def test_a_manifest_with_a_5000_digit_number_is_one_line(artifact, tmp_path):
    import shutil

    bad = tmp_path / "a"
    shutil.copytree(artifact, bad)
    text = (bad / "manifest.json").read_text()
    (bad / "manifest.json").write_text(text.replace('"opset": ', '"opset": ' + "9" * 5000 + ", \"x\": ", 1))
    with pytest.raises(ManifestError, match="corrupt manifest"):
        load_manifest(bad)
    one_error_line(cabinlm("chat", bad), "corrupt manifest")


def test_a_manifest_path_instead_of_its_folder_says_to_pass_the_folder(artifact):
    one_error_line(cabinlm("chat", artifact / "manifest.json"), "pass the folder", str(artifact))
    one_error_line(cabinlm("serve", artifact / "manifest.json", "--port", "0"), "pass the folder")


# -- the session's threads and config entries, before ONNX Runtime sees them ----------------------


def spec_with(**session) -> BuildSpec:
    return dataclasses.replace(BuildSpec.for_export(), session=SessionSettings(**session))


def test_a_thread_count_beyond_the_machine_is_refused_before_onnx_runtime_starts_them():
    import os

    from cabinlm.engines.backend import BackendError
    from cabinlm.engines.onnxruntime.session import session_options
    from cabinlm.contract.buildspec import THREADS_PER_CORE

    most = THREADS_PER_CORE * (os.cpu_count() or 1)
    session_options(spec_with(intra_op_num_threads=most))
    with pytest.raises(BackendError, match=f"intra_op_num_threads {most + 1}: this machine has"):
        session_options(spec_with(intra_op_num_threads=most + 1))
    assert session_options(spec_with(intra_op_num_threads=1024), threads=1).intra_op_num_threads == 1  # --threads decides


config_keys = st.sampled_from(["session.set_denormal_as_zero", "session.intra_op.allow_spinning",
                               "session.qdq_matmulnbits_accuracy_level", "session.load_model_format",
                               "session.optimized_model_external_initializers_file_name", "ep.context_enable",
                               "ep.context_file_path", "session.use_ort_model_bytes_directly",
                               "session.intra_op_thread_affinities", ""]) | st.text(max_size=12)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(entries=st.dictionaries(config_keys, st.text(max_size=6) | st.sampled_from(["0", "1", "4", "ORT", "/tmp/x"]),
                               max_size=3))  # fmt: skip
def test_session_config_entries_are_refused_unless_a_build_sets_them_with_a_value_they_take(entries):
    from cabinlm.engines.backend import BackendError
    from cabinlm.engines.onnxruntime.session import MANIFEST_CONFIG_ENTRIES, session_options

    spec = spec_with(config=entries)
    if set(entries) & DANGEROUS:
        with pytest.raises(BackendError, match="build.session.config"):
            session_options(spec)
        return
    fine = all(k in MANIFEST_CONFIG_ENTRIES and MANIFEST_CONFIG_ENTRIES[k].fullmatch(v) for k, v in entries.items())
    if fine:
        so = session_options(spec)
        assert all(so.get_session_config_entry(k) == v for k, v in entries.items())
    else:
        with pytest.raises(BackendError, match="build.session.config"):
            session_options(spec)


def test_a_build_asking_for_1024_threads_is_one_line_not_a_minute(artifact, tmp_path):
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    out = build_artifact(artifact, load_profile("cpu"), tmp_path / "b", attention="graph")
    d = json.loads((out / "manifest.json").read_text())
    d["build"]["session"]["intra_op_num_threads"] = 1024
    (out / "manifest.json").write_text(json.dumps(d))
    one_error_line(cabinlm("chat", out, stdin="hi\n"), "1024", "this machine has")
    d["build"]["session"]["intra_op_num_threads"] = None
    d["build"]["session"]["config"] = {"ep.context_file_path": "/tmp/written-by-a-manifest"}
    (out / "manifest.json").write_text(json.dumps(d))
    one_error_line(cabinlm("chat", out, stdin="hi\n"), "ep.context_file_path")


# -- the model config: every parse of untrusted JSON, one line -------------------------------------


@pytest.fixture(scope="module")
def config(tiny_qwen2_dir) -> dict:
    return json.loads((tiny_qwen2_dir / "config.json").read_text())


PLAN_CASES = {
    "a 5000-digit integer": lambda c: json.dumps(c).replace(f'"hidden_size": {c["hidden_size"]}',
                                                             '"hidden_size": ' + "9" * 5000),
    "100,000-deep nesting": lambda c: json.dumps(c)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    'rope_scaling: "fast"': lambda c: json.dumps({**c, "rope_scaling": "fast"}),
    "rms_norm_eps inf": lambda c: json.dumps({**c, "rms_norm_eps": float("inf")}),
    "vocab_size 1e30": lambda c: json.dumps({**c, "vocab_size": 1e30}),
    "rms_norm_eps a string": lambda c: json.dumps({**c, "rms_norm_eps": "small"}),
    "partial_rotary_factor a list": lambda c: json.dumps({**c, "partial_rotary_factor": [1]}),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_cabinlm_plan_on_a_hostile_config_prints_one_line(config, tmp_path, case):
    (tmp_path / "config.json").write_text(PLAN_CASES[case](config))
    one_error_line(cabinlm("plan", tmp_path), str(tmp_path / "config.json"))


def _plan(folder: Path) -> None:
    """What `cabinlm plan FOLDER` runs, in process."""
    from cabinlm.cli.export import model_facts
    from cabinlm.export.options import ExportRequest, check_profile_request
    from cabinlm.profiles import load_profile
    from cabinlm.profiles.planner import plan

    spec, vision, image = model_facts(str(folder))
    device = load_profile("cpu")
    check_profile_request(spec, device, ExportRequest(pinned=124), image)
    plan(spec, device, pinned=124, vision_params=vision, image_tokens=image)


config_values = st.recursive(numbers | st.sampled_from(["fast", "linear", "", "silu"]),
                             lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3),
                             max_leaves=6)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_config_value_is_a_cabinlm_error_or_a_plan(config, tmp_path_factory, data):
    """Any key of the model's config (and the RoPE and vision keys a config may hold) given any JSON
    value: `cabinlm plan` refuses it with a CabinlmError (one line) or plans, never another exception."""
    keys = sorted(config) + ["rope_scaling", "partial_rotary_factor", "head_dim", "sliding_window", "layer_types",
                             "vision_config", "text_config", "num_key_value_heads", "rope_parameters"]  # fmt: skip
    key = data.draw(st.sampled_from(keys))
    c = {**config, key: data.draw(config_values)}
    folder = tmp_path_factory.mktemp("config")
    (folder / "config.json").write_text(json.dumps(c))
    try:
        _plan(folder)
    except CabinlmError:
        pass


# -- session headers --------------------------------------------------------------------------------


def test_a_session_header_with_a_5000_digit_number_or_a_damaged_size_says_what_is_wrong(artifact, tmp_path):
    from cabinlm.runtime import Dialogue, open_artifact
    from cabinlm.runtime.persist import HEADER_BYTES, SessionError, load_session, save_session

    dec, tok = open_artifact(artifact, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=4)
    d.ask("hello")
    save_session(tmp_path / "s", d)
    raw = (tmp_path / "s").read_bytes()
    damaged = raw[:12] + (HEADER_BYTES + 8).to_bytes(4, "little") + raw[16:]
    (tmp_path / "s").write_bytes(damaged)
    with pytest.raises(SessionError, match="header size") as e:
        load_session(tmp_path / "s", d)
    assert "format version" not in str(e.value)
    header = raw[16 : 16 + HEADER_BYTES].decode().rstrip()
    forged = header.replace('"turns": 1', '"turns": ' + "9" * 5000, 1).encode()
    assert forged != header.encode() and len(forged) <= HEADER_BYTES
    body = raw[:16] + forged.ljust(HEADER_BYTES, b" ") + raw[16 + HEADER_BYTES : -32]
    (tmp_path / "s").write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(SessionError, match="unreadable session header"):
        load_session(tmp_path / "s", d)
