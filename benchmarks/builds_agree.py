"""Whether two fused cpu builds of one export compute the same logits bit for bit over one dialogue that
goes through every path of the attention kernel: two seats of each build, a pinned prompt, chunks of
60 tokens, batched runs where one seat steps and the other verifies a 5-token draft (keeping 3), then
one-token steps, until the window has turned over (1330 tokens with the demo build). Made to check
that a kernel change meant to change no arithmetic changes none.

    python benchmarks/builds_agree.py BUILD_A BUILD_B [--records FILE]

Prints the tokens each seat saw, the number of logits arrays compared and whether all are equal;
exits 1 where they differ. --records FILE appends one record per build (its provenance, the figure
`agrees` on both) (docs/results.md#x86-and-arm-paths)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.runtime import Decoder
from cabinlm.runtime.decoder import seats_together


def trace(build: str) -> tuple[list[np.ndarray], int]:
    rng = np.random.default_rng(1)
    first = Decoder(build, threads=2)
    second = first.seat()
    out = []
    for dec in (first, second):
        dec.feed(rng.integers(100, 20000, 50), pin=True)
    for _ in range(20):
        for dec in (first, second):
            out.append(dec.feed(rng.integers(100, 20000, 60)))
        got = seats_together([first, second], [rng.integers(100, 20000, 1), rng.integers(100, 20000, 5)],
                             accepts=[None, lambda logits: 3])  # fmt: skip
        out += [logits for logits, _ in got]
        for _ in range(3):
            out.append(first.step(rng.integers(100, 20000, 1))[-1].copy())
    return out, first.cache.seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build_a")
    ap.add_argument("build_b")
    ap.add_argument("--records", type=Path, default=None, help="append one record per build here")
    args = ap.parse_args()
    start, load = utc_now(), load_average()
    a, seen_a = trace(args.build_a)
    b, seen_b = trace(args.build_b)
    same = len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    print(f"tokens seen {seen_a} / {seen_b}; {len(a)} logits arrays; all equal bit for bit: {same}")
    rec = Recorder("benchmarks/builds_agree.py")
    for build, seen in ((args.build_a, seen_a), (args.build_b, seen_b)):
        rec.add({"against": Path(args.build_b if build == args.build_a else args.build_a).name}, {"tokens_seen": seen,
                "logits_arrays": len(a), "agrees": same}, utc_start=start, loadavg_start=load, artifact=build, threads=2)  # fmt: skip
    rec.write_to(args.records)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
