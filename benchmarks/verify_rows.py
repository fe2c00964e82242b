"""What a verified draft's rows cost in a batched run: 4 seats of one build filled with FILL tokens
(after PINNED pinned ones), then runs of runtime.seats_together where each seat feeds a chunk of the
given row counts (a seat with more than one row verifies: every row's logits, one token kept), the
median of 30 runs per configuration in ms: what a drafted row adds, against what a plain step's
token costs with one seat and with four (why a draft must be accepted more often to pay among four
seats: docs/benchmarks.md, section 20, stop 45).

    python benchmarks/verify_rows.py BUILD [--fill 300] [--pinned 0]"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cabinlm.runtime import Decoder
from cabinlm.runtime.decoder import seats_together

CONFIGS = ([1], [5], [9], [1, 1, 1, 1], [5, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [5, 5, 5, 5], [9, 9, 9, 9])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--fill", type=int, default=300)
    ap.add_argument("--pinned", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    first = Decoder(a.build, threads=a.threads)
    seats = [first] + [first.seat() for _ in range(3)]
    rng = np.random.default_rng(0)
    for d in seats:
        if a.pinned:
            d.feed(rng.integers(100, 20000, a.pinned), pin=True)
        d.feed(rng.integers(100, 20000, a.fill))

    def run(rows: list[int], reps: int) -> float:
        times = []
        for _ in range(reps):
            chunks = [rng.integers(100, 20000, r) for r in rows]
            accepts = [(lambda logits: 1) if r > 1 else None for r in rows]  # a verification keeping one token
            t = time.perf_counter()
            seats_together(seats[: len(rows)], chunks, accepts=accepts)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    print(f"fill {a.fill}, pinned {a.pinned}, {a.threads} threads, load {open('/proc/loadavg').read().split()[0]}")
    for rows in CONFIGS:
        run(list(rows), 5)
        print(f"rows per seat {list(rows)}: {run(list(rows), 30):.2f} ms")


if __name__ == "__main__":
    main()
