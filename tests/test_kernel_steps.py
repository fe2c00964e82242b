"""cabinlm's attention kernel running a chunk's rows as one-token steps (kernels/int8_kv_attention.cc,
"What row i sees"; inputs 11..15): row i of a chunk is, bit for bit, the one-token kernel call that
follows i steps over the chunk's first tokens (their K/V in their slots, the window's oldest tokens
they overwrote gone, the sink / pinned keys in row i's own rotation); against an independent float64
reference of the same semantics; bad inputs get the kernel's own error. The runtime's side (the slot
table's per-row facts, the fused build's verified drafts) is in tests/test_speculative.py and
tests/test_cache.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from cabinlm.engines.ort_fused import kernels
from cabinlm.engines.ort_fused.kernels.compiler import compile_library

H, HKV, D = 6, 2, 32  # three query heads per kv head
N, C = 60, 8  # slots, scratch rows
R = N + C
NH = 140  # slots of the cases with empty pinned tiles (the kernel skips whole tiles of 32 positions)
LAYERS = 3  # key_source holds three layers; the node reads LAYER
LAYER = 1
P = 12  # sink + pinned rows key_source holds
NAMES = ("qkv", "keys", "values", "seqlens_k", "total", "cos", "sin", "position_ids", "bias", "k_scale", "v_scale",
         "key_source", "source_cos", "source_sin", "layer", "row_slots")  # fmt: skip


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """One Int8KVAttention node taking all 16 inputs, from the library `cabinlm build` compiles (under
    emulation, `make test-arm`, the one cross-compiled for aarch64: CABINLM_TEST_KERNEL_LIBRARY)."""
    handed = os.environ.get("CABINLM_TEST_KERNEL_LIBRARY")
    library = Path(handed) if handed else compile_library(tmp_path_factory.mktemp("kernels")).path
    f, i8, i64 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT64
    types = dict(qkv=f, keys=i8, values=i8, seqlens_k=TensorProto.INT32, total=TensorProto.INT32, cos=f, sin=f,
                 position_ids=i64, bias=f, k_scale=f, v_scale=f, key_source=f, source_cos=f, source_sin=f, layer=i64,
                 row_slots=i64)  # fmt: skip
    inputs = [helper.make_tensor_value_info(name, types[name], None) for name in NAMES]
    node = helper.make_node(kernels.ATTENTION_OP, list(NAMES), ["out"], domain=kernels.DOMAIN)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(kernels.DOMAIN, 1)]
    graph = helper.make_graph([node], "attention", inputs, [helper.make_tensor_value_info("out", f, None)])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(session, feeds: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The output and the caches after the run (the kernel writes its cache inputs in place)."""
    b = session.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    b.bind_output("out")
    session.run_with_iobinding(b)
    return b.copy_outputs_to_cpu()[0], feeds["keys"], feeds["values"]


class Chunk:
    """n rows after F slots in use, bound for `slots` (the rows' destination slots): random cache codes
    (`rows` cache rows), hidden (empty) slots, un-rotated sink / pinned keys (K of key_source's P rows
    in use) with one rotation per row, and each row's own query rotation."""

    def __init__(self, rng, n: int, F: int, slots, K: int, hidden=(), rows: int = R):
        self.n, self.F, self.K = n, F, K
        self.slots = np.asarray(slots, np.int64)
        self.qkv = (rng.standard_normal((1, n, (H + 2 * HKV) * D)) * 2).astype(np.float32)
        self.keys = rng.integers(-120, 121, (1, HKV, rows, D)).astype(np.int8)
        self.values = rng.integers(-120, 121, (1, HKV, rows, D)).astype(np.int8)
        angles = rng.random((n, D // 2)) * 6
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        self.hidden = np.zeros(F, bool)
        self.hidden[list(hidden)] = True
        self.source = (rng.standard_normal((1, LAYERS * HKV, P, D)) * 2).astype(np.float32)
        src_angles = rng.random((n, K, D // 2)) * 6
        self.source_cos, self.source_sin = np.cos(src_angles).astype(np.float32), np.sin(src_angles).astype(np.float32)
        pair = rng.random((HKV, D // 2)) * 0.04 + 0.02  # keys: one scale per rotation pair
        self.k_scale = np.concatenate([pair, pair], -1).reshape(-1).astype(np.float32)
        self.v_scale = (rng.random(HKV * D) * 0.03 + 0.01).astype(np.float32)

    def bias(self) -> np.ndarray:
        """(1, 1, n, F + n): the hidden slots, then the chunk causally."""
        b = np.zeros((self.n, self.F + self.n), np.float32)
        b[:, : self.F][:, self.hidden] = -1e30
        b[:, self.F :] = np.where(np.tri(self.n, dtype=bool), 0, -1e30)
        return b[None, None]

    def feeds(self) -> dict:
        F, n = self.F, self.n
        return dict(qkv=self.qkv, keys=self.keys.copy(), values=self.values.copy(),
                    seqlens_k=np.array([F + n - 1], np.int32), total=np.array(F + n, np.int32), cos=self.cos,
                    sin=self.sin, position_ids=np.arange(n, dtype=np.int64)[None], bias=self.bias(),
                    k_scale=self.k_scale, v_scale=self.v_scale, key_source=self.source, source_cos=self.source_cos,
                    source_sin=self.source_sin, layer=np.array([LAYER], np.int64), row_slots=self.slots)  # fmt: skip

    def sees(self, i: int) -> tuple[int, dict[int, int]]:
        """X_i and, for each position up to it that holds a chunk row, that row."""
        X = max([self.F] + [int(s) + 1 for s in self.slots[:i]])
        chunk = {int(s): m for m, s in enumerate(self.slots[:i])}  # the latest row wins
        chunk[X] = i
        return X, chunk

    def step_feeds(self, i: int, keys: np.ndarray, values: np.ndarray) -> dict:
        """The one-token call row i stands for: the caches with rows 0..i-1 in their slots (their K/V as
        the chunk wrote them at F + m), row i's own query and rotation of the sink / pinned keys."""
        X, chunk = self.sees(i)
        k, v = self.keys.copy(), self.values.copy()
        bias = np.zeros((1, 1, 1, X + 1), np.float32)
        bias[0, 0, 0, : self.F][self.hidden] = -1e30
        bias[0, 0, 0, self.F : X] = -1e30  # empty slots after F, unless a row took one
        for pos, m in chunk.items():
            if pos < X:
                k[:, :, pos], v[:, :, pos] = keys[:, :, self.F + m], values[:, :, self.F + m]
                bias[0, 0, 0, pos] = 0.0
        return dict(qkv=self.qkv[:, i : i + 1], keys=k, values=v, seqlens_k=np.array([X], np.int32),
                    total=np.array(X + 1, np.int32), cos=self.cos, sin=self.sin,
                    position_ids=np.array([[i]], np.int64), bias=bias, k_scale=self.k_scale, v_scale=self.v_scale,
                    key_source=self.source, source_cos=self.source_cos[i : i + 1], source_sin=self.source_sin[i : i + 1],
                    layer=np.array([LAYER], np.int64), row_slots=np.array([X], np.int64))  # fmt: skip


CASES = {  # n, F, slots, K, hidden[, cache rows]
    "full window: rows overwrite the oldest slots": (6, N, [40, 41, 42, 43, 44, 45], 7, [9, 10]),
    "the ring wraps inside the chunk": (5, N, [58, 59, 12, 13, 14], 12, []),
    "the window fills, then turns over": (6, 57, [57, 58, 59, 12, 13, 14], 5, [7]),
    "an empty pinned region before the window": (4, 20, [30, 31, 32, 33], 4, list(range(8, 20))),
    "the chunk semantics (slots F, F+1, ...)": (5, 33, [33, 34, 35, 36, 37], 6, [5]),
    "a long chunk (16-lane edges)": (8, N, list(range(20, 28)), 0, []),
    # the pinned slots a short system prompt leaves empty, whole tiles of them: skipped by the block and
    # by each step alike; then a block that cannot skip them (a chunk row lands there) against its
    # first row's step, which does: bit for bit all the same
    "empty pinned tiles, skipped": (4, NH, [100, 101, 102, 103], 5, list(range(5, 100)), NH + C),
    "a chunk row in the empty pinned tiles": (3, NH, [40, 41, 42], 5, list(range(5, 100)), NH + C),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_row_is_its_one_token_step_bit_for_bit(session, case):
    n, F, slots, K, hidden, *rows = CASES[case]
    c = Chunk(np.random.default_rng(len(case)), n, F, slots, K, hidden, *rows)
    out, keys, values = run(session, c.feeds())
    for i in range(n):
        one, k1, v1 = run(session, c.step_feeds(i, keys, values))
        X, _ = c.sees(i)
        np.testing.assert_array_equal(out[0, i], one[0, 0], err_msg=f"row {i}")
        # the step writes its own K/V where the chunk wrote row i's
        np.testing.assert_array_equal(k1[:, :, X], keys[:, :, F + i])
        np.testing.assert_array_equal(v1[:, :, X], values[:, :, F + i])


def reference(c: Chunk) -> np.ndarray:
    """The semantics in float64 numpy: each row's view (sees()), the sink / pinned keys rotated from
    key_source by the row's tables and quantized with the key scales, the chunk's own K/V as the
    kernel quantizes them; softmax over the visible positions."""
    q = c.qkv[0, :, : H * D].reshape(c.n, H, D).astype(np.float64)
    k = c.qkv[0, :, H * D : (H + HKV) * D].reshape(c.n, HKV, D).astype(np.float64)
    v = c.qkv[0, :, (H + HKV) * D :].reshape(c.n, HKV, D).astype(np.float64)
    ks, vs = c.k_scale.reshape(HKV, D).astype(np.float64), c.v_scale.reshape(HKV, D).astype(np.float64)
    h = D // 2

    def rotate(x, cos, sin):
        cos, sin = cos.astype(np.float64), sin.astype(np.float64)
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    new_k = np.stack([np.clip(np.rint(rotate(k[i], c.cos[i], c.sin[i]) / ks), -127, 127) for i in range(c.n)])
    new_v = np.stack([np.clip(np.rint(v[i] / vs), -127, 127) for i in range(c.n)])
    src = c.source[0, LAYER * HKV : (LAYER + 1) * HKV].astype(np.float64)  # (HKV, P, D)
    out = np.zeros((c.n, H, D))
    for i in range(c.n):
        X, chunk = c.sees(i)
        step = np.clip(np.rint(rotate(src[:, : c.K], c.source_cos[i], c.source_sin[i]) / ks[:, None]), -127, 127)
        for hq in range(H):
            g = hq // (H // HKV)
            keys, vals, visible = [], [], []
            for pos in range(X + 1):
                if pos in chunk:
                    m = chunk[pos]
                    keys.append(new_k[m, g]), vals.append(new_v[m, g]), visible.append(True)
                elif pos < c.F:
                    keys.append(step[g, pos] if pos < c.K else c.keys[0, g, pos].astype(np.float64))
                    vals.append(c.values[0, g, pos].astype(np.float64))
                    visible.append(not c.hidden[pos])
            keys, vals = np.stack(keys) * ks[g], np.stack(vals) * vs[g]
            scores = keys @ rotate(q[i, hq], c.cos[i], c.sin[i]) / np.sqrt(D)
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max())
            out[i, hq] = (p / p.sum()) @ vals
    return out.reshape(c.n, H * D)


@pytest.mark.parametrize("case", list(CASES))
def test_the_rows_follow_a_float64_reference_of_what_each_row_sees(session, case):
    n, F, slots, K, hidden, *rows = CASES[case]
    c = Chunk(np.random.default_rng(len(case)), n, F, slots, K, hidden, *rows)
    out, _, _ = run(session, c.feeds())
    want = reference(c)
    # float32 against float64: a step key may round to the neighbouring int8 code (one scale step)
    np.testing.assert_allclose(out[0], want, atol=2e-2 * np.abs(want).max())
    # with teeth: the chunk semantics (every row sees the cache as it was before the chunk) differ, but
    # where every row lands in an empty slot (the two then differ only in the rows' positions)
    if list(slots) != list(range(F, F + n)) and not all(s < F and c.hidden[s] for s in slots):
        plain = Chunk(np.random.default_rng(len(case)), n, F, range(F, F + n), K, hidden, *rows)
        plain.source_cos, plain.source_sin = c.source_cos[:1], c.source_sin[:1]
        other, _, _ = run(session, plain.feeds())
        assert np.abs(other[0] - out[0]).max() > 10 * 2e-2 * np.abs(want).max()


def test_bad_step_inputs_get_the_kernels_own_error(session, tmp_path):
    c = Chunk(np.random.default_rng(1), 4, N, [40, 41, 42, 43], 5)
    bad = {
        "row_slots": (c.feeds() | {"row_slots": np.array([2, 41, 42, 43], np.int64)}, "not a slot after the 5 sink / pinned rows"),
        "layer": (c.feeds() | {"layer": np.array([LAYERS], np.int64)}, "layer 3 is not one of key_source's 3"),
        "versions": (c.feeds() | {"source_cos": c.source_cos[:2], "source_sin": c.source_sin[:2]}, "one index and (tokens,)"),
        "rows": (c.feeds() | {"key_source": c.source[:, :, :4]}, "key_source holds 4"),
    }
    for name, (feeds, message) in bad.items():
        with pytest.raises(Exception, match="Int8KVAttention: .*" + message.replace("(", r"\(").replace(")", r"\)")):
            run(session, feeds)
