"""Median decode latency at a full cache: 300 single-token steps after filling the cache (20 warm-up).

    python benchmarks/step_time.py BUILD_DIR [THREADS]
"""
import sys
import time

import numpy as np

from cabinlm.runtime import Decoder

build = sys.argv[1]; threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
dec = Decoder(build, threads=threads)
lay = dec.layout
dec.feed(np.arange(100, 100 + lay.slots + 2 * lay.chunk) % dec.manifest.model.vocab_size)
w = []
for t in range(300):
    t0 = time.perf_counter(); dec.step(np.array([500 + t])); w.append(time.perf_counter() - t0)
w = np.array(w[20:]) * 1e3
print(f"{build} slots={lay.slots} threads={threads}: p50 {np.median(w):.2f} ms  p10 {np.percentile(w,10):.2f} p90 {np.percentile(w,90):.2f}  -> {1000/np.median(w):.1f} tok/s")
