"""cabinlm's BlockQ8MatMul (kernels/block_q8_matmul.cc): the fused cpu build's LM head over its
symmetric int8 blocks, read in place by every graph of the build (the one-seat graph and the batched
ones), so no session packs a copy of it.

Checked against independent references: numpy's float64 product of the quantized rows and the
exported blocks (the kernel's arithmetic), x @ W (the int8 activations' rounding apart), ONNX
Runtime's MatMulNBits on the same blocks (what the head ran on before), and, in the SmolLM2 build,
the exported embedding table's rows gathered back out of the kernel's tiles.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_kernels import _matmul_session, _row_codes, library  # noqa: F401  (library: the module fixture)

from cabinlm.engines.onnxruntime.offline import read_graph
from cabinlm.engines.ort_fused import kernels, single_op
from cabinlm.engines.ort_fused.block_layouts import block_q8_layout
from cabinlm.engines.ort_fused.kernels.compiler import compile_library
from cabinlm.engines.ort_fused.node_builder import ExportedWeights
from cabinlm.contract.manifest import load_manifest


def _q8_case(K: int, N: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes (K, N) in -127..127 and float32 scales (K / 32, N), as the export writes a head."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    q[:32, 0] = 127  # a block at the top of the range ...
    q[32:64, 1] = -127  # ... and one at the bottom
    s = (rng.random((K // 32, N)) * 0.02 + 1e-3).astype(np.float32)
    return q, s


def _q8_reference(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic in float64: each row quantized per block of 32 to int8 codes (scale
    amax / 127, half to even), times the exported blocks."""
    K = x.shape[1]
    codes, scale = _row_codes(x)
    dot = np.einsum("mbk,bkn->mbn", codes, q.reshape(K // 32, 32, -1).astype(np.float64))
    return (dot * s[None].astype(np.float64) * scale[..., None]).sum(1)


def test_the_q8_layout_holds_the_exported_codes_and_scales():
    """An independent reading of block_q8_layout gives back every code and scale; a width that is not
    tiles of 16, or a code of -128 (outside the symmetric range), is not laid out."""
    K, N = 96, 48
    q, s = _q8_case(K, N)
    blob = block_q8_layout(q, s)
    assert blob.shape == (N // 16, K // 32, 576) and blob.dtype == np.uint8
    for t in range(N // 16):
        for b in range(K // 32):
            cell = blob[t, b]
            for j in range(8):
                for c in range(16):
                    for i in range(4):
                        assert int(cell[64 * j + 4 * c + i]) - 128 == q[32 * b + 4 * j + i, 16 * t + c]
            np.testing.assert_array_equal(cell[512:].view(np.float32), s[b, 16 * t : 16 * t + 16])
    assert block_q8_layout(q[:, :40], s[:, :40]) is None  # 40 columns: not tiles of 16
    q[5, 5] = -128
    assert block_q8_layout(q, s) is None


@pytest.mark.parametrize("path", ["native", "generic"])
def test_block_q8_matmul_computes_the_int8_block_product(path, library, tmp_path):  # noqa: F811
    """Both paths (this CPU's, and the plain C++ one other CPUs get) against the numpy reference of
    the kernel's arithmetic (float32 rounding apart) and x @ W in float64 (the int8 activations'
    rounding apart); a block of zeros, several tiles, row counts around the blocks of 4 rows; the
    two paths agree bit for bit."""
    native = _matmul_session(block_q8_layout(*_q8_case(160, 80, seed=1)), library, op=kernels.Q8_MATMUL_OP)
    if path == "generic":
        compiled = compile_library(tmp_path, defines=("CABINLM_GENERIC",))
        assert compiled.facts.matmul_isa == "generic"
        library = compiled.path
    K, N = 160, 80  # five tiles: the parallel units take two neighbours each, the last unit one tile
    q, s = _q8_case(K, N, seed=1)
    session = _matmul_session(block_q8_layout(q, s), library, op=kernels.Q8_MATMUL_OP)
    W = (q.reshape(K // 32, 32, N) * s[:, None].astype(np.float64)).reshape(K, N)
    rng = np.random.default_rng(2)
    for rows in (1, 3, 4, 9):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x[0, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
        y = session.run(None, {"x": x[None]})[0][0]
        assert y.shape == (rows, N)
        ref = _q8_reference(x, q, s)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(y - ref).max()
        exact = x.astype(np.float64) @ W
        assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations
        assert np.array_equal(y, native.run(None, {"x": x[None]})[0][0])


def test_block_q8_matmul_rows_are_one_row_runs_bit_for_bit(library):  # noqa: F811
    """A row's logits whatever rows run beside it: a batched graph's seat gets its own run's logits,
    a verified draft's rows their one-token steps'."""
    session = _matmul_session(block_q8_layout(*_q8_case(96, 48, seed=3)), library, op=kernels.Q8_MATMUL_OP)  # three tiles
    x = np.random.default_rng(4).standard_normal((1, 11, 96)).astype(np.float32)
    chunk = session.run(None, {"x": x})[0]
    steps = np.concatenate([session.run(None, {"x": x[:, i : i + 1]})[0] for i in range(11)], axis=1)
    assert np.array_equal(chunk, steps)


def test_block_q8_matmul_refuses_weights_of_another_shape(library):  # noqa: F811
    session = _matmul_session(block_q8_layout(*_q8_case(64, 16)), library, width="k", op=kernels.Q8_MATMUL_OP)
    with pytest.raises(Exception, match=r"BlockQ8MatMul: x \(1, 2, 96\) and weights \(1, 2, 576\) are not \(\.\.\., K\)"):
        session.run(None, {"x": np.zeros((1, 2, 96), np.float32)})


def test_block_q8_matmul_follows_matmulnbits_on_the_same_blocks(library):  # noqa: F811
    """What the head ran on before: MatMulNBits, 8 bits, accuracy level 4 (int8 activations too), over
    the same blocks as (N, K / 32, 32) codes + 128: the same products within float rounding."""
    K, N = 576, 256
    q, s = _q8_case(K, N, seed=6)
    nb = K // 32
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=8, block_size=32,
                            accuracy_level=4)  # fmt: skip
    model = single_op.model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", K])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                            [onnx.numpy_helper.from_array((q.T.astype(np.int16) + 128).astype(np.uint8).reshape(N, nb, 32), "w"),
                             onnx.numpy_helper.from_array(np.ascontiguousarray(s.T), "s")], name="nbits")  # fmt: skip
    nbits = single_op.session(model, threads=2)
    ours = _matmul_session(block_q8_layout(q, s), library, op=kernels.Q8_MATMUL_OP)
    x = np.random.default_rng(7).standard_normal((1, 5, K)).astype(np.float32)
    a, b = ours.run(None, {"x": x})[0], nbits.run(None, {"x": x})[0]
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), np.abs(a - b).max()


def test_the_smollm2_build_runs_its_head_in_every_graph_and_gathers_the_embedding_from_its_tiles(smollm2_fused, smollm2,
                                                                                                    export_to):  # fmt: skip
    """The default cpu build of SmolLM2 (tied int8 head): the LM head on BlockQ8MatMul in the one-seat
    graph and in each batched graph (they end in logits; no head graph, no MatMulNBits anywhere), the
    manifest saying so; and the embedding's rows, gathered out of the kernel's tiles, are the exported
    table's rows (codes times scales) bit for bit."""
    build = smollm2_fused
    manifest = json.loads((build / "manifest.json").read_text())
    fused = manifest["build"]["fused"]
    assert fused["head_kernel"] == "cabinlm" and fused["seat_batches"] == [2, 4]
    assert "graph_head" not in manifest["files"]
    for name in ["decoder.opt.onnx", *(f"decoder.seats{b}.onnx" for b in (2, 4))]:
        g = onnx.load(str(build / name), load_external_data=False).graph
        ops = [n.op_type for n in g.node]
        assert ops.count(kernels.Q8_MATMUL_OP) == 1 and "MatMulNBits" not in ops, name
        assert g.output[0].name == "logits", name

    # the embedding: input_ids -> the rows the first layer reads, cut out of the one-seat graph
    model = onnx.load(str(build / "decoder.opt.onnx"))
    embed = next(n.output[0] for n in model.graph.node if n.op_type == "GatherElements")
    rows = next(n.output[0] for n in model.graph.node if n.op_type == "Reshape" and embed in _ancestors(model, n))
    needed = _ancestors(model, next(n for n in model.graph.node if rows in n.output)) | {rows}
    nodes = [n for n in model.graph.node if any(o in needed for o in n.output)]
    inits = [i for i in model.graph.initializer if i.name in needed]
    ids_in = next(i for i in model.graph.input if i.name == "input_ids")
    cut = helper.make_model(helper.make_graph(nodes, "embed", [ids_in], [helper.make_tensor_value_info(rows, TensorProto.FLOAT, None)],
                                              inits), opset_imports=model.opset_import, ir_version=10)  # fmt: skip
    ids = np.array([0, 1, 15, 16, 17, 12345, smollm2.spec.vocab_size - 1], np.int64)
    got = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    artifact = export_to(smollm2, kv="int8", sink=4, pinned=60, window=252, chunk=32, weights="int4")  # smollm2_fused's
    W = ExportedWeights(read_graph(artifact, load_manifest(artifact)))
    table = W.get("lm_head.q").T.astype(np.float32).reshape(-1, 18, 32) * W.get("lm_head.scale").T.astype(np.float32)[..., None]
    assert np.array_equal(got.reshape(len(ids), -1), table[ids].reshape(len(ids), -1))


def _ancestors(model: onnx.ModelProto, node) -> set[str]:
    """Every tensor name `node` depends on (its inputs, theirs, ...)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, todo = set(), list(node.input)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in producer:
            todo.extend(producer[name].input)
    return seen
