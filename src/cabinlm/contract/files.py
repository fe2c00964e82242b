"""What each file of an artifact is: the roles `manifest.files` names them by, and the entry each
role holds (the path inside the artifact folder, its size, its sha256).

    role                     written by                      read by
    graph, graph_data        the export; every build          every engine's backend
    graph_decode             static pairs, HTP builds         their backends (tokens = 1)
    graph_head               fused builds with batched seats  the batched runs' LM head (MatMulNBits heads)
    graph_seats{B}           fused builds                     B seats' rows in one run (seats_graph(B))
    graph_plain[_seats{B}]   fused builds with adapter inputs the decoder (and batched ones) without the
                                                              adapter nodes, for seats without an adapter
    rotate_graph             fused builds                     the sink / pinned keys' refresh
    kernel_library           fused builds                     a custom-op library its graphs need registered
    tokenizer                the export; every build          the runtime
    vision_graph, _data      VLM exports; most builds         the camera encoder on the CPU provider
    vision_context[_binary]  HTP builds of VLMs               the camera encoder on the HTP
    context_binary[_N]       HTP builds                       the compiled graphs' binaries (context_binary(N))
    engine                   TensorRT engine builds           the TensorRT backend
    adapter.{NAME}           builds with switchable adapters  the seats that choose NAME

A role ending in SIMULATOR (contract/engines/qnn.py) is the x86 simulator's twin of that role.
Roles are strings in the manifest; FileRole gives the fixed ones a name in code.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from pathlib import Path


class FileRole(str, enum.Enum):
    """The fixed roles of an artifact's files (the table above)."""

    GRAPH = "graph"
    GRAPH_DATA = "graph_data"
    GRAPH_DECODE = "graph_decode"
    GRAPH_HEAD = "graph_head"
    GRAPH_PLAIN = "graph_plain"  # a fused build's decoder without its switchable adapters' inputs
    ROTATE_GRAPH = "rotate_graph"
    CUSTOM_OPS = "kernel_library"
    TOKENIZER = "tokenizer"
    VISION_GRAPH = "vision_graph"
    VISION_DATA = "vision_data"
    VISION_CONTEXT = "vision_context"
    VISION_CONTEXT_BINARY = "vision_context_binary"
    ENGINE = "engine"

    def __str__(self) -> str:  # the role as the manifest writes it, in messages and f-strings too
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def seats_graph(batch: int, plain: bool = False) -> str:
    """The role of a fused build's batched graph for `batch` seats (plain: its twin without adapter inputs)."""
    return f"graph_plain_seats{batch}" if plain else f"graph_seats{batch}"


def context_binary(index: int) -> str:
    """The role of an HTP build's index-th context binary (the first: "context_binary")."""
    return "context_binary" if index == 0 else f"context_binary_{index}"


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the artifact folder, inside it
    bytes: int
    sha256: str

    def __post_init__(self) -> None:
        p = self.path
        if not isinstance(p, str) or not p or p.startswith("/") or "\\" in p or ".." in p.split("/"):
            raise ValueError(f"file path {p!r} must be relative and inside the artifact folder")
        if type(self.bytes) is not int or not 0 <= self.bytes < 1 << 45:
            raise ValueError(f"{p}: size {self.bytes!r} is not a byte count")
        if not isinstance(self.sha256, str) or len(self.sha256) != 64:
            raise ValueError(f"{p}: sha256 must be 64 hex digits")

    @classmethod
    def of(cls, folder: Path, relpath: str) -> FileEntry:
        p = folder / relpath
        return cls(relpath, p.stat().st_size, file_sha256(p))


def file_sha256(path: Path | str) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks (OSError as open() raises it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
