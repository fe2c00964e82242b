"""What ONNX Runtime's SkipSimplifiedLayerNormalization (the fused cpu build's norms, 2 a layer) costs a
node at 1, 4, 8 and 64 rows of SmolLM2-135M's width (576): a chain of 61 such nodes, as a decode step
of the 30 layers runs them, on THREADS threads with the pool spinning (as the runtime's sessions do),
the median of 300 runs divided by 61. One row runs on the calling thread; more rows go to the pool,
so the difference between 1 and 4 rows is what four seats' batched step pays for the norms.

    python benchmarks/norm_rows.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper, numpy_helper

NODES, WIDTH = 61, 576


def session(rows: int, threads: int) -> ort.InferenceSession:
    nodes, x, r = [], "x", "r"
    gamma = numpy_helper.from_array(np.random.default_rng(0).random(WIDTH, np.float32) + 0.5, "gamma")
    for i in range(NODES):
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [x, r, "gamma"], [f"h{i}", "", "", f"s{i}"],
                                      domain="com.microsoft", epsilon=1e-5))  # fmt: skip
        x, r = f"h{i}", f"s{i}"
    ins = [helper.make_tensor_value_info(n, T.FLOAT, [1, rows, WIDTH]) for n in ("x", "r")]
    graph = helper.make_graph(nodes, "norms", ins, [helper.make_tensor_value_info(x, T.FLOAT, None)], [gamma])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)  # fmt: skip
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(model.SerializeToString(), so)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    for rows in (1, 4, 8, 64):
        s = session(rows, a.threads)
        feeds = {n: rng.random((1, rows, WIDTH), np.float32) for n in ("x", "r")}
        for _ in range(50):
            s.run(None, feeds)
        times = []
        for _ in range(300):
            t = time.perf_counter()
            s.run(None, feeds)
            times.append(time.perf_counter() - t)
        print(f"{rows} rows: {statistics.median(times) / NODES * 1e6:.2f} us a node")


if __name__ == "__main__":
    main()
