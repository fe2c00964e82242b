"""A build's switchable LoRA adapters at run time: each prepared file loaded once, shared by every seat.

    AdapterSet(folder, manifest)     the adapters the build lists (manifest lora.adapters)
    .feeds(name)                     name -> {lora_a.{l}.{t}: (R, in), lora_b.{l}.{t}: (out, R)} float32,
                                     loaded on first use and kept; None -> the zeros of no adapter
                                     (the base model bit for bit), made once

The arrays are read-only and shared: a backend binds them as graph inputs, never writes them.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from cabinlm.contract.adapters import adapter_role
from cabinlm.contract.errors import InputError, ManifestError
from cabinlm.contract.manifest import Manifest


class AdapterSet:
    """The adapters of one loaded artifact (folder, manifest with lora set)."""

    def __init__(self, folder: Path, manifest: Manifest):
        if manifest.lora is None:
            raise ValueError("the artifact takes no adapter inputs")
        self.folder = Path(folder)
        self.manifest = manifest
        self.lora = manifest.lora
        self.specs = {t.name: t for t in self.lora.inputs(manifest.model.num_layers, manifest.lora_shapes)}
        self._loaded: dict[str | None, dict[str, np.ndarray]] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return self.lora.names

    def check(self, name: str | None) -> None:
        """An unknown name: InputError naming the adapters there are."""
        if name is not None and self.lora.adapter(name) is None:
            there = ", ".join(self.names) or "none"
            raise InputError(f"no adapter named {name!r} in this build (it holds: {there}); prepare it with "
                             f"`cabinlm build EXPORT --adapter {name}=DIR`")  # fmt: skip

    def feeds(self, name: str | None) -> dict[str, np.ndarray]:
        self.check(name)
        if name not in self._loaded:
            self._loaded[name] = self._zeros() if name is None else self._read(name)
        return self._loaded[name]

    def _zeros(self) -> dict[str, np.ndarray]:
        out = {}
        for n, t in self.specs.items():
            a = np.zeros(t.shape, dtype=np.float32)  # type: ignore[arg-type]
            a.flags.writeable = False
            out[n] = a
        return out

    def _read(self, name: str) -> dict[str, np.ndarray]:
        entry = self.manifest.files[adapter_role(name)]
        path = self.folder / entry.path
        again = "run `cabinlm build` again"
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise ManifestError(f"{path}: adapter {name!r} is not readable ({str(e)[:120]}); {again}") from e
        if set(arrays) != set(self.specs):
            raise ManifestError(f"{path}: adapter {name!r} does not hold this export's adapter inputs; {again}")
        for k, a in arrays.items():
            t = self.specs[k]
            if a.dtype != np.float32 or a.shape != tuple(t.shape):
                raise ManifestError(f"{path}: {k} is {a.dtype} {a.shape}, the graph takes float32 {tuple(t.shape)}; {again}")
            a = np.ascontiguousarray(a)
            a.flags.writeable = False
            arrays[k] = a
        return arrays

    def nbytes(self, name: str) -> int:
        """The bytes one adapter's arrays hold in memory."""
        return sum(int(np.prod(t.shape)) * 4 for t in self.specs.values())  # type: ignore[arg-type]
