"""The StreamingLLM table from benchmarks/streaming_table.sh's per-token NLL files (markdown)."""

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
ranges = [(0, 255, "tokens 2-256 (nothing evicted yet)"), (0, 7999, "tokens 2-8000"), (255, 20479, "tokens 257-20480 (evicting)"), (0, 20479, "all 20480")]
print("| attention | KV | " + " | ".join(r[2] for r in ranges) + " |")
print("|---|---|" + "---|" * len(ranges))
for label, prefix in (("dense (all 8000 in the cache)", "dense"), ("window only, S=0, W=252", "stream-s0"), ("sink + window, S=4, W=252", "stream-s4")):
    for kv in ("fp32", "int8", "fp8"):
        f = work / f"{prefix}-{kv}.npy"
        if not f.exists():
            continue
        nll = np.load(f)
        print(f"| {label} | {kv} | " + " | ".join(cell(ppl(nll, lo, hi)) for lo, hi, _ in ranges) + " |")

# The same per-token NLLs as a picture: a rolling mean over 1024 tokens against the position in the text.
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
fig, ax = plt.subplots(figsize=(9, 4.5))
styles = {"fp32": "-", "int8": "--", "fp8": ":"}
colors = {"dense": "tab:green", "stream-s0": "tab:red", "stream-s4": "tab:blue"}
labels = {"dense": "dense", "stream-s0": "window only (S=0)", "stream-s4": "sink + window (S=4)"}
k = 1024
for prefix in ("dense", "stream-s0", "stream-s4"):
    for kv in ("fp32", "int8", "fp8"):
        f = work / f"{prefix}-{kv}.npy"
        if not f.exists():
            continue
        nll = np.load(f)
        roll = np.convolve(nll, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(nll) + 1), np.exp(roll), styles[kv], color=colors[prefix], lw=1.1,
                label=f"{labels[prefix]}, {kv} KV")
ax.axvline(256, color="grey", lw=0.8)
ax.text(270, ax.get_ylim()[1] * 0.95, "eviction starts (256 slots)", fontsize=8, va="top")
ax.set_xlabel("token position in the text (one token per step)")
ax.set_ylabel(f"perplexity, rolling {k} tokens")
ax.set_yscale("log")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=7, ncol=3)
fig.tight_layout()
out = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/img/streaming_nll.png")
out.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(out, dpi=110)
print(f"\nwrote {out}")
