"""Two builds' decode steps in one process, alternating: for each build 4 seats filled with FILL window
tokens after PINNED pinned ones, then, round after round, 20 steps of B seats together (step_seats,
B = 1 and 4) on one build and then on the other, so that both see the same machine from one moment to
the next (this machine's speed drifts by 10-20% over minutes), the first of the two alternating, and
neither build's thread pools spinning after a run (each would take the cores from the other's next
run; ONNX Runtime's allow_spinning off for both, which makes every run a little slower than
seats_steps.py's). Per build and B: the median and the minimum over the rounds of the mean step in ms. Made to compare two kernel libraries under one
runtime (a build made by an older commit loads in this one).

    python benchmarks/seats_steps_ab.py BUILD_A BUILD_B [--fill 200 600 960] [--pinned 0] [--rounds 15]

One JSON line per fill."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from cabinlm.runtime import Decoder, step_seats


def seats_of(build: str, fill: int, pinned: int, threads: int) -> list[Decoder]:
    # no spinning: a pool that spins after its run would take the cores from the other build's next run
    first = Decoder(build, threads=threads, session_config={"session.intra_op.allow_spinning": "0"})
    seats = [first] + [first.seat() for _ in range(3)]
    for d in seats if pinned else ():
        d.feed(np.arange(1000, 1000 + pinned), pin=True)
    C = first.layout.chunk
    for start in range(0, fill, C):
        step_seats(seats, [np.arange(100 + start, 100 + min(start + C, fill))] * 4)
    return seats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs=2)
    ap.add_argument("--fill", type=int, nargs="+", default=[200, 600, 960])
    ap.add_argument("--pinned", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for fill in a.fill:
        groups = [seats_of(b, fill, a.pinned, a.threads) for b in a.builds]
        times: dict[tuple[int, int], list[float]] = {(g, b): [] for g in range(2) for b in (1, 4)}
        for r in range(a.rounds):
            for b in (1, 4):
                for g in (0, 1) if r % 2 == 0 else (1, 0):  # which build goes first alternates too
                    seats = groups[g]
                    for _ in range(3):  # warm: the other build's run just left the caches
                        step_seats(seats[:b], [[5]] * b)
                    t0 = time.perf_counter()
                    for _ in range(20):
                        step_seats(seats[:b], [[5]] * b)
                    times[(g, b)].append((time.perf_counter() - t0) / 20 * 1e3)
        row = {"fill": fill, "pinned": a.pinned, "load1": open("/proc/loadavg").read().split()[0]}
        for g, build in enumerate(a.builds):
            for b in (1, 4):
                ts = times[(g, b)]
                row[f"{'ab'[g]}_{b}_ms_median"] = round(statistics.median(ts), 3)
                row[f"{'ab'[g]}_{b}_ms_min"] = round(min(ts), 3)
        row["builds"] = a.builds
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
