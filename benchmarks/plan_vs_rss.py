"""The planner's total for the cpu profile against the peak resident memory of a real dialogue
run from an export or a build (docs/benchmarks.md, "Planner against peak RSS").

    python benchmarks/plan_vs_rss.py FOLDER [--turns 40] [--max-new 64] [--json-out DIR] [--label NAME]

One folder per process (peak RSS is per process). Prints one JSON object (the raw numbers: the plan's
terms, RSS after the imports, after opening the artifact, after the first turn and the peak) and one
table row: build kind, weights, plan MiB, peak RSS MiB, plan / peak. The dialogue must fill the
window and evict (evicted_tokens > 0), or the script exits non-zero. --table prints the table of
every JSON file in DIR instead.
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


def peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def row(r: dict) -> str:
    return (f"| {r['label']:<20} | {r['build_kind']:<18} | {r['weights']:<7} | {r['plan']['weights_layout']:<46} | "
            f"{r['kv']:<4} | {r['plan_total_mib']:8.1f} | {r['peak_rss_mib']:8.1f} | {r['plan_over_peak']:5.3f} |")


HEADER = ("| build                | build kind         | weights | held as (the plan's weights row)               | KV   | plan MiB | peak MiB | ratio |\n"
          "|----------------------|--------------------|---------|------------------------------------------------|------|---------:|---------:|------:|")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--json-out", type=Path, default=None, help="write the raw JSON here (a folder)")
    ap.add_argument("--label", default=None, help="the row's name (default: the folder's name)")
    ap.add_argument("--table", type=Path, default=None, help="print the table of the JSON files in this folder")
    a = ap.parse_args()
    if a.table is not None:
        print(HEADER)
        for f in sorted(a.table.glob("*.json")):
            print(row(json.loads(f.read_text())))
        return

    rss_start = rss_bytes()  # python + cabinlm.runtime.memory only
    from cabinlm.profiles import load_profile
    from cabinlm.profiles.planner import plan_for_manifest
    from cabinlm.manifest import load_manifest
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
        "folder": str(a.folder),
        "build_kind": kind,
        "weights": weights,
        "kv": m.cache.kv_dtype.value,
        "window": m.cache.window,
        "turns": a.turns,
        "max_new_tokens": a.max_new,
        "plan": p.to_dict(),
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
    if a.json_out is not None:
        a.json_out.mkdir(parents=True, exist_ok=True)
        (a.json_out / f"{r['label']}.json").write_text(json.dumps(r, indent=1) + "\n")
    if r["evicted_tokens"] <= 0:
        sys.exit(f"the dialogue did not evict ({r['seen_tokens']} tokens seen): use more --turns")


if __name__ == "__main__":
    main()
