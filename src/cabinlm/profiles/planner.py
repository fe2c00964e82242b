"""The memory planner: a model's ModelSpec + a device profile -> the largest window that fits, with the
breakdown. Standard library only: the spec comes from a bare config.json (cabinlm.source.config),
never from the weights.

    total = weights + KV cache (sink + pinned + window slots, with scales) + activations of one chunk
            + vision tower + runtime overhead                                   <= profile budget

Qualcomm HTP profiles (QNNExecutionProvider) also count the context binaries: a prefill and a decode
graph, one binary holding both with one weights copy where the HTP shares weights between graphs
(v73 on), two binaries and two weights copies where it does not (v68). The token table is a float
gather on the HTP (fp16). The HTP runs them in one process on the NPU, whose 32-bit address space
caps binaries + KV + activations (htp_process_limit_bytes). Their int8 KV is a uint8 cache (one byte per
K / V element, no value scales) and, where it holds rotated keys (qnn_htp/spec.rotated_keys_possible: a
text model without local layers), the sink and pinned keys' un-rotated fp16 copy beside it.

ONNX Runtime CPU profiles (the cpu profile) count what the build being planned holds, since their
builds hold the same weights in different layouts (docs/results.md, "Plan against RSS"):

    total = held weights + packed copies + KV + activations x ACTIVATION_FACTOR[build]
            + ORT_CPU_RUNTIME_BYTES + tokenizer

packed copies (packed_bytes): a fused build whose graphs read one map of its weights file packs, in its
dialogue's session, a copy of every weight on ONNX Runtime's matmuls (MatMulNBits, MatMul) beside the
map, which stays resident; the build records the bytes (FusedSettings.packed_bytes, read by
build_facts). None where the build reads them in place (cabinlm's BlockQ4MatMul / BlockQ8MatMul), nor
before a build: a model is planned for the profile's default build, which takes cabinlm's kernels.

A fused build with batched graphs (FusedSettings.seat_batches) also says what seats decoding together
add, beside the total, which plans one dialogue: what the batched graphs' and their head graph's
sessions pack (together_bytes: those sessions open when a loaded build gets its second seat,
engines/ort_fused/sessions.FusedGraphs; the build's packed_bytes, or, planning a model, the LM head's
copy, none for a head on cabinlm's BlockQ8MatMul, FusedSettings.head_kernel), and the largest batch's
activations with the idle seat's cache while a batched step runs (batch_bytes).

held weights (held_weights): the matrices at the build's bits per weight, block scales, zero points
and minimums included (a fused build's int4 GGUF blocks in cabinlm's BlockQ4 layout or as 8-bit
blocks; an export's as exported), the output head, and a quantized tied table's gather copy where
ONNX Runtime reads it at load. The build kind and layout come from the manifest's build facts when
planning an artifact (plan_for_manifest), from the profile's default build when planning a model.
The runtime term (interpreter, numpy, ONNX Runtime, a session) and the tokenizer are measured
constants there, in place of the profile's runtime_overhead_bytes; other profiles keep precision x
count and their runtime_overhead_bytes.

Switchable LoRA adapters (an export with --lora-rank R; plan(lora=...)): each adapter a seat uses is
held once in memory as its float32 inputs padded to rank R (SwitchableLora.bytes_per_adapter), and
so are the zeros of no adapter; a chunk's activations grow by the adapter terms (adapter_activation_bytes).
The plan counts the zeros and every listed adapter in the total, and says each adapter's cost.

KV bytes come from CacheLayout (the one owner of cache geometry); nothing here re-derives them. The
weights counted and the layouts ONNX Runtime CPU builds hold them in are profiles/weights.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cabinlm.contract.adapters import SwitchableLora, adapter_role, target_shapes
from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import LayoutError
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.manifest import ModelSpec
from cabinlm.contract.precision import KVDType, WeightFormat
from cabinlm.profiles.schema import DeviceProfile
from cabinlm.profiles.weights import (  # noqa: F401 - PlanError re-exported: callers catch it from the planner
    ACTIVATION_FACTOR,
    MIB,
    ORT_CPU_BUILDS,
    ORT_CPU_RUNTIME_BYTES,
    batched_seats,
    packed_head_bytes,
    TOKENIZER_BYTES_PER_FILE_BYTE,
    HeldWeights,
    PlanError,
    build_facts,
    default_build,
    held_weights,
    htp_graph_weight_bytes,
    parameter_count,
    tokenizer_estimate,
    weight_bytes,
)
from cabinlm.contract.engines.qnn import key_source_bytes, rotated_keys_possible, shares_weights, uint8_cache_bytes
from cabinlm.profiles import htp_estimate


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


def adapter_activation_bytes(spec: ModelSpec, chunk: int, lora: SwitchableLora) -> int:
    """A chunk's workspace for the adapter terms of one layer (float32; reused from layer to layer as
    activation_bytes assumes): for every target t, its input's rows (T in_t), x A^T (T R) and the
    term (T out_t) (engines/ort_fused/adapter_graph.py), none assumed shared."""
    shapes = lora_shapes(spec)
    return 4 * chunk * sum(shapes[t][1] + lora.rank + shapes[t][0] for t in lora.targets)


def lora_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    return target_shapes(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size)


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
    # HTP profiles: the decode speed ESTIMATE (profiles/htp_estimate.py: bytes a decode step reads at a
    # bandwidth calibrated on Qualcomm's published figures; not measured), and its one-line account.
    htp_step_bytes: int = 0
    htp_tokens_per_s_estimate: float = 0.0
    htp_estimate: str = ""
    # ONNX Runtime CPU profiles only: the build kind planned for (held_weights; "" elsewhere), the layout
    # its weights are held in, and the tokenizer's memory (a row of its own; 0 elsewhere, where the
    # profile's runtime_overhead_bytes covers it).
    build: str = ""
    weights_layout: str = ""
    tokenizer_bytes: int = 0
    # A fused build's batched graphs (seats decoding together; () elsewhere), neither in the total,
    # which plans one dialogue: together_bytes, the head graph's packed LM head, held once the loaded
    # build has a second seat; batch_bytes, the largest batch's activations and the idle seat's cache
    # (engines/ort_fused/seats.idle_step fills a batch's empty places with it) while seats step together.
    seat_batches: tuple[int, ...] = ()
    together_bytes: int = 0
    batch_bytes: int = 0
    # ONNX Runtime CPU builds: the copies the dialogue's session packs beside the mapped weights file (in
    # the total; 0 elsewhere), and the LM head's share of together_bytes.
    packed_bytes: int = 0
    together_head_bytes: int = 0
    recall: int = 0  # slots of the cache's recall region (docs/design.md, "The recall region")
    # Switchable LoRA adapter inputs (0 / () without): their rank and targets, the bytes one adapter
    # holds in memory (float32, padded to the rank: the zeros of no adapter hold as much), the
    # adapter terms' share of activation_bytes, and each adapter planned, (name, its file's bytes).
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    adapter_bytes: int = 0
    adapter_activation_bytes: int = 0
    adapters: tuple[tuple[str, int], ...] = ()

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def slots(self) -> int:
        return self.sink + self.pinned + self.recall + self.window

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
    seat_batches: tuple[int, ...] | None = None,
    packed_head: bool = True,
    packed: int = 0,
    seats_packed: dict[str, int] | None = None,
    recall: int = 0,
    lora: SwitchableLora | None = None,
    adapters: tuple[tuple[str, int], ...] = (),
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
    runtime_overhead_bytes, as before. seat_batches: the batched graphs of the build (default: what
    `cabinlm build --profile` gives the build kind, weights.batched_seats); their term is together_bytes,
    with the LM head's packed copy where packed_head (a build whose head runs on cabinlm's BlockQ8MatMul
    holds none: its facts say so; before a build, the copy is counted), or, where seats_packed is given
    (a build's FusedSettings.packed_bytes less its one-seat graph's, by graph role), what those sessions
    pack. packed: what the dialogue's session packs beside the mapped weights (a build's facts; 0 before
    a build), counted in the total. lora: the export's switchable adapter inputs (--lora-rank), adapters:
    the adapters planned with them, (name, file bytes) each: the zeros of no adapter and every adapter
    held in memory (adapter_bytes each) and the adapter terms' activations, in the total.
    """
    kv = resolve_kv(profile, kv)
    sink = profile.default_sink if sink is None else sink
    chunk = profile.default_chunk if chunk is None else chunk
    if chunk < 1 or sink < 0 or pinned < 0 or recall < 0:
        raise LayoutError(f"chunk {chunk} must be >= 1 and sink {sink}, pinned {pinned}, recall {recall} >= 0")
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
    fixed = weights + packed + vision + overhead + tokenizer
    if adapters and lora is None:
        raise PlanError("adapters are planned with the export's adapter inputs: give their rank (--lora-rank)")
    one_adapter = lora.bytes_per_adapter(spec.num_layers, lora_shapes(spec)) if lora is not None else 0
    fixed += one_adapter * (1 + len(adapters))  # the zeros of no adapter, and each adapter, held once
    batches = batched_seats(profile, kind, kv) if seat_batches is None else tuple(seat_batches)
    if seats_packed is not None:  # the build's own record of what its batched graphs' sessions pack
        head_copy, together = seats_packed.get("graph_head", 0), sum(seats_packed.values())
    else:
        head_copy = together = packed_head_bytes(spec) if packed_head else 0
    head_copy, together = (head_copy, together) if batches else (0, 0)
    htp = profile.htp_arch is not None
    binaries = binary_bytes = 0
    if htp:
        binaries = 1 if shares_weights(profile.htp_arch) else 2
        binary_bytes = htp_graph_weight_bytes(spec, params, fmt) * binaries
        fixed += binary_bytes - weights  # the binaries replace the plain weights term
    room = spec.max_positions - sink - pinned - image_tokens - recall - chunk  # positions left for the window
    max_by_positions = (room // chunk) * chunk

    def make(w: int) -> Plan:
        layout = CacheLayout(sink=sink, pinned=pinned, window=w, chunk=chunk, layers=spec.num_layers,
                             kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, kv_dtype=kv, image=image_tokens,
                             recall=recall, **spec.local_geometry(sink + pinned + image_tokens + recall + w + chunk))  # as export's make_layout
        kv_total = layout.cache_bytes + layout.key_scale_bytes
        if htp and layout.quantized:  # int8 KV on the HTP: its uint8 cache, no value scales (engines/qnn_htp)
            kv_total = uint8_cache_bytes(layout)
            if rotated_keys_possible(layout, vision=vision_params > 0):  # rotated keys: the sink / pinned fp16 copy
                kv_total += key_source_bytes(layout)
        lora_act = adapter_activation_bytes(spec, chunk, lora) if lora is not None else 0
        act = int(activation_bytes(spec, layout) * act_factor) + lora_act
        batch = 0
        if batches:  # a decode step of the largest batch: its rows through the layers, each seat's own cache
            rows = dataclasses.replace(layout, chunk=max(batches))
            batch = int(activation_bytes(spec, rows) * act_factor) + kv_total
        total = fixed + kv_total + act
        process = binary_bytes + kv_total + act if htp else 0
        limit = profile.htp_process_limit_bytes or 0
        guess = htp_estimate.estimate(spec, fmt, layout, profile.htp_arch) if htp else None
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
            seat_batches=batches, together_bytes=together, batch_bytes=batch, packed_bytes=packed,
            together_head_bytes=head_copy, recall=recall, lora_rank=lora.rank if lora else 0,
            lora_targets=lora.targets if lora else (), adapter_bytes=one_adapter, adapter_activation_bytes=lora_act,
            adapters=tuple(adapters),
            htp_step_bytes=guess.step_bytes if guess else 0,
            htp_tokens_per_s_estimate=round(guess.tokens_per_s, 1) if guess else 0.0,
            htp_estimate=guess.line() if guess else "",
        )  # fmt: skip

    if window is not None:
        if sink + pinned + image_tokens + recall + window + chunk > spec.max_positions:
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
    slots = "+".join(str(n) for n in (p.sink, p.pinned, p.image_tokens or None, p.recall or None, p.window) if n is not None)
    region = f" + {p.recall} recalled" if p.recall else ""  # a local layer keeps the region in slots of its own
    rings = f"; {p.local_layers} local layers on rings of {p.local_window}{region}" if p.local_layers else ""
    kv_row = f"KV cache ({slots} slots at {p.kv}, {p.kv_bytes_per_token} B/token{rings})"
    rows = [
        first,
        *([("packed copies (ONNX Runtime's session packs the weights on its matmuls beside the mapped file)",
            p.packed_bytes)] if p.packed_bytes else []),
        (kv_row, p.kv_bytes),
        (f"activations (chunk of {p.chunk})", p.activation_bytes),
        (f"vision tower ({p.vision_params / 1e6:.1f}M params)", p.vision_bytes),
        ("runtime overhead" + (" (Python, numpy, ONNX Runtime and its session)" if p.build else ""),
         p.runtime_overhead_bytes),
        *([("tokenizer", p.tokenizer_bytes)] if p.build else []),
        *_adapter_rows(p),
        ("total", p.total_bytes),
        (f"budget of {p.profile}", p.budget_bytes),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {mib(value)}" for name, value in rows]
    if p.htp_process_limit_bytes:
        lines.append(f"{'HTP process (binaries + KV + activations)':<{width}}  {mib(p.htp_process_bytes)}  of "
                     f"{p.htp_process_limit_bytes / MIB:.1f} MiB a 32-bit NPU process maps")  # fmt: skip
    if p.seat_batches:
        packs = [what for what, n in (("the LM head packed again for the batched graphs", p.together_head_bytes),
                                      ("each batched graph's own packed copy of the weights on ONNX Runtime's matmuls",
                                       p.together_bytes - p.together_head_bytes)) if n]  # fmt: skip
        head = (f"add {p.together_bytes / MIB:.1f} MiB from a second seat on ({'; '.join(packs)}) and"
                if p.together_bytes else "hold the LM head once (cabinlm's BlockQ8MatMul reads it in place) and add")
        lines.append(f"seats decoding together (graphs for {', '.join(map(str, p.seat_batches))} seats) {head} up to "
                     f"{p.batch_bytes / MIB:.1f} MiB while they step (the largest batch's activations and an idle seat), "
                     "beside each seat's own KV and activations; `--seats` counts them against memory")  # fmt: skip
    if p.htp_estimate:
        lines.append(p.htp_estimate)
    if p.lora_rank:
        lines.append(f"each adapter: {p.adapter_bytes / MIB:.1f} MiB held once however many seats use it (float32, "
                     f"padded to rank {p.lora_rank}), and its terms add {p.adapter_activation_bytes / MIB:.1f} MiB "
                     "to a chunk's activations (counted above)")  # fmt: skip
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"{verdict}: window {p.window}, headroom {p.headroom_bytes / MIB:.1f} MiB")
    return "\n".join(lines)


def _adapter_rows(p: Plan) -> list[tuple[str, int]]:
    """The plan's rows of switchable adapters: the zeros of no adapter, then each adapter planned."""
    if not p.lora_rank:
        return []
    targets = ",".join(t.removesuffix("_proj") for t in p.lora_targets)
    rows = [(f"LoRA adapter inputs (rank {p.lora_rank}, {targets}): the zeros of no adapter", p.adapter_bytes)]
    rows += [(f"adapter {name} (its file {size / MIB:.1f} MiB)", p.adapter_bytes) for name, size in p.adapters]
    return rows


def plan_for_manifest(manifest: Any, profile: DeviceProfile, *, tokenizer_bytes: int | None = None) -> Plan:
    """The plan of an artifact as exported or built: its cache layout and its build facts (build_facts).
    The tokenizer's memory is estimated from its tokenizer.json (TOKENIZER_BYTES_PER_FILE_BYTE)."""
    lay = manifest.cache
    tok = manifest.files.get(FileRole.TOKENIZER)
    if tokenizer_bytes is None and tok is not None and tok.bytes:
        tokenizer_bytes = tok.bytes * TOKENIZER_BYTES_PER_FILE_BYTE
    facts = build_facts(manifest)
    if facts["build"] is None:
        facts = {"weights": facts["weights"]}
    lora = manifest.lora
    adapters = tuple((a.name, manifest.files[adapter_role(a.name)].bytes or 0) for a in lora.adapters) if lora else ()
    return plan(manifest.model, profile, kv=lay.kv_dtype, sink=lay.sink, chunk=lay.chunk, pinned=lay.pinned,
                window=lay.window, image_tokens=lay.image, recall=lay.recall, tokenizer_bytes=tokenizer_bytes,
                lora=lora, adapters=adapters, **facts)  # fmt: skip
