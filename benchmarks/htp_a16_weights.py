"""Which weight form the HTP compiler takes beside 16-bit activations (docs/architecture.md "16-bit
activations on the HTP"): the a16 graph of an int8-KV export (engines/qnn_htp/qdq.py) with its weights
int8 per channel, int4 per channel, or the export's int4 blocks (DequantizeLinear block_size 32),
compiled for sa8775p (prefill graph), run in the simulator on the last 8 calibration chunks, against
the same QDQ graph and the float graph on ONNX Runtime's CPU provider (max |logit error| / max |logit|).

    python benchmarks/htp_a16_weights.py ARTIFACT {int16,int8,int4,int4block,int4sym,int4sym-lpbq,int8block,a16w4}

a16w4: the build's own int4 form (--a16-weights int4: a16_weights.sym_blocks' scale search, the LM head int8).

int8block: the float matrices as signed int8 blocks of 32, symmetric (scale absmax / 127).
int4sym: the float matrices re-quantized to signed int4 blocks of 32, symmetric (zero point 0, scale
absmax / 7), DequantizeLinear(block_size 32) feeding the 16-bit MatMul (the export's blocks are uint4
with a zero point per block); int4sym-lpbq: the same with the QNN provider's
enable_block_quant_weight_optimization = 1 (its conversion of symmetric int4 blocks to LPBQ).
"""
import sys, os, tempfile, numpy as np, onnx, onnxruntime as ort
from pathlib import Path
from cabinlm.manifest import load_manifest
from cabinlm.engines.onnxruntime.offline import read_graph, fix_tokens
from cabinlm.engines.qnn_htp import qdq
from cabinlm.engines.qnn_htp.builder import compile_graph, profile_provider
from cabinlm.engines.qnn_htp import plugin as qp
from cabinlm.profiles import load_profile
variant=sys.argv[2]
qdq.MIN_FIDELITY = qdq.MIN_FIDELITY_INT4 = -1.0; qdq.MAX_PERPLEXITY_RATIO = float("inf")  # measure, do not refuse
qdq.PER_CHANNEL = None if variant == "a16w4" else "int4" if variant.startswith("int4") else "int8" if variant.startswith("int8") else variant
W=Path(tempfile.mkdtemp(prefix="a16-weights-")); art=Path(sys.argv[1]); m=load_manifest(art)
# float reference with the same rewrites (uint8 cache I/O)
f, _, kv_sc, rot = qdq.a16_float_graph(art, m)  # the build's float graph: keys rotated where the build rotates them
ids,_=qdq.calibration_ids(art,m,None)
feeds=[x for x in qdq.calibration_feeds(f, art, m, ids, kv_sc if rot else None) if x["input_ids"].shape[0]==4][-8:]
q,_,_,_=qdq.a16_graph(art,m,None,W,weights="int4" if variant=="a16w4" else "int8")
if variant=="int4block":
    orig=read_graph(art,m); oc={t.name:t for t in orig.graph.initializer}
    blocks={n.output[0]: n for n in orig.graph.node if n.op_type=="DequantizeLinear" and n.input[0] in oc and any(a.name=="block_size" for a in n.attribute)}
    have={t.name for t in q.graph.initializer}
    for n in q.graph.node:
        if n.op_type=="DequantizeLinear" and n.input[0].endswith("_quantized") and n.input[0][:-10] in blocks:
            b=blocks[n.input[0][:-10]]; n.input[:]=list(b.input); del n.attribute[:]; n.attribute.extend(b.attribute)
            for i in b.input:
                if i and i not in have: q.graph.initializer.append(oc[i]); have.add(i)
if variant.startswith("int4sym") or variant=="int8block":
    bits_max, onnx_type = (127, onnx.TensorProto.INT8) if variant=="int8block" else (7, onnx.TensorProto.INT4)
    from onnx import numpy_helper as nh
    fw={t.name: t for t in f.graph.initializer}
    for n in q.graph.node:
        if n.op_type=="DequantizeLinear" and n.input[0].endswith("_quantized") and n.input[0][:-10] in fw:
            w=nh.to_array(fw[n.input[0][:-10]]).astype(np.float32)
            if w.ndim!=2 or w.shape[0]%32 or n.input[0].startswith("embed"): continue  # matrices only, not the token table
            K,N=w.shape
            sc=np.maximum(np.abs(w.reshape(K//32,32,N)).max(1)/bits_max, 1e-12).astype(np.float32)
            qq=np.clip(np.rint(w/np.repeat(sc,32,0)),-bits_max-1,bits_max).astype(np.int8)
            base=n.input[0][:-10]+"_sym"
            q.graph.initializer.extend([onnx.helper.make_tensor(base+"_q", onnx_type, (K,N), qq.ravel().tolist()),
                                        nh.from_array(sc, base+"_s")])
            n.input[:]=[base+"_q", base+"_s"]; del n.attribute[:]
            n.attribute.extend([onnx.helper.make_attribute("axis",0), onnx.helper.make_attribute("block_size",32)])
    if variant.endswith("lpbq"):
        import cabinlm.engines.qnn_htp.builder as B
        pp=B.profile_provider
        def with_lpbq(p):
            e=pp(p); e.options["enable_block_quant_weight_optimization"]="1"; return e
        B.profile_provider=profile_provider=with_lpbq
fix_tokens(q, 4, m.cache); onnx.save(q, str(W/"q.onnx"))
prof=load_profile("sa8775p"); import cabinlm.engines.qnn_htp.builder as B; B.compile_graph(W/"q.onnx", W/"q.ctx.onnx", prof, share=False, last=True)
h=qp.open_context_session(W/"q.ctx.onnx", profile_provider(prof), share=False)
sq=ort.InferenceSession(str(W/"q.onnx"), providers=["CPUExecutionProvider"]); sf=ort.InferenceSession(f.SerializeToString(), providers=["CPUExecutionProvider"])
e1=[];e2=[];e3=[]
for fd in feeds:
    a=h.run(["logits"],fd)[0]; b=sq.run(["logits"],fd)[0]; r=sf.run(["logits"],fd)[0]
    e1.append(np.abs(a-b).max()/np.abs(b).max()); e2.append(np.abs(b-r).max()/np.abs(r).max()); e3.append(np.abs(a-r).max()/np.abs(r).max())
if variant=="int4block":  # the same graph on the CPU with every block zero point dropped (read as 0)
    q2=onnx.load(str(W/"q.onnx"))
    for n in q2.graph.node:
        if n.op_type=="DequantizeLinear" and any(a.name=="block_size" for a in n.attribute): n.input[:]=n.input[:2]
    s2=ort.InferenceSession(q2.SerializeToString(), providers=["CPUExecutionProvider"])
    e4=[np.abs(h.run(["logits"],fd)[0]-s2.run(["logits"],fd)[0]).max()/np.abs(s2.run(["logits"],fd)[0]).max() for fd in feeds]
    print("int4block HTP vs the QDQ graph on the CPU with the blocks' zero points dropped: %.4f-%.4f" % (min(e4), max(e4)))
print(variant, "HTP vs same QDQ on CPU: %.3f-%.3f" % (min(e1),max(e1)), "QDQ CPU vs float: %.3f-%.3f" % (min(e2),max(e2)), "HTP vs float %.3f-%.3f" % (min(e3), max(e3)))
