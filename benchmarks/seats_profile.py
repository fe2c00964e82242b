"""Where a decode step's time goes, one seat against 4 seats together: ONNX Runtime's profiler on every
session of a loaded fused build (the one-seat graph, the batched graph for 4, and the LM head's graph
where the build has one),
4 seats filled with FILL window tokens, then STEPS decode steps of one seat (the one-seat graph) and
STEPS of 4 seats together (step_seats). Per session: its mean run time, and the kernels' time per op
type, ms per step (ONNX Runtime's "_kernel_time" events, summed over the pool's threads' share of a
node as the profiler records it: one event per node run).

    python benchmarks/seats_profile.py BUILD [--fill 512] [--pinned 0] [--steps 30] [--session-config JSON]

Profiles are written under a temporary folder and removed. One JSON line."""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

import cabinlm.engines.ort_fused.backend as fused_backend

try:  # where the fused build's sessions are opened (engines/ort_fused/sessions.py, or backend.py before it)
    import cabinlm.engines.ort_fused.sessions as fused_sessions
except ImportError:
    fused_sessions = fused_backend


def summarize(path: str, runs: int) -> dict:
    """The last `runs` model runs of one session's profile: mean run time and kernel time per op type."""
    events = json.loads(Path(path).read_text())
    model_runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-runs:]
    since = model_runs[0]["ts"]
    by_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= since:
            by_op[e["args"]["op_name"]] += e["dur"]
    return {"run_ms": round(sum(r["dur"] for r in model_runs) / len(model_runs) / 1e3, 3),
            "ops_ms": {k: round(v / len(model_runs) / 1e3, 3) for k, v in by_op.most_common(12)}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--fill", type=int, default=512)
    ap.add_argument("--pinned", type=int, default=0, help="tokens each seat pins first (a system prompt)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--session-config", default="{}")
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="seats-profile-"))
    plain = fused_sessions.session_options

    def profiled(*args, **kwargs):
        so = plain(*args, **kwargs)
        so.enable_profiling = True
        so.profile_file_prefix = str(folder / "session")
        return so

    fused_sessions.session_options = profiled  # every session the build opens, profiled
    from cabinlm.runtime import Decoder, step_seats

    try:
        first = Decoder(a.build, threads=a.threads, session_config=json.loads(a.session_config) or None)
        seats = [first] + [first.seat() for _ in range(3)]
        C = first.layout.chunk
        for d in seats if a.pinned else ():
            d.feed(np.arange(1000, 1000 + a.pinned), pin=True)
        for start in range(0, a.fill, C):
            step_seats(seats, [np.arange(100 + start, 100 + min(start + C, a.fill))] * 4)
        for _ in range(a.steps):
            step_seats(seats[:1], [[5]])
        for _ in range(a.steps):
            step_seats(seats, [[5]] * 4)
        g = first.backend.graphs
        row = {"fill": a.fill, "pinned": a.pinned, "steps": a.steps, "load1": open("/proc/loadavg").read().split()[0],
               "one_seat": summarize(g.decoder.end_profiling(), a.steps),
               "four_seats": summarize(g.seats[4].end_profiling(), a.steps)}
        if g.head is not None:  # builds whose LM head runs in a graph of its own (head_kernel "onnxruntime")
            row["four_seats_head"] = summarize(g.head.end_profiling(), a.steps)
        print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
