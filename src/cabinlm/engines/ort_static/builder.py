"""onnxruntime-static builds (a user's static-shape CPU profile): a prefill graph (tokens = chunk) and
a decode graph (tokens = 1), every dimension fixed, both pointing at one weights file; the manifest
lists where each weight lies, and the runtime maps the file once for both sessions."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import onnx

from cabinlm.contract.files import FileRole
from cabinlm.contract.buildspec import BuildSpec, OptimizationLevel
from cabinlm.engines.builder import Builder, BuildError, BuildRequest
from cabinlm.engines.onnxruntime.offline import fix_tokens
from cabinlm.engines.ort_graph.builder import spec_for, targets_cpu
from cabinlm.contract.engines.static import SharedWeight, SharedWeights
from cabinlm.engines.output import BuildOutput
from cabinlm.contract.engines import BackendKind

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

PREFILL_GRAPH, DECODE_GRAPH = "decoder.prefill.onnx", "decoder.decode.onnx"


_NUMPY = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64",
          onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8"}


def weight_table(model: onnx.ModelProto, data_name: str) -> SharedWeights:
    """Where each external initializer lies in the weights file."""
    tensors = []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        if info.get("location") != data_name or init.data_type not in _NUMPY:
            raise BuildError(f"initializer {init.name} is not in {data_name} or has an unsupported type")
        tensors.append(SharedWeight(init.name, _NUMPY[init.data_type], tuple(init.dims), int(info.get("offset", 0)),
                                    int(info["length"])))  # fmt: skip
    return SharedWeights(data_name, tuple(tensors))




class StaticBuilder(Builder):
    kind: ClassVar[BackendKind] = BackendKind.STATIC_PAIR

    def targets(self, profile: DeviceProfile) -> bool:
        return targets_cpu(profile, static=True)

    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        manifest = request.manifest
        output.copy(FileRole.TOKENIZER)
        output.copy_if_present(FileRole.VISION_GRAPH, FileRole.VISION_DATA)
        src = onnx.load(str(request.artifact / manifest.files[FileRole.GRAPH].path), load_external_data=False)
        data_name = manifest.files[FileRole.GRAPH_DATA].path
        for name, tokens in ((PREFILL_GRAPH, manifest.cache.chunk), (DECODE_GRAPH, 1)):
            m = onnx.ModelProto()
            m.CopyFrom(src)
            fix_tokens(m, tokens, manifest.cache)
            onnx.save_model(m, str(output.path(name)))  # initializers keep pointing at the shared data file
        output.add(FileRole.GRAPH, PREFILL_GRAPH)
        output.add(FileRole.GRAPH_DECODE, DECODE_GRAPH)
        output.copy(FileRole.GRAPH_DATA)
        request.log(f"wrote a static prefill graph (tokens = {manifest.cache.chunk}) and a decode graph (tokens = 1) sharing weights")
        return spec_for(self.kind, request, OptimizationLevel.ALL, weight_table(src, data_name))


BUILDER = StaticBuilder()
