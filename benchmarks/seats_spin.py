"""Why a prompt fed right after seats decoded together takes longer (docs/benchmarks.md section 20, time to
first token together / in turns), and what ONNX Runtime's thread pools' spinning costs a batched step.

Each session of a loaded fused build has a thread pool of its own; after a run its worker threads
spin (busy-wait for the next parallel section) for a while before they sleep. A batched step runs
the batched graph's session and then the head's; a prompt then runs on the one-seat session. On
2 cores, a pool still spinning takes a core from the session that runs next.

Measured here, on 4 seats filled with FILL window tokens:
    step4      the mean of 20 decode steps of 4 seats together (step_seats), ms
    step1      the mean of 20 decode steps of one seat (the one-seat graph), ms
    prefill_after_batch   a prompt of PROMPT tokens fed on a fifth seat right after a batched step, ms
    prefill_after_solo    the same prompt right after a one-seat step, ms
(each the minimum and the median over REPEATS, taken in turns; the fifth seat is fed from empty and
reset after each prompt, so every repeat feeds the same tokens into the same cache).

    python benchmarks/seats_spin.py BUILD [--fill 512] [--prompt 48]
                                    [--session-config '{"session.force_spinning_stop": "1"}']

--session-config: ONNX Runtime session entries for every session of the build (Decoder's
session_config), e.g. force_spinning_stop = 1 (the pools stop spinning when a run returns)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cabinlm.runtime import Decoder, step_seats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--fill", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--session-config", default="{}")
    a = ap.parse_args()
    config = json.loads(a.session_config)
    first = Decoder(a.build, threads=a.threads, session_config=config or None)
    seats = [first] + [first.seat() for _ in range(3)]
    C = first.layout.chunk
    for start in range(0, a.fill, C):
        step_seats(seats, [np.arange(100 + start, 100 + min(start + C, a.fill))] * 4)
    prompt = np.arange(2000, 2000 + a.prompt, dtype=np.int64)
    newcomer = first.seat()  # the prompt's seat: fed from empty, then reset, every repeat alike

    def steps(b: int) -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            step_seats(seats[:b], [[5]] * b)
        return (time.perf_counter() - t0) / 20

    def prefill_after(b: int) -> float:
        step_seats(seats[:b], [[5]] * b)
        t0 = time.perf_counter()
        newcomer.feed(prompt)
        took = time.perf_counter() - t0
        newcomer.reset()
        return took

    for b in (1, 4):
        steps(b)  # warm-up
    prefill_after(1)
    row: dict[str, float | str | dict] = {"session_config": config, "fill": a.fill, "prompt": a.prompt}
    got: dict[str, list[float]] = {"step4": [], "step1": [], "prefill_after_batch": [], "prefill_after_solo": []}
    for _ in range(a.repeats):  # alternating, so that a busy moment of the machine hits every figure alike
        got["step4"].append(steps(4))
        got["prefill_after_batch"].append(prefill_after(4))
        got["step1"].append(steps(1))
        got["prefill_after_solo"].append(prefill_after(1))
    for k, v in got.items():
        row[f"{k}_ms"] = round(min(v) * 1e3, 2)
        row[f"{k}_median_ms"] = round(float(np.median(v)) * 1e3, 2)
    row["load1"] = open("/proc/loadavg").read().split()[0]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
