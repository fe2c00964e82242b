"""The LM head alone: cabinlm's BlockQ8MatMul (kernels/block_q8_matmul.cc) against ONNX Runtime's
MatMulNBits (8 bits, accuracy level 4: the head's kernel before it) on the same random int8 blocks
of a head's shape, in one session each, 2 threads; the median of 50 runs after 10, per row count (a
decode step's rows: one per seat, and a verified draft's rows). One JSON line per row count.

    python benchmarks/head_kernel.py BUILD/libcabinlm_kernels.so [--vocab 49152 --hidden 576] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from cabinlm.engines.ort_fused.block_layouts import block_q8_layout


def session(node, inits, library: str | None, threads: int) -> ort.InferenceSession:
    g = helper.make_graph([node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", node_k(inits)])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("ai.cabinlm", 1), helper.make_opsetid("com.microsoft", 1)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library:
        so.register_custom_ops_library(library)
    return ort.InferenceSession(helper.make_model(g, opset_imports=opsets, ir_version=10).SerializeToString(), so)


def node_k(inits) -> int:
    w = inits[0]
    return w.dims[1] * 32  # (N / 16, K / 32, 576) or (N, K / 32, 32): K / 32 blocks either way


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("library", help="a build's libcabinlm_kernels.so")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 20, 36])
    a = ap.parse_args()
    K, N, nb = a.hidden, a.vocab, a.hidden // 32
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    s = (rng.random((nb, N)) * 0.01 + 0.001).astype(np.float32)
    ours = session(helper.make_node("BlockQ8MatMul", ["x", "w"], ["y"], domain="ai.cabinlm"),
                   [numpy_helper.from_array(block_q8_layout(q, s), "w")], a.library, a.threads)  # fmt: skip
    codes = (q.T.astype(np.int16) + 128).astype(np.uint8).reshape(N, nb, 32)
    nbits = session(helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=8,
                                     block_size=32, accuracy_level=4),
                    [numpy_helper.from_array(codes, "w"), numpy_helper.from_array(np.ascontiguousarray(s.T), "s")], None,
                    a.threads)  # fmt: skip
    for rows in a.rows:
        x = rng.standard_normal((rows, K)).astype(np.float32)
        out = {"rows": rows}
        for name, sess in (("BlockQ8MatMul", ours), ("MatMulNBits", nbits)):
            for _ in range(10):
                sess.run(None, {"x": x})
            times = []
            for _ in range(50):
                t = time.perf_counter()
                sess.run(None, {"x": x})
                times.append(time.perf_counter() - t)
            out[f"{name}_ms"] = round(1e3 * float(np.median(times)), 3)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
