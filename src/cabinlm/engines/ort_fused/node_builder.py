"""The fused decoder's graph-making parts (engines/ort_fused/graph.py): the exported graph's
initializers read by name, and a list of nodes and initializers with names of their own."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cabinlm.contract.errors import BuildError


class ExportedWeights:
    """Initializers of the exported graph by name."""

    def __init__(self, model: onnx.ModelProto):
        self.inits = {i.name: i for i in model.graph.initializer}
        self.nodes = {n.name: n for n in model.graph.node}

    def has(self, name: str) -> bool:
        return name in self.inits

    def get(self, name: str) -> np.ndarray:
        if name not in self.inits:
            raise BuildError(f"the exported graph has no initializer {name!r}; it is not a cabinlm decoder, re-export")
        t = self.inits[name]
        if t.data_type == TensorProto.UINT4:  # packed two per byte, low nibble first
            raw = np.frombuffer(t.raw_data, dtype=np.uint8)
            flat = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(-1)
            return flat[: int(np.prod(t.dims))].reshape(tuple(t.dims))
        return numpy_helper.to_array(t)


class NodeBuilder:
    """Nodes and initializers of a graph being made; constants held once by content."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}#{self._n}"

    def op(self, op_type: str, *inputs: str, out: str | None = None, outputs: int = 1, domain: str = "", hint: str = "", **attrs):
        base = hint or op_type.lower()
        outs = [out] if out else [self.name(f"{base}/out{i}") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name(f"n/{base}"), domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def weight(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def const(self, arr: np.ndarray) -> str:
        arr = np.asarray(arr)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(self.name("const"), arr)
        return self._consts[key]
