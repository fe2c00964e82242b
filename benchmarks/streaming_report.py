"""The StreamingLLM table from benchmarks/streaming_table.sh's per-token NLL files (markdown)."""

import json
import sys
from pathlib import Path

import numpy as np

work = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench")


def ppl(nll, lo, hi):
    part = nll[lo:hi]
    return float(np.exp(part.mean())) if len(part) == hi - lo else None


def cell(x):
    return "n/a" if x is None else f"{x:.3f}"


rows = []
ranges = [(0, 1147, "tokens 2-1148 (no eviction yet)"), (0, 7999, "tokens 2-8000"), (1147, 20479, "tokens 1149-20480 (evicting)")]
print("| attention | KV | " + " | ".join(r[2] for r in ranges) + " |")
print("|---|---|" + "---|" * len(ranges))
for label, prefix in (("dense (all 8000 in the cache)", "dense"), ("window only, S=0, W=1020", "stream-s0"), ("sink + window, S=4, W=1020", "stream-s4")):
    for kv in ("fp32", "int8", "fp8"):
        f = work / f"{prefix}-{kv}.npy"
        if not f.exists():
            continue
        nll = np.load(f)
        print(f"| {label} | {kv} | " + " | ".join(cell(ppl(nll, lo, hi)) for lo, hi, _ in ranges) + " |")
