"""Where an a16 graph (engines/qnn_htp/qdq.py) leaves its float graph: one prefill chunk of a text (the
pinned head the calibration feeds first) through the QDQ graph and the float graph on ONNX Runtime's
CPU provider, max |error| / max |value| of each tensor of the first layers (those above 5%), and the
logits. docs/benchmarks.md section 15, "16-bit activations on sa8775p".

    python benchmarks/htp_a16_tensors.py ARTIFACT TEXT
"""
import sys, numpy as np, onnxruntime as ort, tempfile, onnx
from pathlib import Path
from tokenizers import Tokenizer
from cabinlm.manifest import load_manifest
from cabinlm.engines.qnn_htp import qdq
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
art=Path(sys.argv[1]); m=load_manifest(art)
f, _, sc, rot = qdq.a16_float_graph(art, m)  # the build's float graph: keys rotated where the build rotates them
qdq.MIN_FIDELITY, qdq.MAX_PERPLEXITY_RATIO = -1.0, float("inf")  # measure, do not refuse
ids=Tokenizer.from_file(str(art/"tokenizer.json")).encode(Path(sys.argv[2]).read_text()).ids[:129]
feeds=qdq.calibration_feeds(f, art, m, ids, sc if rot else None)  # records feeds of this text (pinned head, chunks)
fd=[x for x in feeds if x["input_ids"].shape[0]>1][0]
print("feed tokens", fd["input_ids"].shape, flush=True)
W=Path(tempfile.mkdtemp(prefix="smoldiag-"))
with tempfile.TemporaryDirectory() as t:
    q,_,_,_=qdq.a16_graph(art,m,None,Path(t))
fi=SymbolicShapeInference.infer_shapes(f, auto_merge=True)
types={v.name: v.type.tensor_type.elem_type for v in fi.graph.value_info}
qn={o for n in q.graph.node for o in n.output}
order=[o for n in f.graph.node for o in n.output if o in qn and types.get(o)==1]
sel=[o for o in order if any(k in o for k in ("layers.0/","layers.1/","layers.2/","_res","norm","logits","embed"))][:400]
for mdl in (f,q):
    have={o.name for o in mdl.graph.output}
    for nm in sel:
        if nm not in have: mdl.graph.output.append(onnx.helper.make_tensor_value_info(nm, 1, None))
so=ort.SessionOptions(); so.log_severity_level=3
sf=ort.InferenceSession(f.SerializeToString(), so, providers=["CPUExecutionProvider"])
del f
qp=W/"q.onnx"; onnx.save_model(q, str(qp), save_as_external_data=True, location="q.data")
del q
sq=ort.InferenceSession(str(qp), so, providers=["CPUExecutionProvider"])
a=dict(zip([o.name for o in sf.get_outputs()], sf.run(None,fd)))
b=dict(zip([o.name for o in sq.get_outputs()], sq.run(None,fd)))
shown=0
for nm in sel+["logits"]:
    if nm in a and nm in b and a[nm].dtype==np.float32:
        x,y=a[nm],b[nm]; e=np.abs(x-y).max()/max(np.abs(x).max(),1e-9)
        if e>0.05 or "res" in nm or nm=="logits":
            print(nm, x.shape, "absmax %.4g" % np.abs(x).max(), "rel %.3f" % e, flush=True); shown+=1
            if shown>40: break
