"""Build: an exported artifact -> what a device profile's engine loads.

    onnxruntime profiles  build/ort.py  the graph optimized offline for the provider, session
                                        settings and checksums in build.json; for static-shape
                                        targets a prefill graph and a decode graph sharing weights
    tensorrt profiles     build/trt.py  the TensorRT compatibility check (runs anywhere), then the
                                        engine where TensorRT and an NVIDIA GPU are present

The output folder is itself an artifact: `cabinlm chat OUT` and `cabinlm perplexity OUT` run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from cabinlm.errors import CabinlmError

BUILD_NAME = "build.json"


class BuildError(CabinlmError):
    """The build cannot be done here or for this artifact."""


def build_artifact(artifact: str | Path, profile, out: str | Path | None = None, log: Callable[[str], None] = lambda s: None,
                   attention: str = "auto", accuracy_level: int = 4, minimums: str = "int8") -> Path:
    """Build `artifact` for `profile` (a DeviceProfile) into `out` (default: ARTIFACT/build-PROFILE).

    ONNX Runtime cpu builds: attention "auto" fuses the decoder (build/ort_fused.py) where the
    artifact allows and keeps the exported graph otherwise; "fused" insists; "graph" keeps the export.
    accuracy_level: the fused build's MatMulNBits activations (4: int8, as llama.cpp; 0: float32).
    minimums: how the fused build runs GGUF Q4_1 blocks ("exact", or "int8": build/ort_fused.py)."""
    if attention not in ("auto", "fused", "graph"):
        raise BuildError(f"attention must be auto, fused or graph, got {attention!r}")
    from cabinlm.build.ort_fused import MINIMUMS

    if minimums not in MINIMUMS:
        raise BuildError(f"minimums must be {' or '.join(MINIMUMS)}, got {minimums!r}")
    from cabinlm.manifest import load_manifest
    from cabinlm.profiles import Engine

    artifact = Path(artifact)
    manifest = load_manifest(artifact)
    if manifest.cache.kv_dtype not in profile.kv_dtypes:
        raise BuildError(
            f"{artifact} holds {manifest.cache.kv_dtype.value} KV, which profile {profile.name} cannot run "
            f"({', '.join(k.value for k in profile.kv_dtypes)}); re-export with --profile {profile.name}"
        )
    out = Path(out) if out is not None else artifact / f"build-{profile.name}"
    if profile.engine == Engine.TENSORRT:
        from cabinlm.build.trt import build_tensorrt

        return build_tensorrt(artifact, manifest, profile, out, log)
    from cabinlm.build.ort import build_onnxruntime

    return build_onnxruntime(artifact, manifest, profile, out, log, attention=attention, accuracy_level=accuracy_level,
                             minimums=minimums)
