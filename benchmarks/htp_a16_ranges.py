"""Which calibrated 16-bit ranges a text leaves (issue 33): the a16 QDQ graph of an artifact
(engines/qnn_htp/qdq.a16_graph, saved once to WORK/q.onnx), then one prefill chunk of TEXT fed the
way the runtime feeds it (qdq.calibration_feeds: the HTP backend's own bookkeeping) through the float
graph with every float intermediate as an output; for each tensor the QDQ graph quantizes, how far
the text's values lie outside the range its scale and zero point can represent (uint16: zp..65535-zp).

    python benchmarks/htp_a16_ranges.py ARTIFACT TEXT WORK [CHUNK_INDEX]
"""
import sys, tempfile
from pathlib import Path

import numpy as np, onnx, onnxruntime as ort
from onnx import numpy_helper
from tokenizers import Tokenizer

from cabinlm.manifest import load_manifest
from cabinlm.engines.qnn_htp import qdq

art, text, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
which = int(sys.argv[4]) if len(sys.argv) > 4 else 0
work.mkdir(parents=True, exist_ok=True)
m = load_manifest(art)
f, _, sc, rot = qdq.a16_float_graph(art, m)  # the build's float graph: keys rotated where the build rotates them
qp = work / "q.onnx"
if not qp.exists():
    qdq.MIN_FIDELITY, qdq.MAX_PERPLEXITY_RATIO = -1.0, float("inf")
    with tempfile.TemporaryDirectory() as t:
        q, rw, _, _ = qdq.a16_graph(art, m, None, Path(t))
    print("fidelity", rw["fidelity"], flush=True)
    onnx.save_model(q, str(qp), save_as_external_data=True, location="q.data")
q = onnx.load(str(qp), load_external_data=False)
inits = {t.name: t for t in q.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
rng = {}  # float tensor -> (lo, hi) the QDQ graph can represent
for n in q.graph.node:
    if n.op_type == "QuantizeLinear" and n.input[1] in inits and n.input[2] in inits:
        s = numpy_helper.to_array(inits[n.input[1]]).astype(np.float64)
        z = numpy_helper.to_array(inits[n.input[2]])
        if s.size != 1:
            continue
        info = np.iinfo(z.dtype)
        zf = float(z)
        rng[n.input[0]] = ((info.min - zf) * float(s), (info.max - zf) * float(s))
ids = Tokenizer.from_file(str(art / "tokenizer.json")).encode(text.read_text()).ids[: m.cache.chunk * (which + 1) + 65]
feeds = [x for x in qdq.calibration_feeds(f, art, m, ids, sc if rot else None) if x["input_ids"].shape[0] > 1]
fd = feeds[which]
print("chunk", which, "tokens", fd["input_ids"][:8], flush=True)
have = {o.name for o in f.graph.output}
names = [o for n in f.graph.node for o in n.output if o in rng and o not in have]
for nm in names:
    f.graph.output.append(onnx.helper.make_tensor_value_info(nm, onnx.TensorProto.FLOAT, None))
so = ort.SessionOptions(); so.log_severity_level = 3
s = ort.InferenceSession(f.SerializeToString(), so, providers=["CPUExecutionProvider"])
outs = [o.name for o in s.get_outputs()]
vals = dict(zip(outs, s.run(None, fd)))
rows = []
for nm in names:
    x = vals[nm]
    if x.dtype != np.float32:
        continue
    lo, hi = rng[nm]
    over = max(x.max() / hi if hi > 0 and x.max() > hi else 0, x.min() / lo if lo < 0 and x.min() < lo else 0)
    if over > 1.0:
        where = np.unravel_index(np.argmax(np.maximum(x - hi, lo - x)), x.shape)
        rows.append((over, nm, x.min(), x.max(), lo, hi, where))
rows.sort(key=lambda r: -r[0])
print(len(rows), "of", len(names), "quantized tensors leave their range")
for over, nm, a, b, lo, hi, where in rows[:40]:
    print(f"{over:8.2f}x {nm:70s} text [{a:.4g}, {b:.4g}] range [{lo:.4g}, {hi:.4g}] at {tuple(int(i) for i in where)}")
