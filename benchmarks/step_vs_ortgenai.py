"""One decode step of a cabinlm build against one step of an onnxruntime-genai model, at the same
number of cached tokens, alternating in one process (this machine drifts by 20-30% within minutes:
only interleaved figures compare).

    python benchmarks/step_vs_ortgenai.py BUILD_DIR ORT_GENAI_DIR [--contexts 16,300,600,1000]
        [--rounds 3] [--steps 60] [--threads 2]

cabinlm: the whole runtime step (Decoder.step: slot plan, sink / pinned refresh, the graph, the
commit), after feeding `context` tokens. ort-genai: its graph alone through ONNX Runtime (I/O bound
once, the cache buffers shared between past and present as its generator does), with an attention
mask of `context` + 1. Each figure is the median over `--steps` single-token steps (the first 5
dropped), each round a new pass over the contexts; the table gives the median over rounds.
"""

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from cabinlm.runtime import Decoder

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("ort_genai", help="an onnxruntime-genai model folder (model.onnx)")
ap.add_argument("--contexts", default="16,300,600,1000")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
contexts = [int(c) for c in a.contexts.split(",")]

dec = Decoder(a.build, threads=a.threads)
V, layers = dec.manifest.model.vocab_size, dec.layout.layers
so = ort.SessionOptions()
so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = a.threads, 1, 3
genai = ort.InferenceSession(f"{a.ort_genai}/model.onnx", so, providers=["CPUExecutionProvider"])
cache_type = next(i for i in genai.get_inputs() if i.name.startswith("past_key_values"))
kv_heads, head_dim = cache_type.shape[1], dec.layout.head_dim
rows = max(contexts) + a.steps + 8
binding = genai.io_binding()
binding.bind_cpu_input("input_ids", np.array([[500]], np.int64))
keep = []
for i in range(layers):
    for n in ("key", "value"):
        dtype = np.int8 if "int8" in cache_type.type else np.float32
        ov = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv_heads, rows, head_dim), dtype))
        keep.append(ov)
        binding.bind_ortvalue_input(f"past_key_values.{i}.{n}", ov)
        binding.bind_ortvalue_output(f"present.{i}.{n}", ov)
logits = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, V), np.float32))
binding.bind_ortvalue_output("logits", logits)
masks = [np.ones((1, n), np.int64) for n in range(rows + 1)]


def genai_step(context: int) -> float:
    ts = []
    for k in range(a.steps):
        binding.bind_cpu_input("attention_mask", masks[context + k + 1])
        t = time.perf_counter()
        genai.run_with_iobinding(binding)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[5:]) * 1e3


def cabinlm_step(context: int) -> float:
    dec.reset()
    if context:
        dec.feed(np.arange(100, 100 + context) % V)
    ts = []
    for k in range(a.steps):
        t = time.perf_counter()
        dec.step(np.array([500 + k]), logits="last")
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[5:]) * 1e3


got = {c: ([], []) for c in contexts}
for r in range(a.rounds):
    for c in contexts:
        ours, theirs = cabinlm_step(c), genai_step(c)
        got[c][0].append(ours)
        got[c][1].append(theirs)
        print(f"round {r + 1}: context {c}: cabinlm {ours:.2f} ms, ort-genai {theirs:.2f} ms", flush=True)
print(f"\n{a.build} against {a.ort_genai}, {a.threads} threads, medians over {a.rounds} rounds of {a.steps} steps\n")
print("| cached tokens | cabinlm ms / step | ort-genai ms / step | cabinlm tok/s ÷ ort-genai tok/s |\n|---:|---:|---:|---:|")
for c in contexts:
    ours, theirs = statistics.median(got[c][0]), statistics.median(got[c][1])
    print(f"| {c} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f} |")
