"""Per-token NLL of the first N tokens of a text through an artifact whose cache holds them all
(nothing is evicted: dense attention), fed in chunks.  python benchmarks/dense_nll.py ART TEXT N OUT.npy"""

import json
import sys

import numpy as np

from cabinlm.runtime import open_artifact

art, text, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dec, tok = open_artifact(art, threads=2)
ids = tok.encode(open(text, encoding="utf-8").read(), add_special_tokens=True)[:n]
if len(ids) + 1 > dec.layout.window + dec.layout.sink + dec.layout.pinned:
    raise SystemExit(f"{n} tokens do not fit in {art}'s cache")
parts = []
C = dec.layout.chunk
for start in range(0, len(ids) - 1, C):
    chunk = ids[start : min(start + C, len(ids) - 1)]
    logits = dec.step(np.asarray(chunk)).astype(np.float64)
    m = logits.max(axis=1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    parts.append(-logp[np.arange(len(chunk)), ids[start + 1 : start + 1 + len(chunk)]])
nll = np.concatenate(parts)
np.save(out, nll)
print(json.dumps({"tokens": len(ids), "ppl": float(np.exp(nll.mean())), "nll_mean": float(nll.mean()), "evicted": dec.cache.evicted}))
