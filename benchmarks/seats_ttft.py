"""`cabinlm bench --seats N`'s scripted rounds (bench/seats.run_seats) in one mode, with extra ONNX Runtime
session entries for every session of the fused build: to see what the thread pools' spinning does to
the time to first token of seats decoding together (docs/benchmarks.md section 20).

    python benchmarks/seats_ttft.py BUILD --mode together [--seats 4] [--rounds 3] [--max-new 64]
                                     [--session-config '{"session.force_spinning_stop": "1"}']

The runtime's options have no way to pass session entries (RuntimeConfig), so this script adds them
where the fused build makes its sessions' options (engines/ort_fused: sessions.py, or backend.py
before it). One JSON line: the mode's figures (SeatsRun.to_dict, without the replies)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build", type=Path)
    ap.add_argument("--mode", choices=("together", "turns"), required=True)
    ap.add_argument("--seats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--session-config", default="{}")
    a = ap.parse_args()
    entries = json.loads(a.session_config)
    try:
        import cabinlm.engines.ort_fused.sessions as where
    except ImportError:
        import cabinlm.engines.ort_fused.backend as where
    plain = where.session_options

    def with_entries(*args, **kwargs):
        so = plain(*args, **kwargs)
        for key, value in entries.items():
            so.add_session_config_entry(key, str(value))
        return so

    where.session_options = with_entries
    from cabinlm.bench.seats import run_seats

    d = run_seats(a.build, a.seats, a.rounds, a.max_new, a.threads, 0, a.mode).to_dict()
    d["session_config"] = entries
    d["load1"] = open("/proc/loadavg").read().split()[0]
    print(json.dumps(d), flush=True)


if __name__ == "__main__":
    main()
