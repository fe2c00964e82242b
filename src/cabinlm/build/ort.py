"""ONNX Runtime builds: the graph optimized offline, session settings, checksums.

Dynamic-token targets (cpu): one graph serves prefill chunks and decode, as exported.
Static-shape targets (Snapdragon HTP through the QNN EP, which refuses dynamic shapes): two graphs
with every dimension fixed, a prefill graph (tokens = chunk) and a decode graph (tokens = 1), both
pointing at one weights file; the runtime pads the last prefill chunk and binds the weights once.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

import onnx
import onnxruntime as ort

from cabinlm import __version__
from cabinlm.build import BUILD_NAME, BuildError
from cabinlm.manifest import FileEntry, Manifest

OPT_GRAPH, OPT_DATA = "decoder.opt.onnx", "decoder.opt.onnx.data"
PREFILL_GRAPH, DECODE_GRAPH, SHARED_DATA = "decoder.prefill.onnx", "decoder.decode.onnx", "decoder.onnx.data"


def _copy_common(artifact: Path, manifest: Manifest, out: Path) -> dict[str, str]:
    files = {}
    for role in ("tokenizer", "key_scales"):
        if role in manifest.files:
            shutil.copy2(artifact / manifest.files[role].path, out / manifest.files[role].path)
            files[role] = manifest.files[role].path
    return files


def _optimize_offline(src: Path, out: Path) -> None:
    """ORT's extended (provider-independent fusions) optimizations, saved with external weights."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out / OPT_GRAPH)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPT_DATA)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.log_severity_level = 3
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


def fix_tokens(model: onnx.ModelProto, tokens: int, slots: int) -> None:
    """Replace the symbolic token range of every graph input and output by a fixed size."""
    dims = {"tokens": tokens, "total": slots + tokens, "rows": tokens}
    for vi in (*model.graph.input, *model.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                if d.dim_param not in dims:
                    raise BuildError(f"graph tensor {vi.name} has an undeclared dynamic dimension {d.dim_param!r}")
                d.dim_value = dims[d.dim_param]


_NUMPY = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64",
          onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8"}


def weight_table(model: onnx.ModelProto, data_name: str) -> dict:
    """Where each external initializer lies in the weights file: [name, dtype, shape, offset, length]."""
    tensors = []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        if info.get("location") != data_name or init.data_type not in _NUMPY:
            raise BuildError(f"initializer {init.name} is not in {data_name} or has an unsupported type")
        tensors.append([init.name, _NUMPY[init.data_type], list(init.dims), int(info.get("offset", 0)), int(info["length"])])
    return {"file": data_name, "tensors": tensors}


def static_pair(artifact: Path, manifest: Manifest, out: Path) -> tuple[dict[str, str], dict]:
    src = onnx.load(str(artifact / manifest.files["graph"].path), load_external_data=False)
    data_name = manifest.files["graph_data"].path
    for name, tokens in ((PREFILL_GRAPH, manifest.cache.chunk), (DECODE_GRAPH, 1)):
        m = onnx.ModelProto()
        m.CopyFrom(src)
        fix_tokens(m, tokens, manifest.cache.slots)
        onnx.save_model(m, str(out / name))  # initializers keep pointing at the shared data file
    shutil.copy2(artifact / data_name, out / data_name)
    files = {"graph": PREFILL_GRAPH, "graph_decode": DECODE_GRAPH, "graph_data": data_name}
    return files, weight_table(src, data_name)


def build_onnxruntime(artifact: Path, manifest: Manifest, profile, out: Path, log: Callable[[str], None]) -> Path:
    if manifest.opset > profile.max_opset:
        raise BuildError(f"{artifact}: graph opset {manifest.opset} is above {profile.name}'s {profile.max_opset}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    files = _copy_common(artifact, manifest, out)
    shared = None
    if profile.static_shapes:
        pair, shared = static_pair(artifact, manifest, out)
        files.update(pair)
        log(f"wrote a static prefill graph (tokens = {manifest.cache.chunk}) and a decode graph (tokens = 1) sharing weights")
        optimization = "all"  # the target's provider (QNN) compiles the static graphs itself
    else:
        _optimize_offline(artifact / manifest.files["graph"].path, out)
        files.update({"graph": OPT_GRAPH, "graph_data": OPT_DATA})
        log(f"optimized the graph offline for {profile.execution_provider}")
        optimization = "basic"  # the heavy fusions are done; the host adds its own at load
    built = Manifest(**{**manifest.__dict__, "files": {r: FileEntry.of(out, p) for r, p in files.items()}})
    built.target = {**(manifest.target or {}), "profile": profile.name, "built_from": str(artifact.resolve())}
    session = {
        "execution_provider": profile.execution_provider,
        "graph_optimization_level": optimization,
        "intra_op_num_threads": profile.threads,
        "enable_cpu_mem_arena": True,
    }
    record = {
        "cabinlm_version": __version__,
        "engine": "onnxruntime",
        "onnxruntime_version": ort.__version__,
        "profile": profile.name,
        "static_shapes": profile.static_shapes,
        "session": session,
        "plan": (manifest.target or {}).get("plan"),
        "shared_weights": shared,
        "source": {"artifact": str(artifact.resolve()), "graph_sha256": manifest.files["graph"].sha256},
        "files": {r: e.sha256 for r, e in built.files.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / BUILD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    built.save(out)
    return out
