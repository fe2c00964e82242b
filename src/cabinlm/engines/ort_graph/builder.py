"""onnxruntime-graph builds: the exported graph, its cached keys' rotation as ONNX Runtime's
RotaryEmbedding kernel, ONNX Runtime's provider-independent fusions done offline. What a cpu build
becomes where the fused decoder does not apply (fp16 / fp8 KV, int8-KV vision-language models) or
`--attention graph` asks for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from cabinlm.contract.files import FileRole
from cabinlm.contract.buildspec import CPU_PROVIDER, BuildSpec, ExecutionProvider, OptimizationLevel
from cabinlm.engines.builder import Builder, BuildRequest
from cabinlm.engines.onnxruntime.offline import (OPT_DATA, OPT_GRAPH, cpu_session, fuse_rotary, log_weights, optimize_offline,
                                                 read_graph)
from cabinlm.engines.output import BuildOutput
from cabinlm.contract.engines import BackendKind

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile


def targets_cpu(profile: DeviceProfile, static: bool) -> bool:
    """An ONNX Runtime profile on the CPU provider, with (static) or without fixed shapes."""
    return profile.engine.value == "onnxruntime" and profile.execution_provider == CPU_PROVIDER and profile.static_shapes == static


def spec_for(kind: BackendKind, request: BuildRequest, optimization: OptimizationLevel, facts=None) -> BuildSpec:
    import onnxruntime as ort

    return BuildSpec(backend=kind, provider=ExecutionProvider(CPU_PROVIDER), session=cpu_session(request.profile, optimization),
                     profile=request.profile.name, engine="onnxruntime", engine_version=ort.__version__, facts=facts)  # fmt: skip


class GraphBuilder(Builder):
    kind: ClassVar[BackendKind] = BackendKind.EXPORTED_GRAPH

    def targets(self, profile: DeviceProfile) -> bool:
        return targets_cpu(profile, static=False)

    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        output.copy(FileRole.TOKENIZER)
        output.copy_if_present(FileRole.VISION_GRAPH, FileRole.VISION_DATA)  # the camera encoder runs as exported
        graph = read_graph(request.artifact, request.manifest)
        vision = request.manifest.vision
        if vision is not None and vision.mrope:  # RotaryEmbedding takes one position per token, M-RoPE three
            request.log("kept the cached keys' rotation as exported (multimodal RoPE: three position components)")
        else:
            n = fuse_rotary(graph, request.manifest)
            request.log(f"fused the cached keys' rotary embedding into RotaryEmbedding in {n} layers")
        optimize_offline(graph.SerializeToString(), output.folder)
        del graph
        output.add(FileRole.GRAPH, OPT_GRAPH)
        output.add(FileRole.GRAPH_DATA, OPT_DATA)
        request.log(f"optimized the graph offline for {request.profile.execution_provider}")
        log_weights(request.manifest, output, request.log)
        # the heavy fusions are done; the host adds its own at load
        return spec_for(self.kind, request, OptimizationLevel.BASIC)


BUILDER = GraphBuilder()
