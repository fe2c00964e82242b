"""The planner's total for the cpu profile against the peak resident memory of a real dialogue
run from the build output (docs/benchmarks.md).

    python benchmarks/plan_vs_rss.py out/smollm2-135m-build-cpu
"""

import json
import resource
import sys

from cabinlm.profiles import load_profile
from cabinlm.profiles.planner import plan
from cabinlm.runtime import Dialogue, open_artifact

folder = sys.argv[1]
dec, tok = open_artifact(folder)
lay = dec.layout
p = plan(dec.manifest.model, load_profile("cpu"), kv=lay.kv_dtype, sink=lay.sink, chunk=lay.chunk,
         pinned=lay.pinned, window=lay.window)  # fmt: skip
d = Dialogue(dec, tok, max_new_tokens=64)
turns = [line.strip() for line in open("demo/dialogue.txt") if line.strip()]
for i in range(40):  # long enough to fill the window and evict
    d.ask(turns[i % len(turns)])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({
    "plan_total_mib": round(p.total_bytes / 2**20, 1),
    "peak_rss_mib": round(peak / 2**20, 1),
    "plan_over_peak": round(p.total_bytes / peak, 3),
    "evicted_tokens": dec.cache.evicted,
    "cache_bytes": dec.cache.nbytes(),
}))
