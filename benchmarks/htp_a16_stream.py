"""The a16 QDQ graph (engines/qnn_htp/qdq.a16_graph) against its float graph through the runtime on
the CPU (a16_feeds.stream_logits: the HTP backend's own feeds, prefill chunks from an empty cache), over the
first TOKENS tokens of a text: perplexity of each, the logit correlation of the first chunk. No
compiler, no simulator: what the 16-bit ranges alone do to a stream the calibration never saw
(issue 33; docs/benchmarks.md section 15, "16-bit activations on sa8775p").

    python benchmarks/htp_a16_stream.py ARTIFACT TEXT [--tokens 256] [--keep-offsets] [--weights int8]

--weights: int8 / int16 per output channel (the quantizer's), int8block / int4block the build's
(--a16-weights int8 / int4).

--keep-offsets: the QDQ graph as before the fix (a Q4_1 matrix's offset term kept as its own MatMul
beside the matrix, each quantized apart: qdq._q4_1_offset disabled).
"""
import argparse, tempfile, time
from pathlib import Path

import numpy as np, onnx
from tokenizers import Tokenizer

from cabinlm.manifest import load_manifest
from cabinlm.engines.qnn_htp import a16_feeds, qdq
from cabinlm.runtime.perplexity import token_nll

ap = argparse.ArgumentParser()
ap.add_argument("artifact"); ap.add_argument("text")
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--keep-offsets", action="store_true")
ap.add_argument("--weights", default="int8block", choices=["int8", "int16", "int8block", "int4block"])
ap.add_argument("--save", help="write the QDQ graph here (a .onnx path)")
a = ap.parse_args()
if a.keep_offsets:
    qdq._q4_1_offset = lambda *args: None
blocks = a.weights.removesuffix("block") if a.weights.endswith("block") else "int8"
qdq.PER_CHANNEL = None if a.weights.endswith("block") else a.weights
qdq.MIN_FIDELITY = qdq.MIN_FIDELITY_INT4 = -1.0; qdq.MAX_PERPLEXITY_RATIO = float("inf")  # measure, do not refuse
art = Path(a.artifact); m = load_manifest(art)
f, _, sc, rot = qdq.a16_float_graph(art, m)  # the build's float graph: keys rotated where the build rotates them
kv = sc if rot else None  # a16_feeds: the rotated cache's scales
ids = Tokenizer.from_file(str(art / "tokenizer.json")).encode(Path(a.text).read_text()).ids[: a.tokens]
t = time.time()
with tempfile.TemporaryDirectory() as w:
    q, rw, _, _ = qdq.a16_graph(art, m, None, Path(w), weights=blocks)
print(f"QDQ graph: weights {a.weights}, {rw['float_weights']} matrices, {rw['offsets_folded']} offsets folded, "
      f"the build's check (held-out text through the runtime): correlation {rw['fidelity']}, perplexity "
      f"{rw['fidelity_perplexity'][1]} against {rw['fidelity_perplexity'][0]}, {time.time() - t:.0f} s", flush=True)
if a.save:
    onnx.save_model(q, a.save, save_as_external_data=True, location=Path(a.save).name + ".data")
nll = lambda x: np.array([token_nll(x[i], ids[i + 1]) for i in range(len(ids) - 1)])  # noqa: E731
lf, lq = a16_feeds.stream_logits(f, art, m, ids, kv), a16_feeds.stream_logits(q, art, m, ids, kv)
ref, got = nll(lf), nll(lq)
corr = np.corrcoef(lf.astype(np.float64).ravel(), lq.astype(np.float64).ravel())[0, 1]
print(f"logit correlation, QDQ against float, over the stream: {corr:.5f}")
C = m.cache.chunk
for name, x in (("float graph", ref), ("QDQ graph", got)):
    print(f"{name}: perplexity {np.exp(x.mean()):.4g} over {len(ids)} tokens (first chunk {np.exp(x[:C - 1].mean()):.4g})")
