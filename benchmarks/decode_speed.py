"""Median single-token decode latency with the cache full (every slot valid, eviction running).

    python benchmarks/decode_speed.py ARTIFACT [ARTIFACT ...] [--threads 2] [--steps 200] [--warmup 0]

--warmup N leaves the first N timed steps out of the median and p90 (docs/benchmarks.md's fused
build figures use --steps 300 --warmup 20).
"""

import argparse
import statistics
import time

import numpy as np

from cabinlm.runtime import Decoder

ap = argparse.ArgumentParser()
ap.add_argument("artifacts", nargs="+")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--warmup", type=int, default=0)
args = ap.parse_args()
for folder in args.artifacts:
    dec = Decoder(folder, threads=args.threads)
    lay = dec.layout
    dec.feed(np.arange(100, 100 + lay.slots + 2 * lay.chunk) % dec.manifest.model.vocab_size)  # past full
    times = []
    for t in range(args.steps):
        t0 = time.perf_counter()
        dec.step(np.array([500 + t]))
        times.append(time.perf_counter() - t0)
    times = times[args.warmup :]
    med = statistics.median(times)
    print(f"{folder}: {lay.kv_dtype.value} KV, {lay.slots} slots, {args.threads} threads: "
          f"median {med * 1e3:.1f} ms/token = {1 / med:.1f} tok/s (p90 {np.percentile(times, 90) * 1e3:.1f} ms)")
