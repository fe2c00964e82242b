"""The memory planner: a model's config + a device profile -> the largest window that fits, with the
breakdown. Standard library only: it reads a bare Hugging Face config.json, never the weights.

    total = weights + KV cache (sink + pinned + window slots, with scales) + activations of one chunk
            + vision tower + runtime overhead                                   <= profile budget

KV bytes come from CacheLayout (the one owner of cache geometry); nothing here re-derives them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cabinlm.errors import CabinlmError, LayoutError, ModelError
from cabinlm.manifest import STATIC_ROPE_TYPES, SUPPORTED_ARCHITECTURES, CacheLayout, KVDType, ModelSpec
from cabinlm.profiles.schema import DeviceProfile, WeightDType

MIB = 1 << 20


class PlanError(CabinlmError):
    """The model cannot be planned on the profile (precision not available, budget too small)."""


# -- config.json -> ModelSpec --------------------------------------------------------------------

# Mirrors transformers' defaults for keys a config may leave out (LlamaConfig() / Qwen2Config(), 5.x):
# LLaVA-style text_config blocks often carry only the keys that differ from them.
_TEXT_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu"),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu"),
}  # fmt: skip
# CLIPVisionConfig() defaults, for vision_config blocks that leave keys out.
_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, image_size=224,
                        patch_size=32, num_channels=3)  # fmt: skip


def _read_config(path: str | Path) -> tuple[dict[str, Any], str]:
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelError(f"{path}: no such file; pass a config.json or the model folder holding one") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(d, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return d, str(path)


def _text_block(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: the top level, or `text_config` of a LLaVA-style VLM."""
    return d["text_config"] if isinstance(d.get("text_config"), dict) else d


def spec_from_config(path: str | Path) -> ModelSpec:
    """ModelSpec from a bare config.json (or its folder): Llama and Qwen2, or a VLM's text_config."""
    d, where = _read_config(path)
    return spec_from_dict(d, where)


def spec_from_dict(d: dict[str, Any], where: str) -> ModelSpec:
    """ModelSpec from a config as a dict (a parsed config.json, or transformers' config.to_dict())."""
    c = _text_block(d)
    archs = [a for a in c.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES]
    model_type = c.get("model_type", "")
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    arch = archs[0] if archs else by_type.get(model_type)
    if arch is None:
        found = ", ".join(c.get("architectures") or []) or model_type or "unknown"
        raise ModelError(
            f"{where}: architecture {found} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(or a LLaVA-style config whose text_config is one of them)"
        )
    # a VLM's tie flag may sit at the top level rather than in its text_config
    tied = c.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
    c = {**_TEXT_DEFAULTS[SUPPORTED_ARCHITECTURES[arch]], **c}

    def num(key: str) -> int:
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(f"{where}: {key} = {v!r} is not a positive integer")
        return v

    if c["hidden_act"] != "silu":
        raise ModelError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (the SwiGLU decoder needs 'silu')")
    heads = num("num_attention_heads")
    kv_heads = num("num_key_value_heads") if c.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise ModelError(f"{where}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelError(
            f"{where}: RoPE type {rope_type!r} depends on the sequence length and cannot be baked into a "
            f"fixed-shape graph; supported: {', '.join(sorted(STATIC_ROPE_TYPES))}"
        )
    return ModelSpec(
        architecture=arch,
        hidden_size=num("hidden_size"),
        num_layers=num("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=num("head_dim") if c.get("head_dim") is not None else num("hidden_size") // heads,
        intermediate_size=num("intermediate_size"),
        vocab_size=num("vocab_size"),
        max_positions=num("max_position_embeddings"),
        rms_norm_eps=float(c["rms_norm_eps"]),
        # Qwen2 always has q/k/v biases; Llama only with attention_bias (export/models.py does the same).
        qkv_bias=bool(c.get("attention_bias") or arch == "Qwen2ForCausalLM"),
        tie_embeddings=bool(tied),
        source=where,
    )


def vision_params_from_config(path: str | Path) -> int:
    """Parameter estimate of a LLaVA-style vision tower + projector (0 when the config has none).

    CLIP/SigLIP ViT with hidden h, MLP i, L layers, patch p, image s, c channels, n = (s/p)^2 patches:
        patch embedding c*p*p*h (+h bias) + position embeddings (n+1)*h + class token h + 2 LayerNorms
        + L * (4*(h*h + h) attention + 2*2h LayerNorms + h*i + i + i*h + h MLP)
    plus LLaVA's projector Linear(h, D) + GELU + Linear(D, D), with biases, D = text hidden size.
    Within ~1% of the real towers (CLIP ViT-L/14-336: 303.5M); other tower families differ.
    """
    d, where = _read_config(path)
    v = d.get("vision_config")
    if not isinstance(v, dict):
        return 0
    v = {**_VISION_DEFAULTS, **v}
    try:
        h, i, layers = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])
        p, s, ch = int(v["patch_size"]), int(v["image_size"]), int(v["num_channels"])
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: vision_config has a non-integer size ({e})") from e
    n = (s // p) ** 2
    embed = ch * p * p * h + h + (n + 1) * h + h + 2 * 2 * h
    layer = 4 * (h * h + h) + 2 * 2 * h + (h * i + i) + (i * h + h)
    text_hidden = int(_text_block(d).get("hidden_size", _TEXT_DEFAULTS["llama"]["hidden_size"]))
    projector = (h * text_hidden + text_hidden) + (text_hidden * text_hidden + text_hidden)
    return embed + layers * layer + projector


def image_tokens_from_config(path: str | Path) -> int:
    """Cache slots one camera frame takes (the image region): (image / patch)^2 patch tokens, plus
    the CLS token unless LLaVA's "default" feature strategy drops it (0 when there is no vision)."""
    d, _ = _read_config(path)
    v = d.get("vision_config")
    if not isinstance(v, dict):
        return 0
    v = {**_VISION_DEFAULTS, **v}
    patches = (int(v["image_size"]) // int(v["patch_size"])) ** 2
    has_cls = v.get("model_type", "clip_vision_model") != "siglip_vision_model"
    keep_cls = has_cls and d.get("vision_feature_select_strategy", "default") != "default"
    return patches + int(keep_cls)


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


def weight_bytes(params: int, dtype: WeightDType) -> int:
    # Plain precision x count; per-group scales of int4/int8 weights (~3% at group 128) are not counted.
    return (params * dtype.bits + 7) // 8


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


def _resolve_kv(profile: DeviceProfile, kv: KVDType | str | None) -> KVDType:
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
) -> Plan:
    """The memory breakdown and the largest window that fits `profile`'s budget.

    window=None: search the largest window W that is a multiple of the chunk, >= chunk, with
    sink + pinned + W + chunk <= the model's positions, and total <= budget (PlanError if even
    W = chunk does not fit). window=N: use it and report `fits`.
    """
    kv = _resolve_kv(profile, kv)
    sink = profile.default_sink if sink is None else sink
    chunk = profile.default_chunk if chunk is None else chunk
    if chunk < 1 or sink < 0 or pinned < 0:
        raise LayoutError(f"chunk {chunk} must be >= 1 and sink {sink}, pinned {pinned} >= 0")
    if vision_params < 0:
        raise PlanError(f"vision_params must be >= 0, got {vision_params}")
    params = parameter_count(spec)
    weights = weight_bytes(params, profile.weight_dtype)
    # The vision tower stays at 16 bits at least: DriveOS LLM SDK keeps the ViT in FP16 even for
    # quantized LLMs (hardware.md section 2); on an fp32 profile it is fp32 like the rest.
    vision_dtype = WeightDType.FP32 if profile.weight_dtype is WeightDType.FP32 else WeightDType.FP16
    vision = weight_bytes(vision_params, vision_dtype)
    fixed = weights + vision + profile.runtime_overhead_bytes
    room = spec.max_positions - sink - pinned - image_tokens - chunk  # positions left for the window
    max_by_positions = (room // chunk) * chunk

    def make(w: int) -> Plan:
        layout = CacheLayout(sink=sink, pinned=pinned, window=w, chunk=chunk, layers=spec.num_layers,
                             kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, kv_dtype=kv,
                             image=image_tokens)  # fmt: skip
        kv_total = layout.cache_bytes + layout.key_scale_bytes
        act = activation_bytes(spec, layout)
        total = fixed + kv_total + act
        return Plan(
            profile=profile.name, model=spec.source or spec.architecture, kv=kv.value,
            weight_dtype=profile.weight_dtype.value, sink=sink, pinned=pinned, window=w, chunk=chunk,
            parameters=params, weights_bytes=weights, kv_bytes=kv_total,
            kv_bytes_per_token=layout.bytes_per_token, activation_bytes=act, vision_params=vision_params,
            vision_bytes=vision, image_tokens=image_tokens, runtime_overhead_bytes=profile.runtime_overhead_bytes, total_bytes=total,
            budget_bytes=profile.budget_bytes, fits=total <= profile.budget_bytes,
            max_window_by_positions=max(max_by_positions, 0),
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
    if not smallest.fits:
        short = smallest.total_bytes - profile.budget_bytes
        raise PlanError(
            f"{spec.source or spec.architecture} does not fit profile {profile.name}: even the smallest "
            f"window ({chunk} tokens) needs {smallest.total_bytes} bytes ({smallest.total_bytes / MIB:.1f} MiB) "
            f"but the budget is {profile.budget_bytes} bytes ({profile.budget_bytes / MIB:.1f} MiB): "
            f"{short} bytes ({short / MIB:.1f} MiB) missing; weights alone are {weights / MIB:.1f} MiB at "
            f"{profile.weight_dtype.value}. Use a smaller model, a smaller --kv/--chunk/--pinned, or a "
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

    rows = [
        (f"weights ({p.parameters / 1e6:.1f}M params at {p.weight_dtype})", p.weights_bytes),
        (f"KV cache ({p.sink}+{p.pinned}+{p.image_tokens}+{p.window} slots at {p.kv}, {p.kv_bytes_per_token} B/token)"
         if p.image_tokens else f"KV cache ({p.sink}+{p.pinned}+{p.window} slots at {p.kv}, {p.kv_bytes_per_token} B/token)",
         p.kv_bytes),
        (f"activations (chunk of {p.chunk})", p.activation_bytes),
        (f"vision tower ({p.vision_params / 1e6:.1f}M params)", p.vision_bytes),
        ("runtime overhead", p.runtime_overhead_bytes),
        ("total", p.total_bytes),
        (f"budget of {p.profile}", p.budget_bytes),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {mib(value)}" for name, value in rows]
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"{verdict}: window {p.window}, headroom {p.headroom_bytes / MIB:.1f} MiB")
    return "\n".join(lines)
