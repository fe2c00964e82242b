"""What the ONNX Runtime engines' builders share: graph work done offline, once, on the build machine.

    fuse_rotary       the cached keys' rotary embedding as ONNX Runtime's RotaryEmbedding kernel
    optimize_offline  ONNX Runtime's provider-independent fusions, saved with external weights
    fix_tokens        every symbolic token dimension fixed (static-shape engines)
    cpu_session       the session settings a CPU-provider build records
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx
import onnxruntime as ort

from cabinlm.contract.files import FileRole
from cabinlm.contract import io_spec
from cabinlm.contract.buildspec import OptimizationLevel, SessionSettings
from cabinlm.contract.errors import BuildError
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.manifest import Manifest

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile
    from cabinlm.engines.output import BuildOutput

OPT_GRAPH, OPT_DATA = "decoder.opt.onnx", "decoder.opt.onnx.data"


def read_graph(artifact: Path, manifest: Manifest) -> onnx.ModelProto:
    """The export's graph with its weights, or a BuildError naming the fix."""
    try:
        return onnx.load(str(artifact / manifest.files[FileRole.GRAPH].path))
    except Exception as e:  # noqa: BLE001 - onnx raises its own validation errors for unreadable data
        raise BuildError(f"{artifact}: cannot read the graph and its weights ({str(e).splitlines()[0]}); re-export") from e


def cpu_session(profile: DeviceProfile, optimization: OptimizationLevel) -> SessionSettings:
    """What a build for ONNX Runtime's CPU provider applies at load."""
    return SessionSettings(
        graph_optimization_level=optimization,
        intra_op_num_threads=profile.threads,
        # Flush denormal floats to zero in the kernels: x86 cores handle denormals in microcode, so
        # flushing them shortens a decode step (0.2-0.45 ms for SmolLM2 on 2 cores) with the same logits.
        denormal_as_zero=True,
    )


def fuse_rotary(model: onnx.ModelProto, manifest: Manifest) -> int:
    """Rewrite the rotary embedding of the cached keys (the exported Split / Concat / Mul / Mul / Add
    over every slot of every layer, named by io_spec.cached_key_rope) into ONNX Runtime's one-pass
    RotaryEmbedding kernel. An engine-specific rewrite, like a TensorRT engine's layer fusions: the
    export stays plain ONNX. Returns the number of layers rewritten."""
    from onnx import helper, numpy_helper

    nodes = {n.name: n for n in model.graph.node}
    lay = manifest.cache
    model.graph.initializer.append(numpy_helper.from_array(np.array([0], dtype=np.int64), "rotary/axis0"))
    new: list[onnx.NodeProto] = []

    def tables(kind: str, ids: str, local: bool, max_position: int) -> str:
        """cos / sin caches of one kind of layer (global, or local with its own RoPE) and its positions."""
        inv_freq, scale = manifest.rotary.for_layer(local)
        angles = np.arange(max_position, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
        model.graph.initializer.extend([
            numpy_helper.from_array((np.cos(angles) * scale).astype(np.float32), f"rotary/{kind}cos_cache"),
            numpy_helper.from_array((np.sin(angles) * scale).astype(np.float32), f"rotary/{kind}sin_cache"),
        ])  # fmt: skip
        positions = f"rotary/{kind}positions_i"
        if _elem_type(model, ids) != onnx.TensorProto.INT64:
            new.append(helper.make_node("Cast", [ids], [f"rotary/{kind}positions_int64"], to=onnx.TensorProto.INT64,
                                        name=f"n/rotary/{kind}positions_int64"))  # fmt: skip
            ids = f"rotary/{kind}positions_int64"
        new.append(helper.make_node("Unsqueeze", [ids, "rotary/axis0"], [positions], name=f"n/rotary/{kind}positions"))
        return kind

    kinds = {False: tables("", io_spec.CACHE_POSITION_IDS, False, lay.slots + lay.chunk)}
    if lay.local_layers:
        kinds[True] = tables("local_", io_spec.LOCAL_CACHE_POSITION_IDS, True, lay.local_slots + lay.chunk)
    drop, layers = set(), 0
    for layer in range(manifest.cache.layers):
        base = io_spec.cached_key_rope(layer)
        add = nodes.get(base)
        parts = [nodes.get(f"{base}/{s}") for s in io_spec.CACHED_KEY_ROPE_PARTS]
        if add is None or any(p is None for p in parts):
            raise BuildError(f"the exported graph has no {base} subgraph (io_spec.cached_key_rope); export again")
        x = parts[0].input[0]
        tag = base[2:]
        kind = kinds[layer in lay.local_layers]
        new += [
            helper.make_node("Unsqueeze", [x, "rotary/axis0"], [f"{tag}/x4"], name=f"{base}/x4"),
            helper.make_node("RotaryEmbedding", [f"{tag}/x4", f"rotary/{kind}positions_i", f"rotary/{kind}cos_cache",
                                                 f"rotary/{kind}sin_cache"],
                             [f"{tag}/y4"], name=f"{base}/rotary", domain="com.microsoft", interleaved=0),
            helper.make_node("Squeeze", [f"{tag}/y4", "rotary/axis0"], [add.output[0]], name=f"{base}/y"),
        ]  # fmt: skip
        drop.update(id(n) for n in (*parts, add))
        layers += 1
    if not layers:
        return 0
    kept = [n for n in model.graph.node if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(new + kept)  # the new nodes read only graph inputs and initializers first
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return layers


def _elem_type(model: onnx.ModelProto, name: str) -> int:
    for vi in model.graph.input:
        if vi.name == name:
            return vi.type.tensor_type.elem_type
    return onnx.TensorProto.INT64


def optimize_offline(src: Path | bytes, out: Path, library: Path | None = None) -> None:
    """ORT's extended (provider-independent fusions) optimizations, saved with external weights.
    library: the kernel library of a graph that uses cabinlm's own kernels (the one the build compiled
    into its folder), registered for the pass."""
    so = ort.SessionOptions()
    if library is not None:
        try:
            so.register_custom_ops_library(str(library))
        except Exception as e:  # onnxruntime's own exception types; register.cc's version refusal is one
            raise BuildError(f"{library}: this onnxruntime ({ort.__version__}) cannot register cabinlm's kernels "
                             f"({str(e).strip().splitlines()[0]})") from e
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out / OPT_GRAPH)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPT_DATA)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.log_severity_level = 3
    ort.InferenceSession(src if isinstance(src, bytes) else str(src), so, providers=["CPUExecutionProvider"])


def fix_tokens(model: onnx.ModelProto, tokens: int, layout: CacheLayout) -> None:
    """Replace the symbolic token range of every graph input and output by a fixed size."""
    dims = {"tokens": tokens, "total": layout.slots + tokens, "local_total": layout.local_slots + tokens, "rows": tokens}
    for vi in (*model.graph.input, *model.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                if d.dim_param not in dims:
                    raise BuildError(f"graph tensor {vi.name} has an undeclared dynamic dimension {d.dim_param!r}")
                d.dim_value = dims[d.dim_param]




def log_weights(manifest: Manifest, output: BuildOutput, log: Callable[[str], None]) -> None:
    weights_bytes = output.path(OPT_DATA).stat().st_size
    output.quality["weights_bytes"] = weights_bytes
    plan = (manifest.target.plan if manifest.target is not None else None) or {}
    if plan.get("weights_bytes"):
        # The plan sizes the weights at their nominal bits; the build holds them as its kernels want
        # them (float32 scales, a fused build's 8-bit Q4_1 blocks, the token table for the output).
        log(f"weights as built: {weights_bytes / 1e6:.1f} MB (the export's plan counted {plan['weights_bytes'] / 1e6:.1f} MB "
            f"of {plan.get('weight_dtype', 'quantized')} weights and sized the window from them; `cabinlm plan "
            f"{output.folder}` counts what this build holds)")  # fmt: skip
