"""A toy engine that lives outside cabinlm: the exported graph on onnxruntime's plain `run` (no I/O
binding), its cache in numpy arrays. It exists to show what a new engine takes: this folder (a
builder.py and a backend.py) and a registration (`register()`), nothing edited in cabinlm.
tests/test_toy_engine.py registers it and runs the engine conformance suite over it."""

from __future__ import annotations

from cabinlm.contract.engines import register_kind, unregister_kind
from cabinlm.engines.registry import EngineEntry, register_engine, unregister_engine

NAME = "toy-numpy"
PROFILE = "toy-host"  # the profile name its builder targets (a test writes the profile file)


def register():
    """Register the toy's kind and engine; returns its kind."""
    from toy_engine.backend import ToyBackend
    from toy_engine.builder import ToyBuilder

    kind = register_kind(NAME, None)  # its builds record no facts of their own
    ToyBackend.kind = ToyBuilder.kind = kind
    register_engine(EngineEntry(kind, "toy_engine", "the exported graph on onnxruntime's run(), a numpy cache"))
    return kind


def unregister(kind) -> None:
    unregister_engine(kind)
    unregister_kind(kind)
