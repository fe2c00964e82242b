"""Two fused cpu builds of one export, alternating (docs/benchmarks.md, section 6): prefill tok/s
filling the window in 64-token feeds after a pinned system prompt, and the median decode step at a
full cache, round after round. Made to compare the attention kernels (`cabinlm build
--attention-kernel cabinlm` against `onnxruntime`), it takes any two builds.

    python benchmarks/attention_ab.py BUILD_A BUILD_B [--rounds 6] [--steps 60] [--threads 2]
"""

import argparse
import time

import numpy as np

from cabinlm.runtime import Decoder
from cabinlm.engines.ort_fused.spec import FusedSettings

ap = argparse.ArgumentParser()
ap.add_argument("builds", nargs=2)
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()

rng = np.random.default_rng(0)
system = rng.integers(100, 40000, 60)
feeds = [rng.integers(100, 40000, 64) for _ in range(19)]  # 60 pinned + 1216: the window turns over


def prefill(d: Decoder) -> float:
    d.reset()
    d.feed(system, pin=True)
    t = time.perf_counter()
    for f in feeds:
        d.feed(f)
    return sum(len(f) for f in feeds) / (time.perf_counter() - t)


def decode(d: Decoder) -> float:
    token, times = 500, []
    for _ in range(a.steps):
        t = time.perf_counter()
        logits = d.step(np.array([token]))
        times.append(time.perf_counter() - t)
        token = int(np.argmax(logits[0]))
    return float(np.median(times[5:])) * 1e3


decoders = {b: Decoder(b, threads=a.threads) for b in a.builds}
for d in decoders.values():
    kernel = d.manifest.runtime_spec.facts_as(FusedSettings).attention_kernel if d.manifest.runtime_spec.facts_as(FusedSettings) else "-"
    print(f"{d.folder}: attention kernel {kernel}")
got = {b: {"prefill": [], "decode": []} for b in a.builds}
for r in range(a.rounds):
    for b, d in decoders.items():
        got[b]["prefill"].append(prefill(d))  # leaves the window full for the decode steps
        got[b]["decode"].append(decode(d))
for b in a.builds:
    p, s = got[b]["prefill"], got[b]["decode"]
    print(f"{b}: prefill tok/s median {np.median(p):.0f} ({' '.join(f'{x:.0f}' for x in p)}); "
          f"decode ms at a full cache median {np.median(s):.2f} ({' '.join(f'{x:.2f}' for x in s)})")
(pa, sa), (pb, sb) = ((got[b]["prefill"], got[b]["decode"]) for b in a.builds)
print(f"B's prefill faster in {sum(y > x for x, y in zip(pa, pb))} of {a.rounds} rounds, "
      f"B's decode step faster in {sum(y < x for x, y in zip(sa, sb))} of {a.rounds}")
