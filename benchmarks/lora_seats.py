"""Switchable LoRA adapters on one build (docs/lora.md, "Measured"): the time to switch a seat's
adapter on a history of about --history tokens (Decoder.set_adapter runs it again), the resident
memory each adapter adds when a seat first uses it, and seats decoding together (step_seats) with a
different adapter each against the same seats on the base model, alternating, --rounds times.

    python benchmarks/lora_seats.py BUILD --adapters a1,a2,a3,a4 [--seats 4] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--adapters", required=True, help="the build's adapter names, comma-separated")
    ap.add_argument("--seats", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per seat and run")
    ap.add_argument("--history", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from cabinlm.runtime import Decoder, step_seats

    names = a.adapters.split(",")
    first = Decoder(a.build, threads=a.threads)
    seats = [first] + [first.seat() for _ in range(a.seats - 1)]
    rng = np.random.default_rng(0)

    # memory: each adapter's arrays, loaded when a seat first takes it
    for name in names:
        before = rss_mb()
        first.set_adapter(name)
        print(f"adapter {name}: RSS +{rss_mb() - before:.1f} MiB ({first.adapters.nbytes(name) / 2**20:.1f} MiB of arrays)")
    first.set_adapter(None)

    # switch time: a seat with a history of about --history tokens, in chunks of the build's chunk
    chunk = first.layout.chunk
    ids = rng.integers(100, 20000, a.history)
    for i in range(0, len(ids), chunk):
        first.step(ids[i : i + chunk], logits="last")
    took = []
    for name in names + [None]:
        t = time.perf_counter()
        first.set_adapter(name)
        took.append(time.perf_counter() - t)
    print(f"switch a seat with {len(ids)} tokens of history: median {statistics.median(took) * 1e3:.0f} ms "
          f"({', '.join(f'{s * 1e3:.0f}' for s in took)} ms)")  # fmt: skip

    def run(adapters) -> float:
        """Every seat reset with its adapter, a 16-token prompt each, then --steps greedy steps together:
        aggregate decode tok/s."""
        for d, n in zip(seats, adapters):
            d.set_adapter(n)
            d.reset()
        last = step_seats(seats, [rng.integers(100, 20000, 16) for _ in seats])
        t = time.perf_counter()
        for _ in range(a.steps):
            last = step_seats(seats, [[int(np.argmax(x))] for x in last])
        return a.seats * a.steps / (time.perf_counter() - t)

    own = [names[i % len(names)] for i in range(a.seats)]
    got = {"base": [], "adapters": []}
    for r in range(a.rounds):
        got["base"].append(run([None] * a.seats))
        got["adapters"].append(run(own))
        print(f"round {r + 1}: {a.seats} seats together, base {got['base'][-1]:.1f} tok/s, adapters {', '.join(own)} "
              f"{got['adapters'][-1]:.1f} tok/s (ratio {got['adapters'][-1] / got['base'][-1]:.2f})")  # fmt: skip
    ratios = [x / y for x, y in zip(got["adapters"], got["base"])]
    print(f"median: base {statistics.median(got['base']):.1f}, adapters {statistics.median(got['adapters']):.1f} tok/s, "
          f"ratio {statistics.median(ratios):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
