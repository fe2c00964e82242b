"""The uint8 cache's I/O through the 16-bit quantizer (qdq.quantize_a16): graph.uint8_kv's cache
inputs and outputs are made float before onnxruntime's QDQ quantizer runs (float_kv_io), each to be
quantized back to uint8 with its own tied scale and zero point 128, and after it the Quantize /
Dequantize at the graph's I/O are taken away again (strip_kv_io), so the built graph reads and writes
the runtime's uint8 cache bytes as they are.

Invariant (checked by strip_kv_io): every removed node carries exactly the tensor's scale and zero
point 128, so the runtime copies the new K/V bytes into the cache without re-quantizing.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from cabinlm.contract.errors import BuildError
from cabinlm.engines.qnn_htp.graph import _consumers

ONE = "htp/one"


def rewire(g: onnx.GraphProto, old: str, new: str) -> None:
    for n in g.node:
        n.input[:] = [new if x == old else x for x in n.input]


def float_kv_io(model: onnx.ModelProto, scales: dict[str, float]) -> dict[str, float]:
    """graph.uint8_kv's cache I/O made float for the quantizer, each tensor to be quantized back to
    uint8 with its own scale (strip_kv_io then takes the Quantize / Dequantize at the I/O away):

        x ─ Div s ─ Clip ─ Q(1, 128) ─ new_K ─ DQ(1, 128) ─ Mul s ─ (chunk)   ->  x = new_K (float) ─ (chunk)
        cache ─ DQ(1, 128) ─ Mul s ─ (attention)                           ->  cache (float) ─ (attention)
        value cache ─ DQ(1, 128) ─ Mul 1 ... probabilities ─ Mul s         ->  value cache (float) ... probabilities

    Returns {tensor: scale} for every cache input and new K/V output (the input's and its output's
    scale the same number: tied), and the output of a Transpose that is a cache input's only reader
    (rotated keys: key_cache ─ Transpose ─ QK^T): the quantizer leaves a Transpose of an unquantized
    input float, so its output is quantized only where QK^T reads it, and with this override as the
    cache's uint8. A multiplier that is not the tensor's scale: BuildError."""
    from cabinlm.contract import io_spec as io

    g = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    users = _consumers(model)
    layers = sorted(int(t.name.split(".")[1]) for t in g.input if t.name.startswith("key_cache."))
    drop: set[str] = set()  # node names
    out: dict[str, float] = {}

    def read_back(dq_out: str, s: float, unit_ok: bool) -> str:
        """The Mul after a cache DQ: its output name; the Mul and DQ dropped."""
        (mul,) = users[dq_out]
        c = next(consts[x] for x in mul.input if x in consts)
        if mul.op_type != "Mul" or not (np.allclose(c, s, rtol=1e-6) or (unit_ok and np.all(c == 1.0))):
            raise BuildError(f"{mul.name}: the cache is read back with {c.ravel()[:1]}, not its scale {s:.6g}; re-export")
        drop.update((mul.name, producer[dq_out].name))
        return mul.output[0]

    for i in layers:
        for cache, new in ((io.key_cache_name(i), io.new_key_name(i)), (io.value_cache_name(i), io.new_value_name(i))):
            s = float(scales[cache])
            q = producer[new]
            clip = producer[q.input[0]]
            div = producer[clip.input[0]]
            if (q.op_type, clip.op_type, div.op_type) != ("QuantizeLinear", "Clip", "Div"):
                raise BuildError(f"{new}: not written by Div ─ Clip ─ QuantizeLinear (graph.uint8_kv); re-export")
            x = div.input[0]
            (dq,) = [n for n in users[new] if n.op_type == "DequantizeLinear"]
            m_new = read_back(dq.output[0], s, False)
            drop.update((q.name, clip.name))
            # the new entries: x times one, a node of their own (the quantizer gives the output of a
            # Transpose / Reshape its input's 16-bit parameters, whatever the override says), read
            # back by the chunk as the cache will hold them
            div.op_type, div.input[1], div.output[0] = "Mul", ONE, new
            rewire(g, m_new, new)
            (dq_c,) = users[cache]
            m_cache = read_back(dq_c.output[0], s, cache == io.value_cache_name(i))
            rewire(g, m_cache, cache)
            out[cache] = out[new] = s
            readers = [n for n in g.node if cache in n.input and n.name not in drop]
            if all(n.op_type == "Transpose" for n in readers):  # rotated keys: the cache straight into QK^T
                out.update((n.output[0], s) for n in readers)  # stays uint8 there (strip_kv_io adds its DQ)
        s_v = f"{io.value_cache_name(i)}.u8_scale"  # the probabilities over the cached values scaled by s
        for mul in [n for n in g.node if n.op_type == "Mul" and s_v in n.input and n.name not in drop]:
            drop.add(mul.name)
            rewire(g, mul.output[0], mul.input[0] if mul.input[1] == s_v else mul.input[1])
    kept = [n for n in g.node if n.name not in drop]
    del g.node[:]
    g.node.extend(kept)
    g.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), ONE))
    for t in (*g.input, *g.output):
        if t.name in out:
            t.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    still = {x for n in g.node for x in n.input}
    inits = [t for t in g.initializer if t.name in still]
    del g.initializer[:]
    g.initializer.extend(inits)
    return out


def strip_kv_io(model: onnx.ModelProto, scales: dict[str, float]) -> None:
    """The quantized graph's cache I/O as uint8 tensors: the QuantizeLinear behind each cache input
    and the DequantizeLinear before each new K/V output removed, so the runtime hands the graph its
    uint8 cache and copies the outputs' bytes. Each removed node must carry the tensor's scale and
    zero point 128 (the invariant float_kv_io's overrides set)."""
    from cabinlm.engines.qnn_htp.graph import KV_ZERO_POINT

    g = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    users = _consumers(model)
    drop: set[str] = set()

    def check(n: onnx.NodeProto, name: str) -> None:
        s, z = consts.get(n.input[1]), consts.get(n.input[2]) if len(n.input) > 2 else None
        if s is None or z is None or z.dtype != np.uint8 or int(z) != KV_ZERO_POINT or not np.isclose(float(s), scales[name], rtol=1e-6):
            raise BuildError(f"{name}: the quantizer did not give it uint8 with scale {scales[name]:.6g} and zero point "
                             f"{KV_ZERO_POINT} ({n.name}); report this")  # fmt: skip

    for t in g.input:
        if t.name not in scales:
            continue
        readers = users[t.name]
        if all(n.op_type == "Transpose" and n.output[0] in scales for n in readers):
            # read only by Transposes (float_kv_io: rotated keys), which the quantizer left float: the
            # cache's DequantizeLinear added here, so QK^T reads DQ ─ Transpose ─ Q ─ DQ, uint8 throughout
            dq, scale, zp = f"{t.name}/dq", f"{t.name}/u8_scale", f"{t.name}/u8_zero_point"
            g.initializer.extend([numpy_helper.from_array(np.array(scales[t.name], np.float32), scale),
                                  numpy_helper.from_array(np.array(KV_ZERO_POINT, np.uint8), zp)])  # fmt: skip
            g.node.insert(0, onnx.helper.make_node("DequantizeLinear", [t.name, scale, zp], [dq], name=f"htp/{dq}"))
            for n in readers:
                n.input[0] = dq
        else:
            (q,) = readers
            check(q, t.name)
            drop.add(q.name)
            rewire(g, q.output[0], t.name)
        t.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    for t in g.output:
        if t.name in scales:
            dq = producer[t.name]
            check(dq, t.name)
            q = producer[dq.input[0]]
            # Q writes the uint8 output; the DQ stays where the graph reads the new entries back
            read = t.name + "/read"
            rewire(g, t.name, read)
            rewire(g, dq.input[0], t.name)
            q.output[0], dq.output[0] = t.name, read
            if not users.get(t.name):
                drop.add(dq.name)
            t.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    kept = [n for n in g.node if n.name not in drop]
    del g.node[:]
    g.node.extend(kept)
