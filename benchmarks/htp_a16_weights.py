"""Which weight form the HTP compiler takes beside 16-bit activations (docs/architecture.md "16-bit
activations on the HTP"): the a16 graph of an int8-KV export (engines/qnn_htp/qdq.py) with its weights
int8 per channel, int4 per channel, or the export's int4 blocks (DequantizeLinear block_size 32),
compiled for sa8775p (prefill graph), run in the simulator on the last 8 calibration chunks, against
the same QDQ graph and the float graph on ONNX Runtime's CPU provider (max |logit error| / max |logit|).

    python benchmarks/htp_a16_weights.py ARTIFACT {int16,int8,int4,int4block}
"""
import sys, os, tempfile, numpy as np, onnx, onnxruntime as ort
from pathlib import Path
from cabinlm.manifest import load_manifest
from cabinlm.engines.onnxruntime.offline import read_graph, fix_tokens
from cabinlm.engines.qnn_htp import qdq, graph as G
from cabinlm.engines.qnn_htp.builder import compile_graph, profile_provider
from cabinlm.engines.qnn_htp import plugin as qp
from cabinlm.profiles import load_profile
variant=sys.argv[2]
qdq.MIN_FIDELITY = -1.0  # measure, do not refuse
qdq.WEIGHTS_A16 = "int4" if variant.startswith("int4") else variant
W=Path(tempfile.mkdtemp(prefix="a16-weights-")); art=Path(sys.argv[1]); m=load_manifest(art)
# float reference with the same rewrites (uint8 cache I/O)
f=read_graph(art,m); G.fuse_rms_norms(f); G.float_embedding(f); qdq.float_weights(f)
sc=G.per_tensor_kv_scales(m.kv_scales.array("keys"), m.kv_scales.array("values"), m.cache.layers); G.uint8_kv(f, sc); qdq.floor_masks(f)
ids,_=qdq.calibration_ids(art,m,None)
feeds=[x for x in qdq.calibration_feeds(f, art, m, ids) if x["input_ids"].shape[0]==4][-8:]
q,_,_,_=qdq.a16_graph(art,m,None,W)
if variant=="int4block":
    orig=read_graph(art,m); oc={t.name:t for t in orig.graph.initializer}
    blocks={n.output[0]: n for n in orig.graph.node if n.op_type=="DequantizeLinear" and n.input[0] in oc and any(a.name=="block_size" for a in n.attribute)}
    have={t.name for t in q.graph.initializer}
    for n in q.graph.node:
        if n.op_type=="DequantizeLinear" and n.input[0].endswith("_quantized") and n.input[0][:-10] in blocks:
            b=blocks[n.input[0][:-10]]; n.input[:]=list(b.input); del n.attribute[:]; n.attribute.extend(b.attribute)
            for i in b.input:
                if i and i not in have: q.graph.initializer.append(oc[i]); have.add(i)
fix_tokens(q, 4, m.cache); onnx.save(q, str(W/"q.onnx"))
prof=load_profile("sa8775p"); compile_graph(W/"q.onnx", W/"q.ctx.onnx", prof, share=False, last=True)
h=qp.open_context_session(W/"q.ctx.onnx", profile_provider(prof), share=False)
sq=ort.InferenceSession(str(W/"q.onnx"), providers=["CPUExecutionProvider"]); sf=ort.InferenceSession(f.SerializeToString(), providers=["CPUExecutionProvider"])
e1=[];e2=[];e3=[]
for fd in feeds:
    a=h.run(["logits"],fd)[0]; b=sq.run(["logits"],fd)[0]; r=sf.run(["logits"],fd)[0]
    e1.append(np.abs(a-b).max()/np.abs(b).max()); e2.append(np.abs(b-r).max()/np.abs(r).max()); e3.append(np.abs(a-r).max()/np.abs(r).max())
print(variant, "HTP vs same QDQ on CPU: %.3f-%.3f" % (min(e1),max(e1)), "QDQ CPU vs float: %.3f-%.3f" % (min(e2),max(e2)), "HTP vs float %.3f-%.3f" % (min(e3), max(e3)))
