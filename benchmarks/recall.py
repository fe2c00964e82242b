"""Long-range recall against distance (docs/results.md#recall): a fact stated N tokens back is recalled
while it is inside the window and forgotten once evicted, unless it was pinned.

    python benchmarks/recall.py ARTIFACT TEXT [--distances 64,256,...] [--trials 8] [--records FILE]

Each trial: a 48-token preamble of filler (so the fact is not among the attention sinks), the fact
"Note: the name of the driver is NAME.", N tokens of filler (public-domain prose), then "Question:
what is the name of the driver? Answer: the name of the driver is". Recalled = the model puts NAME
first among the 12 candidate names (each one token), read from the next-token logits. With --pin
the fact is pinned (as `cabinlm chat` pins a system prompt) and never evicted. --records FILE appends
one record per (pinned, distance) with its provenance (bench/records.py).
"""

import argparse
import time
from pathlib import Path

import numpy as np

from cabinlm.bench.records import Recorder
from cabinlm.runtime import open_artifact

NAMES = ["Clara", "Oscar", "Maria", "Felix", "Nina", "Hugo", "Emma", "Leo", "Sofia", "Anna", "Tom", "Max"]

ap = argparse.ArgumentParser()
ap.add_argument("artifact")
ap.add_argument("text")
ap.add_argument("--distances", default="32,128,256,512,768,896,960,1100,1300,1600,2400")
ap.add_argument("--trials", type=int, default=12)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--records", type=Path, default=None, help="append one record per (pinned, distance) here")
a = ap.parse_args()

dec, tok = open_artifact(a.artifact, threads=a.threads)
filler = tok.encode(open(a.text, encoding="utf-8").read(), add_special_tokens=False)
cand = [tok.encode(" " + n, add_special_tokens=False) for n in NAMES]
assert all(len(c) == 1 for c in cand), "every candidate name must be one token"
cand = np.array([c[0] for c in cand])
question = tok.encode("\n\nQuestion: what is the name of the driver?\nAnswer: the name of the driver is", add_special_tokens=False)
lay = dec.layout
rec = Recorder("benchmarks/recall.py")
results = []
for pin in (False, True):
    for n in [int(x) for x in a.distances.split(",")]:
        params = {"pinned": pin, "filler": n, "trials": a.trials, "text": Path(a.text).name, "sink": lay.sink,
                  "window": lay.window}
        with rec.run(params, artifact=a.artifact, threads=a.threads) as figures:
            hits, t0 = 0, time.perf_counter()
            for trial in range(a.trials):
                name = NAMES[trial % len(NAMES)]
                fact = tok.encode(f"\n\nNote: the name of the driver is {name}.\n\n", add_special_tokens=False)
                start = 5000 + trial * 2917  # a different stretch of filler per trial
                pre, body = filler[start : start + 48], filler[start + 48 : start + 48 + n]
                dec.reset()
                if pin:
                    dec.feed(np.asarray(pre[: lay.sink]))  # the sinks, then the pinned fact
                    dec.feed(np.asarray(fact), pin=True)
                    dec.feed(np.asarray(pre[lay.sink :]))
                else:
                    dec.feed(np.asarray(pre + fact))
                dec.feed(np.asarray(body))
                logits = dec.feed(np.asarray(question))
                hits += int(NAMES[int(np.argmax(logits[cand]))] == name)
            # tokens between the fact's end and the question's end, and whether the fact is still cached
            results.append({"pinned": pin, "distance": n + len(question), "filler": n, "trials": a.trials,
                            "accuracy": hits / a.trials, "in_window": n + len(question) <= lay.window,
                            "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
            figures.update({k: results[-1][k] for k in ("accuracy", "distance", "in_window", "seconds")})
        r = results[-1]
        print(f"{'pinned' if pin else 'in the stream'}: fact {r['distance']:5d} tokens back "
              f"({'pinned' if pin else 'inside the window' if r['in_window'] else 'outside the window'}): recalled {hits}/{a.trials}", flush=True)
    if not pin:
        a.distances = "1600,2400"  # pinned facts: only far beyond the window is interesting
rec.write_to(a.records)
