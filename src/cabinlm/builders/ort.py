"""ONNX Runtime builds: the graph optimized offline, session settings, checksums.

Dynamic-token targets (cpu): one graph serves prefill chunks and decode, as exported.
Static-shape targets (Snapdragon HTP through the QNN EP, which refuses dynamic shapes): two graphs
with every dimension fixed, a prefill graph (tokens = chunk) and a decode graph (tokens = 1), both
pointing at one weights file; the runtime pads the last prefill chunk and binds the weights once.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from cabinlm import __version__
from cabinlm.builders import BUILD_NAME, BuildError
from cabinlm import io_spec
from cabinlm import manifest as mf
from cabinlm.buildspec import CPU_PROVIDER, BackendKind, BuildSpec, ExecutionProvider, FusedSettings, OptimizationLevel
from cabinlm.buildspec import SessionSettings, SharedWeight, SharedWeights
from cabinlm.manifest import FORMAT_VERSION, FileEntry, Manifest

OPT_GRAPH, OPT_DATA = "decoder.opt.onnx", "decoder.opt.onnx.data"
PREFILL_GRAPH, DECODE_GRAPH, SHARED_DATA = "decoder.prefill.onnx", "decoder.decode.onnx", "decoder.onnx.data"


def _copy_common(artifact: Path, manifest: Manifest, out: Path) -> dict[str, str]:
    files = {}
    for role in ("tokenizer",):
        shutil.copy2(artifact / manifest.files[role].path, out / manifest.files[role].path)
        files[role] = manifest.files[role].path
    return files


def fuse_rotary(model: onnx.ModelProto, manifest: Manifest) -> int:
    """Rewrite the rotary embedding of the cached keys (the exported Split / Concat / Mul / Mul / Add
    over every slot of every layer, named by io_spec.cached_key_rope) into ONNX Runtime's one-pass
    RotaryEmbedding kernel. An engine-specific rewrite, like a TensorRT engine's layer fusions: the
    export stays plain ONNX. Returns the number of layers rewritten."""
    from onnx import helper, numpy_helper

    nodes = {n.name: n for n in model.graph.node}
    inv_freq = np.asarray(manifest.rotary.inv_freq, dtype=np.float64)
    scale = manifest.rotary.scale
    max_position = manifest.cache.slots + manifest.cache.chunk
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    model.graph.initializer.extend([
        numpy_helper.from_array((np.cos(angles) * scale).astype(np.float32), "rotary/cos_cache"),
        numpy_helper.from_array((np.sin(angles) * scale).astype(np.float32), "rotary/sin_cache"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "rotary/axis0"),
    ])  # fmt: skip
    ids = io_spec.CACHE_POSITION_IDS
    new = [helper.make_node("Unsqueeze", [ids], ["rotary/positions_i"], name="n/rotary/positions")]
    if _elem_type(model, ids) != onnx.TensorProto.INT64:
        new[0].output[0] = "rotary/positions_raw"
        new.append(helper.make_node("Cast", ["rotary/positions_raw"], ["rotary/positions_i"], to=onnx.TensorProto.INT64,
                                    name="n/rotary/positions_int64"))  # fmt: skip
    new[0].input.append("rotary/axis0")
    drop, layers = set(), 0
    for layer in range(manifest.cache.layers):
        base = io_spec.cached_key_rope(layer)
        add = nodes.get(base)
        parts = [nodes.get(f"{base}/{s}") for s in io_spec.CACHED_KEY_ROPE_PARTS]
        if add is None or any(p is None for p in parts):
            raise BuildError(f"the exported graph has no {base} subgraph (io_spec.cached_key_rope); export again")
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


def _own_library(asked: str, kept: str, log: Callable[[str], None]) -> Path | None:
    """cabinlm's compiled kernel library, or None (logged: ONNX Runtime's `kept` stays) where it
    cannot be had and the kernel was not insisted on (`asked` "cabinlm": a BuildError instead)."""
    from cabinlm import kernels

    try:
        return kernels.library()
    except kernels.KernelError as e:
        if asked == "cabinlm":
            raise BuildError(str(e)) from e
        log(f"kept ONNX Runtime's {kept}: {str(e).splitlines()[0]}")
        return None


def _attention_kernel(manifest: Manifest, asked: str, log: Callable[[str], None]) -> str:
    """The fused build's attention kernel (FusedSettings.attention_kernel) for builders.AttentionKernel
    `asked`: cabinlm's own for int8 KV unless asked otherwise or no compiler here."""
    from cabinlm.layout import KVDType

    spec = manifest.model
    why = None
    if manifest.cache.kv_dtype != KVDType.INT8:
        why = f"it takes int8 KV; this export holds {manifest.cache.kv_dtype.value} KV"
    elif spec.head_dim % 16 or spec.head_dim > 256 or spec.num_heads // spec.num_kv_heads > 16:
        why = f"it takes a head_dim that is a multiple of 16 up to 256 and at most 16 query heads per kv head " \
              f"(this model: {spec.head_dim}, {spec.num_heads // spec.num_kv_heads})"
    if asked == "onnxruntime" or (asked == "auto" and why):
        return "onnxruntime"
    if why:
        raise BuildError(f"--attention-kernel cabinlm does not apply: {why}; use --attention-kernel onnxruntime")
    path = _own_library(asked, "GroupQueryAttention", log)
    if path is None:
        return "onnxruntime"
    log(f"attention over the int8 cache: cabinlm's kernel, compiled for this CPU ({path.name})")
    return "cabinlm"


def _matmul_kernel(q4_1: int, asked: str, accuracy_level: int, log: Callable[[str], None]) -> str:
    """The fused build's matmul kernel for its `q4_1` Q4_1 matrices (FusedSettings.matmul_kernel) for
    builders.MatmulKernel `asked`: cabinlm's own where this machine compiles its fast path (AVX-512
    VNNI) and the activations are int8 (accuracy level 4, the kernel's only arithmetic), unless
    asked otherwise; its plain C++ path is correct but slower than MatMulNBits."""
    from cabinlm import kernels

    why = None
    if not q4_1:
        why = "the export holds no Q4_1 matrices (it takes a GGUF's Q4_1 blocks)"
    elif accuracy_level != 4:
        why = f"it computes with int8 activations (accuracy level 4), not level {accuracy_level}"
    if asked == "onnxruntime" or (asked == "auto" and why):
        return "onnxruntime"
    if why:
        raise BuildError(f"--matmul-kernel cabinlm does not apply: {why}; use --matmul-kernel onnxruntime")
    path = _own_library(asked, "MatMulNBits", log)
    if path is None:
        return "onnxruntime"
    isa = kernels.matmul_isa(str(path))
    if asked == "auto" and isa != "avx512-vnni":
        log("kept ONNX Runtime's MatMulNBits: this CPU has no AVX-512 VNNI, and cabinlm's Q4_1 matmul has no faster "
            "path here (--matmul-kernel cabinlm runs its plain C++ path)")
        return "onnxruntime"
    log(f"{q4_1} Q4_1 matrices: cabinlm's BlockQ4MatMul ({isa}), 4-bit codes and minimums as exported")
    return "cabinlm"


def _optimize_offline(src: Path | bytes, out: Path, kernels: bool = False) -> None:
    """ORT's extended (provider-independent fusions) optimizations, saved with external weights.
    kernels: the graph uses cabinlm's own kernels (cabinlm.kernels), registered for the pass."""
    so = ort.SessionOptions()
    if kernels:
        from cabinlm import kernels as own

        so.register_custom_ops_library(str(own.library()))
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


def weight_table(model: onnx.ModelProto, data_name: str) -> SharedWeights:
    """Where each external initializer lies in the weights file."""
    tensors = []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        if info.get("location") != data_name or init.data_type not in _NUMPY:
            raise BuildError(f"initializer {init.name} is not in {data_name} or has an unsupported type")
        tensors.append(SharedWeight(init.name, _NUMPY[init.data_type], tuple(init.dims), int(info.get("offset", 0)),
                                    int(info["length"])))  # fmt: skip
    return SharedWeights(data_name, tuple(tensors))


def static_pair(artifact: Path, manifest: Manifest, out: Path) -> tuple[dict[str, str], SharedWeights]:
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


def build_onnxruntime(artifact: Path, manifest: Manifest, profile, out: Path, log: Callable[[str], None],
                      attention: str = "auto", accuracy_level: int = 4, minimums: str = "int8",
                      attention_kernel: str = "auto", matmul_kernel: str = "auto") -> Path:
    """attention, minimums, attention_kernel, matmul_kernel: builders.Attention, .Minimums,
    .AttentionKernel, .MatmulKernel (str enums)."""
    if manifest.opset > profile.max_opset:
        raise BuildError(f"{artifact}: graph opset {manifest.opset} is above {profile.name}'s {profile.max_opset}")
    out.mkdir(parents=True, exist_ok=True)
    (out / mf.MANIFEST_NAME).unlink(missing_ok=True)
    (out / BUILD_NAME).unlink(missing_ok=True)  # written by cabinlm before manifest format 4
    t0 = time.perf_counter()
    files = _copy_common(artifact, manifest, out)
    for role in ("vision_graph", "vision_data"):  # the camera encoder runs as exported
        if role in manifest.files:
            shutil.copy2(artifact / manifest.files[role].path, out / manifest.files[role].path)
            files[role] = manifest.files[role].path
    shared = None
    fused = None
    backend = BackendKind.EXPORTED_GRAPH
    if profile.static_shapes:
        pair, shared = static_pair(artifact, manifest, out)
        files.update(pair)
        backend = BackendKind.STATIC_PAIR
        log(f"wrote a static prefill graph (tokens = {manifest.cache.chunk}) and a decode graph (tokens = 1) sharing weights")
        log(f"the static pair runs on ONNX Runtime's CPU provider: compiling it for {profile.execution_provider} is not "
            "part of this cabinlm version")
        optimization = OptimizationLevel.ALL
    else:
        try:
            graph = onnx.load(str(artifact / manifest.files["graph"].path))  # with its weights
        except Exception as e:  # noqa: BLE001 - onnx raises its own validation errors for unreadable data
            raise BuildError(f"{artifact}: cannot read the graph and its weights ({str(e).splitlines()[0]}); re-export") from e
        lay = manifest.cache
        from cabinlm.builders import ort_fused

        why = ort_fused.ineligible(manifest) if attention != "graph" else "--attention graph"
        if why is not None and attention == "fused":
            raise BuildError(f"{artifact}: the fused attention does not apply: {why}")
        if why is None:
            q4_1 = sum(1 for i in graph.graph.initializer if i.name.endswith(io_spec.QUANT_SUFFIXES[3]))
            kernel = _attention_kernel(manifest, str(getattr(attention_kernel, "value", attention_kernel)), log)
            matmul = _matmul_kernel(q4_1, str(getattr(matmul_kernel, "value", matmul_kernel)), accuracy_level, log)
            fused_model = ort_fused.fused_model(graph, manifest, accuracy_level, minimums, kernel, matmul)
            fused = FusedSettings(accuracy_level=accuracy_level, minimums=str(getattr(minimums, "value", minimums)),
                                  attention_kernel=kernel, matmul_kernel=matmul)  # fmt: skip
            op = "cabinlm's Int8KVAttention" if kernel == "cabinlm" else "GroupQueryAttention"
            mm = "BlockQ4MatMul for the Q4_1 matrices, " if matmul == "cabinlm" else ""
            log(f"fused the decoder: {len(fused_model.graph.node)} nodes (the export has {len(graph.graph.node)}), "
                f"{op} over {lay.kv_dtype.value} KV, {mm}MatMulNBits accuracy level {accuracy_level}")
            from cabinlm.kernels import MATMUL_OP, SWIGLU_MATMUL_OP

            on_nbits = q4_1 - sum(n.op_type in (MATMUL_OP, SWIGLU_MATMUL_OP) for n in fused_model.graph.node)
            if on_nbits:
                log(f"{on_nbits} Q4_1 matrices on MatMulNBits: " + ("4-bit blocks, minimums added exactly (block sums)" if minimums == "exact"
                    else "8-bit blocks with integer zero points (each minimum rounded to 1/34 of its block's step)"))
            del graph
            graph, backend = fused_model, BackendKind.FUSED
            onnx.save_model(ort_fused.rotation_model(manifest), str(out / ort_fused.ROTATE_GRAPH))
            files["rotate_graph"] = ort_fused.ROTATE_GRAPH
        else:
            log(f"kept the exported attention ({why})")
            n = fuse_rotary(graph, manifest)
            log(f"fused the cached keys' rotary embedding into RotaryEmbedding in {n} layers")
        _optimize_offline(graph.SerializeToString(), out, kernels=fused is not None and fused.own_kernels)
        del graph
        files.update({"graph": OPT_GRAPH, "graph_data": OPT_DATA})
        log(f"optimized the graph offline for {profile.execution_provider}")
        optimization = OptimizationLevel.BASIC  # the heavy fusions are done; the host adds its own at load
    cpu = profile.execution_provider == CPU_PROVIDER or profile.static_shapes
    spec = BuildSpec(
        backend=backend,
        provider=ExecutionProvider(CPU_PROVIDER),  # the provider every build of this version runs on
        session=SessionSettings(
            graph_optimization_level=optimization,
            intra_op_num_threads=profile.threads,
            # Flush denormal floats to zero in the kernels: 0.2-0.45 ms less per SmolLM2 decode step
            # on 2 cores, the same logits (docs/benchmarks.md, section 11).
            denormal_as_zero=cpu,
        ),
        profile=profile.name,
        engine="onnxruntime",
        engine_version=ort.__version__,
        shared_weights=shared,
        fused=fused,
    )
    built = Manifest(**{**manifest.__dict__, "files": {r: FileEntry.of(out, p) for r, p in files.items()},
                        "build": spec, "format_version": FORMAT_VERSION, "quality": dict(manifest.quality)})  # fmt: skip
    built.target = {**(manifest.target or {}), "profile": profile.name, "built_from": str(artifact.resolve())}
    weights_bytes = built.files["graph_data"].bytes if "graph_data" in built.files else None
    plan = (manifest.target or {}).get("plan") or {}
    if weights_bytes and plan.get("weights_bytes"):
        # The plan sizes the weights at their nominal bits; the build holds them as its kernels want
        # them (float32 scales, a fused build's 8-bit Q4_1 blocks, the token table for the output).
        log(f"weights as built: {weights_bytes / 1e6:.1f} MB (the export's plan counted {plan['weights_bytes'] / 1e6:.1f} MB "
            f"of {plan.get('weight_dtype', 'quantized')} weights; `cabinlm plan` sizes the window from the latter)")
    built.quality["build"] = {"cabinlm_version": __version__, "weights_bytes": weights_bytes,
                              "source_graph_sha256": manifest.files["graph"].sha256}  # fmt: skip
    built.save(out)
    if backend == BackendKind.FUSED:
        check = _check_fused(artifact, out)
        built.quality["build"]["check"] = check
        log(f"checked against the exported graph: next-token agreement {check['agreement']:.0%} over "
            f"{check['tokens']} tokens, max |logit diff| {check['max_abs_diff']:.3g}")
    built.quality["build"]["seconds"] = round(time.perf_counter() - t0, 1)
    built.save(out)
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
        (out / mf.MANIFEST_NAME).unlink(missing_ok=True)
        raise BuildError(f"the fused build disagrees with the exported graph: the same next token at only {agreement:.0%} "
                         f"of {len(ids)} positions (max |logit diff| {check['max_abs_diff']}); build with --attention graph "
                         "and report this")  # fmt: skip
    return check
