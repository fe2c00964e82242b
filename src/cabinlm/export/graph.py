"""A small ONNX graph builder: named nodes, constants and initializers, one opset.

Only standard-domain ops are emitted, so the graph runs in ONNX Runtime and parses in TensorRT.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# IR version per opset, set explicitly: onnxruntime refuses IR versions newer than it knows,
# and onnx writes its newest by default.
IR_VERSION_FOR_OPSET = {17: 8, 18: 8, 19: 9, 20: 9, 21: 10}


class GraphBuilder:
    def __init__(self, name: str, opset: int = 17):
        if opset not in IR_VERSION_FOR_OPSET:
            raise ValueError(f"opset {opset} is not one of {sorted(IR_VERSION_FOR_OPSET)}")
        self.name = name
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}

    def _fresh(self, hint: str) -> str:
        name, i = hint, 0
        while name in self._names:
            i += 1
            name = f"{hint}_{i}"
        self._names.add(name)
        return name

    # -- graph I/O ---------------------------------------------------------------------------------

    def input(self, name: str, elem_type: int, shape: tuple) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: tuple) -> str:
        """Expose `value` as graph output `name` (through an Identity when the names differ)."""
        if value != name:
            self._names.add(name)
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"{name}/identity"))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    # -- values ------------------------------------------------------------------------------------

    def weight(self, name: str, array: np.ndarray) -> str:
        name = self._fresh(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def raw(self, name: str, elem_type: int, dims: tuple[int, ...], data: bytes) -> str:
        """An initializer from raw little-endian bytes (packed 4-bit types numpy cannot hold)."""
        name = self._fresh(name)
        self.initializers.append(helper.make_tensor(name, elem_type, list(dims), data, raw=True))
        return name

    def const(self, value, dtype=np.float32) -> str:
        """A small constant, deduplicated by value."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight("const", arr)
        return self._consts[key]

    def scalar(self, elem_type: int, value) -> str:
        """A scalar of any ONNX element type numpy cannot name (e.g. float8), deduplicated."""
        key = ("scalar", elem_type, value)
        if key not in self._consts:
            name = self._fresh("const")
            self.initializers.append(helper.make_tensor(name, elem_type, [], [value]))
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values) -> str:
        return self.const(values, np.int64)

    # -- nodes -------------------------------------------------------------------------------------

    def op(self, op_type: str, *inputs: str, name: str | None = None, outputs: int = 1, **attrs):
        base = name or op_type.lower()
        outs = [self._fresh(base if outputs == 1 else f"{base}_{i}") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self._fresh(f"n/{base}"), **attrs))
        return outs[0] if outputs == 1 else outs

    def reduce(self, op_type: str, x: str, axes: list[int], name: str | None = None) -> str:
        # opset 18 moved `axes` from an attribute to an input for ReduceMean, ReduceMax, ...
        if self.opset >= 18:
            return self.op(op_type, x, self.ints(axes), name=name, keepdims=1)
        return self.op(op_type, x, name=name, axes=axes, keepdims=1)

    def split(self, x: str, sizes: list[int], axis: int, name: str | None = None) -> list[str]:
        return self.op("Split", x, self.ints(sizes), name=name, outputs=len(sizes), axis=axis)

    # -- output ------------------------------------------------------------------------------------

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", self.opset)],
            producer_name="cabinlm",
            ir_version=IR_VERSION_FOR_OPSET[self.opset],
        )
        return model


def save_model(model: onnx.ModelProto, path: Path, data_name: str) -> None:
    """Save with all weights in one external-data file next to the graph (the graph stays small)."""
    path = Path(path)
    data = path.parent / data_name
    if data.exists():
        data.unlink()  # onnx appends to an existing data file
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )


ELEM = {
    "float": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "bool": TensorProto.BOOL,
    "int8": TensorProto.INT8,
    "uint8": TensorProto.UINT8,
    "float8e4m3fn": TensorProto.FLOAT8E4M3FN,
}
