"""onnxruntime-fused builds (the cpu profile's default): the exported graph's weights re-emitted around
ONNX Runtime's kernels and cabinlm's own (graph.py), the sink / pinned keys' refresh graph, ONNX
Runtime's fusions done offline, then the build checked against the exported graph."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx

from cabinlm.contract.files import FileRole, seats_graph
from cabinlm.contract import io_spec
from cabinlm.contract.buildspec import BuildSpec, OptimizationLevel
from cabinlm.engines.builder import Builder, BuildError, BuildRequest
from cabinlm.engines.ort_fused.options import FusedBuildOptions
from cabinlm.engines.onnxruntime.offline import OPT_DATA, OPT_GRAPH, log_weights, optimize_offline, read_graph
from cabinlm.engines.ort_fused import graph as fused_graph
from cabinlm.engines.ort_fused.kernels import LIBRARY, MATMUL_OP, Q8_MATMUL_OP, SWIGLU_MATMUL_OP, host_machine
from cabinlm.engines.ort_fused.head_graph import head_model
from cabinlm.engines.ort_fused.kernels.compiler import registrable
from cabinlm.contract.engines.fused import FusedSettings, KernelLibrary
from cabinlm.engines.ort_graph.builder import spec_for, targets_cpu
from cabinlm.engines.ort_static.builder import weight_table
from cabinlm.contract.engines.static import SharedWeights
from cabinlm.engines.output import BuildOutput
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import MANIFEST_NAME, Manifest

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile


def _attention_wanted(manifest: Manifest, asked: str) -> str:
    """"cabinlm" where the build should take cabinlm's attention kernel if its library can be had
    (builders.AttentionKernel `asked`), else "onnxruntime". "auto" takes it for int8 KV; fp32 KV
    (FloatKVAttention: rows as steps and batched graphs, camera frames included) when asked for by name,
    its speed against GroupQueryAttention not yet measured."""
    from cabinlm.contract.layout import KVDType

    spec = manifest.model
    why = None
    if manifest.cache.kv_dtype not in (KVDType.INT8, KVDType.FP32):
        why = f"it takes int8 or fp32 KV; this export holds {manifest.cache.kv_dtype.value} KV"
    elif asked == "auto" and manifest.cache.kv_dtype != KVDType.INT8:
        why = "fp32 KV takes it only when asked for (--attention-kernel cabinlm)"
    elif spec.head_dim % 16 or spec.head_dim > 256 or spec.num_heads // spec.num_kv_heads > 16:
        why = f"it takes a head_dim that is a multiple of 16 up to 256 and at most 16 query heads per kv head " \
              f"(this model: {spec.head_dim}, {spec.num_heads // spec.num_kv_heads})"
    if asked == "onnxruntime" or (asked == "auto" and why):
        return "onnxruntime"
    if why:
        raise BuildError(f"--attention-kernel cabinlm does not apply: {why}; use --attention-kernel onnxruntime")
    return "cabinlm"


def _head_op(model: onnx.ModelProto) -> str | None:
    """The operator that writes the decoder's logits (the LM head), None where none does."""
    return next((n.op_type for n in model.graph.node if io_spec.LOGITS in n.output), None)


def _matmul_wanted(blocks: int, asked: str, accuracy_level: int) -> str:
    """"cabinlm" where the build should take cabinlm's block matmuls for its `blocks` block-quantized
    matrices if its library can be had (builders.MatmulKernel `asked`; the kernels compute with int8
    activations, accuracy level 4, only), else "onnxruntime"."""
    why = None
    if not blocks:
        why = "the export holds no block-quantized matrices (export with --weights int4 or int8, or from a GGUF)"
    elif accuracy_level != 4:
        why = f"it computes with int8 activations (accuracy level 4), not level {accuracy_level}"
    if asked == "onnxruntime" or (asked == "auto" and why):
        return "onnxruntime"
    if why:
        raise BuildError(f"--matmul-kernel cabinlm does not apply: {why}; use --matmul-kernel onnxruntime")
    return "cabinlm"


def _kernel_library(request: BuildRequest, folder: Path, insisted: bool, kept: str) -> KernelLibrary | None:
    """cabinlm's kernel library compiled for the profile's CPU (cpu_march) into the build folder, or
    None where it cannot be had (logged; ONNX Runtime's kernels stay), or a BuildError where a kernel
    of it was insisted on."""
    from cabinlm.engines.ort_fused import kernels
    from cabinlm.engines.ort_fused.kernels.compiler import KernelError, compile_library

    profile, march = request.profile, request.profile.kernels_march
    try:
        oldest = profile.engine_version  # the oldest onnxruntime the profile's target runs
        if oldest is not None and oldest.split(".")[1].isdigit() and int(oldest.split(".")[1]) < kernels.api_version():
            raise KernelError(f"they need onnxruntime >= 1.{kernels.api_version()} and profile {profile.name} runs "
                              f"onnxruntime {oldest}")  # fmt: skip
        compiled = compile_library(folder, march, machine=profile.cpu_arch)  # cross-compiled for another architecture
    except KernelError as e:
        if insisted:
            raise BuildError(f"cabinlm's kernels cannot be had for profile {profile.name}: {e}") from e
        request.log(f"kept ONNX Runtime's {kept}: cabinlm's kernels cannot be had ({str(e).splitlines()[0]})")
        return None
    lib = compiled.facts
    request.log(f"cabinlm's kernels: {lib.file} compiled for -march={march} ({lib.machine}, {len(lib.cpu_flags)} CPU features a "
                f"CPU running it must have), onnxruntime C API {lib.ort_api}, {lib.compiler}"
                + (" (from this machine's compile cache)" if compiled.cached else ""))  # fmt: skip
    return lib


# The inputs ONNX Runtime's CPU kernels pack a copy of when a session loads (PrePack), by operator: in
# a session handed its weights from a map (SharedWeights), the packed copy is held beside the mapped
# bytes (docs/results.md, "Plan against RSS"). cabinlm's operators and gathers pack nothing.
PREPACKED_INPUTS = {"MatMulNBits": (1, 2, 3), "MatMul": (1,), "Gemm": (1,)}


def packed_bytes(model: onnx.ModelProto) -> int:
    """The bytes of `model`'s initializers its session packs a copy of (PREPACKED_INPUTS), once per
    consuming node (each kernel packs its own)."""
    sizes = {i.name: int(np.prod(i.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
             for i in model.graph.initializer}  # fmt: skip
    return sum(sizes[n.input[k]] for n in model.graph.node for k in PREPACKED_INPUTS.get(n.op_type, ())
               if k < len(n.input) and n.input[k] in sizes)  # fmt: skip


def seats_graph_file(seats: int, plain: bool = False) -> str:
    return f"decoder.plain.seats{seats}.onnx" if plain else f"decoder.seats{seats}.onnx"


PLAIN_GRAPH = "decoder.plain.onnx"  # the one-seat decoder without adapter inputs (FusedSettings.plain_graphs)


def _content_key(dtype: int, dims, data: bytes) -> tuple:
    return dtype, tuple(dims), hashlib.sha256(data).hexdigest()


def _share_weights(model: onnx.ModelProto, own_data: Path, base: SharedWeights, base_data: Path, tag: str) -> None:
    """Point every external initializer of `model` (a batched graph, its weights written to own_data by
    the offline optimization) at the one-seat graph's copy of the same bytes in base_data, under that
    copy's name, so that one map of base_data serves both graphs. A weight with no identical twin in
    the one-seat graph is a BuildError (the two graphs are built from the same initializers and
    optimized alike, so there is none). An embedded initializer whose name the shared table holds is
    renamed (the session would otherwise be handed the shared tensor of that name)."""
    base_bytes = base_data.read_bytes()
    own_bytes = own_data.read_bytes()
    np_types = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "int64": onnx.TensorProto.INT64,
                "int32": onnx.TensorProto.INT32, "int8": onnx.TensorProto.INT8, "uint8": onnx.TensorProto.UINT8}  # fmt: skip
    by_content = {}
    for t in base.tensors:
        by_content.setdefault(_content_key(np_types[t.dtype], t.shape, base_bytes[t.offset : t.offset + t.length]), t)
    rename: dict[str, str] = {}
    keep, seen = [], set()
    shared_names = {t.name for t in base.tensors}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            offset, length = int(info.get("offset", 0)), int(info["length"])
            twin = by_content.get(_content_key(init.data_type, init.dims, own_bytes[offset : offset + length]))
            if twin is None:
                raise BuildError(f"the {tag} graph's weight {init.name!r} ({list(init.dims)}) is not the one-seat graph's: "
                                 "its graphs could not share one weights file; build with --attention graph and report this")
            rename[init.name] = twin.name
            if twin.name in seen:
                continue  # the same bytes twice: one initializer of that name
            seen.add(twin.name)
            init.name = twin.name
            del init.external_data[:]
            for key, value in (("location", base.file), ("offset", str(twin.offset)), ("length", str(twin.length))):
                entry = init.external_data.add()
                entry.key, entry.value = key, value
        elif init.name in shared_names:
            rename[init.name] = init.name = f"{init.name}@{tag}"
        keep.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]


HEAD_GRAPH = "decoder.head.onnx"


def _twin_graphs(request: BuildRequest, output: BuildOutput, graph: onnx.ModelProto, solo: onnx.ModelProto, kernel: str,
                 matmul: str, registered: Path | None) -> tuple[tuple[int, ...], bool, SharedWeights | None, dict[str, int]]:
    """The graphs beside the one-seat decoder, each optimized offline like it and pointed at its
    weights file: the batched graphs (graph.fused_model(seats=B) for B in the profile's seat_batches)
    and the LM head they share (head_graph.head_model of `solo`, the one-seat fused decoder); and, for
    an export with switchable adapter inputs whose graphs pack no weights (cabinlm's block matmuls),
    the plain twins (fused_model(adapters=False)) of the one-seat graph and of each batched graph.
    Returns the batch sizes, whether the plain twins were written, that file's table (for the
    runtime's shared map; None where there are no twins) and the bytes each twin's session packs
    (packed_bytes), by role. No batched graphs where the profile asks for none, or the attention is
    not cabinlm's kernel (GroupQueryAttention's steps refresh the cache's sink / pinned rows
    themselves: a per-seat side graph this first step does not have)."""
    for name in (HEAD_GRAPH, PLAIN_GRAPH, *(p.name for p in output.folder.glob("decoder.*seats*.onnx"))):
        output.path(name).unlink(missing_ok=True)  # an earlier build's, in the same folder
    batches = request.profile.seat_batches
    if kernel != "cabinlm" and batches:
        request.log("no batched graphs: they take cabinlm's attention kernel (seats' steps run one after another)")
        batches = ()
    manifest = request.manifest
    # a plain twin's session packing nothing keeps the weights once (ONNX Runtime's matmuls would pack theirs again)
    plain = manifest.lora is not None and packed_bytes(solo) == 0
    if not batches and not plain:
        return (), False, None, {}
    base = weight_table(onnx.load(str(output.path(OPT_GRAPH)), load_external_data=False), OPT_DATA)
    packed: dict[str, int] = {}

    def write(model: onnx.ModelProto, file: str, role: str) -> None:
        with tempfile.TemporaryDirectory(dir=output.folder) as tmp:
            optimize_offline(model.SerializeToString(), Path(tmp), registered)
            shared = onnx.load(str(Path(tmp) / OPT_GRAPH), load_external_data=False)
            data = Path(tmp) / OPT_DATA
            if not data.exists():  # every weight small enough to stay in the graph
                data.write_bytes(b"")
            _share_weights(shared, data, base, output.path(OPT_DATA), role)
        onnx.save_model(shared, str(output.path(file)))
        output.add(role, file)
        packed[role] = packed_bytes(shared)

    opts = request.options_for(FusedBuildOptions)

    def fused(seats: int, adapters: bool) -> onnx.ModelProto:
        return fused_graph.fused_model(graph, manifest, opts.accuracy_level, opts.minimums, kernel, matmul, seats=seats,
                                       adapters=adapters)  # fmt: skip

    own_head = _head_op(solo) == Q8_MATMUL_OP
    if batches and not own_head:  # MatMulNBits: packed once per session, so the batched graphs share one head graph
        write(head_model(solo, manifest), HEAD_GRAPH, FileRole.GRAPH_HEAD)
    for b in batches:
        write(fused(b, True), seats_graph_file(b), seats_graph(b))
    if batches:
        head = "each with the LM head" if own_head else "and their LM head"
        request.log(f"seats decode together: batched graphs for {', '.join(map(str, batches))} seats (one attention per "
                    f"seat over its own cache) {head}, every graph reading one map of the weights")  # fmt: skip
    if plain:
        write(fused(0, False), PLAIN_GRAPH, FileRole.GRAPH_PLAIN)
        for b in batches:
            write(fused(b, False), seats_graph_file(b, plain=True), seats_graph(b, plain=True))
        request.log("seats without an adapter: the decoder" + (" and its batched graphs" if batches else "") + " without "
                    "adapter nodes, reading the same map of the weights")  # fmt: skip
    return batches, plain, base, packed


class FusedBuilder(Builder):
    kind: ClassVar[BackendKind] = BackendKind.FUSED
    preference: ClassVar[int] = 10  # the cpu profile's engine wherever it applies
    options_type: ClassVar[type | None] = FusedBuildOptions

    def targets(self, profile: DeviceProfile) -> bool:
        return targets_cpu(profile, static=False)

    def check(self, request: BuildRequest) -> str | None:
        return fused_graph.ineligible(request.manifest)

    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        manifest, opts, log = request.manifest, request.options_for(FusedBuildOptions), request.log
        output.copy(FileRole.TOKENIZER)
        output.copy_if_present(FileRole.VISION_GRAPH, FileRole.VISION_DATA)  # the camera encoder runs as exported
        graph = read_graph(request.artifact, manifest)
        # block-quantized matrices (int4 / int8 blocks): what cabinlm's block matmuls run
        blocks = sum(1 for i in graph.graph.initializer if i.name.endswith(io_spec.QUANT_SUFFIXES[0]))
        kernel = _attention_wanted(manifest, opts.attention_kernel.value)
        matmul = _matmul_wanted(blocks, opts.matmul_kernel.value, opts.accuracy_level)
        output.path(LIBRARY).unlink(missing_ok=True)  # an earlier build's, in the same folder
        library = None
        if "cabinlm" in (kernel, matmul):
            insisted = "cabinlm" in (opts.attention_kernel.value, opts.matmul_kernel.value)
            kept = " and ".join(k for k, w in (("GroupQueryAttention", kernel), ("MatMulNBits", matmul)) if w == "cabinlm")
            library = _kernel_library(request, output.folder, insisted, kept)
        if library is None:
            kernel = matmul = "onnxruntime"
        elif matmul == "cabinlm" and library.matmul_isa == "generic":
            log(f"cabinlm's block matmuls run their plain C++ path: -march={library.march} has neither AVX2 nor Arm's dot "
                "product; exact (a chunk's rows are its steps), slower than ONNX Runtime's MatMulNBits, which "
                "--matmul-kernel onnxruntime keeps")  # fmt: skip
        kv = manifest.cache.kv_dtype.value
        own_op = "Int8KVAttention" if kv == "int8" else "FloatKVAttention"
        if kernel == "cabinlm":
            log(f"attention over the {kv} cache: cabinlm's {own_op}")
        if "cabinlm" not in (kernel, matmul) and library is not None:
            output.path(library.file).unlink()  # compiled, then not taken: the build does not carry it
            library = None
        model = fused_graph.fused_model(graph, manifest, opts.accuracy_level, opts.minimums, kernel, matmul)
        op = f"cabinlm's {own_op}" if kernel == "cabinlm" else "GroupQueryAttention"
        ops = [n.op_type for n in model.graph.node]
        q4, q8, nbits = ops.count(MATMUL_OP) + ops.count(SWIGLU_MATMUL_OP), ops.count(Q8_MATMUL_OP), ops.count("MatMulNBits")
        mm = "cabinlm's block matmuls, " if q4 or q8 else ""
        log(f"fused the decoder: {len(model.graph.node)} nodes (the export has {len(graph.graph.node)}), "
            f"{op} over {manifest.cache.kv_dtype.value} KV, {mm}" + (f"MatMulNBits accuracy level {opts.accuracy_level}"
            if nbits else "no MatMulNBits"))  # fmt: skip
        if q4:
            log(f"{q4} 4-bit matrices: cabinlm's BlockQ4MatMul ({library.matmul_isa}), codes, scales and minimums as exported")
        if q8:
            log(f"{q8} int8 matrices: cabinlm's BlockQ8MatMul ({library.matmul_isa}), read in place (no packed copy)")
        head_kernel = "cabinlm" if _head_op(model) == Q8_MATMUL_OP else "onnxruntime"
        if head_kernel == "cabinlm":
            log("the LM head: cabinlm's BlockQ8MatMul, its int8 blocks read in place by every graph (no packed copy)")
        if nbits:
            offsets = sum(1 for i in graph.graph.initializer if i.name.endswith(io_spec.QUANT_SUFFIXES[3]))
            why = ("--matmul-kernel onnxruntime" if matmul != "cabinlm"
                   else "8-bit codes with zero points or minimums, which cabinlm's kernels do not hold")  # fmt: skip
            log(f"{nbits} matrices on MatMulNBits ({why})" + ("" if not offsets else ": Q4_1 blocks as " + (
                "4-bit blocks, minimums added exactly (block sums)" if opts.minimums.value == "exact"
                else "8-bit blocks with integer zero points (each minimum rounded to 1/34 of its block's step)")))  # fmt: skip

        output.path(fused_graph.ROTATE_GRAPH).unlink(missing_ok=True)  # an earlier build's, in the same folder
        if kernel != "cabinlm":  # GroupQueryAttention reads the sink / pinned keys from the cache: the runtime refreshes them
            onnx.save_model(fused_graph.rotation_model(manifest), str(output.path(fused_graph.ROTATE_GRAPH)))
            output.add(FileRole.ROTATE_GRAPH, fused_graph.ROTATE_GRAPH)
        if library is not None:
            output.add(FileRole.CUSTOM_OPS, library.file)  # listed with its sha256, as fused.kernels records it
        with registrable(output.path(library.file) if library else None, library) as registered:  # a cross build's: this machine's twin
            optimize_offline(model.SerializeToString(), output.folder, registered)
            batches, plain, shared, packed = _twin_graphs(request, output, graph, model, kernel, matmul, registered)
        del graph, model
        packed = {"graph": packed_bytes(onnx.load(str(output.path(OPT_GRAPH)), load_external_data=False)), **packed}
        facts = FusedSettings(accuracy_level=opts.accuracy_level, minimums=opts.minimums.value,
                              attention_kernel=kernel, matmul_kernel=matmul, kernels=library,
                              step_rows=kernel == "cabinlm", seat_batches=batches, shared_weights=shared,
                              head_kernel=head_kernel, packed_bytes=packed, plain_graphs=plain)  # fmt: skip
        output.add(FileRole.GRAPH, OPT_GRAPH)
        output.add(FileRole.GRAPH_DATA, OPT_DATA)
        log(f"optimized the graph offline for {request.profile.execution_provider}")
        log_weights(manifest, output, log)
        return spec_for(self.kind, request, OptimizationLevel.BASIC, facts)

    def after_save(self, request: BuildRequest, output: BuildOutput, built: Manifest) -> None:
        lib = built.build.facts.kernels
        if lib is not None and lib.machine != host_machine():
            request.log(f"not checked against the exported graph here: its kernels are for {lib.machine} CPUs and this machine "
                        f"is {host_machine()} (`make test-arm` runs such a build under emulation; on the car, `cabinlm "
                        "perplexity` runs it)")  # fmt: skip
            return
        check = _check_fused(request.artifact, output.folder)
        output.update_quality(built, check=check)
        request.log(f"checked against the exported graph: next-token agreement {check['agreement']:.0%} over "
                    f"{check['tokens']} tokens, max |logit diff| {check['max_abs_diff']:.3g}")


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
        (out / MANIFEST_NAME).unlink(missing_ok=True)  # a refused build never looks finished
        raise BuildError(f"the fused build disagrees with the exported graph: the same next token at only {agreement:.0%} "
                         f"of {len(ids)} positions (max |logit diff| {check['max_abs_diff']}); build with --attention graph "
                         "and report this")  # fmt: skip
    return check


BUILDER = FusedBuilder()
