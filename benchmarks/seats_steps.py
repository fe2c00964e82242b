"""Decode steps of 1..4 seats in one step_seats call, at a given cache fill: the runtime's side of seats
decoding together, without a dialogue around it. Each of 4 seats is filled with FILL window tokens
(fed together, chunk by chunk), then for B = 1..4 the minimum over 3 repeats of the mean of 20
steps of the first B seats, and 4 seats stepping one after another (Decoder.step each).

    python benchmarks/seats_steps.py out/smollm2-135m-build-cpu --fill 64 512 960 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cabinlm.runtime import Decoder, step_seats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--fill", type=int, nargs="+", default=[64])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for fill in a.fill:
        first = Decoder(a.build, threads=a.threads)
        seats = [first] + [first.seat() for _ in range(3)]
        C = first.layout.chunk
        for start in range(0, fill, C):
            step_seats(seats, [np.arange(100 + start, 100 + min(start + C, fill))] * 4)
        row = {"fill": fill, "load1": open("/proc/loadavg").read().split()[0]}
        for b in (1, 2, 3, 4):
            for _ in range(5):
                step_seats(seats[:b], [[5]] * b)
            best = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(20):
                    step_seats(seats[:b], [[5]] * b)
                best.append((time.perf_counter() - t0) / 20)
            row[f"together_{b}_ms"] = round(min(best) * 1e3, 2)
            row[f"together_{b}_tok_s"] = round(b / min(best), 1)
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(20):
                for d in seats:
                    d.step(np.array([5]), logits="last")
            best.append((time.perf_counter() - t0) / 20)
        row["turns_4_ms_per_round"] = round(min(best) * 1e3, 2)
        row["turns_4_tok_s"] = round(4 / min(best), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
