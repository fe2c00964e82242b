"""The memory planner: a model's ModelSpec + a device profile -> the largest window that fits, with the
breakdown. Standard library only: the spec comes from a bare config.json (cabinlm.model_config),
never from the weights.

    total = weights + KV cache (sink + pinned + window slots, with scales) + activations of one chunk
            + vision tower + runtime overhead                                   <= profile budget

Qualcomm HTP profiles (QNNExecutionProvider) also count the context binaries: a prefill and a decode
graph, one binary holding both with one weights copy where the HTP shares weights between graphs
(v73 on), two binaries and two weights copies where it does not (v68). The token table is a float
gather on the HTP (fp16). The HTP runs them in one process on the NPU, whose 32-bit address space
caps binaries + KV + activations (htp_process_limit_bytes).

ONNX Runtime CPU profiles (the cpu profile) count what the build being planned holds, since their
builds hold the same weights in different layouts (docs/benchmarks.md, "Planner against peak RSS"):

    total = held weights + KV + activations x ACTIVATION_FACTOR[build] + ORT_CPU_RUNTIME_BYTES + tokenizer

held weights (held_weights): the matrices at the build's bits per weight, block scales, zero points
and minimums included (a fused build's int4 GGUF blocks in cabinlm's BlockQ4 layout or as 8-bit
blocks; an export's as exported), the output head, and a quantized tied table's gather copy where
ONNX Runtime reads it at load. The build kind and layout come from the manifest's build facts when
planning an artifact (plan_for_manifest), from the profile's default build when planning a model.
The runtime term (interpreter, numpy, ONNX Runtime, a session) and the tokenizer are measured
constants there, in place of the profile's runtime_overhead_bytes; other profiles keep precision x
count and their runtime_overhead_bytes.

KV bytes come from CacheLayout (the one owner of cache geometry); nothing here re-derives them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cabinlm.errors import CabinlmError, LayoutError
from cabinlm.layout import CacheLayout
from cabinlm.manifest import ModelSpec
from cabinlm.precision import KVDType, WeightFormat
from cabinlm.profiles.schema import DeviceProfile
from cabinlm.engines.qnn_htp.spec import shares_weights

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
    the minimums through block sums (minimums "exact": 6 bits).
    head: the output projection of int8/int4 exports (export --head)."""
    fmt = WeightFormat(fmt)
    if build not in ORT_CPU_BUILDS:
        raise PlanError(f"build kind {build!r} is not an ONNX Runtime CPU build; use one of {list(ORT_CPU_BUILDS)}")
    scale = 32 / BLOCK
    head_bits = {"int8": 8 + scale, "int4": 4 + scale + 8 / BLOCK}[head]
    if not fmt.quantized:  # fp32 (fp16: an engine precision only): one table, gathered from and prepacked as the head
        return HeldWeights(build, float(fmt.bits), float(fmt.bits), f"{fmt.value}, the table twice", gather_copy=True)
    minimum = 32 / BLOCK if block_minimums else 0.0
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
    if matmul_kernel == "cabinlm":  # nothing prepacked at load: the mapped gather copy is read one row per token
        return HeldWeights(build, 4 + 2 * 16 / BLOCK, head_bits, "cabinlm BlockQ4 (4-bit, fp16 scale + minimum)",
                           gather_copy=False)
    if minimums == "int8":
        return HeldWeights(build, 8 + scale + 8 / BLOCK, head_bits, "Q4_1 as 8-bit blocks + zero points")
    return HeldWeights(build, 4 + scale + minimum, head_bits, "MatMulNBits 4-bit + block-sum minimums")


# Measured (docs/benchmarks.md, "Planner against peak RSS"; SmolLM2-135M, onnxruntime 1.31, x86-64 Linux):
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


def activation_bytes(spec: ModelSpec, layout: CacheLayout) -> int:
    """Workspace of one chunk through the graph (float32, 4 bytes per value: an upper bound for
    fp16 engines). T = chunk, N = slots, D = hidden, H/Hkv = heads, Dh = head_dim, I = MLP, V = vocab.

    Buffers are reused from one layer to the next (ONNX Runtime's memory planner, TensorRT's
    activation pool), but within a layer nothing is assumed to be shared, so the terms add up:
        hidden states    3 T D            residual, normed input, attention/MLP output
        qkv              T (H + 2 Hkv) Dh
        keys, values     4 Hkv (N + T) Dh  dequantized cache ++ chunk for K and V, rotated K, a RoPE temporary
        RoPE tables      2 (N + 2T) Dh     cos/sin for cache ++ chunk keys and for the queries
        scores           2 H T (N + T)     pre- and post-softmax: heads x chunk x (slots + chunk)
        context          T H Dh
        MLP              3 T I             gate|up (2I) and the SwiGLU product (I)
        logits           T V
    plus the new K/V outputs of every layer, 2 L Hkv T Dh in the KV precision.
    """
    t, n = layout.chunk, layout.slots
    d, h, hkv, dh = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    values = (
        3 * t * d
        + t * (h + 2 * hkv) * dh
        + 4 * hkv * (n + t) * dh
        + 2 * (n + 2 * t) * dh
        + 2 * h * t * (n + t)
        + t * h * dh
        + 3 * t * spec.intermediate_size
        + t * spec.vocab_size
    )
    new_kv = 2 * spec.num_layers * hkv * t * dh * layout.kv_dtype.itemsize
    return 4 * values + new_kv


# -- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    profile: str
    model: str
    kv: str
    weight_dtype: str
    sink: int
    pinned: int
    window: int
    chunk: int
    parameters: int
    weights_bytes: int
    kv_bytes: int  # cache buffers + per-channel key scales
    kv_bytes_per_token: int
    activation_bytes: int
    vision_params: int
    vision_bytes: int
    image_tokens: int  # slots of the cache's image region (one camera frame)
    runtime_overhead_bytes: int
    total_bytes: int
    budget_bytes: int
    fits: bool
    max_window_by_positions: int  # the largest chunk-multiple window the model's positions allow
    # Qualcomm HTP profiles only (0 elsewhere): context binaries, the bytes they hold, and what the
    # NPU process maps (binaries + KV + activations) against its per-process limit.
    # Per-layer cache geometry (CacheLayout.local_layers): local layers on rings of local_window slots,
    # whatever the window; kv_bytes_per_token then counts the global layers only.
    local_layers: int = 0
    local_window: int = 0
    htp_binaries: int = 0
    htp_binary_bytes: int = 0
    htp_process_bytes: int = 0
    htp_process_limit_bytes: int = 0
    # ONNX Runtime CPU profiles only: the build kind planned for (held_weights; "" elsewhere), the layout
    # its weights are held in, and the tokenizer's memory (a row of its own; 0 elsewhere, where the
    # profile's runtime_overhead_bytes covers it).
    build: str = ""
    weights_layout: str = ""
    tokenizer_bytes: int = 0

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def slots(self) -> int:
        return self.sink + self.pinned + self.window

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["headroom_bytes"] = self.headroom_bytes
        return d


def resolve_kv(profile: DeviceProfile, kv: KVDType | str | None) -> KVDType:
    if kv is None:
        return profile.default_kv
    try:
        kv = KVDType(kv)
    except ValueError as e:
        raise PlanError(f"--kv {kv!r} is not a KV precision; use one of {[k.value for k in KVDType]}") from e
    if kv not in profile.kv_dtypes:
        why = f" ({profile.precision_notes})" if profile.precision_notes else ""
        raise PlanError(
            f"--kv {kv.value} is not available on profile {profile.name} ({profile.chip}){why}; "
            f"it runs {', '.join(k.value for k in profile.kv_dtypes)}"
        )
    return kv


def plan(
    spec: ModelSpec,
    profile: DeviceProfile,
    kv: KVDType | str | None = None,
    sink: int | None = None,
    chunk: int | None = None,
    pinned: int = 124,
    window: int | None = None,
    vision_params: int = 0,
    image_tokens: int = 0,
    *,
    weights: WeightFormat | str | None = None,
    build: str | None = None,
    held: HeldWeights | None = None,
    tokenizer_bytes: int | None = None,
) -> Plan:
    """The memory breakdown and the largest window that fits `profile`'s budget.

    window=None: search the largest window W that is a multiple of the chunk, >= chunk, with
    sink + pinned + W + chunk <= the model's positions, and total <= budget (PlanError if even
    W = chunk does not fit). window=N: use it and report `fits`.

    ONNX Runtime CPU profiles count what the build holds (plan_for_manifest passes an artifact's facts):
    weights: the export's format (default: the profile's weight_dtype); build: the build kind
    (default_build: what `cabinlm build --profile` makes); held: the weights' layout (default:
    held_weights(weights, build)); tokenizer_bytes (default: tokenizer_estimate). Their runtime term is
    ORT_CPU_RUNTIME_BYTES, measured, not the profile's runtime_overhead_bytes; activations are scaled
    by ACTIVATION_FACTOR[build]. Other profiles count weights at precision x count and the profile's
    runtime_overhead_bytes, as before.
    """
    kv = resolve_kv(profile, kv)
    sink = profile.default_sink if sink is None else sink
    chunk = profile.default_chunk if chunk is None else chunk
    if chunk < 1 or sink < 0 or pinned < 0:
        raise LayoutError(f"chunk {chunk} must be >= 1 and sink {sink}, pinned {pinned} >= 0")
    if vision_params < 0:
        raise PlanError(f"vision_params must be >= 0, got {vision_params}")
    params = parameter_count(spec)
    fmt = profile.weight_dtype if weights is None else WeightFormat(weights)
    kind = build or default_build(profile, kv)
    if kind is not None and kind not in ORT_CPU_BUILDS:
        raise PlanError(f"build kind {kind!r} is not one profile {profile.name} makes; use one of {list(ORT_CPU_BUILDS)}")
    if kind is not None:
        held = held or held_weights(fmt, kind)
        weights = held.nbytes(spec)
        tokenizer = tokenizer_estimate(spec) if tokenizer_bytes is None else tokenizer_bytes
        overhead = ORT_CPU_RUNTIME_BYTES
        act_factor = ACTIVATION_FACTOR[kind]
    else:
        weights = weight_bytes(params, fmt)
        tokenizer, overhead, act_factor = 0, profile.runtime_overhead_bytes, 1.0
    # The vision tower stays at 16 bits at least: DriveOS LLM SDK keeps the ViT in FP16 even for
    # quantized LLMs (hardware.md section 2); on an fp32 profile it is fp32 like the rest.
    vision_dtype = WeightFormat.FP32 if fmt is WeightFormat.FP32 else WeightFormat.FP16
    vision = weight_bytes(vision_params, vision_dtype)
    fixed = weights + vision + overhead + tokenizer
    htp = profile.htp_arch is not None
    binaries = binary_bytes = 0
    if htp:
        binaries = 1 if shares_weights(profile.htp_arch) else 2
        binary_bytes = htp_graph_weight_bytes(spec, params, fmt) * binaries
        fixed += binary_bytes - weights  # the binaries replace the plain weights term
    room = spec.max_positions - sink - pinned - image_tokens - chunk  # positions left for the window
    max_by_positions = (room // chunk) * chunk

    def make(w: int) -> Plan:
        layout = CacheLayout(sink=sink, pinned=pinned, window=w, chunk=chunk, layers=spec.num_layers,
                             kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, kv_dtype=kv, image=image_tokens,
                             **spec.local_geometry(sink + pinned + image_tokens + w + chunk))  # as export's make_layout
        kv_total = layout.cache_bytes + layout.key_scale_bytes
        act = int(activation_bytes(spec, layout) * act_factor)
        total = fixed + kv_total + act
        process = binary_bytes + kv_total + act if htp else 0
        limit = profile.htp_process_limit_bytes or 0
        return Plan(
            profile=profile.name, model=spec.source or spec.architecture, kv=kv.value,
            weight_dtype=fmt.value, sink=sink, pinned=pinned, window=w, chunk=chunk,
            parameters=params, weights_bytes=weights, kv_bytes=kv_total,
            kv_bytes_per_token=layout.bytes_per_token, activation_bytes=act, vision_params=vision_params,
            local_layers=len(layout.local_layers), local_window=layout.local_window,
            vision_bytes=vision, image_tokens=image_tokens, runtime_overhead_bytes=overhead, total_bytes=total,
            budget_bytes=profile.budget_bytes, fits=total <= profile.budget_bytes and (not limit or process <= limit),
            max_window_by_positions=max(max_by_positions, 0), htp_binaries=binaries, htp_binary_bytes=binary_bytes,
            htp_process_bytes=process, htp_process_limit_bytes=limit, build=kind or "",
            weights_layout=held.layout if kind else "", tokenizer_bytes=tokenizer,
        )  # fmt: skip

    if window is not None:
        if sink + pinned + image_tokens + window + chunk > spec.max_positions:
            raise LayoutError(
                f"sink {sink} + pinned {pinned} + window {window} + chunk {chunk} = "
                f"{sink + pinned + window + chunk} positions, but the model has only {spec.max_positions}; "
                f"use --window {room} or less"
            )
        return make(window)
    if max_by_positions < chunk:
        raise LayoutError(
            f"the model has {spec.max_positions} positions: sink {sink} + pinned {pinned} + chunk {chunk} "
            f"leave no room for a window of at least one chunk; lower --pinned or --chunk"
        )
    smallest = make(chunk)
    if smallest.total_bytes <= profile.budget_bytes and not smallest.fits:  # the budget holds, the NPU process not
        raise PlanError(
            f"{spec.source or spec.architecture} does not fit one HTP process on profile {profile.name}: even the "
            f"smallest window ({chunk} tokens) maps {smallest.htp_process_bytes / MIB:.1f} MiB ({smallest.htp_binaries} "
            f"context binaries {smallest.htp_binary_bytes / MIB:.1f} MiB + KV + activations) in the NPU process, "
            f"whose limit is {smallest.htp_process_limit_bytes / MIB:.1f} MiB (a 32-bit address space). Splitting a "
            "model over several contexts is not part of this cabinlm version: use a smaller model or int4 weights"
        )
    if not smallest.fits:
        short = smallest.total_bytes - profile.budget_bytes
        raise PlanError(
            f"{spec.source or spec.architecture} does not fit profile {profile.name}: even the smallest "
            f"window ({chunk} tokens) needs {smallest.total_bytes} bytes ({smallest.total_bytes / MIB:.1f} MiB) "
            f"but the budget is {profile.budget_bytes} bytes ({profile.budget_bytes / MIB:.1f} MiB): "
            f"{short} bytes ({short / MIB:.1f} MiB) missing; weights alone are {weights / MIB:.1f} MiB at "
            f"{fmt.value}. Use a smaller model, a smaller --kv/--chunk/--pinned, or a "
            "profile with a larger budget_bytes"
        )
    # total(W) grows with W, so binary-search the largest fitting multiple of the chunk.
    lo, hi = 1, max_by_positions // chunk  # in chunks; lo fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if make(mid * chunk).fits:
            lo = mid
        else:
            hi = mid - 1
    return make(lo * chunk)


def format_plan(p: Plan) -> str:
    """A plain-text breakdown, one line per term (for `cabinlm plan`)."""

    def mib(b: int) -> str:
        return f"{b / MIB:10.1f} MiB"

    if p.htp_binaries:
        how = "prefill + decode, one weights copy" if p.htp_binaries == 1 else "prefill, decode: a weights copy each"
        first = (f"HTP context binaries ({p.htp_binaries}: {how}; {p.parameters / 1e6:.1f}M params at "
                 f"{p.weight_dtype} + block scales, head 8-bit, token table fp16)", p.htp_binary_bytes)  # fmt: skip
    elif p.build:
        first = (f"weights ({p.parameters / 1e6:.1f}M params at {p.weight_dtype}, {p.build}: {p.weights_layout})",
                 p.weights_bytes)
    else:
        first = (f"weights ({p.parameters / 1e6:.1f}M params at {p.weight_dtype})", p.weights_bytes)
    slots = f"{p.sink}+{p.pinned}+{p.image_tokens}+{p.window}" if p.image_tokens else f"{p.sink}+{p.pinned}+{p.window}"
    rings = f"; {p.local_layers} local layers on rings of {p.local_window}" if p.local_layers else ""
    kv_row = f"KV cache ({slots} slots at {p.kv}, {p.kv_bytes_per_token} B/token{rings})"
    rows = [
        first,
        (kv_row, p.kv_bytes),
        (f"activations (chunk of {p.chunk})", p.activation_bytes),
        (f"vision tower ({p.vision_params / 1e6:.1f}M params)", p.vision_bytes),
        ("runtime overhead" + (" (Python, numpy, ONNX Runtime and its session)" if p.build else ""),
         p.runtime_overhead_bytes),
        *([("tokenizer", p.tokenizer_bytes)] if p.build else []),
        ("total", p.total_bytes),
        (f"budget of {p.profile}", p.budget_bytes),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {mib(value)}" for name, value in rows]
    if p.htp_process_limit_bytes:
        lines.append(f"{'HTP process (binaries + KV + activations)':<{width}}  {mib(p.htp_process_bytes)}  of "
                     f"{p.htp_process_limit_bytes / MIB:.1f} MiB a 32-bit NPU process maps")  # fmt: skip
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"{verdict}: window {p.window}, headroom {p.headroom_bytes / MIB:.1f} MiB")
    return "\n".join(lines)



def build_facts(manifest: Any) -> dict[str, Any]:
    """What plan() needs to know of an artifact (an export or a build): its weights format, the build
    kind, and the weights layout held (held_weights), from the manifest alone."""
    build = manifest.build
    kind = EXPORT if build is None else build.backend.value
    fmt = WeightFormat(manifest.weights)
    quality = (manifest.quality or {}).get("weights") or {}
    # imported GGUF blocks: cabinlm's built-in GGUFs are Q4_1, whose blocks carry a float minimum
    block_minimums = bool(quality.get("imported")) and fmt.quantized
    fused = (build.to_dict().get("fused") or {}) if build is not None else {}
    if kind not in ORT_CPU_BUILDS:
        return {"weights": fmt, "build": None, "held": None}
    held = held_weights(fmt, kind, block_minimums=block_minimums, minimums=fused.get("minimums", "int8"),
                        matmul_kernel=fused.get("matmul_kernel", "onnxruntime"), head=quality.get("head", "int8"))
    data = manifest.files.get("graph_data")
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
    return {"weights": fmt, "build": kind, "held": held}


def plan_for_manifest(manifest: Any, profile: DeviceProfile, *, tokenizer_bytes: int | None = None) -> Plan:
    """The plan of an artifact as exported or built: its cache layout and its build facts (build_facts).
    The tokenizer's memory is estimated from its tokenizer.json (TOKENIZER_BYTES_PER_FILE_BYTE)."""
    lay = manifest.cache
    tok = manifest.files.get("tokenizer")
    if tokenizer_bytes is None and tok is not None and tok.bytes:
        tokenizer_bytes = tok.bytes * TOKENIZER_BYTES_PER_FILE_BYTE
    facts = build_facts(manifest)
    if facts["build"] is None:
        facts = {"weights": facts["weights"]}
    return plan(manifest.model, profile, kv=lay.kv_dtype, sink=lay.sink, chunk=lay.chunk, pinned=lay.pinned,
                window=lay.window, image_tokens=lay.image, tokenizer_bytes=tokenizer_bytes, **facts)
