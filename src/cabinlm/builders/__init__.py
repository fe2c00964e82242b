"""Build: an exported artifact -> what a device profile's engine loads.

    onnxruntime profiles  builders/ort.py  the graph optimized offline for the provider, the build as
                                        typed data in the manifest (buildspec.BuildSpec); for static-shape
                                        targets a prefill graph and a decode graph sharing weights
    qnn profiles          builders/qnn.py  Qualcomm's compiler (the onnxruntime-qnn plugin): prefill and
                                        decode graphs as HTP context binaries (qnn_graph.py makes the
                                        graph HTP-ready and fp16-safe)
    tensorrt profiles     builders/trt.py  the TensorRT compatibility check and the target bundle (run
                                        anywhere), then the engine where TensorRT and an NVIDIA GPU are
                                        present; `cabinlm build BUNDLE` on the target finishes a bundle

The output folder is itself an artifact: `cabinlm chat OUT` and `cabinlm perplexity OUT` run it.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Callable

from cabinlm.errors import CabinlmError, OptionError

BUILD_NAME = "build.json"  # the untyped build record of cabinlm before manifest format 4 (removed on rebuild)


class BuildError(CabinlmError):
    """The build cannot be done here or for this artifact."""


class Attention(str, enum.Enum):
    """cpu builds: which attention the built decoder runs."""

    AUTO = "auto"  # fused where the artifact allows it, the exported graph otherwise
    FUSED = "fused"  # ONNX Runtime's GroupQueryAttention (builders/ort_fused.py); refuse if it does not apply
    GRAPH = "graph"  # the exported graph's own attention


class AttentionKernel(str, enum.Enum):
    """Fused cpu builds: which kernel computes the attention over the cache."""

    AUTO = "auto"  # cabinlm's for int8 KV where this machine compiles it, ONNX Runtime's otherwise
    CABINLM = "cabinlm"  # kernels/int8_kv_attention.cc (int8 KV): a prefill chunk about twice as fast
    ONNXRUNTIME = "onnxruntime"  # com.microsoft::GroupQueryAttention


class MatmulKernel(str, enum.Enum):
    """Fused cpu builds: which kernel computes the layers' matmuls over GGUF Q4_1 blocks."""

    AUTO = "auto"  # cabinlm's where this machine compiles its fast path (AVX-512 VNNI), ONNX Runtime's otherwise
    CABINLM = "cabinlm"  # kernels/block_q4_matmul.cc: the 4-bit blocks and minimums read as exported
    ONNXRUNTIME = "onnxruntime"  # com.microsoft::MatMulNBits (the blocks as --minimums says)


class Minimums(str, enum.Enum):
    """Fused cpu builds: how GGUF Q4_1 blocks (4-bit codes plus a float block minimum) run."""

    INT8 = "int8"  # 8-bit codes with an integer zero point, the minimum rounded to 1/34 of a step
    EXACT = "exact"  # 4-bit codes plus blocksum(x) @ minimum (two more kernels per matrix)


def build_artifact(artifact: str | Path, profile, out: str | Path | None = None, log: Callable[[str], None] = lambda s: None,
                   attention: Attention = Attention.AUTO, accuracy_level: int = 4, minimums: Minimums = Minimums.INT8,
                   attention_kernel: AttentionKernel = AttentionKernel.AUTO,
                   matmul_kernel: MatmulKernel = MatmulKernel.AUTO) -> Path:
    """Build `artifact` for `profile` (a DeviceProfile; None: cpu) into `out` (default: ARTIFACT/build-PROFILE).
    A TensorRT bundle (`artifact` made by a tensorrt profile's build) gets its engine built, in place
    unless `out` is given; its profile is the one it was made for.

    ONNX Runtime cpu builds: attention "auto" fuses the decoder (builders/ort_fused.py) where the
    artifact allows and keeps the exported graph otherwise; "fused" insists; "graph" keeps the export.
    accuracy_level: the fused build's MatMulNBits activations (4: int8, as llama.cpp; 0: float32).
    minimums: how the fused build runs GGUF Q4_1 blocks ("exact", or "int8": builders/ort_fused.py).
    attention_kernel, matmul_kernel: the fused build's kernels (AttentionKernel, MatmulKernel)."""
    try:
        attention, minimums, attention_kernel = Attention(attention), Minimums(minimums), AttentionKernel(attention_kernel)
        matmul_kernel = MatmulKernel(matmul_kernel)
    except ValueError as e:
        raise BuildError(str(e)) from e
    if isinstance(accuracy_level, bool) or accuracy_level not in (0, 1, 2, 3, 4):  # MatMulNBits' levels
        raise OptionError(f"--accuracy-level must be 0..4 (4 = int8 activations, 0 = float32), got {accuracy_level!r}")
    from cabinlm.manifest import load_manifest
    from cabinlm.profiles import Engine

    artifact = Path(artifact)
    manifest = load_manifest(artifact)
    if manifest.build is not None and manifest.build.tensorrt is not None:  # a TensorRT bundle, on the target
        from cabinlm.builders.trt import finish_bundle

        return finish_bundle(artifact, manifest, profile, Path(out) if out is not None else None, log)
    if profile is None:  # no --profile: the host CPU
        from cabinlm.profiles import load_profile

        profile = load_profile("cpu")
    if manifest.build is not None:
        raise BuildError(f"{artifact} is already a build (for {manifest.build.profile}); pass the folder `cabinlm export` "
                         f"wrote: {(manifest.target or {}).get('built_from', 'its parent')}")
    if manifest.cache.kv_dtype not in profile.kv_dtypes:
        raise BuildError(
            f"{artifact} holds {manifest.cache.kv_dtype.value} KV, which profile {profile.name} cannot run "
            f"({', '.join(k.value for k in profile.kv_dtypes)}); re-export with --profile {profile.name}"
        )
    out = Path(out) if out is not None else artifact / f"build-{profile.name}"
    if profile.engine == Engine.TENSORRT:
        from cabinlm.builders.trt import build_tensorrt

        return build_tensorrt(artifact, manifest, profile, out, log)
    if profile.execution_provider == "QNNExecutionProvider":
        from cabinlm.builders.qnn import build_qnn

        return build_qnn(artifact, manifest, profile, out, log)
    from cabinlm.builders.ort import build_onnxruntime

    return build_onnxruntime(artifact, manifest, profile, out, log, attention=attention, accuracy_level=accuracy_level,
                             minimums=minimums, attention_kernel=attention_kernel, matmul_kernel=matmul_kernel)
