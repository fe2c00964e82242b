"""Switchable LoRA adapters: the graph inputs an export declares for them, and the adapters a build
prepared for them. Standard library only.

An export with `--lora-rank R` adds to every targeted projection y = x W^T (W: out x in) the term
(x A^T) B^T, with A and B graph inputs of the fixed maximum rank R:

    lora_a.{l}.{t}   float  (R, in)    the adapter's A, rows past its own rank zero
    lora_b.{l}.{t}   float  (out, R)   the adapter's B times its scaling (s * SCALE), columns past its rank zero

for every layer l and target t in `targets` (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj). No adapter feeds zeros: x A^T is then exactly zero, and y + 0 is y, so the logits are
the base export's bit for bit (tests/test_lora_switch.py).

A build prepares each adapter once (`cabinlm build --adapter NAME=DIR[:SCALE]`) into one file of
those arrays, ADAPTER_FOLDER/NAME.npz (listed in the manifest's files as adapter_role(NAME), so its
size and sha256 are checked as every file's are), and records it as an AdapterRecord.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from cabinlm.contract.io_spec import TensorSpec, lora_inputs

# The projections an export can take adapter inputs on, in the graph's order.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FOLDER = "adapters"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # an adapter's name: a file name and a model-id suffix


def adapter_role(name: str) -> str:
    """The manifest's files role of adapter `name`'s prepared file."""
    return f"adapter.{name}"


def adapter_file(name: str) -> str:
    return f"{ADAPTER_FOLDER}/{name}.npz"


def target_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection of a Llama-like layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}  # fmt: skip


@dataclass(frozen=True)
class AdapterRecord:
    """One adapter a build prepared (manifest lora.adapters): where it came from and what it holds."""

    name: str
    source: str  # the folder or file given to --adapter
    format: str  # "peft" or "gguf"
    sha256: str  # of the adapter's own weights file (adapter_model.safetensors or the .gguf)
    scale: float  # SCALE of NAME=DIR:SCALE, folded into B with the adapter's own scaling
    rank: int  # its own rank (<= the export's maximum)
    targets: tuple[str, ...]  # the projections it changes
    base_model: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.match(self.name):
            raise ValueError(f"adapter name {self.name!r}: letters, digits, '_', '.', '-' (up to 64, not starting with a sign)")
        object.__setattr__(self, "targets", tuple(self.targets))
        if type(self.rank) is not int or self.rank < 1:
            raise ValueError(f"adapter {self.name}: rank {self.rank!r} is not a positive whole number")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "format": self.format, "sha256": self.sha256,
                "scale": self.scale, "rank": self.rank, "targets": list(self.targets), "base_model": self.base_model}  # fmt: skip


@dataclass(frozen=True)
class SwitchableLora:
    """An export's adapter inputs (manifest "lora"): their fixed maximum rank and target projections,
    and, in a build, the adapters prepared for them."""

    rank: int
    targets: tuple[str, ...] = TARGETS
    adapters: tuple[AdapterRecord, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if type(self.rank) is not int or not 1 <= self.rank <= 1024:
            raise ValueError(f"lora.rank must be a whole number in 1..1024, got {self.rank!r}")
        if not self.targets or any(t not in TARGETS for t in self.targets) or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets {list(self.targets)!r}: some of {', '.join(TARGETS)}, each once")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))  # the graph's order
        adapters = tuple(a if isinstance(a, AdapterRecord) else AdapterRecord(**a) for a in self.adapters)
        object.__setattr__(self, "adapters", adapters)
        names = [a.name for a in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"lora.adapters: a name given twice ({', '.join(names)})")
        for a in adapters:
            if a.rank > self.rank or any(t not in self.targets for t in a.targets):
                raise ValueError(f"adapter {a.name}: rank {a.rank} / targets {list(a.targets)} beyond the export's "
                                 f"rank {self.rank} / targets {list(self.targets)}")  # fmt: skip

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)

    def adapter(self, name: str) -> AdapterRecord | None:
        return next((a for a in self.adapters if a.name == name), None)

    def inputs(self, layers: int, shapes: dict[str, tuple[int, int]]) -> tuple[TensorSpec, ...]:
        """Every adapter input (io_spec.lora_inputs), layer by layer, target by target, A before B."""
        return lora_inputs(self.rank, self.targets, layers, shapes)

    def bytes_per_adapter(self, layers: int, shapes: dict[str, tuple[int, int]]) -> int:
        """The float32 bytes of one adapter's inputs (what each prepared adapter holds in memory)."""
        return sum(4 * t.shape[0] * t.shape[1] for t in self.inputs(layers, shapes))  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "targets": list(self.targets), "adapters": [a.to_dict() for a in self.adapters]}
