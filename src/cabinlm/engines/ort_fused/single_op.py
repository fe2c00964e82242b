"""A graph of a few operators and a session over it: how the kernel tests and the kernel
micro-benchmarks run cabinlm's operators (and ONNX Runtime's, to compare) outside a whole decoder.

    graph = single_op.model([node], inputs, outputs, initializers)   # opsets: "", com.microsoft, ai.cabinlm
    sess = single_op.session(graph, library=lib, threads=2)         # the kernel library registered

One place for the opset versions, the IR version and the session options, so that a test's result
and a benchmark's timing come from the same graph the same way. Build-side code: it imports onnx
(the export extra), which the runtime never does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import onnx
import onnxruntime as ort
from onnx import helper

from cabinlm.engines.ort_fused import kernels

# The operator sets every single-op graph imports: the standard one the fused decoder is exported at,
# ONNX Runtime's contrib operators (GroupQueryAttention, MatMulNBits) and cabinlm's own.
OPSETS = (("", 21), ("com.microsoft", 1), (kernels.DOMAIN, 1))
IR_VERSION = 10  # the lowest onnxruntime cabinlm supports (1.20) reads IR 10


def model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], initializers: Iterable[onnx.TensorProto] = (),
          name: str = "single_op") -> onnx.ModelProto:  # fmt: skip
    """NODES as a model: INPUTS fed, OUTPUTS fetched, INITIALIZERS held in the graph."""
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid(domain, version) for domain, version in OPSETS]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def session(graph: onnx.ModelProto | bytes, *, library: str | Path | None = None, threads: int = 2,
            spinning: bool = True) -> ort.InferenceSession:  # fmt: skip
    """A CPU session of GRAPH on THREADS intra-op threads (one inter-op), ONNX Runtime's own messages
    kept to errors, LIBRARY (a kernel library file) registered where the graph has cabinlm's operators;
    spinning False: the pool's threads sleep between runs instead of waiting actively."""
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if library is not None:
        so.register_custom_ops_library(str(library))
    data = graph if isinstance(graph, bytes) else graph.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
