"""What the kernels cost for one SmolLM2-sized decode step, each measured alone (docs/benchmarks.md,
section 11): the attention over the cache per KV format (ONNX Runtime's GroupQueryAttention, and
cabinlm's own Int8KVAttention over int8 KV), the quantized matmuls per weight format (MatMulNBits,
and cabinlm's own BlockQ4MatMul over Q4_1 blocks), and the two kernels a Q4_1 block minimum adds
when it is kept exact.

    python benchmarks/kernel_costs.py [--threads 2] [--runs 200] [--ort-genai DIR]

Each row is one session holding that kernel for all 30 layers (random data of the real shapes), run
--runs times; medians. --ort-genai DIR also times a whole onnxruntime-genai model's step at a short
and a full context with the same plain ONNX Runtime calls (I/O bound once, as cabinlm does).
"""

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper, numpy_helper

LAYERS, H, HKV, DH, SLOTS, CHUNK = 30, 9, 3, 64, 1148, 64
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # q|k|v, o, gate|up, down
MS = "com.microsoft"

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--runs", type=int, default=200)
ap.add_argument("--ort-genai", default=None, help="an onnxruntime-genai model folder (model.onnx)")
a = ap.parse_args()


@functools.lru_cache(maxsize=1)
def own_library() -> str:
    """cabinlm's kernel library for this machine's CPU, compiled as `cabinlm build` compiles it."""
    from cabinlm.engines.ort_fused.kernels.compiler import compile_library

    return str(compile_library(Path(tempfile.mkdtemp(prefix="kernel-costs-"))).path)


def session(model, own_kernels: bool = False):
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = a.threads, 1, 3
    if own_kernels:
        so.register_custom_ops_library(own_library())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def model(nodes, inputs, outputs, inits, typed=()):
    outs = [helper.make_tensor_value_info(o, T.FLOAT, None) for o in outputs] + list(typed)
    g = helper.make_graph(nodes, "k", inputs, outs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1), helper.make_opsetid("ai.cabinlm", 1)]
    return helper.make_model(g, opset_imports=opsets, ir_version=10)


def timed(run, runs):
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[runs // 10 :]) * 1e3


def attention(kv: str, filled: int, tokens: int) -> float:
    """GroupQueryAttention (rotary inside, additive bias) over `filled` slots for all layers; kv
    "cabinlm int8": cabinlm's Int8KVAttention (kernels/int8_kv_attention.cc) over int8 KV instead."""
    own = kv == "cabinlm int8"
    kv = "int8" if own else kv
    rows = SLOTS + CHUNK
    packed = kv == "int4"
    etype = {"fp32": T.FLOAT, "int8": T.INT8, "int4": T.UINT8}[kv]
    width = DH // 2 if packed else DH
    ins = [helper.make_tensor_value_info("qkv", T.FLOAT, [1, tokens, (H + 2 * HKV) * DH]),
           helper.make_tensor_value_info("cos", T.FLOAT, [rows, DH // 2]), helper.make_tensor_value_info("sin", T.FLOAT, [rows, DH // 2]),
           helper.make_tensor_value_info("pos", T.INT64, [1, tokens]), helper.make_tensor_value_info("bias", T.FLOAT, [1, 1, tokens, filled + tokens]),
           helper.make_tensor_value_info("seqlens", T.INT32, [1]), helper.make_tensor_value_info("total", T.INT32, [])]  # fmt: skip
    nodes, inits, outs, caches = [], [], [], []
    for i in range(LAYERS):
        caches += [helper.make_tensor_value_info(f"p{n}{i}", etype, [1, HKV, rows, width]) for n in ("k", "v")]
        ins += [helper.make_tensor_value_info(f"k{i}", etype, [1, HKV, rows, width]),
                helper.make_tensor_value_info(f"v{i}", etype, [1, HKV, rows, width])]  # fmt: skip
        gi = ["qkv", "", "", f"k{i}", f"v{i}", "seqlens", "total", "cos", "sin", "pos", "bias", ""]
        attrs = dict(num_heads=H, kv_num_heads=HKV, scale=DH**-0.5, do_rotary=1, rotary_interleaved=0)
        if kv != "fp32":
            for n in ("ks", "vs"):
                inits.append(numpy_helper.from_array(np.full((1, HKV, 1, DH), 0.05, np.float32), f"{n}{i}"))
            gi += [f"ks{i}", f"vs{i}"]
            attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=4 if packed else 8)
        if own:  # the chunk's K/V written into k{i} / v{i} in place: no present outputs
            inits = [t for t in inits if t.name not in (f"ks{i}", f"vs{i}")]  # flat (kv_heads * head_dim) scales
            for n in ("ks", "vs"):
                inits.append(numpy_helper.from_array(np.full(HKV * DH, 0.05, np.float32), f"{n}{i}"))
            ci = ["qkv", f"k{i}", f"v{i}", "seqlens", "total", "cos", "sin", "pos", "bias", f"ks{i}", f"vs{i}"]
            nodes.append(helper.make_node("Int8KVAttention", ci, [f"o{i}"], domain="ai.cabinlm"))
        else:
            nodes.append(helper.make_node("GroupQueryAttention", gi, [f"o{i}", f"pk{i}", f"pv{i}"], domain=MS, **attrs))
        outs.append(f"o{i}")
    s = session(model(nodes, ins, outs, inits, () if own else caches), own_kernels=own)
    rng = np.random.default_rng(0)
    b = s.io_binding()
    feeds = {"qkv": rng.standard_normal((1, tokens, (H + 2 * HKV) * DH), np.float32),
             "cos": np.ones((rows, DH // 2), np.float32), "sin": np.zeros((rows, DH // 2), np.float32),
             "pos": np.arange(filled, filled + tokens, dtype=np.int64)[None] % rows,
             "bias": np.zeros((1, 1, tokens, filled + tokens), np.float32),
             "seqlens": np.array([filled + tokens - 1], np.int32), "total": np.array(filled + tokens, np.int32)}  # fmt: skip
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    keep = []
    dtype = {"fp32": np.float32, "int8": np.int8, "int4": np.uint8}[kv]
    for i in range(LAYERS):
        for n in ("k", "v"):
            ov = ort.OrtValue.ortvalue_from_numpy((rng.standard_normal((1, HKV, rows, width)) * 20).astype(dtype))
            keep.append(ov)
            b.bind_ortvalue_input(f"{n}{i}", ov)
            if not own:
                b.bind_ortvalue_output(f"p{n}{i}", ov)  # past and present share the buffer, as in the fused build
        b.bind_output(f"o{i}")
    return timed(lambda: s.run_with_iobinding(b), a.runs if tokens == 1 else max(20, a.runs // 10))


def matmuls(kind: str) -> float:
    """The 120 per-layer projections of one decode step (M = 1) in one weight format."""
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    for i in range(LAYERS):
        for j, (K, N) in enumerate(SHAPES):
            x, p, nb = ("x" if K == 576 else "y"), f"l{i}_{j}", K // 32
            if kind.startswith("cabinlm"):  # Q4_1 blocks as exported: 4-bit codes, float16 scale and minimum
                blob = rng.integers(0, 256, (N // 16, nb, 320), dtype=np.uint8)
                blob[:, :, 256:] = np.frombuffer(np.full(N // 16 * nb * 32, 0.01, np.float16).tobytes(), np.uint8).reshape(N // 16, nb, 64)
                inits.append(numpy_helper.from_array(blob, p + "w"))
                nodes.append(helper.make_node("BlockQ4MatMul", [x, p + "w"], [p + "o"], domain="ai.cabinlm"))
                outs.append(p + "o")
                continue
            bits = 8 if kind == "int8 + zero points (Q4_1 as int8)" else 4
            inits += [numpy_helper.from_array(rng.integers(0, 256, (N, nb, 32 * bits // 8), dtype=np.uint8), p + "w"),
                      numpy_helper.from_array(rng.random((N, nb), np.float32) * 0.01, p + "s")]  # fmt: skip
            mm = [x, p + "w", p + "s"]
            if bits == 8:
                inits.append(numpy_helper.from_array(rng.integers(100, 156, (N, nb), dtype=np.uint8), p + "z"))
                mm.append(p + "z")
            elif kind.startswith("int4 + float zero points"):  # the minimum as a float zero point (-m / d)
                inits.append(numpy_helper.from_array(rng.random((N, nb), np.float32) * 15, p + "z"))
                mm.append(p + "z")
            out = p + ("y" if kind.startswith("int4 + exact") else "o")
            nodes.append(helper.make_node("MatMulNBits", mm, [out], domain=MS, K=K, N=N, bits=bits, block_size=32, accuracy_level=4))
            if kind.startswith("int4 + exact"):  # the exact Q4_1 minimum: blocksum(x) @ minimum, added
                inits += [numpy_helper.from_array(np.kron(np.eye(nb, dtype=np.float32), np.ones((32, 1), np.float32)), p + "i"),
                          numpy_helper.from_array(rng.random((nb, N), np.float32) * 0.01, p + "m")]  # fmt: skip
                nodes += [helper.make_node("MatMul", [x, p + "i"], [p + "b"]), helper.make_node("Gemm", [p + "b", p + "m", out], [p + "o"])]
            outs.append(p + "o")
    ins = [helper.make_tensor_value_info("x", T.FLOAT, [1, 576]), helper.make_tensor_value_info("y", T.FLOAT, [1, 1536])]
    s = session(model(nodes, ins, outs, inits), own_kernels=kind.startswith("cabinlm"))
    feeds = {"x": rng.standard_normal((1, 576), np.float32), "y": rng.standard_normal((1, 1536), np.float32)}
    return timed(lambda: s.run(None, feeds), a.runs if "float zero" not in kind else max(10, a.runs // 20))


def genai_step(folder: str, context: int) -> float:
    s = ort.InferenceSession(f"{folder}/model.onnx", session_options_plain(), providers=["CPUExecutionProvider"])
    cache_type = next(i.type for i in s.get_inputs() if i.name.startswith("past_key_values"))
    dtype = np.int8 if "int8" in cache_type else np.float32
    b = s.io_binding()
    b.bind_cpu_input("input_ids", np.array([[500]], np.int64))
    b.bind_cpu_input("attention_mask", np.ones((1, context + 1), np.int64))
    keep = []
    for i in range(LAYERS):
        for n in ("key", "value"):
            ov = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, HKV, SLOTS, DH), dtype))
            keep.append(ov)
            b.bind_ortvalue_input(f"past_key_values.{i}.{n}", ov)
            b.bind_ortvalue_output(f"present.{i}.{n}", ov)
    b.bind_output("logits")
    return timed(lambda: s.run_with_iobinding(b), a.runs)


def session_options_plain():
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = a.threads, 1, 3
    return so


print(f"ONNX Runtime {ort.__version__}, {a.threads} threads, {LAYERS} layers, medians of {a.runs} runs\n")
print("| attention, all layers | KV | slots attended | ms |\n|---|---|---:|---:|")
for tokens in (1, 40, 64):
    for filled in ((256, SLOTS) if tokens == 1 else (SLOTS,)):
        for kv in ("cabinlm int8", "int8", "fp32", "int4"):
            what = "decode (1 token)" if tokens == 1 else f"prefill ({tokens} tokens)"
            print(f"| {what} | {kv} | {filled} | {attention(kv, filled, tokens):.2f} |", flush=True)
print("\n| the 120 layer projections (M = 1) | ms |\n|---|---:|")
for kind in ("cabinlm's BlockQ4MatMul (Q4_1 as exported)", "int4 (no minimum)", "int4 + exact Q4_1 minimum (MatMul + Gemm)",
             "int8 + zero points (Q4_1 as int8)", "int4 + float zero points (the minimum in the kernel)"):
    print(f"| {kind} | {matmuls(kind):.2f} |", flush=True)
if a.ort_genai:
    print(f"\n| {a.ort_genai}: one decode step | context | ms |\n|---|---:|---:|")
    for context in (16, 1024):
        print(f"| | {context} | {genai_step(a.ort_genai, context):.2f} |", flush=True)
