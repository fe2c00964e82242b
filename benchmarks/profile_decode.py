"""Where a decode step's time goes: ONNX Runtime's profiler over single-token steps at a full cache,
summed by operator type and by the graph's own node names (layers merged).

    python benchmarks/profile_decode.py BUILD_DIR [--threads 2] [--steps 100]
"""

import argparse
import collections
import json
import re
import statistics
import time

import numpy as np

import cabinlm.engines.ort_graph.backend as exported_mod
import cabinlm.engines.ort_fused.backend as fused_mod
from cabinlm.runtime import Decoder

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=100)
a = ap.parse_args()

plain = fused_mod.session_options  # the same function in every ONNX Runtime backend


def profiled(*args, **kw):
    so = plain(*args, **kw)
    so.enable_profiling = True
    so.profile_file_prefix = "/tmp/cabinlm_decode_profile"
    return so


fused_mod.session_options = exported_mod.session_options = profiled
dec = Decoder(a.build, threads=a.threads)
lay = dec.layout
dec.feed(np.arange(100, 100 + lay.slots + 2 * lay.chunk) % dec.manifest.model.vocab_size)  # past full
wall = []
for t in range(a.steps):
    t0 = time.perf_counter()
    dec.step(np.array([500 + t]))
    wall.append(time.perf_counter() - t0)
events = json.load(open(dec.backend._decode.session.end_profiling()))
step_runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-a.steps :]
runs = [e["dur"] for e in step_runs]
since = step_runs[0]["ts"]  # the decode steps only: the feed's prefill chunks ran in the same session
by_op, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
for e in events:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= since:
        op = e["args"]["op_name"]
        by_op[op] += e["dur"]
        count[op] += 1
        name = re.sub(r"layers\.\d+", "L", e["name"][: -len("_kernel_time")])
        by_name[re.sub(r"(_\d+|#\d+)$", "", name)] += e["dur"]
n_runs = len(step_runs)
total = sum(by_op.values())
print(f"{a.build}: {lay.slots} slots, {dec.manifest.weights} weights, {lay.kv_dtype.value} KV, {a.threads} threads")
print(f"wall median {statistics.median(wall) * 1e3:.2f} ms/token; ONNX Runtime run median {statistics.median(runs) / 1e3:.2f} ms; "
      f"kernels {total / n_runs / 1e3:.2f} ms/run over {sum(count.values()) / n_runs:.0f} nodes")
print("\n| op type | ms / token | share | nodes |\n|---|---:|---:|---:|")
for op, d in by_op.most_common(14):
    print(f"| {op} | {d / n_runs / 1e3:.3f} | {100 * d / total:.1f}% | {count[op] / n_runs:.0f} |")
print("\n| graph nodes (L = every layer) | ms / token | share |\n|---|---:|---:|")
for name, d in by_name.most_common(16):
    print(f"| `{name}` | {d / n_runs / 1e3:.3f} | {100 * d / total:.1f}% |")
