"""The a16 build's fidelity check alone (engines/qnn_htp/a16_feeds.stream_fidelity: the QDQ graph's logits
against the float graph's over held-out text fed by the runtime, both on the CPU) for a weight form,
without compiling or refusing.

    python benchmarks/htp_a16_fidelity.py ARTIFACT {int16,int8,int4}
"""
import sys, tempfile
from pathlib import Path
from cabinlm.manifest import load_manifest
from cabinlm.engines.qnn_htp import qdq
qdq.WEIGHTS_A16 = sys.argv[2]; qdq.MIN_FIDELITY, qdq.MAX_PERPLEXITY_RATIO = -1.0, float("inf")
art = Path(sys.argv[1]); m = load_manifest(art)
with tempfile.TemporaryDirectory() as t:
    _, rw, _, _ = qdq.a16_graph(art, m, None, Path(t))
print("weights", sys.argv[2], "fidelity", rw["fidelity"], "perplexity (float, QDQ)", rw["fidelity_perplexity"])
