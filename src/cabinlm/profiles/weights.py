"""How many weights a model has, and what an ONNX Runtime CPU build holds them as: the counting the
planner (profiles/planner.py) adds up, and the build facts it reads off an artifact's manifest.
Standard library only.

The cpu profile's builds hold the same weights in different layouts (docs/results.md, "Plan
against RSS"): held_weights gives a build kind's bits per weight, block scales, zero points and
minimums included, and whether a quantized tied table is held twice; build_facts reads the kind and
layout of an export or a build from its manifest (and, for a GGUF of several block widths, the
matrices' bits from the weights file the build wrote).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.manifest import ModelSpec
from cabinlm.contract.precision import KVDType, WeightFormat
from cabinlm.profiles.schema import DeviceProfile

MIB = 1 << 20


class PlanError(CabinlmError):
    """The model cannot be planned on the profile (precision not available, budget too small)."""

# -- counting ------------------------------------------------------------------------------------


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of the decoder as exported: embeddings (held once when tied), attention (with
    Qwen2's q/k/v biases), SwiGLU MLP, RMSNorm weights."""
    d, dh, i, v = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.vocab_size
    q, kv = spec.num_heads * dh, spec.num_kv_heads * dh
    attention = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if spec.qkv_bias else 0)  # Wq, Wk, Wv, Wo (+bias)
    mlp = 3 * d * i  # gate, up, down
    norms = 2 * d  # input and post-attention RMSNorm
    embeddings = v * d * (1 if spec.tie_embeddings else 2)  # embed_tokens (+ lm_head when untied)
    return embeddings + spec.num_layers * (attention + mlp + norms) + d  # + final norm


def weight_bytes(params: int, fmt: WeightFormat) -> int:
    # Plain precision x count; per-group scales of int4/int8 weights (~3% at group 128) are not counted.
    return (params * fmt.bits + 7) // 8


def htp_graph_weight_bytes(spec: ModelSpec, params: int, fmt: WeightFormat) -> int:
    """The weights one HTP context binary holds, as engines/qnn_htp/builder.py builds them: the token table as
    fp16 (the HTP gathers float tables), the output projection as 8-bit blocks (the export's default
    head), every other matrix at `fmt` (fp16 for float formats), and each block of 32 codes with its
    float32 scale (one more bit per weight)."""
    table = spec.vocab_size * spec.hidden_size
    rest = params - table * (1 if spec.tie_embeddings else 2)
    if not fmt.quantized:
        return 2 * (rest + 2 * table)
    return (rest * (fmt.bits + 1) + table * (8 + 1)) // 8 + 2 * table


# -- what an ONNX Runtime CPU build holds -------------------------------------------------------
#
# The cpu profile's builds (engines/ort_*/builder.py) hold their weights in different layouts, so one
# precision x count does not describe them. A build kind here is a BackendKind value, or EXPORT: a plain
# export run directly (BuildSpec.for_export: the exported graph, ONNX Runtime's optimizations at load).

EXPORT = "export"
FUSED, GRAPH, STATIC = "onnxruntime-fused", "onnxruntime-graph", "onnxruntime-static"
ORT_CPU_BUILDS = (EXPORT, GRAPH, FUSED, STATIC)
BLOCK = 32  # weights per quantization block (export/wquant.py)


@dataclass(frozen=True)
class HeldWeights:
    """Bits per weight a build holds resident, block scales / zero points / minimums included:
    `matrix_bits` for the attention and MLP matrices, `head_bits` for the token table (the output
    projection's copy, which every step reads in full, and the gather copy where held)."""

    build: str
    matrix_bits: float
    head_bits: float
    layout: str  # for the plan's breakdown
    # a tied table held twice: a quantized export stores a gather copy beside the head, and ONNX Runtime
    # reads every weight at load where it prepacks them (MatMulNBits, MatMul; a float table gathered from
    # is prepacked again for the head's Gemm). Not the fused build on cabinlm's BlockQ4 kernel: nothing
    # prepacked, its mapped weights file is paged in as read, the gather copy one row per token.
    gather_copy: bool = True

    def nbytes(self, spec: ModelSpec) -> int:
        d, v = spec.hidden_size, spec.vocab_size
        table = v * d
        matrices = parameter_count(spec) - table * (1 if spec.tie_embeddings else 2)
        small = spec.num_layers * (2 * d + ((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                                            if spec.qkv_bias else 0)) + d  # norms (+ biases): float32
        tables = table * (1 if spec.tie_embeddings and not self.gather_copy else 2)  # untied: the embedding table too
        return int((matrices - small) * self.matrix_bits / 8 + small * 4 + tables * self.head_bits / 8)


def held_weights(fmt: WeightFormat | str, build: str = FUSED, *, block_minimums: bool = False,
                 minimums: str = "int8", matmul_kernel: str = "cabinlm", head: str = "int8") -> HeldWeights:
    """The layout `build` holds weights of format `fmt` in (engines/ort_fused/graph.py, block_layouts.py,
    export/wquant.py). Block scales are float32 (1 bit per weight at blocks of 32); an int4 export's
    zero points one byte per block (0.25 bit), MatMulNBits' packed 4-bit ones (the builds') 0.125 bit.

    block_minimums: the export's int4/int8 blocks carry GGUF Q4_1's float minimum (a Q4_1 .gguf
    imported, as the built-in smollm2-135m is): one more float32 per block, unless the fused build
    re-lays them out: cabinlm's BlockQ4MatMul (matmul_kernel "cabinlm": 4-bit codes, float16 scale and
    minimum, 5 bits) or 8-bit codes with a zero point (minimums "int8": 9.25 bits) or MatMulNBits plus
    the minimums through block sums (minimums "exact": 6 bits). matmul_kernel "cabinlm" also holds
    other 4-bit blocks as BlockQ4MatMul's float32 scale and minimum (6 bits) and int8 ones as exported.
    head: the output projection of int8/int4 exports (export --head)."""
    fmt = WeightFormat(fmt)
    if build not in ORT_CPU_BUILDS:
        raise PlanError(f"build kind {build!r} is not an ONNX Runtime CPU build; use one of {list(ORT_CPU_BUILDS)}")
    scale = 32 / BLOCK
    head_bits = {"int8": 8 + scale, "int4": 4 + scale + 8 / BLOCK}[head]
    if not fmt.quantized:  # fp32 (fp16: an engine precision only): one table, gathered from and prepacked as the head
        return HeldWeights(build, float(fmt.bits), float(fmt.bits), f"{fmt.value}, the table twice", gather_copy=True)
    minimum = 32 / BLOCK if block_minimums else 0.0
    if build == FUSED and matmul_kernel == "cabinlm" and not (fmt is WeightFormat.INT8 and block_minimums):
        # cabinlm's block matmuls (every CPU): nothing prepacked at load, the mapped weights file paged
        # in as read, a tied table's gather copy read one row per token. 4-bit matrices on BlockQ4MatMul:
        # a GGUF Q4_1's float16 scale and minimum (1 bit per weight), any other's float32 pair (2 bits);
        # int8 ones on BlockQ8MatMul as exported. The int8 head on BlockQ8MatMul: its tiles hold float32
        # scales of their own beside the table's, which a tied embedding gathers (one bit more per head
        # weight; an untied head's table has none: an upper estimate there); an int4 head on BlockQ4MatMul.
        own_head = head_bits + scale if head == "int8" else 4 + 2 * 32 / BLOCK
        if fmt is WeightFormat.INT8:
            return HeldWeights(build, 8 + scale, own_head, "cabinlm BlockQ8 (8-bit, float32 scale)", gather_copy=False)
        if block_minimums:
            return HeldWeights(build, 4 + 2 * 16 / BLOCK, own_head, "cabinlm BlockQ4 (4-bit, fp16 scale + minimum)",
                               gather_copy=False)  # fmt: skip
        return HeldWeights(build, 4 + 2 * 32 / BLOCK, own_head, "cabinlm BlockQ4 (4-bit, float32 scale + minimum)",
                           gather_copy=False)  # fmt: skip
    if fmt is WeightFormat.INT8:
        bits = 8 + scale + minimum
        how = "8-bit blocks + float32 scales" + (" and minimums" if block_minimums else "")
        if build == FUSED and block_minimums:  # 8-bit codes with a zero point (MatMulNBits)
            bits, how = 8 + scale + 8 / BLOCK, "8-bit blocks + scales, zero points"
        return HeldWeights(build, bits, head_bits, how)
    if build != FUSED:  # the exported layout: 4-bit codes, scales, and zero points (a byte each as exported,
        # packed to 4 bits where the build fuses them into MatMulNBits offline) or minimums
        bits = 4 + scale + (minimum if block_minimums else (8 if build == EXPORT else 4) / BLOCK)
        return HeldWeights(build, bits, head_bits, "4-bit blocks + float32 scales, " +
                           ("minimums" if block_minimums else "zero points"))
    if not block_minimums:
        return HeldWeights(build, 4 + scale + 4 / BLOCK, head_bits, "MatMulNBits 4-bit blocks")
    if minimums == "int8":
        return HeldWeights(build, 8 + scale + 8 / BLOCK, head_bits, "Q4_1 as 8-bit blocks + zero points")
    return HeldWeights(build, 4 + scale + minimum, head_bits, "MatMulNBits 4-bit + block-sum minimums")


# Measured (benchmarks/plan_vs_rss.py; SmolLM2-135M, onnxruntime 1.31, x86-64 Linux):
# the interpreter with numpy, onnxruntime and cabinlm's runtime imported (55 MiB), plus one session's
# own memory beyond its weights, KV buffers and arena (about 25 MiB).
ORT_CPU_RUNTIME_BYTES = 80 * MIB
# The tokenizer (Hugging Face tokenizers, the artifact's tokenizer.json) per vocabulary entry: 30.5 MiB
# measured for SmolLM2's 49152 entries (a 3.5 MB tokenizer.json).
TOKENIZER_BYTES_PER_TOKEN = 650
# ... and per byte of tokenizer.json, where the file is at hand (an artifact): 9.1 for SmolLM2's
# (3.5 MB, 30.5 MiB), 8.7 for Gemma 3 270M's (33.4 MB, 291 MiB: 262k entries and their merges).
TOKENIZER_BYTES_PER_FILE_BYTE = 9
# What a dialogue adds beyond the weights and KV buffers (ONNX Runtime's arena for the chunk and decode
# graphs, the steps' numpy buffers), against activation_bytes: the fused decoder's attention kernels keep
# about its bound; the exported graph's attention over every slot (dequantized keys and values, scores)
# grows the arena to 2x (run as exported, every optimization at load) or 3x (a built graph, basic
# optimizations at load). The static pair (a static profile's build) is not measured: taken as a graph build.
ACTIVATION_FACTOR = {EXPORT: 2.0, GRAPH: 3.0, FUSED: 1.0, STATIC: 3.0}


# Seats decoding together (a fused build's batched graphs, FusedSettings.seat_batches) with the LM head
# on MatMulNBits: the head is a graph of its own, and ONNX Runtime keeps a packed copy of its 8-bit
# matrix in that session (38 MB for SmolLM2's 28 MB of head codes): bytes
# per head code. A build whose head runs on cabinlm's BlockQ8MatMul (wherever cabinlm's library compiles,
# FusedSettings.head_kernel) holds no copy; the plan of a model, made before a build knows its kernels,
# counts the copy: an upper estimate there. A build records what each of its graphs' sessions packs
# (FusedSettings.packed_bytes), which the plan of the build and the runtime's seat limit count instead.
PACKED_HEAD_BYTES_PER_CODE = 1.35


def packed_head_bytes(spec: ModelSpec) -> int:
    """The head graph's packed copy of the LM head (vocab x hidden codes), held once per process."""
    return int(PACKED_HEAD_BYTES_PER_CODE * spec.vocab_size * spec.hidden_size)


def batched_seats(profile: DeviceProfile, kind: str | None, kv: KVDType) -> tuple[int, ...]:
    """The batched graphs `cabinlm build --profile` gives a build of this kind: the profile's
    seat_batches for a fused build over int8 KV (they take cabinlm's attention kernel), else none."""
    return tuple(profile.seat_batches) if kind == FUSED and kv is KVDType.INT8 else ()


def tokenizer_estimate(spec: ModelSpec) -> int:
    return spec.vocab_size * TOKENIZER_BYTES_PER_TOKEN


def default_build(profile: DeviceProfile, kv: KVDType) -> str | None:
    """The build kind `cabinlm build EXPORT --profile P` makes on an ONNX Runtime CPU profile (None
    elsewhere): the fused decoder where it applies (int8 / fp32 KV), else the exported graph; static
    profiles: the static pair."""
    if profile.engine.value != "onnxruntime" or profile.execution_provider != "CPUExecutionProvider":
        return None
    if profile.static_shapes:
        return STATIC
    return FUSED if kv in (KVDType.INT8, KVDType.FP32) else GRAPH


def build_facts(manifest: Any) -> dict[str, Any]:
    """What plan() needs to know of an artifact (an export or a build): its weights format, the build
    kind, the weights layout held (held_weights), the batched graphs it carries and what ONNX Runtime
    packs beside the weights (packed, seats_packed: FusedSettings.packed_bytes), from the manifest alone.

    A fused build whose graphs read one map of its weights file (FusedSettings.shared_weights) holds
    each weight there once, and each session packs its own copy of the weights on ONNX Runtime's
    matmuls (MatMulNBits, MatMul) beside the map, which stays: the one-seat graph's copy is `packed`,
    the batched graphs' and their head graph's `seats_packed` (sessions opened from a second seat on).
    Elsewhere ONNX Runtime reads the weights file itself and frees what it packed: held_weights' layout."""
    build = manifest.build
    kind = EXPORT if build is None else build.backend.value
    fmt = WeightFormat(manifest.weights)
    quality = manifest.quality.weights or {}
    # imported GGUF blocks: cabinlm's built-in GGUFs are Q4_1, whose blocks carry a float minimum
    block_minimums = bool(quality.get("imported")) and fmt.quantized
    fused = (build.to_dict().get("fused") or {}) if build is not None else {}
    if kind not in ORT_CPU_BUILDS:
        return {"weights": fmt, "build": None, "held": None}
    held = held_weights(fmt, kind, block_minimums=block_minimums, minimums=fused.get("minimums", "int8"),
                        matmul_kernel=fused.get("matmul_kernel", "onnxruntime"), head=quality.get("head", "int8"))
    data = manifest.files.get(FileRole.GRAPH_DATA)
    if kind == FUSED and held.gather_copy and fmt.quantized and manifest.model.tie_embeddings and data is not None:
        # fused builds may gather the embedding from the head's blocks (no second copy): the weights
        # file's size (a manifest fact) says which, whichever of the two layouts it is nearer
        single = dataclasses.replace(held, gather_copy=False)
        if abs(single.nbytes(manifest.model) - data.bytes) < abs(held.nbytes(manifest.model) - data.bytes):
            held = single
    if (kind == FUSED and fmt.quantized and data is not None and quality.get("head", "int8") == "int8"
            and abs(held.nbytes(manifest.model) - data.bytes) > 0.15 * data.bytes):  # fmt: skip
        # A GGUF of several block types (K-quants: Q5_0 / Q6_K / Q8_0 matrices imported as 8-bit blocks
        # beside Q4_K's 4-bit ones) is not one width: the matrices' bits per weight are read off the
        # weights file the build wrote (its size is a manifest fact), the tables as held_weights says.
        spec = manifest.model
        bare = dataclasses.replace(held, matrix_bits=0.0)
        matrices = parameter_count(spec) - spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2)
        bits = max(0.0, (data.bytes - bare.nbytes(spec)) * 8 / max(matrices, 1))
        held = dataclasses.replace(held, matrix_bits=round(bits, 2), layout=f"as built: {bits:.2f} bits per matrix weight "
                                   "(the weights file's size: GGUF blocks of several widths)")  # fmt: skip
    # what each graph's session packs, as the build recorded it (None: plan() estimates the LM head's copy)
    packed: dict[str, int] | None = fused.get("packed_bytes") if kind == FUSED else None
    mapped = packed is not None and bool(fused.get("shared_weights"))
    if mapped:  # one map: each weight once (a table gathered from is paged in a row at a time), packed copies apart
        held = dataclasses.replace(held, gather_copy=False, layout=(held.layout if fmt.quantized else fmt.value)
                                   + ", one map of the weights file")  # fmt: skip
    # the batched graphs the build carries (none for an export, or a build made before seats decoded together),
    # and whether its LM head is packed by a session (MatMulNBits) or read in place (cabinlm's BlockQ8MatMul)
    return {"weights": fmt, "build": kind, "held": held, "seat_batches": tuple(fused.get("seat_batches") or ()),
            "packed_head": fused.get("head_kernel", "onnxruntime") != "cabinlm",
            "packed": packed.get("graph", 0) if mapped and packed is not None else 0,
            "seats_packed": None if packed is None else {r: v for r, v in packed.items() if r != "graph"}}  # fmt: skip
