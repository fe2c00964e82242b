"""Adapters prepared for a switchable export's inputs (`cabinlm build --adapter NAME=DIR[:SCALE]`).

    AdapterRequest.parse("NAME=DIR[:SCALE]")
    prepare(request, manifest) -> PreparedAdapter   read (export/lora.py), checked against the model and
                                                    the export's inputs, zero-padded to its rank
    PreparedAdapter.save(folder) -> relative path   ADAPTER_FOLDER/NAME.npz, uncompressed float32

Each pair becomes the graph's inputs (contract/adapters.py) for its layer and projection:

    lora_a.{l}.{t}  (R, in)   A in rows 0..r-1, zeros below
    lora_b.{l}.{t}  (out, R)  B * s * SCALE in columns 0..r-1, zeros after

so (x A^T) B^T is the adapter's s * SCALE * (x A^T) B^T exactly as far as the rank's zeros go (they add
exact zeros). Inputs the adapter does not touch (a layer or projection it lacks) are zeros.
Reading needs numpy, safetensors and gguf, not torch.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cabinlm.contract.adapters import NAME, AdapterRecord, adapter_file
from cabinlm.contract.errors import ModelError, OptionError
from cabinlm.contract.manifest import Manifest
from cabinlm.contract.io_spec import lora_a_name, lora_b_name
from cabinlm.export.lora import FUSED_FAMILIES, LoraRequest, check_adapter, read_adapter


@dataclass(frozen=True)
class AdapterRequest:
    """One --adapter NAME=DIR[:SCALE]."""

    name: str
    lora: LoraRequest

    @classmethod
    def parse(cls, text: str) -> AdapterRequest:
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise OptionError(f"--adapter {text}: give NAME=DIR[:SCALE], e.g. --adapter manual=adapters/manual:0.8")
        if not NAME.match(name):
            raise OptionError(f"--adapter {text}: the name {name!r} must be letters, digits, '_', '.' or '-' (up to 64, "
                              "starting with a letter or digit)")  # fmt: skip
        return cls(name, LoraRequest.parse(rest))


@dataclass(frozen=True)
class PreparedAdapter:
    record: AdapterRecord
    arrays: dict[str, np.ndarray]  # every adapter input of the export, float32

    def save(self, folder: Path) -> str:
        rel = adapter_file(self.record.name)
        path = Path(folder) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        np.savez(buf, **self.arrays)
        path.write_bytes(buf.getvalue())
        return rel


def prepare(request: AdapterRequest, manifest: Manifest) -> PreparedAdapter:
    """The adapter read and checked (one line each: another base model, a target or rank the export's
    inputs do not have, an unreadable file), then padded into the export's inputs."""
    lora = manifest.lora
    head = f"--adapter {request.name}={request.lora.path}"
    if lora is None:
        raise OptionError(f"{head}: this export has no adapter inputs; export the model with --lora-rank R (or merge "
                          "the adapter with `cabinlm export --lora`)")  # fmt: skip
    if manifest.model.architecture in FUSED_FAMILIES:
        raise OptionError(f"{head}: {manifest.model.architecture} takes no switchable adapters")
    try:
        adapter = check_adapter(read_adapter(request.lora.path), manifest.model)
    except ModelError as e:
        msg = str(e)
        raise ModelError(head + msg[msg.index(":") :] if msg.startswith("--lora ") else f"{head}: {msg}") from None
    if adapter.rank > lora.rank:
        raise ModelError(f"{head}: rank {adapter.rank}, above the export's maximum {lora.rank}; re-export with "
                         f"--lora-rank {adapter.rank} or more")  # fmt: skip
    outside = [t for t in adapter.targets if t not in lora.targets]
    if outside:
        raise ModelError(f"{head}: changes {', '.join(outside)}, but the export takes adapter inputs on "
                         f"{', '.join(lora.targets)} only; re-export with --lora-targets covering them (e.g. all)")  # fmt: skip
    specs = {t.name: t for t in lora.inputs(manifest.model.num_layers, manifest.lora_shapes)}
    arrays = {n: np.zeros(t.shape, dtype=np.float32) for n, t in specs.items()}  # type: ignore[arg-type]
    for p in adapter.pairs:
        r = p.rank
        arrays[lora_a_name(p.layer, p.projection)][:r] = p.a
        # the scaling folded into B in float32: PEFT scales (x A^T) B^T by s in float32 too, after the product
        arrays[lora_b_name(p.layer, p.projection)][:, :r] = p.b * np.float32(p.scaling * request.lora.scale)
    record = AdapterRecord(name=request.name, source=str(request.lora.path), format=adapter.format, sha256=adapter.sha256,
                           scale=request.lora.scale, rank=adapter.rank, targets=adapter.targets,
                           base_model=adapter.base_model)  # fmt: skip
    return PreparedAdapter(record, arrays)
