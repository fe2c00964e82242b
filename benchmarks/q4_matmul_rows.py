"""BlockQ4MatMul alone: the time of one decode step's worth of the layers' int4 matmuls (SmolLM2-135M's
shapes: per layer q|k|v 576 -> 960, o 576 -> 576, gate|up 576 -> 3072, and the SwiGLU down
projection 1536 -> 576; 30 layers, 66 MB of Q4_1 blocks, more than the L3 cache) for M rows at once,
M = 1..4 the seats of a batched decode step, larger M a prefill chunk.

    python benchmarks/q4_matmul_rows.py [--library LIB.so ...] [--rows 1 2 3 4 8 64] [--threads 2] [--records FILE]

Each library (default: one compiled now from this checkout's sources, as `cabinlm build` does) gets
the same random weights and rows; per M: the minimum over 5 repeats of the mean of 20 runs, and
whether its outputs equal the first library's and, row by row, its own one-row runs (bit for bit).
With --threads 1 the calling thread's CPU time is reported too (the kernels' cost, less disturbed by a
busy machine than wall time). One line per (library, M); --records FILE appends them as records, each
with the library's sha256 and matmul path (docs/results.md#x86-and-arm-paths, #seats)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.engines.ort_fused import kernels, single_op
from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

HIDDEN, QKV, FFN, LAYERS = 576, 960, 1536, 30


def _blob(rng: np.random.Generator, K: int, N: int) -> np.ndarray:
    q = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = rng.uniform(1e-3, 2e-2, (K // 32, N)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(-2, 15, (K // 32, N))).astype(np.float16).astype(np.float32)
    return block_q4_layout(q, d, m)


def model_bytes(seed: int = 0) -> bytes:
    """x (1, M, 576) and gate|up (1, M, 3072) -> every layer's four products, as outputs."""
    rng = np.random.default_rng(seed)
    nodes, inits, outs = [], [], []
    shapes = (("qkv", HIDDEN, QKV, "x", kernels.MATMUL_OP), ("o", HIDDEN, HIDDEN, "x", kernels.MATMUL_OP),
              ("gu", HIDDEN, 2 * FFN, "x", kernels.MATMUL_OP), ("down", FFN, HIDDEN, "gu_in", kernels.SWIGLU_MATMUL_OP))
    for layer in range(LAYERS):
        for name, K, N, src, op in shapes:
            w = f"w.{layer}.{name}"
            inits.append(onnx.numpy_helper.from_array(_blob(rng, K, N), w))
            nodes.append(helper.make_node(op, [src, w], [f"y.{layer}.{name}"], domain=kernels.DOMAIN))
            outs.append(helper.make_tensor_value_info(f"y.{layer}.{name}", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", HIDDEN]),
              helper.make_tensor_value_info("gu_in", TensorProto.FLOAT, [1, "m", 2 * FFN])]
    return single_op.model(nodes, inputs, outs, inits, name="q4_rows").SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", type=Path, nargs="*", default=[])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--records", type=Path, default=None, help="append one record per (library, rows) here")
    a = ap.parse_args()
    rec = Recorder("benchmarks/q4_matmul_rows.py")
    libraries = list(a.library)
    if not libraries:
        from cabinlm.engines.ort_fused.kernels.compiler import compile_library

        libraries = [compile_library(Path(tempfile.mkdtemp(prefix="q4rows-"))).path]
    model = model_bytes()
    rng = np.random.default_rng(1)
    feeds = {M: {"x": rng.standard_normal((1, M, HIDDEN)).astype(np.float32),
                 "gu_in": (rng.standard_normal((1, M, 2 * FFN)) * 2).astype(np.float32)} for M in a.rows}  # fmt: skip
    first: dict[int, list[np.ndarray]] = {}
    for lib in libraries:
        s = single_op.session(model, library=lib, threads=a.threads)
        for M in a.rows:
            start, load = utc_now(), load_average()
            got = s.run(None, feeds[M])
            alone = [s.run(None, {k: v[:, i : i + 1] for k, v in feeds[M].items()}) for i in range(M)]
            rows_alone = all(np.array_equal(np.concatenate([a[j] for a in alone], axis=1), got[j])
                             for j in range(len(got)))  # fmt: skip
            same = None
            if M in first:
                same = all(np.array_equal(x, y) for x, y in zip(first[M], got))
            else:
                first[M] = got
            for _ in range(3):
                s.run(None, feeds[M])
            best, cpu = [], []
            for _ in range(5):
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(20):
                    s.run(None, feeds[M])
                best.append((time.perf_counter() - t0) / 20)
                cpu.append((time.thread_time() - c0) / 20)
            r = rec.add({"rows": M}, {"ms": round(min(best) * 1e3, 3), "ms_per_row": round(min(best) * 1e3 / M, 3),
                                      # with --threads 1 the calling thread runs everything: its CPU time is
                                      # the kernels' whole cost, less disturbed by other processes than wall time
                                      "calling_thread_cpu_ms": round(min(cpu) * 1e3, 3),
                                      "rows_are_one_row_runs": rows_alone, "equals_first_library": same},
                        utc_start=start, loadavg_start=load, library=lib, threads=a.threads)  # fmt: skip
            print(f"{lib} ({r.matmul_isa}): {M} rows {r.figures['ms']} ms, rows are one-row runs: {rows_alone}"
                  f"{'' if same is None else f', equal to the first library: {same}'}", flush=True)
    rec.write_to(a.records)


if __name__ == "__main__":
    main()
