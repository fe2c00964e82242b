"""A decode step's time with and without a switchable LoRA adapter (docs/lora.md, "Measured"): seats
of one build, one without an adapter and one with ADAPTER, and optionally a seat of the fused build of
the same model exported without --lora-rank (--plain), each taking one-token steps in blocks of
--steps, the blocks alternating --blocks times, in one process. Reports each one's median and 10th
percentile step time, as the process's CPU time (what the step computed, which other tenants of a
shared machine disturb less than the wall clock) and as wall time.

    python benchmarks/lora_step_time.py BUILD --adapter a1 [--plain PLAIN_BUILD] [--threads 1] [--blocks 10] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--adapter", required=True, help="one of the build's adapter names")
    ap.add_argument("--plain", help="the fused build of the same model exported without --lora-rank")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    from cabinlm.runtime import Decoder

    none = Decoder(a.build, threads=a.threads)
    adapted = none.seat()
    adapted.set_adapter(a.adapter)
    seats = {"plain build": Decoder(a.plain, threads=a.threads)} if a.plain else {}
    seats.update({"no adapter": none, f"adapter {a.adapter}": adapted})
    prompt = np.arange(10, 200)
    for d in seats.values():
        d.feed(prompt)
    cpu: dict[str, list[float]] = {k: [] for k in seats}
    wall: dict[str, list[float]] = {k: [] for k in seats}
    token = np.array([5])
    for _ in range(a.blocks):
        for name, d in seats.items():
            for _ in range(a.steps):
                c0, w0 = time.process_time(), time.perf_counter()
                d.step(token)
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    print(f"{a.threads} thread(s), {a.blocks} alternating blocks of {a.steps} steps, load average {os.getloadavg()[0]:.2f}")
    for name in seats:
        c, w = np.array(cpu[name]) * 1e3, np.array(wall[name]) * 1e3
        print(f"{name:>14}: CPU {np.median(c):.2f} ms (p10 {np.percentile(c, 10):.2f}), "
              f"wall {np.median(w):.2f} ms (p10 {np.percentile(w, 10):.2f}) a step")  # fmt: skip


if __name__ == "__main__":
    main()
