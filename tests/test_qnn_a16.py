"""16-bit activations on the HTP (`cabinlm build --activations a16`): the int8-KV export as
a calibrated QDQ graph (uint16 activations, int8 or int4 weights in symmetric blocks of 32, the uint8 cache with
its tied scales, keys rotated when written as the fp16 build's: QK^T reads 8-bit keys), compiled by
Qualcomm's compiler for sa8775p (v73) and run in its x86 simulator.

Tolerance, measured over test_qnn's stream (prefill in chunks, decode, > 8 windows of eviction,
pinned spans, one younger than window tokens), as (worst, median) of a step's max |logit error| /
max |logit|, and top-1 agreement (161 steps, one run each):

    a16 build, rotated keys (HTP simulator) vs the CPU float32-KV export        0.150 / 0.041 / 93%
    a16 build, rotated keys                 vs the CPU build of the int8 export  0.509 / 0.099 / 82%
    a16 build, pinned spans dropped, vs either                                   1.67  / 0.79-0.80 / 20-21%
    (un-rotated keys, the a16 build before: 0.139 / 0.040 / 94%, 0.485 / 0.098 / 81%, 1.68 / 0.78-0.79 / 20%)
    (the fp16 uint8-cache build, rotated, tests/test_qnn_kv8.py: 0.064 / 0.027 / 92% and 0.48 / 0.097 / 79%)
    (the CPU int8 export itself vs float32: 0.44 / 0.091 / 81%)

With `--a16-weights int4` (int4 blocks, the LM head int8) against the CPU build of the int8 export: 0.74 /
0.33 / 48%, pins dropped 1.74 / 0.85 / 16% (un-rotated: 0.75 / 0.32 / 48%, 1.74 / 0.85 / 17%; why wider:
test_the_int4_a16_build_follows_the_cpu_...).

The a16 graph re-rounds every activation to 16 bits over ranges calibrated on 512 tokens of the
built-in text, and its weights to symmetric int8 blocks of 32 (from the export's int4 blocks); the
8-bit cache rounds as the fp16 build's does (tests/test_qnn_kv8.py: 0.48 / 0.097 / 79% against the
CPU int8 build). The bounds hold the a16 build about as close to the CPU int8 build as that fp16 build is, and
within 20% / 8% (median) of float32; a cache without its pinned spans fails both by far. On this random
model rotated and un-rotated keys score about the same (the figures above, one run each); SmolLM2's
differ (docs/results.md, "The HTP in the simulator"). What the rotation changes in the graph is checked directly:
test_qk_t_reads_8_bit_keys_that_were_rounded_after_their_rotation (the un-rotated graph fails it: the
keys into QK^T were uint16 there).
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
# the uint8-cache tests' artifacts (the same tiny model, int8 KV / fp32 KV) and their bound check
from test_qnn_kv8 import close, fp32_artifact, int8_artifact  # noqa: E402, F401
from test_qnn_kv8 import session_resumes_the_same_stream, sink_and_pinned_keys_are_rotated_at_rank_plus_e  # noqa: E402

FLOAT = (0.2, 0.08, 0.85)  # (worst, median, top-1) against the float32-KV export of the same weights
SAME_EXPORT = (0.7, 0.16, 0.7)  # against the CPU build of the same int8 export
INT4_SAME_EXPORT = (1.0, 0.45, 0.35)  # --a16-weights int4 against the same (test_the_int4_a16_build_follows_the_cpu_...)




@pytest.fixture(scope="module")
def a16_build(int8_artifact, tmp_path_factory):
    return build_artifact(int8_artifact, load_profile("sa8775p"), tmp_path_factory.mktemp("a16") / "b", activations="a16")


@pytest.fixture(scope="module")
def a16_qdq(int8_artifact, tmp_path_factory):
    """The QDQ graph the a16 build compiles (qdq.a16_graph) and its cache's scales."""
    from cabinlm.engines.qnn_htp.qdq import a16_graph

    g, _, scales, _ = a16_graph(int8_artifact, load_manifest(int8_artifact), None, tmp_path_factory.mktemp("a16-qdq"))
    return g, scales


def test_the_a16_build_records_its_precision_scales_and_calibration(a16_build, int8_artifact):
    from cabinlm.engines.qnn_htp.qdq import calibration_ids, ids_sha256
    from cabinlm.engines.qnn_htp.rotated_graph import rotated_key_scales

    art, m = load_manifest(int8_artifact), load_manifest(a16_build)
    q = m.build.facts
    assert (q.htp_arch, q.activations, q.weights, q.kv_cache, q.rotated_keys) == (73, "int16", "int8", "uint8", True)
    assert q.check["same_top1"] and q.check["correlation"] > 0.99  # the compiled graph against the QDQ graph
    assert 0.99 <= q.rewrites["fidelity"] <= 1.0  # the QDQ graph against the float graph, held-out text
    assert q.rewrites["weight_blocks"] == 9 and q.rewrites["fidelity_tokens"] == 65
    # rotated keys: each key tensor's scale the rotation pairs' bound (as the fp16 build's, test_qnn_kv8)
    assert q.kv_scales == pytest.approx(rotated_key_scales(art.kv_scales.array("keys"), art.kv_scales.array("values"), 2))
    names = {t.name: t for t in (*m.io.inputs, *m.io.outputs)}
    cache_io = [t for n, t in names.items() if n.split(".")[0] in ("key_cache", "value_cache", "new_key", "new_value")]
    assert len(cache_io) == 8 and all(t.dtype == "uint8" for t in cache_io)
    assert not any("position_ids" in n for n in names) and names["rope_cos"].shape == ("tokens", 8)
    assert [names[f"new_key_source.{i}"].dtype for i in range(2)] == ["float16"] * 2
    for role in ("graph", "graph_decode", "graph_simulator", "graph_decode_simulator"):  # all on the HTP
        ctx = onnx.load(str(a16_build / m.files[role].path), load_external_data=False)
        assert {n.op_type for n in ctx.graph.node} == {"EPContext"}
    calib = m.quality.build["activation_calibration"]
    ids, source = calibration_ids(int8_artifact, art, None)
    assert calib["tokens"] == len(ids) == 512 and calib["source"] == source
    assert calib["ids_sha256"] == ids_sha256(ids) != art.quality.calibration["ids_sha256"]


def test_the_a16_graph_is_16_bit_with_the_uint8_cache_tied(a16_qdq):
    """The QDQ graph itself: every activation quantized to uint16 except the cache's uint8 I/O, whose
    QuantizeLinear (new K/V) and DequantizeLinear (cache) carry the same scale, zero point 128."""
    g, scales = a16_qdq
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}
    acts = {consts[n.input[2]].dtype for n in g.graph.node if n.op_type == "QuantizeLinear"}
    assert acts == {np.dtype(np.uint16), np.dtype(np.uint8)}
    weights = [consts[n.input[0]] for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in consts
               and consts[n.input[0]].ndim == 2 and consts[n.input[0]].dtype == np.int8]  # fmt: skip
    assert len(weights) == 9  # 2 layers x (qkv, o, gate_up, down) + the LM head
    # symmetric int8 blocks of 32 along K (qdq.block_weights): the compiler reads a block zero point as 0
    blocks = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in consts and consts[n.input[0]].ndim == 2
              and consts[n.input[0]].dtype == np.int8]  # fmt: skip
    for n in blocks:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        K, N = consts[n.input[0]].shape
        assert attrs == {"axis": 0, "block_size": 32} and len(n.input) == 2 and consts[n.input[1]].shape == (K // 32, N)
    producer = {o: n for n in g.graph.node for o in n.output}
    for i in range(2):
        for cache, new in ((f"key_cache.{i}", f"new_key.{i}"), (f"value_cache.{i}", f"new_value.{i}")):
            q = producer[new]
            (dq,) = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == cache]
            for n in (q, dq):
                assert consts[n.input[1]] == np.float32(scales[cache]) and consts[n.input[2]] == 128
                assert consts[n.input[2]].dtype == np.uint8


def test_qk_t_reads_8_bit_keys_that_were_rounded_after_their_rotation(a16_qdq):
    """Rotated keys in the QDQ graph (rotated_graph.rotate_cached_keys before the quantizer): each layer's
    two QK^T MatMuls (scores over the cache, over the chunk) take 16-bit queries and, as keys, the
    DequantizeLinear of uint8 codes with the key tensor's scale and zero point 128, reached from
    key_cache.l / new_key.l through Transposes and their uint8 Q / DQ only: a 16x8 matmul. new_key.l
    is the uint8 QuantizeLinear of the chunk's keys after their rotation (the chunk's rope behind it).
    The un-rotated graph (the a16 build before) rotated the dequantized keys here into 16 bits."""
    from cabinlm.contract import io_spec as io

    g, scales = a16_qdq
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}
    producer = {o: n for n in g.graph.node for o in n.output}
    ends = {t.name for t in (*g.graph.input, *g.graph.output)}
    matmuls = {n.name: n for n in g.graph.node if n.op_type == "MatMul"}

    def zero_point(n):
        return consts[n.input[2]]

    def keys_of(t: str, scale: float) -> str:
        """From a MatMul's key input back to the graph tensor it reads, every Q / DQ on the way uint8 with `scale`."""
        while t not in ends:
            n = producer[t]
            assert n.op_type in ("DequantizeLinear", "QuantizeLinear", "Transpose"), f"{n.name} ({n.op_type}) before QK^T"
            if n.op_type != "Transpose":
                zp = zero_point(n)
                assert zp.dtype == np.uint8 and int(zp) == 128 and np.isclose(consts[n.input[1]], scale), n.name
            t = n.input[0]
        return t

    for i in range(2):
        s = scales[f"key_cache.{i}"]
        for part, source in (("s_cache", f"key_cache.{i}"), ("s_chunk", f"new_key.{i}")):
            mm = matmuls[f"n/layers.{i}/{part}"]
            dq_q, dq_k = producer[mm.input[0]], producer[mm.input[1]]
            assert dq_q.op_type == dq_k.op_type == "DequantizeLinear"
            assert zero_point(dq_q).dtype == np.uint16 and zero_point(dq_k).dtype == np.uint8  # 16 x 8
            assert keys_of(mm.input[1], s) == source
        q = producer[f"new_key.{i}"]  # the chunk's keys: rotated, then rounded to the cache's codes
        assert q.op_type == "QuantizeLinear" and zero_point(q).dtype == np.uint8 and np.isclose(consts[q.input[1]], s)
        behind, todo = set(), [q.input[0]]
        while todo:  # back to the first node that is not a (de)quantization or the Mul by one
            n = producer.get(todo.pop())
            if n is not None and n.op_type in ("DequantizeLinear", "QuantizeLinear", "Mul") and n.name not in behind:
                behind.add(n.name)
                todo += [x for x in n.input if x not in consts]
            elif n is not None:
                behind.add(n.name)
        assert io.chunk_key_rope(i) in behind


@pytest.mark.slow
def test_the_a16_build_follows_the_cpu_through_prefill_decode_eviction_and_pins(a16_build, int8_artifact, fp32_artifact):
    ids = stream_ids()
    cpu = run_stream(int8_artifact, ids, session_config=EXACT)
    float32 = run_stream(fp32_artifact, ids, session_config=EXACT)
    got = run_stream(a16_build, ids)  # asserts the sessions run on the QNN EP, CPU fallback off
    assert close(got, float32, FLOAT), agreement(got, float32)
    assert close(got, cpu, SAME_EXPORT), agreement(got, cpu)
    wrong = run_stream(a16_build, ids, pins=False)
    assert not close(wrong, float32, FLOAT) and not close(wrong, cpu, SAME_EXPORT), agreement(wrong, cpu)


def test_the_runtime_holds_the_a16_cache_in_uint8(a16_build):
    bufs = Decoder(a16_build).backend.buffers()
    assert bufs["keys"].dtype == bufs["values"].dtype == np.uint8 and "value_scales" not in bufs
    assert (bufs["keys"] == 128).all()
    assert set(bufs) == {"keys", "values", "key_source"} and bufs["key_source"].dtype == np.float16


def test_the_a16_sink_and_pinned_keys_are_their_copies_rotated_at_rank_plus_e(a16_build):
    """test_qnn_kv8's check of the refresh's bytes, on the a16 build: its key_source rows (the QDQ
    graph's new_key_source, un-rotated) rotated at rank + E are what the sink / pinned slots hold."""
    sink_and_pinned_keys_are_rotated_at_rank_plus_e(a16_build)


def test_a_session_saved_from_the_a16_build_resumes_the_same_stream(a16_build, tmp_path):
    """test_qnn_kv8's session test on the a16 build: the uint8 cache and the sink / pinned keys' copy
    saved and restored as bytes, the next steps' logits the uninterrupted dialogue's bit for bit."""
    session_resumes_the_same_stream(a16_build, tmp_path)


def test_a16_is_refused_on_sa8295p_for_fp16_kv_and_off_the_htp(int8_artifact, load, tiny_llama_dir, export_to, tmp_path):
    with pytest.raises(BuildError, match=r"--activations a16 is for HTP v73\+ \(sa8775p\); sa8295p is v68, where Qualcomm ships fp16"):
        build_artifact(int8_artifact, load_profile("sa8295p"), tmp_path / "v68", activations="a16")
    fp16 = export_to(load(str(tiny_llama_dir)), kv="fp16", weights="int4", **LAYOUT)
    with pytest.raises(BuildError, match=r"keeps the KV cache 8-bit .* this export holds fp16 KV: re-export with --kv int8"):
        build_artifact(fp16, load_profile("sa8775p"), tmp_path / "fp16", activations="a16")
    with pytest.raises(BuildError, match=r"are for the Snapdragon HTP builds"):
        build_artifact(int8_artifact, load_profile("cpu"), tmp_path / "cpu", activations="a16")
    with pytest.raises(BuildError, match=r"--activations must be fp16 or a16, got 'a8'"):
        build_artifact(int8_artifact, load_profile("sa8775p"), tmp_path / "a8", activations="a8")


def test_the_cli_refuses_a16_on_sa8295p_in_one_line(int8_artifact, tmp_path):
    from test_cli import assert_clean_error, cabinlm

    p = cabinlm("build", int8_artifact, "--profile", "sa8295p", "--activations", "a16", "-o", tmp_path / "v68")
    assert_clean_error(p, "--activations a16 is for HTP v73+ (sa8775p); sa8295p is v68", "AI Hub's export refuses w4a16")


def test_a16_graph_that_loses_the_model_is_refused(int8_artifact, tmp_path, monkeypatch):
    """The build compares the QDQ graph's logits with the float graph's over held-out text fed by the
    runtime (on the CPU) and refuses below qdq.MIN_FIDELITY: here the bar is put above what any graph reaches."""
    from cabinlm.engines.qnn_htp import qdq

    monkeypatch.setattr(qdq, "MIN_FIDELITY", 1.001)
    with pytest.raises(BuildError, match=r"the 16-bit graph does not follow the float graph over \d+ held-out tokens through the "
                                         r"runtime on the CPU \(logit correlation [01]\.\d+, at least 1.001; perplexity .*"
                                         r"build it with --activations fp16"):
        build_artifact(int8_artifact, load_profile("sa8775p"), tmp_path / "b", activations="a16")


# -- GGUF Q4_1 blocks (their offsets unfolded, SmolLM2's a16 graph scored 1.5e9) -------------------------------------
# The tests above export the tiny model's int4 with integer zero points; a GGUF Q4_1 file (SmolLM2's) brings
# blocks d * q + m, whose minimum m the export adds as blocksum(x) @ offset beside x @ (d q). Quantized to 16
# bits apart, the two terms (each carrying the block's mean weight) no longer cancel: on the tiny model the
# QDQ graph's logits over the 65 held-out tokens then follow the float graph's at correlation 0.43 (perplexity
# 926 against 635); folded into one matrix: 0.998 (635.9 against 634.6).


def q4_1_blocks(w: np.ndarray):
    """A float (K, N) matrix as GGUF Q4_1 blocks: gguf-py's own quantizer, imported as a .gguf's are."""
    from gguf import quants as gq

    from cabinlm.export import wquant

    raw = gq.quantize(np.ascontiguousarray(w.T, np.float32), gq.GGMLQuantizationType.Q4_1)  # (N, bytes per row)
    return wquant.from_gguf_rows(raw, "Q4_1", w.shape[0])


@pytest.fixture(scope="module")
def q4_1_artifact(tiny_llama_dir, tmp_path_factory):
    """The tiny model's int8-KV export with its int4 matrices in Q4_1 form (scale, 4-bit codes 0..15, offset)."""
    from cabinlm.export import ExportOptions, export_loaded, wquant
    from cabinlm.export.models import load_model

    out = tmp_path_factory.mktemp("q4_1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wquant, "quantize_int4", q4_1_blocks)
        export_loaded(load_model(str(tiny_llama_dir)), out, ExportOptions(kv="int8", weights="int4", verify=False,
                                                                         gate=False, **LAYOUT))  # fmt: skip
    return out


def _float_graph(art, m):
    """The a16 pipeline's float graph (qdq.a16_float_graph: the cache's keys rotated), its (matrices,
    offsets folded) and its cache's scales."""
    from cabinlm.engines.qnn_htp import qdq

    g, rewrites, scales, rotated = qdq.a16_float_graph(art, m)
    assert rotated
    return g, (rewrites["float_weights"], rewrites["offsets_folded"]), scales


def test_a_q4_1_offset_is_folded_into_its_matrix_and_computes_the_same(q4_1_artifact):
    from cabinlm.engines.onnxruntime.offline import read_graph
    from cabinlm.engines.qnn_htp.a16_feeds import stream_logits
    from cabinlm.engines.qnn_htp.qdq import held_out_ids

    m = load_manifest(q4_1_artifact)
    exported = read_graph(q4_1_artifact, m)
    offsets = [n for n in exported.graph.node if n.op_type == "ReduceSum" and n.name.endswith("/block_sums")]
    assert len(offsets) == 8  # 2 layers x (qkv, o, gate_up, down): every matrix but the int8 head
    g, (matrices, folded), scales = _float_graph(q4_1_artifact, m)
    assert (matrices, folded) == (9, 8)
    assert not [n for n in g.graph.node if n.op_type == "ReduceSum" or "offset" in n.name]
    # the same numbers as the export's two MatMuls: the float graph with and without the fold, through the runtime
    ids = held_out_ids(q4_1_artifact, m, None)
    with pytest.MonkeyPatch.context() as mp:
        from cabinlm.engines.qnn_htp import qdq

        mp.setattr(qdq, "_q4_1_offset", lambda *a: None)  # the offsets kept as the export wrote them
        kept, (_, none), _ = _float_graph(q4_1_artifact, m)
    assert none == 0 and [n for n in kept.graph.node if n.op_type == "ReduceSum"]
    a, b = stream_logits(g, q4_1_artifact, m, ids, scales), stream_logits(kept, q4_1_artifact, m, ids, scales)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_the_a16_graph_of_q4_1_blocks_follows_the_float_graph_through_the_runtime(q4_1_artifact, tmp_path):
    """The QDQ graph and the float graph fed by the runtime (prefill chunks from an empty cache, the
    window evicting) over held-out text and over test_qnn's stream: the same logits to within 16-bit rounding."""
    from cabinlm.engines.qnn_htp.a16_feeds import stream_fidelity
    from cabinlm.engines.qnn_htp.qdq import a16_graph, held_out_ids

    m = load_manifest(q4_1_artifact)
    q, rewrites, _, _ = a16_graph(q4_1_artifact, m, None, tmp_path)
    assert rewrites["offsets_folded"] == 8 and rewrites["fidelity"] >= 0.99
    reference, _, scales = _float_graph(q4_1_artifact, m)
    for ids in (held_out_ids(q4_1_artifact, m, None), [int(t) for t in stream_ids()]):
        fid = stream_fidelity(reference.SerializeToString(), q, q4_1_artifact, m, ids, scales)
        ppl_f, ppl_q = fid["perplexity"]
        assert fid["correlation"] >= 0.99 and abs(ppl_q / ppl_f - 1) < 0.05, fid


def test_the_build_refuses_an_a16_graph_that_fails_on_text_it_was_not_calibrated_on(q4_1_artifact, tmp_path, monkeypatch):
    """The offsets quantized apart (the graph before the fix): the build's check, which runs held-out
    text through the runtime, refuses it."""
    from cabinlm.engines.qnn_htp import qdq

    monkeypatch.setattr(qdq, "_q4_1_offset", lambda *a: None)
    with pytest.raises(BuildError, match=r"does not follow the float graph over \d+ held-out tokens through the runtime .*"
                                         r"logit correlation 0\.[0-8]"):
        build_artifact(q4_1_artifact, load_profile("sa8775p"), tmp_path / "b", activations="a16")


def test_the_calibration_text_is_the_users_choice(int8_artifact, tmp_path):
    """--calib FILE: its tokens (of the export's 60% calibration part the first and last 256), not the built-in mix."""
    from tokenizers import Tokenizer

    from cabinlm.engines.qnn_htp.qdq import MAX_CALIB_TOKENS, calibration_ids, ids_sha256

    m = load_manifest(int8_artifact)
    text = tmp_path / "calib.txt"
    text.write_text("The car turns left at the next junction, then parks by the river. " * 60, encoding="utf-8")
    ids, source = calibration_ids(int8_artifact, m, text)
    every = Tokenizer.from_file(str(int8_artifact / m.files["tokenizer"].path)).encode(text.read_text()).ids
    part = every[: int(len(every) * 0.6)]  # the export's calibration part: its first and last 256 tokens
    assert len(part) > MAX_CALIB_TOKENS and source == str(text)
    assert ids == part[: MAX_CALIB_TOKENS // 2] + part[-(MAX_CALIB_TOKENS // 2) :]
    assert ids_sha256(ids) != ids_sha256(calibration_ids(int8_artifact, m, None)[0])
    text.write_text("too short", encoding="utf-8")
    from cabinlm.contract.errors import CabinlmError

    with pytest.raises(CabinlmError, match=r"--calib .*calib.txt: only \d+ tokens; give at least 256"):
        calibration_ids(int8_artifact, m, text)


# -- int4 weights, w4a16 (`--a16-weights int4`) ---------------------------------------------------------------
# The matrices as symmetric int4 blocks of 32 (a16_weights.sym_blocks), the LM head int8 blocks; the rest as
# the int8 build above. What the tests above cannot catch: int4 codes packed wrong (a nibble order, a sign),
# the head left int4, the manifest still saying int8, or a compiler that reads the int4 blocks otherwise.


@pytest.fixture(scope="module")
def a4_build(int8_artifact, tmp_path_factory):
    return build_artifact(int8_artifact, load_profile("sa8775p"), tmp_path_factory.mktemp("a4") / "b", activations="a16",
                          a16_weights="int4")  # fmt: skip


def test_int4_blocks_round_each_block_at_least_as_well_as_absmax_over_7():
    from cabinlm.engines.qnn_htp.a16_weights import sym_blocks

    w = np.random.default_rng(3).standard_t(4, (96, 40)).astype(np.float32)  # heavy tails: the extremes matter
    codes, scale = sym_blocks(w, 4)
    assert codes.dtype == np.int8 and codes.min() >= -8 and codes.max() <= 7
    assert scale.shape == (3, 40) and (scale > 0).all()
    err = ((codes * np.repeat(scale, 32, axis=0) - w) ** 2).reshape(3, 32, 40).sum(axis=1)
    c7 = np.abs(w).reshape(3, 32, 40).max(axis=1) / 7  # the scale that never clips: every block at most its error
    s7 = np.repeat(c7, 32, axis=0)
    err7 = ((np.clip(np.rint(w / s7), -7, 7) * s7 - w) ** 2).reshape(3, 32, 40).sum(axis=1)
    assert (err <= err7 + 1e-9).all() and err.sum() < 0.95 * err7.sum()
    assert (codes == -8).any()  # the 16th level is used


def test_int4_codes_pack_as_onnx_runtime_reads_them(tmp_path):
    """a16_weights.int4_tensor's nibbles, read by ONNX Runtime's DequantizeLinear(block_size 32): codes * scale."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from cabinlm.engines.qnn_htp.a16_weights import int4_tensor, sym_blocks

    w = np.random.default_rng(5).normal(size=(64, 7)).astype(np.float32)  # K x N with N odd: a half byte at the end
    codes, scale = sym_blocks(w, 4)
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=32)
    g = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [64, 7])],
                          [int4_tensor(codes, "q"), onnx.numpy_helper.from_array(scale, "s")])  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    assert np.array_equal(got, codes.astype(np.float32) * np.repeat(scale, 32, axis=0))


def test_the_int4_a16_graph_holds_int4_blocks_and_an_int8_head(int8_artifact, tmp_path):
    """The graph the build compiles (qdq.a16_graph, what builder.py saves and hands the compiler): the 8
    layer matrices INT4 initializers in symmetric blocks of 32, the LM head int8 blocks, the token table untouched."""
    from cabinlm.engines.qnn_htp.a16_weights import lm_head
    from cabinlm.engines.qnn_htp.qdq import a16_graph

    g, rewrites, _, _ = a16_graph(int8_artifact, load_manifest(int8_artifact), None, tmp_path, weights="int4")
    assert (rewrites["weight_blocks"], rewrites["weight_blocks_int8"]) == (9, 1)
    inits = {t.name: t for t in g.graph.initializer}
    head = lm_head(g)
    blocks = {n.output[0]: inits[n.input[0]] for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
              and any(a.name == "block_size" for a in n.attribute)}  # fmt: skip
    assert len(blocks) == 9 and head in blocks
    assert {t.data_type for o, t in blocks.items() if o != head} == {onnx.TensorProto.INT4}
    assert blocks[head].data_type == onnx.TensorProto.INT8
    for n in g.graph.node:
        if n.output[0] in blocks:
            K, N = blocks[n.output[0]].dims
            assert len(n.input) == 2 and tuple(inits[n.input[1]].dims) == (K // 32, N)  # no zero point: symmetric
    (table,) = [t for t in g.graph.initializer if t.name.startswith("embed") and len(t.dims) == 2]
    assert table.data_type == onnx.TensorProto.UINT16  # the token table as the int8 build has it (the quantizer's)


def test_the_int4_a16_build_records_int4_weights(a4_build):
    q = load_manifest(a4_build).build.facts
    assert (q.htp_arch, q.activations, q.weights, q.kv_cache) == (73, "int16", "int4", "uint8")
    assert (q.rewrites["weight_blocks"], q.rewrites["weight_blocks_int8"]) == (9, 1)
    assert q.check["same_top1"] and q.check["correlation"] > 0.99 and q.rewrites["fidelity"] >= 0.95


@pytest.mark.slow
def test_the_int4_a16_build_follows_the_cpu_through_prefill_decode_eviction_and_pins(a4_build, int8_artifact):
    """Bounds (INT4_SAME_EXPORT) against the CPU build of the same int8-KV export. Measured (one run, rotated keys):
    0.74 / 0.33 / 48%; pinned spans dropped 1.74 / 0.85 / 16%, outside all three (un-rotated: 0.75 / 0.32 / 48%).
    Wider than the int8 build's (0.51 / 0.099 / 82%) because the tiny export's int4 blocks are asymmetric (a zero
    point each) and are rounded a second time, to symmetric int4 blocks: on a random model that is as large as the docs' int4sym row (the QDQ graph itself
    0.32-0.49 from the float graph on the CPU, docs/architecture.md) and random logits sit close together, so
    top-1 flips. The compiler's own fidelity to the int4 graph is the build's check (manifest test above:
    one-step correlation > 0.99, the same top-1)."""
    ids = stream_ids()
    cpu = run_stream(int8_artifact, ids, session_config=EXACT)
    got = run_stream(a4_build, ids)  # asserts the sessions run on the QNN EP, CPU fallback off
    assert close(got, cpu, INT4_SAME_EXPORT), agreement(got, cpu)
    wrong = run_stream(a4_build, ids, pins=False)
    assert not close(wrong, cpu, INT4_SAME_EXPORT), agreement(wrong, cpu)


def test_int4_weights_are_refused_without_a16(int8_artifact, tmp_path):
    with pytest.raises(BuildError, match=r"--a16-weights int4 is for --activations a16 builds \(this build: --activations fp16"):
        build_artifact(int8_artifact, load_profile("sa8775p"), tmp_path / "w4", a16_weights="int4")
    with pytest.raises(BuildError, match=r"--a16-weights must be int8 or int4, got 'int2'"):
        build_artifact(int8_artifact, load_profile("sa8775p"), tmp_path / "w2", activations="a16", a16_weights="int2")


def test_an_int4_graph_below_its_own_bar_is_refused_and_pointed_at_int8(int8_artifact, tmp_path, monkeypatch):
    """int4 weights have their own correlation bar (qdq.MIN_FIDELITY_INT4: their rounding alone moves the
    logits), and a refusal names the int8 blocks as the way out: here the bar is put above what any graph reaches."""
    from cabinlm.engines.qnn_htp import qdq

    monkeypatch.setattr(qdq, "MIN_FIDELITY_INT4", 1.001)
    with pytest.raises(BuildError, match=r"logit correlation [01]\.\d+, at least 1.001; .* int4 weight blocks lose this model; "
                                         r"build it with --a16-weights int8 or --activations fp16"):
        qdq.a16_graph(int8_artifact, load_manifest(int8_artifact), None, tmp_path, weights="int4")
    qdq.a16_graph(int8_artifact, load_manifest(int8_artifact), None, tmp_path, weights="int8")  # the int8 bar: passes
