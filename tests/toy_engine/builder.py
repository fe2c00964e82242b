"""The toy's build: the export's graph, weights and tokenizer copied as they are."""

from __future__ import annotations

import onnxruntime as ort

from cabinlm.contract.buildspec import BuildSpec, ExecutionProvider
from cabinlm.engines.builder import Builder, BuildRequest
from cabinlm.engines.output import BuildOutput


class ToyBuilder(Builder):
    preference = 100  # tried before the built-in engines on the profile it targets
    # kind: set by toy_engine.register() (a kind registered at run time)

    def targets(self, profile) -> bool:
        from toy_engine import PROFILE

        return profile.name == PROFILE

    def check(self, request: BuildRequest) -> str | None:
        m = request.manifest
        if m.cache.local_layers or m.vision is not None or m.cache.quantized:
            return "the toy engine runs text models with float KV and no local layers"
        return None

    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        output.copy("tokenizer")
        output.copy("graph")
        output.copy_if_present("graph_data")
        return BuildSpec(backend=self.kind, provider=ExecutionProvider(), profile=request.profile.name,
                         engine="onnxruntime", engine_version=ort.__version__)


BUILDER = ToyBuilder()
