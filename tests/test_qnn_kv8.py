"""The HTP's 8-bit KV cache, compiled by Qualcomm's compiler and run in its x86 simulator:
an int8-KV export built for sa8775p (v73) and sa8295p (v68) holds its cache as uint8 (zero point 128,
one calibrated scale per tensor, the same scale quantizing the new K/V and reading the cache), with
keys rotated once, when written, at their virtual positions; the runtime re-rotates the sink and
pinned keys from their un-rotated fp16 copy after evicting steps (engines/qnn_htp/rotated_graph.py).

Tolerance, measured over test_qnn's stream (prefill in chunks, decode, > 8 windows of eviction,
pinned spans, one of them younger than window tokens), as (worst, median) of a step's max |logit
error| / max |logit|, and top-1 agreement (161 steps):

    HTP uint8 cache, rotated keys  vs the CPU float32-KV export   0.064 / 0.027 / 92%   v73
                                                                  0.057 / 0.026 / 93%   v68
    HTP uint8 cache, rotated keys  vs the CPU build of the same   0.48  / 0.097 / 79%   (both)
                                   int8 export
    CPU int8 export  vs the CPU float32-KV export                 0.44  / 0.091 / 81%
    HTP, pinned spans dropped, vs either                          1.66  / 0.79  / 19-20%
    HTP, sink / pinned keys not re-rotated as E grows, vs float32 1.73  / 0.73  / 32%   (measured once,
                                                                  by patching the refresh; not a test)
    (un-rotated keys, the build before: 0.076 / 0.027 / 94-96% against float32)

The same int8 export on the CPU (per-channel key scales, per-token value scales) is itself that far
from float32 on this tiny random model; the HTP's one scale per tensor is closer to float32 than it.
So the tests hold the HTP to float32 tightly (FLOAT: fp16 arithmetic plus the 8-bit cache) and to the
CPU int8 build loosely (SAME_EXPORT: the two 8-bit caches' different rounding); a cache without its
pinned spans fails both by far, and test_the_sink_and_pinned_keys_are_their_copies_rotated_at_rank_plus_e
checks the refresh's bytes directly. This random model cannot tell rotated from un-rotated keys apart
on perplexity (SmolLM2 can: docs/results.md, "The HTP in the simulator").
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from cabinlm.engines.build import build_artifact
from cabinlm.contract.errors import BuildError
from cabinlm.contract.manifest import load_manifest
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
    from cabinlm.engines.qnn_htp.rotated_graph import pair_bounds

    art = load_manifest(int8_artifact)
    keys, values = art.kv_scales.array("keys"), art.kv_scales.array("values")
    for profile in ("sa8295p", "sa8775p"):
        m = load_manifest(kv8_builds[profile])
        q = m.build.facts
        assert q.kv_cache == "uint8" and q.rotated_keys and q.check["same_top1"]
        # one scale per tensor: values the largest calibrated channel's; rotated keys the largest
        # rotation pair's bound, sqrt(s_i^2 + s_(i+Dh/2)^2), above the largest channel
        half = keys.shape[-1] // 2
        bound = [float(np.sqrt(keys[i][:, :half] ** 2 + keys[i][:, half:] ** 2).max()) for i in range(2)]
        assert q.kv_scales == {**{f"key_cache.{i}": pytest.approx(bound[i]) for i in range(2)},
                               **{f"value_cache.{i}": pytest.approx(float(values[i].max())) for i in range(2)}}  # fmt: skip
        assert all(bound[i] > keys[i].max() for i in range(2)) and np.allclose(pair_bounds(keys).max(axis=(1, 2)), bound)
        cache_io = [t for t in (*m.io.inputs, *m.io.outputs) if t.name.split(".")[0] in
                    ("key_cache", "value_cache", "new_key", "new_value")]  # fmt: skip
        assert len(cache_io) == 8 and all(t.dtype == "uint8" for t in cache_io)
        names = {t.name: t for t in (*m.io.inputs, *m.io.outputs)}
        assert not any("value_scale" in n or "position_ids" in n for n in names)  # rotated: no ranks in
        assert names["rope_cos"].shape == names["rope_sin"].shape == ("tokens", 8)  # head_dim / 2
        assert [names[f"new_key_source.{i}"].dtype for i in range(2)] == ["float16"] * 2
        assert m.quality.calibration["ids_sha256"] == art.quality.calibration["ids_sha256"]


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
    # beside it, the sink / pinned keys' un-rotated fp16 copy: (layers, kv_heads, sink + pinned, head_dim)
    assert set(bufs) == {"keys", "values", "key_source"}
    assert bufs["key_source"].dtype == np.float16 and bufs["key_source"].shape == (2, 2, LAYOUT["sink"] + LAYOUT["pinned"], 16)


def test_the_rotated_graph_rounds_each_key_once_after_its_rotation(int8_artifact):
    """After rotated_graph.rotate_cached_keys: the chunk's keys are rotated (with the runtime's rows,
    no position input left) before the Div by the one key scale that quantizes them; the scores read
    them back as the cache holds them, and the cache itself unrotated; the un-rotated keys leave as
    fp16 new_key_source."""
    from cabinlm.contract import io_spec as io
    from cabinlm.engines.onnxruntime.offline import read_graph
    from cabinlm.engines.qnn_htp.graph import htp_ready, uint8_kv
    from cabinlm.engines.qnn_htp.rotated_graph import rotate_cached_keys, rotated_key_scales

    m = load_manifest(int8_artifact)
    g = read_graph(int8_artifact, m)
    htp_ready(g)
    scales = rotated_key_scales(m.kv_scales.array("keys"), m.kv_scales.array("values"), 2)
    uint8_kv(g, scales)
    assert rotate_cached_keys(g, 16) == ["new_key_source.0", "new_key_source.1"]
    names = {t.name for t in g.graph.input}
    assert {"rope_cos", "rope_sin"} <= names and not names & {"position_ids", "cache_position_ids"}
    producer = {o: n for n in g.graph.node for o in n.output}
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}
    readers = {}
    for n in g.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    for i in range(2):
        q = producer[f"new_key.{i}"]
        div = producer[producer[q.input[0]].input[0]]
        assert div.op_type == "Div" and np.unique(consts[div.input[1]]).item() == pytest.approx(scales[f"key_cache.{i}"])
        rope = producer[div.input[0]]  # rotated, then rounded
        assert rope.name == io.chunk_key_rope(i) and rope.op_type == "Add"
        source = producer[f"new_key_source.{i}"]
        split = next(n for n in g.graph.node if n.name == f"{io.chunk_key_rope(i)}/half")
        assert source.op_type == "Cast" and split.input[0] == source.input[0]  # the same un-rotated keys
        for cache in (f"key_cache.{i}", f"new_key.{i}"):  # DQ ─ Mul s ─ Transpose into the scores: no rotation
            dq = next(n for n in readers[cache] if n.op_type == "DequantizeLinear")
            mul = readers[dq.output[0]][0]
            assert mul.op_type == "Mul" and div.input[1] in mul.input
            assert [n.op_type for n in readers[mul.output[0]]] == ["Transpose"]
    assert not any(n.name.startswith(io.cached_key_rope(0)) for n in g.graph.node)


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
    K / V element, no value scales (the CPU's int8 KV holds per-token scales beside it), and the
    rotated keys' fp16 copy of the sink and pinned keys."""
    from cabinlm.contract.layout import KVDType
    from cabinlm.source.config import spec_from_config
    from cabinlm.profiles.planner import plan

    spec = spec_from_config(tiny_llama_dir)
    geometry = dict(window=LAYOUT["window"], sink=LAYOUT["sink"], pinned=LAYOUT["pinned"], chunk=LAYOUT["chunk"])
    source = 2 * 2 * (LAYOUT["sink"] + LAYOUT["pinned"]) * 16 * 2  # the sink / pinned keys' fp16 copy
    for profile in ("sa8295p", "sa8775p"):
        u8 = plan(spec, load_profile(profile), kv=KVDType.INT8, **geometry)
        fp16 = plan(spec, load_profile(profile), kv=KVDType.FP16, **geometry)
        assert (u8.kv_bytes - source) * 2 == fp16.kv_bytes
    bufs = Decoder(kv8_builds["sa8775p"]).backend.buffers()
    assert u8.kv_bytes == sum(b.nbytes for b in bufs.values())


def test_a_session_saved_from_the_uint8_cache_resumes_the_same_stream(kv8_builds, tmp_path):
    """A session file of an sa8775p uint8-cache dialogue (window turned over, pinned spans, one younger
    than window tokens) holds the cache's bytes as the HTP backend keeps them, the sink / pinned keys'
    un-rotated copy included; restored into a dialogue of another loaded model, the buffers are those
    bytes and the next steps' logits are the uninterrupted dialogue's, bit for bit (the same binary,
    the same inputs; the first step re-rotates the sink / pinned keys from the restored copy). The
    cache is copied as bytes: nothing is re-quantized."""
    session_resumes_the_same_stream(kv8_builds["sa8775p"], tmp_path)


def session_resumes_the_same_stream(build, tmp_path) -> None:
    """The session test above on any rotated-key uint8-cache build (test_qnn_a16's too)."""
    from cabinlm.runtime import Dialogue, Tokenizer
    from cabinlm.runtime.persist import load_session, save_session

    tok = Tokenizer(build / load_manifest(build).files["tokenizer"].path)
    first = Dialogue(Decoder(build), tok, system="")
    dec = first.decoder
    rng = np.random.default_rng(11)
    dec.feed(rng.integers(3, 300, 5), pin=True)
    for _ in range(LAYOUT["window"] + 6):  # the window turns over
        logits = dec.step(rng.integers(3, 300, 1))
    dec.feed(rng.integers(3, 300, 2), pin=True)  # a pinned span younger than window tokens
    for _ in range(3):
        logits = dec.step(rng.integers(3, 300, 1))
    assert dec.cache.evicted > 0 and dec.cache.pinned_fill == 5  # sink 2 + 3 pinned, then 2 more
    assert (dec.backend.buffers()["key_source"][:, :, : LAYOUT["sink"] + 5] != 0).any(axis=(0, 1, 3)).all()
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


def test_the_sink_and_pinned_keys_are_their_copies_rotated_at_rank_plus_e(kv8_builds):
    """After evicting steps, with a pinned span younger than window tokens (its rank falls as older
    window tokens go), the cache's sink / pinned rows hold, byte for byte (to one code where float32
    and float64 round a half differently), their un-rotated copy rotated at rank + E in float64,
    divided by the key tensor's one scale, rounded, + 128: the state the last step ran with. Rotated
    at the rank alone (E left out), the bytes differ."""
    sink_and_pinned_keys_are_rotated_at_rank_plus_e(kv8_builds["sa8775p"])


def sink_and_pinned_keys_are_rotated_at_rank_plus_e(build) -> None:
    """The test above on any rotated-key uint8-cache build (test_qnn_a16's too)."""
    m = load_manifest(build)
    dec = Decoder(build)
    rng = np.random.default_rng(5)
    dec.feed(rng.integers(3, 300, 6), pin=True)  # sink 2 + 4 pinned
    for _ in range(2 * LAYOUT["window"]):
        dec.step(rng.integers(3, 300, 1))
    dec.feed(rng.integers(3, 300, 2), pin=True)  # younger than every window token
    for _ in range(4):
        plan = dec.cache.plan(1)  # what the next step runs with (nothing changes yet)
        dec.step(rng.integers(3, 300, 1))
    assert plan.evicted > LAYOUT["window"] and plan.pinned_fill == 6
    slots = np.concatenate([np.arange(LAYOUT["sink"]), LAYOUT["sink"] + np.arange(6)])
    ranks = plan.cache_position_ids[slots]
    assert ranks[-1] > ranks[-3] + 1  # the young span comes after window tokens
    bufs = dec.backend.buffers()
    inv_freq = np.asarray(m.rotary.inv_freq, np.float64)
    half = len(inv_freq)
    scales = np.array([m.build.facts.kv_scales[f"key_cache.{i}"] for i in range(2)])[:, None, None, None]

    def codes(positions):
        angle = positions[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angle) * m.rotary.scale, np.sin(angle) * m.rotary.scale
        x = bufs["key_source"][:, :, slots].astype(np.float64) / scales
        x1, x2 = x[..., :half], x[..., half:]
        rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return np.clip(np.rint(rotated), -127, 127) + 128

    held = bufs["keys"][:, :, slots].astype(np.float64)
    diff = np.abs(held - codes(ranks + plan.evicted))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99, (diff.max(), (diff == 0).mean())
    assert (np.abs(held - codes(ranks.astype(np.float64))) > 1).mean() > 0.3
