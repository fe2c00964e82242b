"""The fused decoder's LM head as a graph of its own (the hidden rows of the final norm -> logits), cut
from the one-seat fused decoder (graph.fused_model): the batched graphs' rows go through it, one graph
for every batch size (engines/ort_fused/seats.py), so ONNX Runtime packs the head's matrix once for
them all (a session packs its own copy of a MatMulNBits matrix; the layers' BlockQ4MatMul weights are
read in place from the one map of the weights)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from cabinlm.contract import io_spec
from cabinlm.contract import manifest as mf
from cabinlm.contract.errors import BuildError
from cabinlm.contract.manifest import Manifest


def head_model(decoder: onnx.ModelProto, manifest: Manifest) -> onnx.ModelProto:
    """The one-seat fused decoder's LM head on its own (its nodes from `hidden` to `logits`, its
    initializers under the same names): what the batched graphs' rows go through, one graph for every
    batch size, so that the head's matrix is packed by ONNX Runtime once for them all (a session
    packs its own copy of a MatMulNBits matrix; the layers' BlockQ4MatMul weights are read in place)."""
    producer = {o: n for n in decoder.graph.node for o in n.output}
    inits = {i.name: i for i in decoder.graph.initializer}
    nodes: set[int] = set()  # ids of the head's nodes
    todo, needed = [mf.LOGITS], set()
    while todo:
        name = todo.pop()
        if name == io_spec.HIDDEN or name in inits or name == "" or name in needed:
            continue
        needed.add(name)
        node = producer.get(name)
        if node is None:
            raise BuildError(f"the fused decoder's LM head reads {name!r}, not only the final norm's rows")
        if id(node) not in nodes:
            nodes.add(id(node))
            todo.extend(node.input)
    order = [n for n in decoder.graph.node if id(n) in nodes]  # the decoder's own (topological) order
    used = {i for n in order for i in n.input}
    io = io_spec.head_io(manifest.model.hidden_size, manifest.model.vocab_size)
    inputs = [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.shape)) for t in io.inputs]
    outputs = [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.shape)) for t in io.outputs]
    g = helper.make_graph(order, "cabinlm_lm_head", inputs, outputs, [inits[n] for n in sorted(used & set(inits))])
    return helper.make_model(g, opset_imports=list(decoder.opset_import), producer_name="cabinlm", ir_version=10)
