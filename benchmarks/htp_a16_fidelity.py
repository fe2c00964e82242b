"""The a16 build's fidelity check alone (engines/qnn_htp/a16_feeds.stream_fidelity: the QDQ graph's logits
against the float graph's over held-out text fed by the runtime, both on the CPU) for a weight form,
without compiling or refusing.

    python benchmarks/htp_a16_fidelity.py ARTIFACT {int16,int8,int4,int8block,int4block}

int16 / int8 / int4: the quantizer's per-channel weights; int8block / int4block: the build's
(--a16-weights int8 / int4).
"""
import sys, tempfile
from pathlib import Path
from cabinlm.manifest import load_manifest
from cabinlm.engines.qnn_htp import qdq
v = sys.argv[2]; qdq.PER_CHANNEL = None if v.endswith("block") else v; qdq.MIN_FIDELITY = qdq.MIN_FIDELITY_INT4 = -1.0; qdq.MAX_PERPLEXITY_RATIO = float("inf")
art = Path(sys.argv[1]); m = load_manifest(art)
with tempfile.TemporaryDirectory() as t:
    _, rw, _, _ = qdq.a16_graph(art, m, None, Path(t), weights=v.removesuffix("block") if v.endswith("block") else "int8")
print("weights", sys.argv[2], "fidelity", rw["fidelity"], "perplexity (float, QDQ)", rw["fidelity_perplexity"])
