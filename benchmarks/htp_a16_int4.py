"""Which int4 weight blocks beside 16-bit activations (issue 33, w4a16; engines/qnn_htp/a16_weights.py):
the a16 QDQ graph of an int8-KV export quantized once (activations, calibration as the build), then its
matrices re-quantized per variant, each run against the float graph through the runtime on the CPU
(a16_feeds.stream_logits, prefill chunks from an empty cache) over the first TOKENS tokens of a text:
perplexity and logit correlation. No compiler, no simulator (docs/benchmarks.md section 15).

    python benchmarks/htp_a16_int4.py ARTIFACT TEXT [--tokens 512] [--variants int8,int4,int4-c7,...]

Variants: int8 (int8 blocks, the w8a16 build), int4 (the build's int4: scale search over
a16_weights.INT4_DIVISORS, the LM head int8), int4-c7 (scale absmax / 7: codes -7..7), int4-c8
(absmax / 8, codes -8..7 clipped), a suffix -head4: the head int4 too.
"""
import argparse, tempfile, time
from pathlib import Path

import numpy as np, onnx
from onnx import numpy_helper
from tokenizers import Tokenizer

from cabinlm.manifest import load_manifest
from cabinlm.engines.qnn_htp import a16_feeds, a16_weights, qdq
from cabinlm.runtime.perplexity import token_nll

ap = argparse.ArgumentParser()
ap.add_argument("artifact"); ap.add_argument("text")
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--variants", default="int8,int4,int4-c7,int4-c8,int4-head4")
a = ap.parse_args()
qdq.PER_CHANNEL, qdq.MIN_FIDELITY, qdq.MAX_PERPLEXITY_RATIO = "int8", -1.0, float("inf")  # blocks below; measure
art = Path(a.artifact); m = load_manifest(art)
f, _, sc, rot = qdq.a16_float_graph(art, m)  # the build's float graph: keys rotated where the build rotates them
kv = sc if rot else None  # a16_feeds: the rotated cache's scales
matrices = {t.name: numpy_helper.to_array(t) for t in f.graph.initializer if len(t.dims) == 2}
ids = Tokenizer.from_file(str(art / "tokenizer.json")).encode(Path(a.text).read_text()).ids[: a.tokens]
t = time.time()
with tempfile.TemporaryDirectory() as w:
    q8, _, _, _ = qdq.a16_graph(art, m, None, Path(w))
print(f"QDQ graph (int8 per channel) in {time.time() - t:.0f} s", flush=True)
nll = lambda x: np.array([token_nll(x[i], ids[i + 1]) for i in range(len(ids) - 1)])  # noqa: E731
lf = a16_feeds.stream_logits(f, art, m, ids, kv)
print(f"float graph: perplexity {np.exp(nll(lf).mean()):.4f} over {len(ids)} tokens", flush=True)
divisors = a16_weights.INT4_DIVISORS
for v in a.variants.split(","):
    bits = 8 if v.startswith("int8") else 4
    a16_weights.INT4_DIVISORS = {"c7": (7.0,), "c8": (8.0,)}.get(v.split("-")[1] if "-c" in v else "", divisors)
    head = None if bits == 8 or v.endswith("head4") else 8
    q = onnx.ModelProto(); q.CopyFrom(q8)
    t = time.time()
    counts = a16_weights.block_weights(q, matrices, bits, head)
    lq = a16_feeds.stream_logits(q, art, m, ids, kv)
    corr = np.corrcoef(lf.astype(np.float64).ravel(), lq.astype(np.float64).ravel())[0, 1]
    print(f"{v}: perplexity {np.exp(nll(lq).mean()):.4f}, logit correlation {corr:.5f}, {counts}, "
          f"{time.time() - t:.0f} s", flush=True)
