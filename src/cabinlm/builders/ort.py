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

import numpy as np
import onnx
import onnxruntime as ort

from cabinlm import __version__
from cabinlm.builders import BUILD_NAME, BuildError
from cabinlm.manifest import FORMAT_VERSION, FileEntry, Manifest

OPT_GRAPH, OPT_DATA = "decoder.opt.onnx", "decoder.opt.onnx.data"
PREFILL_GRAPH, DECODE_GRAPH, SHARED_DATA = "decoder.prefill.onnx", "decoder.decode.onnx", "decoder.onnx.data"


def _copy_common(artifact: Path, manifest: Manifest, out: Path) -> dict[str, str]:
    files = {}
    for role in ("tokenizer", "key_scales"):
        if role in manifest.files:
            shutil.copy2(artifact / manifest.files[role].path, out / manifest.files[role].path)
            files[role] = manifest.files[role].path
    return files


def fuse_rotary(model: onnx.ModelProto, max_position: int) -> int:
    """Rewrite the rotary embedding of the cached keys (the exported Split / Concat / Mul / Mul / Add
    over every slot of every layer) into ONNX Runtime's one-pass RotaryEmbedding kernel. An
    engine-specific rewrite, like a TensorRT engine's layer fusions: the export stays plain ONNX.
    Returns the number of layers rewritten (0 when the graph has no such pattern)."""
    from onnx import helper, numpy_helper

    nodes = {n.name: n for n in model.graph.node}
    inits = {i.name: i for i in model.graph.initializer}
    freqs = nodes.get("n/rope_cache/freqs")
    if freqs is None or freqs.input[1] not in inits:
        return 0
    inv_freq = numpy_helper.to_array(inits[freqs.input[1]]).reshape(-1).astype(np.float64)
    scale = 1.0
    scaled = nodes.get("n/rope_cache/cos_scaled")
    if scaled is not None and scaled.input[1] in inits:
        scale = float(numpy_helper.to_array(inits[scaled.input[1]]))
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    model.graph.initializer.extend([
        numpy_helper.from_array((np.cos(angles) * scale).astype(np.float32), "rotary/cos_cache"),
        numpy_helper.from_array((np.sin(angles) * scale).astype(np.float32), "rotary/sin_cache"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "rotary/axis0"),
    ])  # fmt: skip
    ids = "cache_position_ids"
    new = [helper.make_node("Unsqueeze", [ids], ["rotary/positions_i"], name="n/rotary/positions")]
    if _elem_type(model, ids) != onnx.TensorProto.INT64:
        new[0].output[0] = "rotary/positions_raw"
        new.append(helper.make_node("Cast", ["rotary/positions_raw"], ["rotary/positions_i"], to=onnx.TensorProto.INT64,
                                    name="n/rotary/positions_int64"))  # fmt: skip
    new[0].input.append("rotary/axis0")
    drop, layers = set(), 0
    for name, add in nodes.items():
        if not (name.startswith("n/layers.") and name.endswith("/rope_kc")) or add.op_type != "Add":
            continue
        base = name
        parts = [nodes.get(f"{base}/{s}") for s in ("half", "rot", "xcos", "rsin")]
        if any(p is None for p in parts):
            continue
        x = parts[0].input[0]
        tag = base[2:]
        new += [
            helper.make_node("Unsqueeze", [x, "rotary/axis0"], [f"{tag}/x4"], name=f"{base}/x4"),
            helper.make_node("RotaryEmbedding", [f"{tag}/x4", "rotary/positions_i", "rotary/cos_cache", "rotary/sin_cache"],
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


def _optimize_offline(src: Path | bytes, out: Path) -> None:
    """ORT's extended (provider-independent fusions) optimizations, saved with external weights."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out / OPT_GRAPH)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPT_DATA)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.log_severity_level = 3
    ort.InferenceSession(src if isinstance(src, bytes) else str(src), so, providers=["CPUExecutionProvider"])


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


def _kv_scales(artifact: Path, manifest: Manifest) -> dict | None:
    if "key_scales" not in manifest.files:
        return None
    path = artifact / manifest.files["key_scales"].path
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BuildError(f"{path}: unreadable KV scales ({e}); re-export") from e


def build_onnxruntime(artifact: Path, manifest: Manifest, profile, out: Path, log: Callable[[str], None],
                      attention: str = "auto", accuracy_level: int = 4, minimums: str = "int8") -> Path:
    if manifest.opset > profile.max_opset:
        raise BuildError(f"{artifact}: graph opset {manifest.opset} is above {profile.name}'s {profile.max_opset}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    files = _copy_common(artifact, manifest, out)
    shared = None
    fused_record = None
    kind = "graph"
    if profile.static_shapes:
        pair, shared = static_pair(artifact, manifest, out)
        files.update(pair)
        log(f"wrote a static prefill graph (tokens = {manifest.cache.chunk}) and a decode graph (tokens = 1) sharing weights")
        optimization = "all"  # the target's provider (QNN) compiles the static graphs itself
    else:
        try:
            graph = onnx.load(str(artifact / manifest.files["graph"].path))  # with its weights
        except Exception as e:  # noqa: BLE001 - onnx raises its own validation errors for unreadable data
            raise BuildError(f"{artifact}: cannot read the graph and its weights ({str(e).splitlines()[0]}); re-export") from e
        lay = manifest.cache
        from cabinlm.builders import ort_fused

        scales = _kv_scales(artifact, manifest)
        why = ort_fused.ineligible(manifest, scales) if attention != "graph" else "--attention graph"
        if why is not None and attention == "fused":
            raise BuildError(f"{artifact}: the fused attention does not apply: {why}")
        if why is None:
            q4_1 = sum(1 for i in graph.graph.initializer if i.name.endswith(".offset"))
            fused_model = ort_fused.fused_model(graph, manifest, scales, accuracy_level, minimums)
            inv_freq, rope_scale = ort_fused.rope_tables(graph)
            kv_scales = scales.get("rotated_key_scales") if lay.kv_dtype.value == "int8" else None
            fused_record = {"inv_freq": inv_freq, "rope_scale": rope_scale, "key_scales": kv_scales,
                            "accuracy_level": accuracy_level, "minimums": minimums}  # fmt: skip
            log(f"fused the decoder: {len(fused_model.graph.node)} nodes (the export has {len(graph.graph.node)}), "
                f"GroupQueryAttention over {lay.kv_dtype.value} KV, MatMulNBits accuracy level {accuracy_level}")
            if q4_1:
                log(f"{q4_1} Q4_1 matrices: " + ("4-bit blocks, minimums added exactly (block sums)" if minimums == "exact"
                    else "8-bit blocks with integer zero points (each minimum rounded to 1/34 of its block's step)"))
            del graph
            graph, kind = fused_model, "fused"
            onnx.save_model(ort_fused.rotation_model(manifest), str(out / ort_fused.ROTATE_GRAPH))
            files["rotate_graph"] = ort_fused.ROTATE_GRAPH
        else:
            log(f"kept the exported attention ({why})")
            fused = fuse_rotary(graph, lay.slots + lay.chunk)
            if fused:
                log(f"fused the cached keys' rotary embedding into RotaryEmbedding in {fused} layers")
        _optimize_offline(graph.SerializeToString(), out)
        del graph
        files.update({"graph": OPT_GRAPH, "graph_data": OPT_DATA})
        log(f"optimized the graph offline for {profile.execution_provider}")
        optimization = "basic"  # the heavy fusions are done; the host adds its own at load
    built = Manifest(**{**manifest.__dict__, "files": {r: FileEntry.of(out, p) for r, p in files.items()},
                        "attention": kind, "format_version": FORMAT_VERSION})  # fmt: skip
    built.target = {**(manifest.target or {}), "profile": profile.name, "built_from": str(artifact.resolve())}
    session = {
        "execution_provider": profile.execution_provider,
        "graph_optimization_level": optimization,
        "intra_op_num_threads": profile.threads,
        "enable_cpu_mem_arena": True,
        # Flush denormal floats to zero in the kernels: 0.2-0.45 ms less per SmolLM2 decode step on 2
        # cores, the same logits (docs/benchmarks.md, section 11). ONNX Runtime sets the flag on
        # its own threads and on the thread that calls run.
        "denormal_as_zero": profile.execution_provider == "CPUExecutionProvider",
    }
    weights_bytes = built.files["graph_data"].bytes if "graph_data" in built.files else None
    plan = (manifest.target or {}).get("plan") or {}
    if weights_bytes and plan.get("weights_bytes"):
        # The plan sizes the weights at their nominal bits; the build holds them as its kernels want
        # them (float32 scales, a fused build's 8-bit Q4_1 blocks, the token table for the output).
        log(f"weights as built: {weights_bytes / 1e6:.1f} MB (the export's plan counted {plan['weights_bytes'] / 1e6:.1f} MB "
            f"of {plan.get('weight_dtype', 'quantized')} weights; `cabinlm plan` sizes the window from the latter)")
    record = {
        "cabinlm_version": __version__,
        "engine": "onnxruntime",
        "onnxruntime_version": ort.__version__,
        "profile": profile.name,
        "static_shapes": profile.static_shapes,
        "session": session,
        "plan": (manifest.target or {}).get("plan"),
        "shared_weights": shared,
        "weights_bytes": weights_bytes,
        "fused": fused_record,
        "source": {"artifact": str(artifact.resolve()), "graph_sha256": manifest.files["graph"].sha256},
        "files": {r: e.sha256 for r, e in built.files.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / BUILD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    built.save(out)
    if kind == "fused":
        record["check"] = _check_fused(artifact, out)
        log(f"checked against the exported graph: next-token agreement {record['check']['agreement']:.0%} over "
            f"{record['check']['tokens']} tokens, max |logit diff| {record['check']['max_abs_diff']:.3g}")
        (out / BUILD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return out


CHECK_TEXT = ("The driver asked the assistant for the fastest route to the airport, and whether the tunnel "
              "on the ring road was open tonight. ")  # fmt: skip


def _check_fused(artifact: Path, out: Path, min_agreement: float = 0.8) -> dict:
    """The fused build against the exported graph on a short text: the same next token at most
    positions (KV quantization and int8 activations may move a few), or the build is refused."""
    from cabinlm.runtime import Decoder, Tokenizer

    ids = Tokenizer(out / "tokenizer.json").encode(CHECK_TEXT * 4, add_special_tokens=True)[:96]
    ref = Decoder(artifact).feed(np.asarray(ids), all_logits=True)
    got = Decoder(out).feed(np.asarray(ids), all_logits=True)
    agreement = float((ref.argmax(-1) == got.argmax(-1)).mean())
    check = {"tokens": len(ids), "agreement": round(agreement, 3), "max_abs_diff": round(float(np.abs(ref - got).max()), 4)}
    if agreement < min_agreement:
        (out / "manifest.json").unlink(missing_ok=True)
        raise BuildError(f"the fused build disagrees with the exported graph: the same next token at only {agreement:.0%} "
                         f"of {len(ids)} positions (max |logit diff| {check['max_abs_diff']}); build with --attention graph "
                         "and report this")  # fmt: skip
    return check
