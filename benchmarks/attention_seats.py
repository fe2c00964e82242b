"""cabinlm's Int8KVSeatsAttention alone, the way a batched decode step runs it: one node per layer for
SmolLM2-135M's 30 layers (9 query heads, 3 kv heads, head_dim 64), SEATS seats of TOKENS rows each
(1: a decode step; more: a verified draft's rows), each seat over its own caches filled to FILLED
slots, STEP_KEYS sink / pinned keys rotated per step (the rows-as-steps inputs, as the runtime feeds them:
the filled sink and pinned slots, 4 for the sink alone, 19 with the bench's pinned system prompt),
random int8 caches and queries, the same inputs for every library.

Inside a whole decode step the caches do not stay in this machine's L3: the weights stream through it
between two layers' attention. `--evict MB` reads a buffer of MB megabytes before every timed run
(not timed), so the caches come from memory as they do there; `--evict 0` keeps them hot (the
kernel's arithmetic alone). Per library and case: the median of RUNS runs in ms, and whether its
outputs equal the first library's bit for bit.

    python benchmarks/attention_seats.py LIB.so [LIB.so ...] [--seats 1 4] [--filled 600] [--tokens 1]
                                          [--threads 2] [--runs 100] [--evict 96] [--step-keys 4]
                                          [--masked FIRST COUNT]

LIB.so: a build's libcabinlm_kernels.so. One JSON line per (library, seats, filled, tokens); with two
libraries or more the runs alternate between them, so drift on a noisy machine hits each alike (the
thread pools do not spin, so one session's idle threads take no core from another's)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import onnxruntime as ort
from attention_decode import kernel_session  # this folder's: run as python benchmarks/attention_seats.py
from onnx import TensorProto as T
from onnx import helper, numpy_helper

LAYERS, H, HKV, DH, SLOTS, CHUNK = 30, 9, 3, 64, 1148, 64
SEAT_INPUTS = ("k", "v", "seqlens", "total", "cos", "sin", "pos", "bias", "ks", "vs", "src", "src_cos", "src_sin", "layer", "slots")


def session(library: str, seats: int, filled: int, tokens: int, threads: int, step_keys: int) -> ort.InferenceSession:
    rows = SLOTS + CHUNK
    f, i64, i32 = T.FLOAT, T.INT64, T.INT32
    ins = [helper.make_tensor_value_info("qkv", f, [1, seats * tokens, (H + 2 * HKV) * DH]),
           helper.make_tensor_value_info("seat_tokens", i64, [seats])]  # fmt: skip
    shared = {"cos": (f, [rows, DH // 2]), "sin": (f, [rows, DH // 2]), "src_cos": (f, [1, step_keys, DH // 2]),
              "src_sin": (f, [1, step_keys, DH // 2]), "seqlens": (i32, [1]), "total": (i32, [])}  # fmt: skip
    ins += [helper.make_tensor_value_info(n, t, d) for n, (t, d) in shared.items()]
    for s in range(seats):
        ins += [helper.make_tensor_value_info(f"pos{s}", i64, [1, tokens]),
                helper.make_tensor_value_info(f"bias{s}", f, [1, 1, tokens, filled + tokens]),
                helper.make_tensor_value_info(f"slots{s}", i64, [tokens]),
                helper.make_tensor_value_info(f"src{s}", f, [1, LAYERS * HKV, step_keys, DH])]  # fmt: skip
    nodes, inits, outs = [], [], []
    for i in range(LAYERS):
        for n in ("ks", "vs"):
            inits.append(numpy_helper.from_array(np.full(HKV * DH, 0.05, np.float32), f"{n}{i}"))
        inits.append(numpy_helper.from_array(np.array([i], np.int64), f"layer{i}"))
        names = ["qkv", "seat_tokens"]
        for s in range(seats):
            ins += [helper.make_tensor_value_info(f"k{i}_{s}", T.INT8, [1, HKV, rows, DH]),
                    helper.make_tensor_value_info(f"v{i}_{s}", T.INT8, [1, HKV, rows, DH])]  # fmt: skip
            names += [f"k{i}_{s}", f"v{i}_{s}", "seqlens", "total", "cos", "sin", f"pos{s}", f"bias{s}", f"ks{i}", f"vs{i}",
                      f"src{s}", "src_cos", "src_sin", f"layer{i}", f"slots{s}"]  # fmt: skip
        nodes.append(helper.make_node("Int8KVSeatsAttention", names, [f"o{i}"], domain="ai.cabinlm"))
        outs.append(helper.make_tensor_value_info(f"o{i}", T.FLOAT, None))
    # two libraries' sessions in one process: pools that spin would take the cores from each other
    return kernel_session(helper.make_graph(nodes, "attention", ins, outs, inits), library, threads, spinning=False)


class Case:
    """One library's session for (seats, filled, tokens), its inputs bound; run() times one run."""

    def __init__(self, library: str, seats: int, filled: int, tokens: int, threads: int, evict_mb: int,
                 step_keys: int = 4, masked: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        self.s = session(library, seats, filled, tokens, threads, step_keys)
        rng = np.random.default_rng(filled * 100 + tokens * 10 + seats)
        rows = SLOTS + CHUNK
        feeds = {"qkv": rng.standard_normal((1, seats * tokens, (H + 2 * HKV) * DH), np.float32),
                 "seat_tokens": np.full(seats, tokens, np.int64),
                 "cos": np.cos(rng.random((rows, DH // 2)) * 6).astype(np.float32),
                 "sin": np.sin(rng.random((rows, DH // 2)) * 6).astype(np.float32),
                 "src_cos": np.cos(rng.random((1, step_keys, DH // 2)) * 6).astype(np.float32),
                 "src_sin": np.sin(rng.random((1, step_keys, DH // 2)) * 6).astype(np.float32),
                 "seqlens": np.array([filled + tokens - 1], np.int32), "total": np.array(filled + tokens, np.int32)}  # fmt: skip
        for s in range(seats):
            feeds[f"pos{s}"] = np.arange(filled, filled + tokens, dtype=np.int64)[None]
            bias = np.where(np.tri(tokens, filled + tokens, filled, dtype=bool), 0, -1e30).astype(np.float32)
            bias[:, masked[0] : masked[0] + masked[1]] = -1e30  # slots no row sees (empty pinned ones)
            feeds[f"bias{s}"] = bias[None, None]
            feeds[f"slots{s}"] = np.arange(filled, filled + tokens, dtype=np.int64)
            feeds[f"src{s}"] = rng.standard_normal((1, LAYERS * HKV, step_keys, DH), np.float32)
        self.b = self.s.io_binding()
        for name, value in feeds.items():
            self.b.bind_cpu_input(name, value)
        # a seat's keys (and values) in one array of every layer, as the runtime holds them (its large
        # allocations on 2 MB pages where the system backs them so), each layer's node bound to its view
        self.caches = {(s, kv): (rng.standard_normal((LAYERS, HKV, rows, DH)) * 20).clip(-127, 127).astype(np.int8)
                       for s in range(seats) for kv in ("k", "v")}  # fmt: skip
        for i in range(LAYERS):  # the kernel writes the chunk's rows in place: the same rows every run
            for (s, kv), c in self.caches.items():
                self.b.bind_cpu_input(f"{kv}{i}_{s}", c[i : i + 1])
            self.b.bind_output(f"o{i}")
        self.evict = np.ones(evict_mb * (1 << 20) // 8, np.float64) if evict_mb else None
        self.times: list[float] = []

    def run(self) -> None:
        if self.evict is not None:
            self.evict.sum()  # streams MB through the caches: the KV caches come from memory, as in a step
        t = time.perf_counter()
        self.s.run_with_iobinding(self.b)
        self.times.append(time.perf_counter() - t)

    def output(self) -> np.ndarray:
        return np.concatenate([o.numpy().ravel() for o in self.b.get_outputs()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("libraries", nargs="+")
    ap.add_argument("--seats", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--filled", type=int, nargs="+", default=[600])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--evict", type=int, default=96, help="MB read before every run (0: caches stay hot)")
    ap.add_argument("--step-keys", type=int, default=4, help="sink + pinned keys rotated every run")
    ap.add_argument("--masked", type=int, nargs=2, default=(0, 0), metavar=("FIRST", "COUNT"),
                    help="slots every row's bias masks, as the pinned slots a short system prompt leaves empty "
                         "(the bench's: 19 109, slots 19..127 of a cpu build's 4 sink + 124 pinned)")  # fmt: skip
    a = ap.parse_args()
    for seats in a.seats:
        for filled in a.filled:
            for tokens in a.tokens:
                cases = [Case(lib, seats, filled, tokens, a.threads, a.evict, a.step_keys, tuple(a.masked))
                         for lib in a.libraries]  # fmt: skip
                for _ in range(a.runs):
                    for c in cases:
                        c.run()
                first = cases[0].output()
                for lib, c in zip(a.libraries, cases):
                    ms = statistics.median(c.times[a.runs // 10 :]) * 1e3
                    print(json.dumps({"library": lib, "seats": seats, "filled": filled, "tokens": tokens, "threads": a.threads,
                                      "evict_mb": a.evict, "step_keys": a.step_keys, "masked": a.masked, "ms": round(ms, 3),
                                      "equals_first_library": bool(np.array_equal(c.output(), first)),
                                      "load1": open("/proc/loadavg").read().split()[0]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
