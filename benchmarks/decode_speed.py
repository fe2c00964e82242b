"""Median single-token decode latency with the cache full (every slot valid, eviction running).

    python benchmarks/decode_speed.py ARTIFACT [ARTIFACT ...] [--threads 2] [--steps 200] [--warmup 0]

--warmup N leaves the first N timed steps out of the median and p90 (docs/benchmarks.md's fused
build figures use --steps 300 --warmup 20). --rounds R runs the list R times, one artifact loaded at
a time, and ends with each one's median over the rounds and its paired difference to the first
artifact (this machine drifts by 20-30% from minute to minute: compare builds this way).
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
ap.add_argument("--rounds", type=int, default=1)
args = ap.parse_args()
medians = {folder: [] for folder in args.artifacts}
for folder in args.artifacts * args.rounds:
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
    medians[folder].append(med)
    del dec
    print(f"{folder}: {lay.kv_dtype.value} KV, {lay.slots} slots, {args.threads} threads: "
          f"median {med * 1e3:.1f} ms/token = {1 / med:.1f} tok/s (p90 {np.percentile(times, 90) * 1e3:.1f} ms)")
if args.rounds > 1:
    first = args.artifacts[0]
    for folder, meds in medians.items():
        diffs = [(m - b) * 1e3 for m, b in zip(meds, medians[first])]
        print(f"{folder}: median over {args.rounds} rounds {statistics.median(meds) * 1e3:.2f} ms/token; against {first}: "
              f"median paired difference {statistics.median(diffs):+.2f} ms, faster in {sum(d < 0 for d in diffs)} of {len(diffs)}")
