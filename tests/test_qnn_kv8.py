"""The HTP's 8-bit KV cache (issue 33), compiled by Qualcomm's compiler and run in its x86 simulator:
an int8-KV export built for sa8775p (v73) and sa8295p (v68) holds its cache as uint8 (zero point 128,
one calibrated scale per tensor, the same scale quantizing the new K/V and reading the cache).

Tolerance, measured over test_qnn's stream (prefill in chunks, decode, > 8 windows of eviction,
pinned spans), as (worst, median) of a step's max |logit error| / max |logit|, and top-1 agreement:

    HTP uint8 cache  vs the CPU float32-KV export of the model   0.076 / 0.027 / 94-96%   (v73, v68)
    HTP uint8 cache  vs the CPU build of the same int8 export   0.49  / 0.098 / 81%
    CPU int8 export  vs the CPU float32-KV export                0.44  / 0.091 / 81%
    HTP, pinned spans dropped, vs either                         1.68  / 0.79  / 19-21%

The same int8 export on the CPU (per-channel key scales, per-token value scales) is itself that far
from float32 on this tiny random model; the HTP's one scale per tensor is closer to float32 than it.
So the tests hold the HTP to float32 tightly (FLOAT: fp16 arithmetic plus the 8-bit cache) and to the
CPU int8 build loosely (SAME_EXPORT: the two 8-bit caches' different rounding); a cache without its
pinned spans fails both by far.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from cabinlm.engines.build import build_artifact
from cabinlm.engines.builder import BuildError
from cabinlm.manifest import load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder
from test_backends import LAYOUT

try:
    import onnxruntime_qnn  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("onnxruntime-qnn (the `qnn` extra) is not installed: `pip install 'cabinlm[qnn]'`", allow_module_level=True)

from test_qnn import EXACT, agreement, run_stream, stream_ids  # noqa: E402

FLOAT = (0.12, 0.04, 0.9)  # (worst, median, top-1) against the float32-KV export
SAME_EXPORT = (0.65, 0.14, 0.72)  # against the CPU build of the same int8 export


def close(got, ref, bounds) -> bool:
    worst, median, top1 = agreement(got, ref)
    return worst <= bounds[0] and median <= bounds[1] and top1 >= bounds[2]


@pytest.fixture(scope="module")
def int8_artifact(load, tiny_llama_dir, export_to):
    """What `cabinlm export --profile sa8775p --kv int8` writes for the tiny model."""
    return export_to(load(str(tiny_llama_dir)), kv="int8", weights="int4", **LAYOUT)


@pytest.fixture(scope="module")
def kv8_builds(int8_artifact, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qnn-kv8")
    return {p: build_artifact(int8_artifact, load_profile(p), tmp / p) for p in ("sa8295p", "sa8775p")}


def test_both_chips_compile_the_uint8_cache_and_the_manifest_records_its_scales(kv8_builds, int8_artifact):
    art = load_manifest(int8_artifact)
    keys, values = art.kv_scales.array("keys"), art.kv_scales.array("values")
    for profile in ("sa8295p", "sa8775p"):
        m = load_manifest(kv8_builds[profile])
        q = m.build.facts
        assert q.kv_cache == "uint8" and q.check["same_top1"]
        # one scale per tensor: the largest calibrated channel's
        assert q.kv_scales == {**{f"key_cache.{i}": pytest.approx(float(keys[i].max())) for i in range(2)},
                               **{f"value_cache.{i}": pytest.approx(float(values[i].max())) for i in range(2)}}  # fmt: skip
        cache_io = [t for t in (*m.io.inputs, *m.io.outputs) if "key" in t.name or "value" in t.name]
        assert cache_io and all(t.dtype == "uint8" for t in cache_io)  # no value_scale tensors left
        assert m.quality["calibration"]["ids_sha256"] == art.quality["calibration"]["ids_sha256"]


def test_the_scales_are_tied_in_the_graph(int8_artifact):
    """The rewritten graph quantizes each new K/V with the very constant its cache input is read with."""
    from cabinlm.engines.onnxruntime.offline import read_graph
    from cabinlm.engines.qnn_htp.graph import htp_ready, per_tensor_kv_scales, uint8_kv

    m = load_manifest(int8_artifact)
    g = read_graph(int8_artifact, m)
    htp_ready(g)
    uint8_kv(g, per_tensor_kv_scales(m.kv_scales.array("keys"), m.kv_scales.array("values"), 2))
    producer = {o: n for n in g.graph.node for o in n.output}
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}
    muls = {}  # constant name -> the Mul nodes that read it
    for n in g.graph.node:
        for x in n.input:
            if n.op_type == "Mul" and x in consts:
                muls.setdefault(x, []).append(n.name)
    for i in range(2):
        for cache, new, reader in ((f"key_cache.{i}", f"new_key.{i}", None),
                                   (f"value_cache.{i}", f"new_value.{i}", f"n/layers.{i}/p_cache_scaled")):  # fmt: skip
            q = producer[new]  # new K/V: Div s ─ Clip ─ QuantizeLinear(1, 128)
            assert q.op_type == "QuantizeLinear" and consts[q.input[2]].dtype == np.uint8 and consts[q.input[2]] == 128
            div = producer[producer[q.input[0]].input[0]]
            s = div.input[1]
            assert div.op_type == "Div" and np.unique(consts[s]).size == 1  # one scale per tensor
            # the cache is read back with the same constant: keys DQ(cache) ─ Mul s; values: the
            # attention probabilities over the cached slots ─ Mul s (then the DQ'd codes)
            dq = next(n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == cache)
            assert consts[dq.input[2]] == 128 and consts[dq.input[1]].item() == 1.0
            if reader is None:
                back = next(n for n in g.graph.node if n.op_type == "Mul" and dq.output[0] in n.input)
                assert s in back.input
            else:
                assert reader in muls[s]
            assert len(muls[s]) >= 2  # and the chunk's own new K/V, read back as the cache will hold them


@pytest.mark.parametrize("profile", ["sa8775p", "sa8295p"])
def test_the_uint8_cache_follows_the_cpu_through_prefill_decode_eviction_and_pins(profile, kv8_builds,
                                                                                   int8_artifact, fp32_artifact):
    ids = stream_ids()
    cpu = run_stream(int8_artifact, ids, session_config=EXACT)
    float32 = run_stream(fp32_artifact, ids, session_config=EXACT)
    got = run_stream(kv8_builds[profile], ids)
    assert close(got, float32, FLOAT), (profile, agreement(got, float32))
    assert close(got, cpu, SAME_EXPORT), (profile, agreement(got, cpu))
    if profile == "sa8775p":  # the tolerances have teeth: a cache that lost its pinned spans fails both
        wrong = run_stream(kv8_builds[profile], ids, pins=False)
        assert not close(wrong, float32, FLOAT) and not close(wrong, cpu, SAME_EXPORT), agreement(wrong, cpu)


def test_the_runtime_holds_the_cache_in_uint8_half_the_bytes_of_fp16(kv8_builds, int4_artifact_fp16):
    dec = Decoder(kv8_builds["sa8775p"])
    bufs = dec.backend.buffers()
    assert bufs["keys"].dtype == bufs["values"].dtype == np.uint8 and "value_scales" not in bufs
    assert (bufs["keys"] == 128).all()  # an empty slot holds the zero point
    fp16 = Decoder(int4_artifact_fp16).backend.buffers()
    assert bufs["keys"].nbytes + bufs["values"].nbytes == (fp16["keys"].nbytes + fp16["values"].nbytes) // 2


@pytest.fixture(scope="module")
def fp32_artifact(load, tiny_llama_dir, export_to):
    """The same weights (int4 blocks) with a float32 cache: the float reference of the stream."""
    return export_to(load(str(tiny_llama_dir)), kv="fp32", weights="int4", **LAYOUT)


@pytest.fixture(scope="module")
def int4_artifact_fp16(load, tiny_llama_dir, export_to):
    return export_to(load(str(tiny_llama_dir)), kv="fp16", weights="int4", **LAYOUT)


def test_a_calibration_whose_scale_overflows_fp16_is_refused(int8_artifact):
    from cabinlm.engines.qnn_htp.graph import per_tensor_kv_scales

    m = load_manifest(int8_artifact)
    keys, values = m.kv_scales.array("keys"), m.kv_scales.array("values")
    keys = keys.copy()
    keys[1, 0, 3] = 1000.0  # a key channel of amax 127,000: beyond fp16 once dequantized
    with pytest.raises(BuildError, match=r"key_cache\.1: calibrated KV scale 1000 puts the uint8 cache beyond fp16"):
        per_tensor_kv_scales(keys, values, 2)
    values = values.copy()
    values[0, 1, 0] = np.inf
    with pytest.raises(BuildError, match=r"value_cache\.0: calibrated KV scale inf is no positive number"):
        per_tensor_kv_scales(m.kv_scales.array("keys"), values, 2)


def test_plan_counts_the_uint8_cache_at_half_the_fp16_bytes(tiny_llama_dir, kv8_builds):
    """`cabinlm plan` for the HTP with --kv int8 counts what the HTP backend allocates: one byte per
    K / V element, no value scales (the CPU's int8 KV holds per-token scales beside it)."""
    from cabinlm.layout import KVDType
    from cabinlm.model_config import spec_from_config
    from cabinlm.profiles.planner import plan

    spec = spec_from_config(tiny_llama_dir)
    geometry = dict(window=LAYOUT["window"], sink=LAYOUT["sink"], pinned=LAYOUT["pinned"], chunk=LAYOUT["chunk"])
    for profile in ("sa8295p", "sa8775p"):
        u8 = plan(spec, load_profile(profile), kv=KVDType.INT8, **geometry)
        fp16 = plan(spec, load_profile(profile), kv=KVDType.FP16, **geometry)
        assert u8.kv_bytes * 2 == fp16.kv_bytes
    bufs = Decoder(kv8_builds["sa8775p"]).backend.buffers()
    assert u8.kv_bytes == sum(b.nbytes for b in bufs.values())


def test_a_session_saved_from_the_uint8_cache_resumes_the_same_stream(kv8_builds, tmp_path):
    """A session file of an sa8775p uint8-cache dialogue (window turned over, a pinned span) holds the
    cache's bytes as the HTP backend keeps them; restored into a dialogue of another loaded model, the
    buffers are those bytes and the next steps' logits are the uninterrupted dialogue's, bit for bit
    (the same binary, the same inputs). The cache is copied as bytes: nothing is re-quantized."""
    from cabinlm.runtime import Dialogue, Tokenizer
    from cabinlm.runtime.persist import load_session, save_session

    build = kv8_builds["sa8775p"]
    tok = Tokenizer(build / load_manifest(build).files["tokenizer"].path)
    first = Dialogue(Decoder(build), tok, system="")
    dec = first.decoder
    rng = np.random.default_rng(11)
    dec.feed(rng.integers(3, 300, 5), pin=True)
    for _ in range(LAYOUT["window"] + 6):  # the window turns over
        logits = dec.step(rng.integers(3, 300, 1))
    assert dec.cache.evicted > 0
    save_session(tmp_path / "kv8", first)
    resumed = Dialogue(Decoder(build), tok, system="")
    load_session(tmp_path / "kv8", resumed)
    for name, buf in dec.backend.buffers().items():
        assert buf.dtype == np.uint8 or name not in ("keys", "values"), name
        np.testing.assert_array_equal(resumed.decoder.backend.buffers()[name], buf, err_msg=name)
    for _ in range(8):
        ids = np.array([int(np.asarray(logits).reshape(-1, logits.shape[-1])[-1].argmax())])
        logits = dec.step(ids)
        np.testing.assert_array_equal(resumed.decoder.step(ids), logits)
