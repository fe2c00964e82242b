"""Decode steps with and without denormal floats flushed to zero, alternating in one process.

    python benchmarks/denormals.py BUILD_DIR [--rounds 12] [--steps 40] [--threads 2]

Two decoders on the same build, one with ONNX Runtime's session.set_denormal_as_zero, both fed
the same 40 pinned and 1160 window tokens, then greedy single-token steps in alternating blocks
(the order flips every round). Prints each decoder's median step, in how many rounds the flushed
one was faster, and the largest logit difference between the two at the end of each block.
"""

import argparse
import statistics
import time

import numpy as np

from cabinlm.runtime import Decoder

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("--rounds", type=int, default=12)
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()

off = {"session.set_denormal_as_zero": "0"}  # the build may set it: override both ways
decs = {"kept": Decoder(a.build, threads=a.threads, session_config=off),
        "flushed": Decoder(a.build, threads=a.threads, session_config={"session.set_denormal_as_zero": "1"})}  # fmt: skip
text = np.random.default_rng(0).integers(100, 20000, 1200)
for d in decs.values():
    d.feed(text[:40], pin=True)
    d.feed(text[40:])
tok = {k: int(np.argmax(d.step(np.array([500]))[0])) for k, d in decs.items()}
times = {k: [] for k in decs}
worst = 0.0
for r in range(a.rounds):
    logits = {}
    for k in list(decs)[:: 1 if r % 2 == 0 else -1]:
        ts = []
        for _ in range(a.steps):
            t = time.perf_counter()
            out = decs[k].step(np.array([tok[k]]))[0]
            ts.append(time.perf_counter() - t)
            tok[k] = int(np.argmax(out))
        times[k].append(statistics.median(ts[3:]))
        logits[k] = out.copy()
    worst = max(worst, float(np.abs(logits["kept"] - logits["flushed"]).max()))
for k, v in times.items():
    print(f"{k}: {statistics.median(v) * 1e3:.3f} ms per step (rounds: {', '.join(f'{x * 1e3:.2f}' for x in v)})")
gain = [a_ - b_ for a_, b_ in zip(times["kept"], times["flushed"])]
print(f"flushed faster in {sum(g > 0 for g in gain)} of {len(gain)} rounds, median gain {statistics.median(gain) * 1e3:.3f} ms")
print(f"largest logit difference at the blocks' ends: {worst}; same greedy token at the end: {tok['kept'] == tok['flushed']}")
