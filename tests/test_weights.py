"""Block-quantized weights: the quantizers against numpy, the GGUF block import against the gguf
library's own de-quantizer and against transformers' weights (bit for bit), the graph against a
float32 graph of the same numbers, and logits for the last row only."""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import onnxruntime as ort
import pytest

import cabinlm.engines.ort_graph.backend as session_mod  # the exported-graph backend opens its sessions with it
from cabinlm.export import wquant
from cabinlm.export.models import decoder_weights
from cabinlm.export.wquant import QuantMatrix
from cabinlm.contract.manifest import load_manifest
from cabinlm.contract.precision import WeightFormat
from cabinlm.runtime import Decoder

RNG = np.random.default_rng(7)


# -- quantizers, against a plain numpy reference -------------------------------------------------------


def test_int8_blocks_match_a_numpy_reference():
    w = RNG.standard_normal((96, 10)).astype(np.float32)
    w[5, 3] = 40.0  # an outlier only spoils its own block
    m = wquant.quantize_int8(w)
    for b in range(3):
        block = w[b * 32 : (b + 1) * 32]
        s = np.abs(block).max(axis=0) / 127
        np.testing.assert_array_equal(m.q[b * 32 : (b + 1) * 32], np.clip(np.round(block / s), -127, 127))
        np.testing.assert_allclose(m.scale[b], s, rtol=1e-7)
    err = np.abs(m.dequantize() - w)
    assert err[32:].max() <= (np.abs(w[32:]).max() / 127) / 2 + 1e-6
    assert m.nbytes == 96 * 10 + 3 * 10 * 4


def test_int4_blocks_keep_the_error_within_half_a_step():
    w = RNG.standard_normal((64, 12)).astype(np.float32) + 0.5
    m = wquant.quantize_int4(w)
    assert m.q.max() <= 15 and m.zero_point is not None
    step = np.repeat(m.scale, 32, axis=0)
    assert np.all(np.abs(m.dequantize() - w) <= step / 2 + 1e-6)
    z = np.zeros((32, 3), np.float32)  # an all-zero block quantizes to exact zeros
    np.testing.assert_array_equal(wquant.quantize_int4(z).dequantize(), z)


def test_uint4_packing_is_low_nibble_first():
    assert wquant.pack_uint4(np.array([[1, 2], [3, 15]], np.uint8)) == bytes([0x21, 0xF3])


# -- GGUF blocks, against the gguf library ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_like_the_gguf_library(kind):
    qt = gq.GGMLQuantizationType[kind]
    rows = RNG.standard_normal((6, 64)).astype(np.float32)
    raw = gq.quantize(rows, qt)  # (N, bytes per row), as a .gguf stores it
    expected = gq.dequantize(raw, qt)  # (N, K)
    m = wquant.from_gguf_rows(raw, kind, 64)
    assert m.shape == (64, 6)
    np.testing.assert_allclose(m.dequantize(), expected.T, rtol=0, atol=1e-6)


def test_joined_matrices_keep_each_part():
    a = wquant.from_gguf_rows(gq.quantize(RNG.standard_normal((4, 32)).astype(np.float32), gq.GGMLQuantizationType.Q4_1), "Q4_1", 32)
    b = wquant.from_gguf_rows(gq.quantize(RNG.standard_normal((3, 32)).astype(np.float32), gq.GGMLQuantizationType.Q4_0), "Q4_0", 32)
    j = wquant.concat([a, b])
    np.testing.assert_allclose(j.dequantize(), np.concatenate([a.dequantize(), b.dequantize()], axis=1), atol=1e-6)


def test_smollm2_gguf_blocks_import_bit_for_bit(smollm2):
    """The imported Q4_1 / Q8_0 blocks hold exactly the numbers transformers de-quantizes the file to:
    no second rounding (q and k rows un-permuted as llama.cpp's converter permuted them)."""
    q = decoder_weights(smollm2, "int4")
    f = decoder_weights(smollm2, "fp32")
    assert q.weight_source == {"imported": 211, "quantized": 0, "head": "int8"}
    for i in (0, 17, 29):
        for name in ("qkv", "o", "gate_up", "down"):
            got = getattr(q.layers[i], name)
            assert isinstance(got, QuantMatrix) and got.bits == 4 and got.offset is not None
            np.testing.assert_array_equal(got.dequantize(), getattr(f.layers[i], name))
    assert q.embed.bits == 8
    np.testing.assert_array_equal(q.embed.dequantize(), f.embed.T)


def test_smollm2_head_int4_re_rounds_the_q8_0_table_and_int8_keeps_it(smollm2):
    """--head int4: the GGUF's Q8_0 token table becomes 4-bit blocks (within half a step of its
    values), the Q4_1 matrices stay imported; --head int8 keeps the file's table as it is; a float
    export has no quantized table to size."""
    f = decoder_weights(smollm2, "fp32")
    h4 = decoder_weights(smollm2, "int4", head="int4")
    assert h4.weight_source == {"imported": 210, "quantized": 1, "head": "int4"}
    assert h4.embed.bits == 4 and h4.embed.zero_point is not None
    step = np.repeat(h4.embed.scale, 32, axis=0)  # (D, V): each value's block step
    assert np.all(np.abs(h4.embed.dequantize() - f.embed.T) <= step / 2 + 1e-6)
    h8 = decoder_weights(smollm2, "int4", head="int8")
    assert h8.weight_source == {"imported": 211, "quantized": 0, "head": "int8"}
    np.testing.assert_array_equal(h8.embed.dequantize(), f.embed.T)
    with pytest.raises(ValueError, match="head"):
        decoder_weights(smollm2, "fp32", head="fp32")


# -- the graph -----------------------------------------------------------------------------------------------


def _logits(folder, ids, level=None, accuracy=None, monkeypatch=None):
    orig = session_mod.session_options

    def so(*a, **k):
        o = orig(*a, **k)
        if level is not None:
            o.graph_optimization_level = level
        if accuracy is not None:
            o.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", accuracy)
        return o

    monkeypatch.setattr(session_mod, "session_options", so)
    return Decoder(folder).feed(np.asarray(ids), all_logits=True)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_graph_computes_with_exactly_its_blocks(fmt, arch, load, export_to, tiny_llama_dir, tiny_qwen2_dir, monkeypatch):
    """The int8 / int4 graph gives the logits of a float32 graph holding the de-quantized weights."""
    loaded = load(str(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir))
    art = export_to(loaded, window=40, chunk=16, weights=fmt)
    assert load_manifest(art).weights == fmt and load_manifest(art).opset == 21
    w = decoder_weights(loaded, fmt)
    # the reference: the same (de-quantized) numbers as float32 matrices, through the float32 path
    from cabinlm.export.decoder import build_decoder
    from cabinlm.export.graph import save_model
    from dataclasses import replace

    deq = lambda m: m.dequantize() if isinstance(m, QuantMatrix) else m  # noqa: E731
    ref_w = replace(
        w,
        embed=deq(w.embed).T.copy(),
        lm_head=None if w.lm_head is None else deq(w.lm_head).T.copy(),
        layers=[replace(l, qkv=deq(l.qkv), o=deq(l.o), gate_up=deq(l.gate_up), down=deq(l.down)) for l in w.layers],
    )
    m = load_manifest(art)
    ref_dir = art.parent / f"{art.name}-ref"
    ref_dir.mkdir(exist_ok=True)
    import shutil

    shutil.copy(art / "tokenizer.json", ref_dir / "tokenizer.json")
    save_model(build_decoder(loaded.spec, m.cache, ref_w, opset=17).model(), ref_dir / "decoder.onnx", "decoder.onnx.data")
    from cabinlm.contract.manifest import FileEntry

    replace(m, opset=17, weights="fp32", files={r: FileEntry.of(ref_dir, n) for r, n in
            (("graph", "decoder.onnx"), ("tokenizer", "tokenizer.json"))}).save(ref_dir)  # fmt: skip
    ids = list(range(3, 60))
    ref = _logits(ref_dir, ids, monkeypatch=monkeypatch)
    exact = _logits(art, ids, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, monkeypatch=monkeypatch)
    np.testing.assert_allclose(exact, ref, atol=2e-4)
    fused = _logits(art, ids, accuracy="0", monkeypatch=monkeypatch)  # MatMulNBits with float32 compute
    np.testing.assert_allclose(fused, ref, atol=2e-3)


def test_logits_for_the_last_row_only(load, export_to, tiny_llama_dir):
    loaded = load(str(tiny_llama_dir))
    art = export_to(loaded, window=40, chunk=16)
    ids = np.arange(5, 50)
    all_rows = Decoder(art).feed(ids, all_logits=True)
    last = Decoder(art).feed(ids)
    np.testing.assert_allclose(last, all_rows[-1], atol=1e-5)
    dec = Decoder(art)
    assert dec.step(ids[:7], logits="last").shape == (1, loaded.spec.vocab_size)
    with pytest.raises(ValueError, match="logits"):
        dec.step(ids[:3], logits="first")


def test_profile_cpu_exports_int4(tmp_path, tiny_llama_dir):
    from cabinlm.export import ExportRequest, options_for_profile
    from cabinlm.export.models import spec_for
    from cabinlm.profiles import load_profile

    spec, small = spec_for(str(tiny_llama_dir)), ExportRequest(chunk=16, pinned=12)
    assert options_for_profile(spec, load_profile("cpu"), small).weights is WeightFormat.INT4
    explicit = ExportRequest(chunk=16, pinned=12, weights="fp32")
    assert options_for_profile(spec, load_profile("cpu"), explicit).weights is WeightFormat.FP32
    thor = options_for_profile(spec, load_profile("thor"), small)
    assert thor.weights is WeightFormat.FP32  # TensorRT applies its own int4 when it builds
    assert load_profile("thor").weight_dtype is WeightFormat.INT4 and WeightFormat("int4").bits == 4
