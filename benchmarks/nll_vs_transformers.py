"""Per-token NLL of the first N tokens of a text through an artifact whose global layers hold them all
(nothing evicted), against transformers' dense forward over the same ids, float32 on both sides.
For a model with local sliding-window layers (Gemma 3), the local rings wrap past their window, so
the tokens past it check the rings against the model's own sliding mask.

    python benchmarks/nll_vs_transformers.py ART MODEL TEXT N [--json OUT]
"""

import argparse
import json

import numpy as np
import torch

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
p.add_argument("--json")
a = p.parse_args()

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
    "artifact": a.artifact, "model": a.model, "tokens": int(len(ids)), "local_window": w,
    "local_layers": list(lay.local_layers), "evicted": int(dec.cache.evicted),
    "nll_mean_cabinlm": float(ours.mean()), "nll_mean_transformers": float(ref.mean()),
    "max_abs_nll_diff": float(diff.max()),
    "max_abs_nll_diff_past_window": float(diff[w:].max()) if w and len(diff) > w else None,
}
print(json.dumps(report, indent=1))
if a.json:
    with open(a.json, "w") as f:
        json.dump({**report, "nll_cabinlm": ours.tolist(), "nll_transformers": ref.tolist()}, f)
