"""The engines an artifact can name, and the typed facts each engine's builds record.

    kind                 facts (manifest build.<KEY>)        module
    onnxruntime-graph    none
    onnxruntime-static   SharedWeights     "shared_weights"  static.py
    onnxruntime-fused    FusedSettings     "fused"           fused.py
    qnn-htp              QnnSettings       "qnn"             qnn.py
    tensorrt             TensorRTSettings  "tensorrt"        tensorrt.py

The manifest names the kind (`build.backend`); engines/registry.py maps each kind to the folder whose
code builds and runs it. Kinds are registered, not enumerated: an engine outside this package (a
test's own) registers its kind and facts here and its folder in the registry. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.engines.qnn import QnnSettings
from cabinlm.contract.engines.static import SharedWeights
from cabinlm.contract.engines.tensorrt import TensorRTSettings
from cabinlm.contract.io_spec import DecoderIO, DecoderShape


class _Kinds(type):
    """Iterating BackendKind gives the kinds registered so far, in registration order."""

    def __iter__(cls) -> Iterator[BackendKind]:
        return iter(list(FACTS))

    def __len__(cls) -> int:
        return len(FACTS)


class BackendKind(str, metaclass=_Kinds):
    """How the decoder graph(s) of an artifact are run, by the name the manifest writes
    (`build.backend`): one engine folder each (engines/registry.py). A kind exists once it is
    registered (register_kind); BackendKind(name) gives that one object (so `is` compares kinds) and
    refuses a name no engine registered, as the manifest's readers need."""

    # The built-in engines' kinds (set below, after the class exists).
    EXPORTED_GRAPH: ClassVar[BackendKind]
    STATIC_PAIR: ClassVar[BackendKind]
    FUSED: ClassVar[BackendKind]
    QNN_HTP: ClassVar[BackendKind]
    TENSORRT: ClassVar[BackendKind]

    def __new__(cls, name: str) -> BackendKind:
        for kind in FACTS:
            if kind == name:
                return kind
        raise ValueError(f"{name!r} is not a backend kind ({', '.join(FACTS)})")

    @property
    def value(self) -> str:
        """The name as the manifest writes it."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"BackendKind({self.value!r})"

    def __reduce__(self):  # a copy or a pickle is the registered kind again
        return (BackendKind, (self.value,))


class EngineFacts(Protocol):
    """An engine's typed build facts: written under build.<KEY> in the manifest; its graphs' contract
    computed from the export's shape (the manifest asks the facts, never which engine it holds)."""

    KEY: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    def decoder_io(self, shape: DecoderShape) -> DecoderIO: ...


# Each registered kind and the class of the facts its builds record (None: it records none), in
# registration order.
FACTS: dict[BackendKind, type | None] = {}


def register_kind(name: str, facts: type | None) -> BackendKind:
    """A new backend kind, its builds recording `facts` (a class with KEY, to_dict, from_dict and
    decoder_io; None: no facts) under build.<KEY>. engines/registry.py registers the built-in
    engines; a kind registered twice is refused."""
    if not name or any(kind == name for kind in FACTS):
        raise ValueError(f"backend kind {name!r} is empty or already registered")
    if facts is not None and any(f is not None and f.KEY == facts.KEY for f in FACTS.values()):
        raise ValueError(f"build.{facts.KEY} already holds another engine's facts")
    kind = str.__new__(BackendKind, name)
    FACTS[kind] = facts
    return kind


def unregister_kind(kind: BackendKind) -> None:
    """Remove a kind registered at run time (a test's own engine); the built-in ones stay."""
    if kind in BUILT_IN:
        raise ValueError(f"{kind.value} is a built-in backend kind")
    del FACTS[kind]


BackendKind.EXPORTED_GRAPH = register_kind("onnxruntime-graph", None)
BackendKind.STATIC_PAIR = register_kind("onnxruntime-static", SharedWeights)
BackendKind.FUSED = register_kind("onnxruntime-fused", FusedSettings)
BackendKind.QNN_HTP = register_kind("qnn-htp", QnnSettings)
BackendKind.TENSORRT = register_kind("tensorrt", TensorRTSettings)
BUILT_IN = frozenset(FACTS)
