"""The bandwidth-bound ceiling of decode (docs/benchmarks.md): measured memory read bandwidth divided
by the bytes one decode step must read (weights as the engine holds them, plus the KV cache). With
--seats N, also a step of N seats together (the weights once, N caches) and its tokens/s against one
seat's ceiling: what reading memory alone allows N seats (docs/benchmarks.md, section 20).

    python benchmarks/bandwidth.py BUILD_DIR [--threads 2] [--seats 4]
"""

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from cabinlm.manifest import load_manifest
from cabinlm.runtime import Decoder

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--seats", type=int, default=1, help="also the ceiling of N seats' batched step")
a = ap.parse_args()

# Read bandwidth: ONNX Runtime summing a 1 GiB float32 tensor with the decode thread count.
n = 1 << 28
x = np.ones(n, dtype=np.float32)
g = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "bw",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])  # fmt: skip
so = ort.SessionOptions()
so.intra_op_num_threads = a.threads
s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString(), so)
times = []
for _ in range(7):
    t = time.perf_counter()
    s.run(None, {"x": x})
    times.append(time.perf_counter() - t)
bw = x.nbytes / statistics.median(times)
del x

# Bytes per decode step: every initializer of the built graph but the token table (one row is read),
# plus the whole cache (keys, values, scales), which every step attends to.
m = load_manifest(a.build)
model = onnx.load(f"{a.build}/{m.files['graph'].path}", load_external_data=False)
sizes = {}
for init in model.graph.initializer:
    length = next((int(e.value) for e in init.external_data if e.key == "length"), None)
    sizes[init.name] = length if length is not None else len(init.raw_data)
consumers = {}
for node in model.graph.node:
    for i in node.input:
        consumers.setdefault(i, set()).add(node.op_type)
gathered = [k for k in sizes if consumers.get(k) == {"Gather"}]  # tables read one row per token
table = sum(sizes[k] for k in gathered)
weights = sum(sizes.values()) - table
cache = Decoder(a.build, threads=a.threads).backend.nbytes()  # the cache buffers, read from the arrays
per_token = weights + cache
ceiling = bw / per_token
print(f"read bandwidth ({a.threads} threads, ONNX Runtime ReduceSum over 1 GiB): {bw / 1e9:.1f} GB/s")
print(f"bytes per decode step: weights {weights / 1e6:.1f} MB (token table {table / 1e6:.1f} MB not counted) "
      f"+ KV cache {cache / 1e6:.1f} MB = {per_token / 1e6:.1f} MB")
print(f"bandwidth-bound ceiling: {ceiling:.0f} tokens/s")
if a.seats > 1:  # one batched step reads the weights once and every seat's cache
    seats = a.seats * bw / (weights + a.seats * cache)
    print(f"{a.seats} seats in one step: weights {weights / 1e6:.1f} MB + {a.seats} x {cache / 1e6:.1f} MB of KV = "
          f"{(weights + a.seats * cache) / 1e6:.1f} MB a step, ceiling {seats:.0f} tokens/s in all, "
          f"{seats / ceiling:.2f}x one seat's")
