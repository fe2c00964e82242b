"""The time to switch a seat's LoRA adapter (docs/lora.md, "Switching"): Decoder.set_adapter runs the
seat's history again, step for step, so the cost grows with the history. Two histories of --tokens
tokens each: fed as prompt chunks (the build's chunk; a prefill), and as one-token steps (a reply's
decoded tokens, each a step of its own). Each switch alternates between the two adapters, --rounds
times; reported per 1,000 tokens of history, with the bytes the history adds to a session file.

    python benchmarks/lora_switch.py BUILD --adapters a1,a2 [--tokens 1000] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--adapters", required=True, help="two of the build's adapter names, comma-separated")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from cabinlm.runtime import Decoder

    names = a.adapters.split(",")
    if len(names) != 2:
        raise SystemExit("--adapters takes two names")
    dec = Decoder(a.build, threads=a.threads)
    ids = np.random.default_rng(0).integers(100, min(20000, dec.manifest.model.vocab_size), a.tokens)
    for what, size in (("prompt chunks", dec.layout.chunk), ("one-token steps", 1)):
        dec.set_adapter(names[0])
        dec.reset()
        for i in range(0, len(ids), size):
            dec.step(ids[i : i + size], logits="last")
        took = []
        for r in range(a.rounds):
            t = time.perf_counter()
            dec.set_adapter(names[(r + 1) % 2])
            took.append(time.perf_counter() - t)
        per_1k = [s * 1000 / a.tokens for s in took]
        print(f"switch with {a.tokens} tokens of history as {what} ({dec.history.entries} steps, "
              f"{dec.history.nbytes / 1024:.1f} KiB in a session file): {statistics.median(per_1k):.2f} s per 1,000 "
              f"tokens (median; rounds {', '.join(f'{s:.2f}' for s in per_1k)})")  # fmt: skip


if __name__ == "__main__":
    main()
