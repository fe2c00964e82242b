"""Per-token NLL of the first N tokens of a text through an artifact whose global layers hold them all
(nothing evicted), against transformers' dense forward over the same ids, float32 on both sides.
For a model with local sliding-window layers (Gemma 3), the local rings wrap past their window, so
the tokens past it check the rings against the model's own sliding mask (docs/results.md#gemma-3).

    python benchmarks/nll_vs_transformers.py ART MODEL TEXT N [--records FILE]

Prints the mean NLL of both and their largest per-token difference; --records FILE appends them as a record.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.export.models import load_model
from cabinlm.runtime import open_artifact
from cabinlm.runtime.perplexity import token_nll


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    return np.array([token_nll(row, int(t)) for row, t in zip(logits, targets)])  # float64 log-softmax


p = argparse.ArgumentParser()
p.add_argument("artifact")
p.add_argument("model")
p.add_argument("text")
p.add_argument("n", type=int)
p.add_argument("--records", type=Path, default=None, help="append the run's record here")
a = p.parse_args()
start, load = utc_now(), load_average()

dec, tok = open_artifact(a.artifact, threads=2)
ids = np.asarray(tok.encode(open(a.text, encoding="utf-8").read(), add_special_tokens=True)[: a.n])
lay = dec.layout
if len(ids) > lay.sink + lay.pinned + lay.window:
    raise SystemExit(f"{len(ids)} tokens do not fit in {a.artifact}'s global cache; export a larger --window")
ours = nll(dec.feed(ids[:-1], all_logits=True), ids[1:])

loaded = load_model(a.model)
with torch.no_grad():
    ref_logits = loaded.model(torch.tensor(ids[None, :-1])).logits[0].float().numpy()
ref = nll(ref_logits, ids[1:])
diff = np.abs(ours - ref)
w = lay.local_window or None
report = {
    "model": a.model, "text": Path(a.text).name, "tokens": int(len(ids)), "local_window": w,
    "local_layers": len(lay.local_layers), "evicted": int(dec.cache.evicted),
    "nll_mean_cabinlm": float(ours.mean()), "nll_mean_transformers": float(ref.mean()),
    "max_abs_nll_diff": float(diff.max()),
    "max_abs_nll_diff_past_window": float(diff[w:].max()) if w and len(diff) > w else None,
}
print(json.dumps(report, indent=1))
if a.records is not None:
    rec = Recorder("benchmarks/nll_vs_transformers.py")
    asked = ("model", "text", "tokens")
    rec.add({k: report[k] for k in asked}, {k: v for k, v in report.items() if k not in asked}, utc_start=start,
            loadavg_start=load, artifact=a.artifact, threads=2)  # fmt: skip
    rec.write(a.records)
