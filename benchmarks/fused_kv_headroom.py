"""Static int8 KV scales of the fused cpu build against float32 KV: perplexity over a held-out text
for multipliers of the calibrated key (rotation-pair) and value ranges (docs/benchmarks.md, section 1).

    cabinlm export smollm2-135m -o out/bench/s252-int8 --sink 4 --pinned 0 --window 252 --kv int8 --weights fp32
    cabinlm export smollm2-135m -o out/bench/s252-fp32 --sink 4 --pinned 0 --window 252 --kv fp32 --weights fp32
    python benchmarks/fused_kv_headroom.py out/bench/s252-int8 out/bench/s252-fp32 --text FILE [--skip CHARS] \
        [--tokens 1500] 1,1 2,1 1,0.7 ...

Each K,V pair multiplies the export's rotated-key and value scales (the export itself applies a
headroom of kvquant.ROTATED_KEY_HEADROOM to the keys: divide by it to see the raw calibration).
Builds use float32 activations (accuracy level 0), so only the KV differs from the reference.
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from cabinlm.engines.build import build_artifact
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import chunked_perplexity

ap = argparse.ArgumentParser()
ap.add_argument("int8")
ap.add_argument("fp32")
ap.add_argument("pairs", nargs="+")
ap.add_argument("--text", default="tests/data/prose.txt")
ap.add_argument("--skip", type=int, default=0)
ap.add_argument("--tokens", type=int, default=1500)
a = ap.parse_args()
art, ref = Path(a.int8), Path(a.fp32)
text = Path(a.text).read_text(errors="ignore")[a.skip :]
ids = Tokenizer(ref / "tokenizer.json").encode(text, add_special_tokens=True)[: a.tokens]
base = chunked_perplexity(Decoder(ref), ids).ppl
orig = json.loads((art / "manifest.json").read_text())["kv_scales"]
work = Path(tempfile.mkdtemp(prefix="cabinlm-headroom-"))
for pair in a.pairs:
    kmul, vmul = (float(x) for x in pair.split(","))
    d = work / pair
    shutil.copytree(art, d, ignore=shutil.ignore_patterns("build-*"))
    m = json.loads((d / "manifest.json").read_text())
    m["kv_scales"]["rotated_keys"] = (np.asarray(orig["rotated_keys"]) * kmul).tolist()
    m["kv_scales"]["values"] = (np.asarray(orig["values"]) * vmul).tolist()
    (d / "manifest.json").write_text(json.dumps(m))
    out = build_artifact(d, load_profile("cpu"), d / "build", attention="fused", accuracy_level=0)
    p = chunked_perplexity(Decoder(out), ids).ppl
    print(f"keys x{kmul} values x{vmul}: ppl {p:.4f} against {base:.4f} (fp32 KV): {100 * (p / base - 1):+.2f}%", flush=True)
shutil.rmtree(work)
