"""The planner's total for the cpu profile against the peak resident memory of a real dialogue
run from an export or a build (docs/results.md#plan-against-rss).

    python benchmarks/plan_vs_rss.py FOLDER [--turns 40] [--max-new 64] [--records FILE] [--label NAME]
    python benchmarks/plan_vs_rss.py --table FILE

One folder per process (peak RSS is per process). Prints the raw numbers (the plan's terms, RSS
after the imports, after opening the artifact, after the first turn and the peak) and one table row:
build kind, weights, plan MiB, peak RSS MiB, plan / peak; --records FILE appends them as a record.
The dialogue must fill the window and evict (evicted_tokens > 0), or the script exits non-zero.
--table prints the table of every record of this script in FILE instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from cabinlm.runtime.memory import rss_bytes

MIB = 1 << 20
TOOL = "benchmarks/plan_vs_rss.py"


def peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def row(r: dict) -> str:
    """A table row of one run's figures and params (a record's, merged)."""
    return (f"| {r['label']:<20} | {r['build_kind']:<18} | {r['weights']:<7} | {r['weights_layout']:<46} | "
            f"{r['kv']:<4} | {r['plan_total_mib']:8.1f} | {r['peak_rss_mib']:8.1f} | {r['plan_over_peak']:5.3f} |")


HEADER = ("| build                | build kind         | weights | held as (the plan's weights row)               | KV   | plan MiB | peak MiB | ratio |\n"
          "|----------------------|--------------------|---------|------------------------------------------------|------|---------:|---------:|------:|")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--records", type=Path, default=None, help="append the run's record here")
    ap.add_argument("--label", default=None, help="the row's name (default: the folder's name)")
    ap.add_argument("--table", type=Path, default=None, help="print the table of this records file's runs")
    a = ap.parse_args()
    if a.table is not None:
        from cabinlm.bench.records import read

        print(HEADER)
        for rec in read(a.table):
            if rec.tool == TOOL:
                print(row({**rec.params, **rec.figures}))
        return
    from cabinlm.bench.provenance import load_average, utc_now  # standard library only: no RSS to speak of

    start, load = utc_now(), load_average()

    rss_start = rss_bytes()  # python + cabinlm.runtime.memory only
    from cabinlm.profiles import load_profile
    from cabinlm.profiles.planner import plan_for_manifest
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.runtime import Dialogue, Tokenizer, open_artifact
    import numpy  # noqa: F401
    import onnxruntime  # noqa: F401

    rss_imports = rss_bytes()
    m = load_manifest(a.folder)
    tok = Tokenizer(Path(a.folder) / m.files["tokenizer"].path)
    rss_tokenizer = rss_bytes()
    dec, tok = open_artifact(a.folder, manifest=m, tokenizer=tok)
    rss_open = rss_bytes()
    p = plan_for_manifest(m, load_profile("cpu"))
    d = Dialogue(dec, tok, max_new_tokens=a.max_new)
    turns = [line.strip() for line in open("demo/dialogue.txt") if line.strip()]
    t0 = time.perf_counter()
    rss_first = 0
    for i in range(a.turns):  # long enough to fill the window and evict
        d.ask(turns[i % len(turns)])
        if i == 0:
            rss_first = rss_bytes()
    seconds = time.perf_counter() - t0
    peak = peak_bytes()
    spec = m.runtime_spec
    kind = spec.backend.value if m.build is not None else "export (unbuilt)"
    weights = m.weights
    r = {
        "label": a.label or Path(a.folder).name,
        "build_kind": kind,
        "weights": weights,
        "kv": m.cache.kv_dtype.value,
        "window": m.cache.window,
        "turns": a.turns,
        "max_new_tokens": a.max_new,
        "weights_layout": p.to_dict()["weights_layout"],
        "plan_total_mib": round(p.total_bytes / MIB, 1),
        "peak_rss_mib": round(peak / MIB, 1),
        "plan_over_peak": round(p.total_bytes / peak, 3),
        "rss_start_mib": round(rss_start / MIB, 1),
        "rss_after_imports_mib": round(rss_imports / MIB, 1),
        "rss_after_tokenizer_mib": round(rss_tokenizer / MIB, 1),
        "rss_after_open_mib": round(rss_open / MIB, 1),
        "rss_after_first_turn_mib": round(rss_first / MIB, 1),
        "rss_end_mib": round(rss_bytes() / MIB, 1),
        "evicted_tokens": dec.cache.evicted,
        "seen_tokens": dec.cache.seen,
        "cache_bytes": dec.backend.nbytes() if hasattr(dec.backend, "nbytes") else None,
        "dialogue_seconds": round(seconds, 1),
    }
    print(json.dumps(r))
    print(HEADER)
    print(row(r))
    if r["evicted_tokens"] <= 0:
        sys.exit(f"the dialogue did not evict ({r['seen_tokens']} tokens seen): use more --turns")
    if a.records is not None:  # only a run that evicted: the plan is for a full cache
        from cabinlm.bench.records import Recorder, flat

        rec = Recorder(TOOL)
        params = ("label", "build_kind", "weights", "weights_layout", "kv", "window", "turns", "max_new_tokens")
        rec.add({k: r[k] for k in params}, {**{k: v for k, v in r.items() if k not in params}, **flat(p.to_dict(), "plan.")},
                utc_start=start, loadavg_start=load, artifact=a.folder)  # fmt: skip
        rec.write(a.records)


if __name__ == "__main__":
    main()
