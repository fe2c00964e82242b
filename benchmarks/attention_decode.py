"""cabinlm's Int8KVAttention alone, the way a decode step runs it: one node per layer for SmolLM2-135M's
30 layers (9 query heads, 3 kv heads, head_dim 64), 1 token (a step) or 4 (a verified draft's rows)
after FILLED cached slots, random int8 caches and queries, the same inputs for every library. Per
library and case: the median of RUNS runs in ms, and whether its outputs equal the first library's
bit for bit (made to compare two builds' kernel libraries: a change that must not change arithmetic).

    python benchmarks/attention_decode.py LIB.so [LIB.so ...] [--filled 256 600 1148] [--threads 1] [--runs 300] \
        [--records FILE]

LIB.so: a build's libcabinlm_kernels.so. The caches (14 MB at 1148 slots) can stay in a large L3
here, as they do not inside a whole decode step: this measures the kernel's arithmetic, not memory.
One line per (library, filled, tokens); --records FILE appends them as records, each with the
library's sha256 and matmul path (docs/results.md#x86-and-arm-paths, #seats)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.engines.ort_fused import kernels, single_op

LAYERS, H, HKV, DH, SLOTS, CHUNK = 30, 9, 3, 64, 1148, 64


def session(library: str, filled: int, tokens: int, threads: int) -> ort.InferenceSession:
    rows = SLOTS + CHUNK
    ins = [helper.make_tensor_value_info("qkv", T.FLOAT, [1, tokens, (H + 2 * HKV) * DH]),
           helper.make_tensor_value_info("cos", T.FLOAT, [rows, DH // 2]), helper.make_tensor_value_info("sin", T.FLOAT, [rows, DH // 2]),
           helper.make_tensor_value_info("pos", T.INT64, [1, tokens]),
           helper.make_tensor_value_info("bias", T.FLOAT, [1, 1, tokens, filled + tokens]),
           helper.make_tensor_value_info("seqlens", T.INT32, [1]), helper.make_tensor_value_info("total", T.INT32, [])]  # fmt: skip
    nodes, inits, outs = [], [], []
    for i in range(LAYERS):
        ins += [helper.make_tensor_value_info(f"k{i}", T.INT8, [1, HKV, rows, DH]),
                helper.make_tensor_value_info(f"v{i}", T.INT8, [1, HKV, rows, DH])]  # fmt: skip
        for n in ("ks", "vs"):
            inits.append(numpy_helper.from_array(np.full(HKV * DH, 0.05, np.float32), f"{n}{i}"))
        names = ["qkv", f"k{i}", f"v{i}", "seqlens", "total", "cos", "sin", "pos", "bias", f"ks{i}", f"vs{i}"]
        nodes.append(helper.make_node(kernels.ATTENTION_OP, names, [f"o{i}"], domain=kernels.DOMAIN))
        outs.append(helper.make_tensor_value_info(f"o{i}", T.FLOAT, None))
    return single_op.session(single_op.model(nodes, ins, outs, inits, name="attention"), library=library, threads=threads)


def measure(library: str, filled: int, tokens: int, threads: int, runs: int) -> tuple[float, np.ndarray]:
    s = session(library, filled, tokens, threads)
    rng = np.random.default_rng(filled * 10 + tokens)
    rows = SLOTS + CHUNK
    feeds = {"qkv": rng.standard_normal((1, tokens, (H + 2 * HKV) * DH), np.float32),
             "cos": np.cos(rng.random((rows, DH // 2)) * 6).astype(np.float32),
             "sin": np.sin(rng.random((rows, DH // 2)) * 6).astype(np.float32),
             "pos": np.arange(filled, filled + tokens, dtype=np.int64)[None],
             "bias": np.where(np.tri(tokens, filled + tokens, filled, dtype=bool), 0, -1e30).astype(np.float32)[None, None],
             "seqlens": np.array([filled + tokens - 1], np.int32), "total": np.array(filled + tokens, np.int32)}  # fmt: skip
    b = s.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    caches = [(rng.standard_normal((1, HKV, rows, DH)) * 20).clip(-127, 127).astype(np.int8) for _ in range(2 * LAYERS)]
    for i in range(LAYERS):  # the kernel writes the chunk's rows in place: the same rows every run
        b.bind_cpu_input(f"k{i}", caches[2 * i])
        b.bind_cpu_input(f"v{i}", caches[2 * i + 1])
        b.bind_output(f"o{i}")
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run_with_iobinding(b)
        times.append(time.perf_counter() - t)
    out = np.concatenate([o.numpy().ravel() for o in b.get_outputs()])
    return statistics.median(times[runs // 10 :]) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("libraries", nargs="+")
    ap.add_argument("--filled", type=int, nargs="+", default=[256, 600, 1148])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--records", type=Path, default=None, help="append one record per (library, filled, tokens) here")
    a = ap.parse_args()
    rec = Recorder("benchmarks/attention_decode.py")
    first: dict[tuple[int, int], np.ndarray] = {}
    for library in a.libraries:
        for filled in a.filled:
            for tokens in a.tokens:
                start, load = utc_now(), load_average()
                ms, out = measure(library, filled, tokens, a.threads, a.runs)
                same = None if (filled, tokens) not in first else bool(np.array_equal(out, first[(filled, tokens)]))
                first.setdefault((filled, tokens), out)
                r = rec.add({"filled": filled, "tokens": tokens, "runs": a.runs}, {"ms": round(ms, 3), "equals_first_library": same},
                            utc_start=start, loadavg_start=load, library=library, threads=a.threads)  # fmt: skip
                print(f"{library} ({r.matmul_isa}): {filled} cached, {tokens} rows: {ms:.3f} ms"
                      f"{'' if same is None else f', equal to the first library: {same}'}", flush=True)
    rec.write_to(a.records)


if __name__ == "__main__":
    main()
