"""cabinlm's own kernels against independent numpy references: the attention over int8 KV
(kernels/int8_kv_attention.cc, also against ONNX Runtime's GroupQueryAttention) and the Q4_1 matmul
(kernels/block_q4_matmul.cc, both of its paths); a chunk's rows are its one-token steps bit for bit;
bad input gets the kernel's own error; builds choose them for the profile's CPU (tests/test_kernel_library.py:
the library as a build carries it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from cabinlm.engines.ort_fused import kernels, single_op
from cabinlm.engines.ort_fused.kernels.compiler import compile_library
from cabinlm.engines.build import BuildError, build_artifact
from cabinlm.profiles import load_profile
from cabinlm.profiles.schema import parse_profile
from cabinlm.runtime import Decoder

H, HKV, D, ROWS = 6, 2, 32, 80  # three query heads per kv head
INPUTS = ("qkv", "keys", "values", "seqlens_k", "total", "cos", "sin", "position_ids", "bias", "k_scale", "v_scale")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The kernel library for this machine's CPU, as `cabinlm build` compiles it; under emulation
    (`make test-arm`: no compiler in the arm64 root) the one the build machine cross-compiled for
    it, CABINLM_TEST_KERNEL_LIBRARY (tests/test_arm.py asserts which BlockQ4MatMul path it holds)."""
    handed = os.environ.get("CABINLM_TEST_KERNEL_LIBRARY")
    if handed:
        return Path(handed)
    return compile_library(tmp_path_factory.mktemp("kernels")).path


def _graph(kind: str, library) -> ort.InferenceSession:
    f, i8 = TensorProto.FLOAT, TensorProto.INT8
    vi = [helper.make_tensor_value_info("qkv", f, [1, "n", (H + 2 * HKV) * D]),
          helper.make_tensor_value_info("keys", i8, [1, HKV, ROWS, D]),
          helper.make_tensor_value_info("values", i8, [1, HKV, ROWS, D]),
          helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
          helper.make_tensor_value_info("total", TensorProto.INT32, []),
          helper.make_tensor_value_info("cos", f, [ROWS, D // 2]), helper.make_tensor_value_info("sin", f, [ROWS, D // 2]),
          helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "n"]),
          helper.make_tensor_value_info("bias", f, [1, 1, "n", "t"]),
          helper.make_tensor_value_info("k_scale", f, None), helper.make_tensor_value_info("v_scale", f, None)]  # fmt: skip
    if kind == "cabinlm":
        node = helper.make_node(kernels.ATTENTION_OP, list(INPUTS), ["out"], domain=kernels.DOMAIN)
        outs = [helper.make_tensor_value_info("out", f, None)]
    else:
        ins = ["qkv", "", "", "keys", "values", "seqlens_k", "total", "cos", "sin", "position_ids", "bias", "", "k_scale", "v_scale"]
        node = helper.make_node("GroupQueryAttention", ins, ["out", "present_keys", "present_values"], domain="com.microsoft",
                                num_heads=H, kv_num_heads=HKV, scale=float(1 / np.sqrt(D)), do_rotary=1, rotary_interleaved=0,
                                local_window_size=-1, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                                kv_cache_bit_width=8)  # fmt: skip
        outs = [helper.make_tensor_value_info(o, t, None) for o, t in (("out", f), ("present_keys", i8), ("present_values", i8))]
    model = single_op.model([node], vi, outs, name="attention")
    return single_op.session(model, library=library if kind == "cabinlm" else None, threads=2)


@pytest.fixture(scope="module")
def sessions(library):
    return {kind: _graph(kind, library) for kind in ("cabinlm", "onnxruntime")}


class Case:
    """A chunk of n tokens after F cached ones: random cache codes, rotation tables, scales, a bias
    that hides a few cached slots (as the runtime hides empty pinned slots) and later chunk rows."""

    def __init__(self, rng, n: int, F: int, hidden: tuple[int, int] = (0, 0)):
        self.n, self.F = n, F
        self.qkv = (rng.standard_normal((1, n, (H + 2 * HKV) * D)) * 2).astype(np.float32)
        self.keys = rng.integers(-120, 121, (1, HKV, ROWS, D)).astype(np.int8)
        self.values = rng.integers(-120, 121, (1, HKV, ROWS, D)).astype(np.int8)
        angles = rng.random((ROWS, D // 2)) * 6
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        self.position_ids = rng.permutation(ROWS)[:n][None].astype(np.int64)
        bias = np.zeros((n, F + n), np.float32)
        bias[:, F:] = np.where(np.tri(n, dtype=bool), 0, -1e30)
        bias[:, hidden[0] : hidden[1]] = -1e30
        self.bias = bias[None, None]
        pair = rng.random((HKV, D // 2)) * 0.04 + 0.02  # keys: one scale per rotation pair
        self.k_scale = np.concatenate([pair, pair], -1).reshape(-1).astype(np.float32)
        self.v_scale = (rng.random(HKV * D) * 0.03 + 0.01).astype(np.float32)

    def feeds(self, kind: str) -> dict:
        shape = (1, HKV, 1, D) if kind == "onnxruntime" else (HKV * D,)
        return dict(qkv=self.qkv, keys=self.keys.copy(), values=self.values.copy(),
                    seqlens_k=np.array([self.F + self.n - 1], np.int32), total=np.array(self.F + self.n, np.int32),
                    cos=self.cos, sin=self.sin, position_ids=self.position_ids, bias=self.bias,
                    k_scale=self.k_scale.reshape(shape), v_scale=self.v_scale.reshape(shape))  # fmt: skip


def run(session, feeds: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The output and the caches after the run (the kernel writes its cache inputs in place; ONNX
    Runtime's kernel writes present outputs bound to the same memory)."""
    b = session.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    b.bind_output("out")
    if len(session.get_outputs()) == 3:
        b.bind_ortvalue_output("present_keys", ort.OrtValue.ortvalue_from_numpy(feeds["keys"]))
        b.bind_ortvalue_output("present_values", ort.OrtValue.ortvalue_from_numpy(feeds["values"]))
    session.run_with_iobinding(b)
    return b.copy_outputs_to_cpu()[0], feeds["keys"], feeds["values"]


def reference(c: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain numpy in float64: rotate, quantize the chunk's K/V into rows F.., attend causally over
    the de-quantized cache."""
    keys, values = c.keys.astype(np.float64), c.values.astype(np.float64)
    q = c.qkv[0, :, : H * D].reshape(c.n, H, D).astype(np.float64)
    k = c.qkv[0, :, H * D : (H + HKV) * D].reshape(c.n, HKV, D).astype(np.float64)
    v = c.qkv[0, :, (H + HKV) * D :].reshape(c.n, HKV, D).astype(np.float64)
    ks, vs = c.k_scale.reshape(HKV, D).astype(np.float64), c.v_scale.reshape(HKV, D).astype(np.float64)

    def rotate(x, i):
        p, h = c.position_ids[0, i], D // 2
        cos, sin = c.cos[p].astype(np.float64), c.sin[p].astype(np.float64)
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    for i in range(c.n):
        keys[0, :, c.F + i] = np.clip(np.rint(rotate(k[i], i) / ks), -127, 127)
        values[0, :, c.F + i] = np.clip(np.rint(v[i] / vs), -127, 127)
    out = np.zeros((c.n, H, D))
    for i in range(c.n):
        for h in range(H):
            g, visible = h // (H // HKV), c.F + i + 1
            scores = keys[0, g, :visible] * ks[g] @ rotate(q[i, h], i) / np.sqrt(D) + c.bias[0, 0, i, :visible]
            p = np.exp(scores - scores.max())
            out[i, h] = (p / p.sum()) @ (values[0, g, :visible] * vs[g])
    return out.reshape(1, c.n, H * D), keys.astype(np.int8), values.astype(np.int8)


@pytest.mark.parametrize("n,F,hidden", [(1, 0, (0, 0)), (1, 37, (3, 9)), (5, 20, (0, 4)), (4, 15, (2, 3)), (16, 40, (10, 30)),
                                         (17, 63, (1, 2)), (1, 79, (30, 31)), (3, 70, (0, 1))])  # fmt: skip
# (4, 15): a row whose keys end on a 16-lane edge; F >= 32: tiles of cached rows only (the kernel's
# plain_tile path: 16 keys and 32 values read as they lie), then the tiles with the chunk's rows

def test_the_kernel_computes_what_plain_numpy_computes(sessions, n, F, hidden):
    c = Case(np.random.default_rng(n * 100 + F), n, F, hidden)
    out, keys, values = run(sessions["cabinlm"], c.feeds("cabinlm"))
    ref_out, ref_keys, ref_values = reference(c)
    for got, want in ((keys, ref_keys), (values, ref_values)):
        diff = np.abs(got.astype(np.int32) - want)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float32 vs float64 at a .5 boundary, rarely
        untouched = np.ones(ROWS, bool)
        untouched[F : F + n] = False
        np.testing.assert_array_equal(got[:, :, untouched], (c.keys if got is keys else c.values)[:, :, untouched])
    # the reference attends over its own rounding of the new rows: compare where both rounded alike
    if np.array_equal(keys, ref_keys) and np.array_equal(values, ref_values):
        np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4)
    else:
        assert np.abs(out - ref_out).max() < 0.01 * np.abs(ref_out).max()


def test_the_kernel_agrees_with_onnxruntimes_group_query_attention(sessions):
    """The same inputs mean the same thing (positions, tables, bias, scales): ONNX Runtime's kernel
    rounds a few values differently, so the outputs agree closely, not to the bit."""
    for n, F in ((1, 50), (9, 30)):
        c = Case(np.random.default_rng(7 + n), n, F, (2, 6))
        out, keys, _ = run(sessions["cabinlm"], c.feeds("cabinlm"))
        ort_out, ort_keys, _ = run(sessions["onnxruntime"], c.feeds("onnxruntime"))
        assert np.abs(keys.astype(np.int32) - ort_keys).max() <= 1
        assert np.abs(out - ort_out).max() < 0.01 * np.abs(ort_out).max()


def test_a_chunks_rows_are_its_one_token_steps_bit_for_bit(sessions):
    """Speculative verification keeps a chunk row's choice only because the row is the step."""
    s = sessions["cabinlm"]
    c = Case(np.random.default_rng(3), 7, 45, (5, 12))
    chunk_out, chunk_keys, chunk_values = run(s, c.feeds("cabinlm"))
    keys, values = c.keys.copy(), c.values.copy()
    for i in range(c.n):
        step = dict(c.feeds("cabinlm"), qkv=np.ascontiguousarray(c.qkv[:, i : i + 1]), keys=keys, values=values,
                    seqlens_k=np.array([c.F + i], np.int32), total=np.array(c.F + i + 1, np.int32),
                    position_ids=np.ascontiguousarray(c.position_ids[:, i : i + 1]),
                    bias=np.ascontiguousarray(c.bias[:, :, i : i + 1, : c.F + i + 1]))  # fmt: skip
        out, keys, values = run(s, step)
        np.testing.assert_array_equal(out[0, 0], chunk_out[0, i])
    np.testing.assert_array_equal(keys, chunk_keys)
    np.testing.assert_array_equal(values, chunk_values)


def test_a_chunk_that_does_not_fit_the_cache_is_refused_with_the_kernels_reason(sessions):
    c = Case(np.random.default_rng(4), 4, ROWS - 2)
    with pytest.raises(Exception, match="do not fit 4 tokens in 80 cache rows"):
        run(sessions["cabinlm"], c.feeds("cabinlm"))
    c = Case(np.random.default_rng(4), 2, 10)
    feeds = dict(c.feeds("cabinlm"), position_ids=np.array([[0, ROWS]], np.int64))
    with pytest.raises(Exception, match="outside the rotation tables"):
        run(sessions["cabinlm"], feeds)


LAYOUT = dict(sink=2, pinned=10, window=16, chunk=4)


def test_int8_builds_take_the_kernel_and_fall_back_where_it_cannot_be_had(load, tiny_llama_dir, export_to, tmp_path, monkeypatch):
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    logs: list[str] = []
    own = build_artifact(art, load_profile("cpu"), tmp_path / "own", log=logs.append)
    manifest = json.loads((own / "manifest.json").read_text())
    assert manifest["build"]["fused"]["attention_kernel"] == "cabinlm"
    graph = onnx.load(str(own / "decoder.opt.onnx"), load_external_data=False)
    assert [n.op_type for n in graph.graph.node].count(kernels.ATTENTION_OP) == 2  # one per layer
    assert not [o.name for o in graph.graph.output if o.name.startswith("present")]  # the cache is written in place
    gqa = build_artifact(art, load_profile("cpu"), tmp_path / "gqa", attention_kernel="onnxruntime")
    a, b = Decoder(own), Decoder(gqa)
    rng = np.random.default_rng(5)
    for ids in (rng.integers(3, 300, 4), rng.integers(3, 300, 3), *[rng.integers(3, 300, 1) for _ in range(40)]):
        la, lb = a.feed(ids), b.feed(ids)
        assert np.abs(la - lb).max() < 0.05 * np.abs(lb).max()  # the same model, rounding apart
    assert a.cache.evicted == b.cache.evicted > 0

    assert manifest["files"]["kernel_library"]["path"] == kernels.LIBRARY  # carried by the build, checksummed

    # A build machine without a C++ compiler: no CXX, and no g++ / c++ / clang++ on PATH.
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-compilers"))
    logs.clear()
    fallback = build_artifact(art, load_profile("cpu"), tmp_path / "fallback", log=logs.append)
    built = json.loads((fallback / "manifest.json").read_text())
    assert built["build"]["fused"]["attention_kernel"] == "onnxruntime" and built["build"]["fused"]["kernels"] is None
    assert "kernel_library" not in built["files"] and not (fallback / kernels.LIBRARY).exists()
    assert any("kept ONNX Runtime's GroupQueryAttention: cabinlm's kernels cannot be had (no C++ compiler" in line
               for line in logs)  # fmt: skip
    with pytest.raises(BuildError, match="no C.. compiler"):
        build_artifact(art, load_profile("cpu"), tmp_path / "refused", attention_kernel="cabinlm")


# --- BlockQ4MatMul ------------------------------------------------------------------------------


def _q4_case(K: int, N: int, seed: int = 0):
    """GGUF-like Q4_1 blocks: 4-bit codes, float16 scales and minimums (some positive)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = rng.uniform(1e-3, 2e-2, (K // 32, N)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(-2, 15, (K // 32, N))).astype(np.float16).astype(np.float32)
    return q, d, m


def _matmul_session(blob: np.ndarray, library, width: int | str | None = None, swiglu: bool = False,
                    op: str | None = None) -> ort.InferenceSession:  # fmt: skip
    T, nb, _ = blob.shape
    op = op or (kernels.SWIGLU_MATMUL_OP if swiglu else kernels.MATMUL_OP)
    node = helper.make_node(op, ["x", "w"], ["y"], domain=kernels.DOMAIN)
    model = single_op.model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", width or nb * 32 * (2 if swiglu else 1)])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                            [onnx.numpy_helper.from_array(blob, "w")], name="matmul")  # fmt: skip
    return single_op.session(model, library=library, threads=2)


def _row_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block matmuls' activations (kernels/block_matmul.h): each row of x (M, K) quantized per
    block of 32 to int8 codes (scale amax / 127, half to even). Returns the codes (M, K / 32, 32) and
    the scales (M, K / 32), as float64."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    return np.rint(xb * inv[..., None]).astype(np.float64), (amax / np.float32(127)).astype(np.float64)


def _q4_reference(x: np.ndarray, q, d, m) -> np.ndarray:
    """The kernel's arithmetic in float64: each row quantized per block of 32 to int8 codes (scale
    amax / 127, half to even), the integer dot products with the codes and with the minimums: the
    exported weights times the quantized row."""
    K = x.shape[1]
    codes, scale = _row_codes(x)
    dot = np.einsum("mbk,bkn->mbn", codes, q.reshape(K // 32, 32, -1).astype(np.float64))
    sums = (scale.astype(np.float32) * codes.sum(-1).astype(np.float32)).astype(np.float64)  # float32, as the kernel
    return (dot * d[None] * scale[..., None] + m[None] * sums[..., None]).sum(1)


def test_the_q4_layout_holds_the_exported_codes_scales_and_minimums():
    """An independent unpacking of builders.block_layouts.block_q4_layout gives back every code, scale
    and minimum: as float16 where they all are float16s, as float32 otherwise; a width that is not
    tiles of 16 is not laid out."""
    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    K, N = 96, 48
    q, d, m = _q4_case(K, N)
    blob = block_q4_layout(q, d, m)
    assert blob.shape == (N // 16, K // 32, 320) and blob.dtype == np.uint8
    for t in range(N // 16):
        for b in range(K // 32):
            cell = blob[t, b]
            for j in range(4):
                for c in range(16):
                    for i in range(4):
                        byte = int(cell[64 * j + 4 * c + i])
                        assert byte & 15 == q[32 * b + 4 * j + i, 16 * t + c]
                        assert byte >> 4 == q[32 * b + 4 * (j + 4) + i, 16 * t + c]
            np.testing.assert_array_equal(cell[256:288].view(np.float16).astype(np.float32), d[b, 16 * t : 16 * t + 16])
            np.testing.assert_array_equal(cell[288:320].view(np.float16).astype(np.float32), m[b, 16 * t : 16 * t + 16])
    d32, m32 = d + np.float32(1e-7), m - np.float32(3e-7)  # float16s no more
    wide = block_q4_layout(q, d32, m32)
    assert wide.shape == (N // 16, K // 32, 384)
    np.testing.assert_array_equal(wide[..., :256], blob[..., :256])  # the same codes
    for t in range(N // 16):
        for b in range(K // 32):
            np.testing.assert_array_equal(wide[t, b, 256:320].view(np.float32), d32[b, 16 * t : 16 * t + 16])
            np.testing.assert_array_equal(wide[t, b, 320:384].view(np.float32), m32[b, 16 * t : 16 * t + 16])
    assert block_q4_layout(q[:, :40], d[:, :40], m[:, :40]) is None  # 40 columns: not tiles of 16


@pytest.mark.parametrize("path", ["native", "generic"])
def test_block_q4_matmul_computes_the_q4_1_product(path, library, tmp_path):
    """Both paths of the kernel (this CPU's, and the plain C++ one other CPUs get) against the numpy
    reference of its arithmetic (float32 rounding apart) and against x @ W in float64 (the int8
    activations' rounding apart); rows of zeros, row counts around the blocks of rows, five tiles (the
    parallel units take two neighbours each: the last one holds one)."""
    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    if path == "generic":
        compiled = compile_library(tmp_path, defines=("CABINLM_GENERIC",))
        assert compiled.facts.matmul_isa == "generic"
        library = compiled.path
    K, N = 160, 80
    q, d, m = _q4_case(K, N, seed=1)
    rng = np.random.default_rng(2)
    # float16 scales and minimums (a GGUF Q4_1's), and float32 ones (zero points, K-quants)
    for dd, mm in ((d, m), (d * np.float32(1.0001), m * np.float32(1.0001))):
        session = _matmul_session(block_q4_layout(q, dd, mm), library)
        W = (q.reshape(K // 32, 32, N) * dd[:, None].astype(np.float64) + mm[:, None]).reshape(K, N)
        for rows in (1, 3, 4, 9):
            x = rng.standard_normal((rows, K)).astype(np.float32)
            x[0, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
            y = session.run(None, {"x": x[None]})[0][0]
            assert y.shape == (rows, N)
            ref = _q4_reference(x, q, dd, mm)
            assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(y - ref).max()
            exact = x.astype(np.float64) @ W
            assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations

    # BlockQ4SwiGLUMatMul: x = gate | up, y = (silu(gate) * up) @ W
    swiglu = _matmul_session(block_q4_layout(q, d, m), library, swiglu=True)
    gu = rng.standard_normal((5, 2 * K)).astype(np.float32) * 3
    gu[0, :16] = [-100, -88, -87, -30, -1e-3, 0, 1e-3, 30, 87, 88, 100, -5, 5, 0.5, -0.5, 2]  # sigmoid's far ends
    g, u = gu[:, :K].astype(np.float64), gu[:, K:].astype(np.float64)
    act = g / (1 + np.exp(-g)) * u
    y = swiglu.run(None, {"x": gu[None]})[0][0]
    ref = _q4_reference(act.astype(np.float32), q, d, m)  # the float32 activation rounds a few codes differently
    assert np.abs(y - ref).max() <= 2e-3 * np.abs(ref).max(), np.abs(y - ref).max()
    exact = act @ W
    assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("rows", [7, 13, 19])  # groups of the kernel's rows: 7; 8 + 5; 8 + 8 + 3 (AVX-512), 2s and a 1 (NEON)
def test_block_q4_matmul_rows_are_one_row_runs_bit_for_bit(library, rows):
    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    q, d, m = _q4_case(96, 48, seed=3)  # three tiles: a unit of two and one of one
    session = _matmul_session(block_q4_layout(q, d, m), library)
    x = np.random.default_rng(4).standard_normal((1, rows, 96)).astype(np.float32)
    chunk = session.run(None, {"x": x})[0]
    steps = np.concatenate([session.run(None, {"x": x[:, i : i + 1]})[0] for i in range(rows)], axis=1)
    assert np.array_equal(chunk, steps)
    swiglu = _matmul_session(block_q4_layout(q, d, m), library, swiglu=True)
    gu = np.random.default_rng(5).standard_normal((1, rows, 192)).astype(np.float32)
    chunk = swiglu.run(None, {"x": gu})[0]
    steps = np.concatenate([swiglu.run(None, {"x": gu[:, i : i + 1]})[0] for i in range(rows)], axis=1)
    assert np.array_equal(chunk, steps)


def test_block_q4_matmul_refuses_weights_of_another_shape(library):
    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    q, d, m = _q4_case(64, 16)
    session = _matmul_session(block_q4_layout(q, d, m), library, width="k")
    with pytest.raises(Exception, match=r"BlockQ4MatMul: x \(1, 2, 96\) and weights \(1, 2, 320\) are not \(\.\.\., K\)"):
        session.run(None, {"x": np.zeros((1, 2, 96), np.float32)})
    swiglu = _matmul_session(block_q4_layout(q, d, m), library, width="k", swiglu=True)
    with pytest.raises(Exception, match=r"BlockQ4SwiGLUMatMul: x \(1, 2, 64\) .* are not \(\.\.\., 2 K\)"):
        swiglu.run(None, {"x": np.zeros((1, 2, 64), np.float32)})


@pytest.mark.slow
def test_smollm2_q4_1_builds_take_the_matmul_kernel(smollm2, export_to, long_text, tmp_path):
    """The GGUF's Q4_1 matrices on BlockQ4MatMul by default (int8 activations), fewer weight bytes;
    against float activations (MatMulNBits, exact minimums, accuracy level 0: which keeps MatMulNBits)
    its logits are as close as MatMulNBits' own int8 activations get; a profile whose CPU stops at AVX2 (cpu_march x86-64-v3) takes it too, on its AVX2 path, and gives this
    machine's build's logits bit for bit; asking for the kernel with float activations is refused."""
    from cabinlm.runtime import Tokenizer

    art = export_to(smollm2, sink=4, pinned=60, window=124, chunk=32, weights="int4")
    logs: list[str] = []
    own = build_artifact(art, load_profile("cpu"), tmp_path / "own", log=logs.append)
    nbits = build_artifact(art, load_profile("cpu"), tmp_path / "nbits", matmul_kernel="onnxruntime", minimums="exact")
    ref = build_artifact(art, load_profile("cpu"), tmp_path / "ref", accuracy_level=0, minimums="exact")
    manifests = {p.name: json.loads((p / "manifest.json").read_text()) for p in (own, nbits, ref)}
    assert [manifests[n]["build"]["fused"]["matmul_kernel"] for n in ("own", "nbits", "ref")] == ["cabinlm", "onnxruntime",
                                                                                                 "onnxruntime"]  # fmt: skip
    ops = [n.op_type for n in onnx.load(str(own / "decoder.opt.onnx"), load_external_data=False).graph.node]
    assert ops.count(kernels.MATMUL_OP) == 3 * smollm2.spec.num_layers  # qkv, o, gate_up of every layer
    assert ops.count(kernels.SWIGLU_MATMUL_OP) == smollm2.spec.num_layers and "Sigmoid" not in ops  # down, its SwiGLU
    assert any("4-bit matrices: cabinlm's BlockQ4MatMul" in line for line in logs)
    assert manifests["own"]["quality"]["build"]["weights_bytes"] < manifests["nbits"]["quality"]["build"]["weights_bytes"]
    ids = Tokenizer(own / "tokenizer.json").encode(long_text, add_special_tokens=True)[:300]
    exact = Decoder(ref).feed(ids, all_logits=True)
    errors = {}
    for name, build in (("own", own), ("nbits", nbits)):
        got = Decoder(build).feed(ids, all_logits=True)
        errors[name] = ((got.argmax(-1) == exact.argmax(-1)).mean(), np.abs(got - exact).mean())
    print("next-token agreement, mean |logit diff| against float activations:", errors)
    assert errors["own"][0] >= 0.9 and errors["own"][1] <= 1.25 * errors["nbits"][1], errors

    with pytest.raises(BuildError, match="int8 activations"):
        build_artifact(art, load_profile("cpu"), tmp_path / "refused", accuracy_level=0, matmul_kernel="cabinlm")
    if kernels.host_machine() != "x86_64":
        return
    logs.clear()
    v3 = build_artifact(art, avx2_profile(), tmp_path / "v3", log=logs.append)
    fused = json.loads((v3 / "manifest.json").read_text())["build"]["fused"]
    assert fused["matmul_kernel"] == "cabinlm" and fused["head_kernel"] == "cabinlm"
    assert (fused["kernels"]["march"], fused["kernels"]["matmul_isa"]) == ("x86-64-v3", "avx2")
    assert any("compiled for -march=x86-64-v3" in line for line in logs)
    assert any("4-bit matrices: cabinlm's BlockQ4MatMul (avx2)" in line for line in logs)
    assert np.array_equal(Decoder(v3).feed(ids, all_logits=True), Decoder(own).feed(ids, all_logits=True))


def avx2_profile():
    """The cpu profile for a car whose CPU stops at AVX2 (x86-64-v3): the kernels compiled for it."""
    text = (Path(load_profile.__code__.co_filename).parent / "builtin" / "cpu.toml").read_text()
    assert 'cpu_march = "native"' in text
    return parse_profile(text.replace('cpu_march = "native"', 'cpu_march = "x86-64-v3"').replace('name = "cpu"', 'name = "cpu-v3"'),
                         "cpu-v3.toml")  # fmt: skip
