"""A model's configuration -> ModelSpec: the one place that reads hidden size, layers, heads,
head_dim, vocabulary, positions and biases out of a Hugging Face config. Standard library only.

    spec_from_config("config.json" or its folder)   the planner, without weights or torch
    spec_from_dict(config.to_dict(), where)         export/models.py: a loaded model, a .gguf's metadata

Both paths go through spec_from_dict, so `cabinlm plan` and `cabinlm export` accept and refuse the
same models and count the same numbers. A bare config.json may leave out keys that equal
transformers' defaults (LLaVA's text_config does); those defaults are filled in here.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path
from typing import Any, Callable, TypeVar

from cabinlm.contract.errors import ModelError
from cabinlm.contract.manifest import STATIC_ROPE_TYPES, SUPPORTED_ARCHITECTURES, SUPPORTED_VLM_ARCHITECTURES, ModelSpec

# Mirrors transformers' defaults for keys a config may leave out (LlamaConfig() / Qwen2Config(), 5.x):
# LLaVA-style text_config blocks often carry only the keys that differ from them.
_TEXT_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu"),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu"),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6, head_dim=128,
                  tie_word_embeddings=False, hidden_act="silu"),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, max_position_embeddings=131072, rms_norm_eps=1e-6, head_dim=128,
                    tie_word_embeddings=False, hidden_act="silu", sliding_window=4096),
    "phi3": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, hidden_act="silu"),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6),
}  # fmt: skip
# The MLP activation each family's decoder graph implements (config key hidden_act, or Gemma's hidden_activation).
_ACTIVATIONS = {"gemma3_text": "gelu_pytorch_tanh"}
# CLIPVisionConfig() defaults, for vision_config blocks that leave keys out.
_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, image_size=224,
                        patch_size=32, num_channels=3)  # fmt: skip


_F = TypeVar("_F", bound=Callable[..., Any])
# What reading a hostile config can raise from Python itself: a value of another type or out of float's
# range where a number belongs, a missing key, a nesting deeper than the interpreter's recursion.
_DATA_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, ZeroDivisionError,
                RecursionError)  # fmt: skip


def _one_line(where_arg: int | None = None) -> Callable[[_F], _F]:
    """A config reader whose data errors become one ModelError naming the file (argument where_arg of
    the call, when given) and the value: `cabinlm plan` and `cabinlm export` print a line, not a traceback."""

    def wrap(f: _F) -> _F:
        @functools.wraps(f)
        def run(*args, **kwargs):
            try:
                return f(*args, **kwargs)
            except _DATA_ERRORS as e:
                where = str(args[where_arg]) if where_arg is not None and len(args) > where_arg else "the model's config"
                raise ModelError(f"{where}: the config cannot be read ({type(e).__name__}: {str(e)[:200]})") from e

        return run  # type: ignore[return-value]

    return wrap


def read_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """A config.json (or the folder holding one) as a dict, and the file name for messages."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelError(f"{path}: no such file; pass a config.json or the model folder holding one") from e
    except (OSError, ValueError) as e:  # JSON and UTF-8 errors, and Python's limit on an integer's digits
        raise ModelError(f"{path}: cannot read it as JSON ({str(e)[:200]})") from e
    except RecursionError as e:
        raise ModelError(f"{path}: cannot read it as JSON (nested deeper than the parser goes)") from e
    if not isinstance(d, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return d, str(path)


# Vision-language families with multimodal RoPE (their own vision tower and position rule; export/qwen2_vl.py):
# transformers class -> (model_type, the text model's family as SUPPORTED_ARCHITECTURES names it).
MROPE_VLM_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2ForCausalLM"),
                           "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2ForCausalLM")}  # fmt: skip
# Idefics3 / SmolVLM: a SigLIP-style tower, pixel shuffle and a projection over a Llama text model
# (export/idefics3.py); transformers class -> model_type.
IDEFICS3_VLM_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "idefics3", "SmolVLMForConditionalGeneration": "smolvlm"}
# Vision-language families transformers has that cabinlm does not export (yet): refused by name.
_OTHER_VLM_TYPES = {"gemma3": "Gemma 3 (vision)", "mllama": "Llama 3.2 Vision", "paligemma": "PaliGemma",
                    "qwen3_vl": "Qwen3-VL", "llava_next": "LLaVA-NeXT", "llava_onevision": "LLaVA-OneVision",
                    "idefics2": "Idefics2", "internvl": "InternVL", "phi4_multimodal": "Phi-4 multimodal"}  # fmt: skip


def is_vlm(d: dict[str, Any]) -> bool:
    """A supported vision-language config: its decoder is the text model in `text_config` (LLaVA-style,
    or a multimodal-RoPE family: mrope_family)."""
    archs = d.get("architectures") or []
    return (any(a in SUPPORTED_VLM_ARCHITECTURES for a in archs) or d.get("model_type", "") == "llava"
            or mrope_family(d) is not None or idefics3_family(d) is not None)  # fmt: skip


def idefics3_family(d: dict[str, Any]) -> str | None:
    """The Idefics3-style family's transformers class (Idefics3, SmolVLM), or None."""
    archs = d.get("architectures") or []
    by_type = {t: a for a, t in IDEFICS3_VLM_ARCHITECTURES.items()}
    return next((a for a in archs if a in IDEFICS3_VLM_ARCHITECTURES), None) or by_type.get(d.get("model_type", ""))


def mrope_family(d: dict[str, Any]) -> str | None:
    """The multimodal-RoPE family's transformers class (Qwen2-VL), or None."""
    archs = d.get("architectures") or []
    by_type = {t: a for a, (t, _) in MROPE_VLM_ARCHITECTURES.items()}
    return next((a for a in archs if a in MROPE_VLM_ARCHITECTURES), None) or by_type.get(d.get("model_type", ""))


def _refuse_other_vlm(d: dict[str, Any], where: str) -> None:
    """A vision-language family cabinlm does not export: one line naming it and what is supported."""
    kind = d.get("model_type", "")
    name = _OTHER_VLM_TYPES.get(kind)
    if name is None and isinstance(d.get("vision_config"), dict):
        name = ", ".join(d.get("architectures") or []) or kind or "unknown"
    if name is not None:
        raise ModelError(
            f"{where}: {name} is a vision-language family cabinlm does not export; supported: "
            f"{', '.join([*SUPPORTED_VLM_ARCHITECTURES, *MROPE_VLM_ARCHITECTURES, *IDEFICS3_VLM_ARCHITECTURES])} (over one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def spec_from_config(path: str | Path) -> ModelSpec:
    """ModelSpec from a bare config.json (or its folder): a SUPPORTED_ARCHITECTURES text model, or a VLM's text_config."""
    d, where = read_config(path)
    return spec_from_dict(d, where)


def _architecture(c: dict[str, Any], where: str) -> str:
    archs = c.get("architectures") or []
    model_type = c.get("model_type", "")
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) or by_type.get(model_type)
    if arch is None:
        found = ", ".join(archs) or model_type or "unknown"
        raise ModelError(
            f"{where}: architecture {found} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama family: SmolLM2, TinyLlama, Llama 3.x; Qwen2/Qwen2.5; Qwen3; "
            "Mistral; Phi-3 without long-context RoPE; Gemma 3 text), "
            f"and {', '.join([*SUPPORTED_VLM_ARCHITECTURES, *MROPE_VLM_ARCHITECTURES, *IDEFICS3_VLM_ARCHITECTURES])} "
            "over one of them"
        )
    return arch


@_one_line(where_arg=1)
def spec_from_dict(d: dict[str, Any], where: str) -> ModelSpec:
    """ModelSpec from a config as a dict (a parsed config.json, or transformers' config.to_dict()).
    Refuses what the decoder graph cannot express, with the reason."""
    c, source = d, where
    if not is_vlm(d):
        _refuse_other_vlm(d, where)
    if is_vlm(d):
        c, where = d.get("text_config"), f"{where} (text model)"
        if not isinstance(c, dict):
            raise ModelError(f"{where}: a LLaVA-style config needs a text_config block")
        family = mrope_family(d)
        if family is not None:  # Qwen2-VL's text model is Qwen2's decoder (q/k/v biases) with M-RoPE positions
            c = {**c, "architectures": [MROPE_VLM_ARCHITECTURES[family][1]],
                 "model_type": SUPPORTED_ARCHITECTURES[MROPE_VLM_ARCHITECTURES[family][1]]}  # fmt: skip
    arch = _architecture(c, where)
    # a VLM's tie flag may sit at the top level rather than in its text_config
    tied = c.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
    c = {**_TEXT_DEFAULTS[SUPPORTED_ARCHITECTURES[arch]], **c}

    def num(key: str) -> int:
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(f"{where}: {key} = {v!r} is not a positive integer")
        return v

    family = SUPPORTED_ARCHITECTURES[arch]
    act, wanted = c.get("hidden_activation") or c.get("hidden_act"), _ACTIVATIONS.get(family, "silu")
    if act != wanted:
        raise ModelError(f"{where}: hidden activation {act!r} is not supported ({family}'s decoder graph implements {wanted!r})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:  # Gemma 2 has them; Gemma 3 does not
            raise ModelError(f"{where}: {key} = {c[key]} (logit soft-capping) is not supported")
    if c.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and c.get("attention_bias")):
        # The decoder carries q/k/v biases (Qwen2) but no output-projection or MLP biases.
        raise ModelError(
            f"{where}: {family} variants with attention_bias / mlp_bias (o_proj or MLP biases) are not supported"
        )
    heads = num("num_attention_heads")
    kv_heads = num("num_key_value_heads") if c.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise ModelError(f"{where}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelError(f"{where}: rope_scaling must be an object such as {{\"rope_type\": \"linear\", \"factor\": 2.0}} "
                         f"or null, got {rope!r}"[:300])
    eps = c.get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and 0 < eps < 1):
        raise ModelError(f"{where}: rms_norm_eps = {eps!r} is not a small positive number")
    # Gemma 3 keeps one RoPE block per kind of layer ({"sliding_attention": {...}, "full_attention": {...}})
    for params in [v for v in rope.values() if isinstance(v, dict)] or [rope]:
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in STATIC_ROPE_TYPES:
            # Phi-3's long-context checkpoints ("longrope", formerly "su") switch their frequency tables at
            # original_max_position_embeddings: a fixed-shape graph holds one table.
            raise ModelError(
                f"{where}: RoPE type {rope_type!r} depends on the sequence length and cannot be baked into a "
                f"fixed-shape graph; supported: {', '.join(sorted(STATIC_ROPE_TYPES))}"
            )
        for partial in (params.get("partial_rotary_factor"), c.get("partial_rotary_factor")):  # either place counts
            if partial is not None and (isinstance(partial, bool) or not isinstance(partial, (int, float))):
                raise ModelError(f"{where}: partial_rotary_factor = {partial!r} is not a number")
            if partial is not None and float(partial) != 1.0:
                raise ModelError(f"{where}: partial_rotary_factor {partial} (RoPE over part of each head) is not supported")
    local = local_layers(c)
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
        qkv_bias=arch == "Qwen2ForCausalLM",  # Qwen2 always has q/k/v biases; the others' are refused above
        tie_embeddings=bool(tied),
        source=source,
        local_layers=local,
        sliding_window=int(c["sliding_window"]) if local else 0,
        **_family_facts(family, c),
    )


def _family_facts(family: str, c: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec's activation / embed_scale / attention_scale / sandwich_norms for a family."""
    if family != "gemma3_text":
        return {}
    # transformers multiplies the rows by hidden_size ** 0.5 held as a float32 tensor
    embed_scale = struct.unpack("f", struct.pack("f", float(c["hidden_size"]) ** 0.5))[0]
    return {"activation": "gelu_tanh", "embed_scale": embed_scale, "sandwich_norms": True,
            "attention_scale": float(c["query_pre_attn_scalar"]) ** -0.5}  # fmt: skip


def layer_types(c: dict[str, Any]) -> list[str]:
    """Each layer's attention kind ("sliding_attention" / "full_attention") from a text config: its
    `layer_types`, or what older configs say instead (Qwen's use_sliding_window + max_window_layers,
    Gemma 3's sliding_window_pattern: every n-th layer global), or full attention everywhere."""
    types = c.get("layer_types")
    n = int(c.get("num_hidden_layers", len(types) if isinstance(types, list) else 0))
    if isinstance(types, list) and len(types) == n:
        return [str(t) for t in types]
    if c.get("model_type") == "gemma3_text":
        pattern = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if c.get("model_type") in ("qwen2", "qwen3"):  # older configs: layers max_window_layers.. slide when use_sliding_window
        first = int(c.get("max_window_layers", 0))
        return ["sliding_attention" if c.get("use_sliding_window") and i >= first else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def local_layers(c: dict[str, Any]) -> tuple[int, ...]:
    """The layers with their own sliding window when the model mixes them with full-attention layers
    (Gemma 3, Qwen with max_window_layers): those get per-layer cache geometry. A model whose every
    layer slides (Mistral, Phi-3) is one attention window for the whole graph (check_attention_window)."""
    if c.get("sliding_window") is None:
        return ()
    types = layer_types(c)
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return local if len(local) < len(types) else ()


def attention_window(d: dict[str, Any]) -> int | None:
    """The whole model's own sliding attention window (how many keys, itself included, a query sees), or
    None. Mistral and Phi-3 slide every layer when `sliding_window` is set (None: full attention);
    Qwen2, Qwen3 and Gemma 3 only the layers `layer_types` (or what older configs say) mark
    "sliding_attention": None when none or only some of them slide (the latter get per-layer cache
    geometry, local_layers), the window when all of them do."""
    c = d.get("text_config") if is_vlm(d) else d
    if not isinstance(c, dict):
        return None
    window = c.get("sliding_window", _TEXT_DEFAULTS["mistral"]["sliding_window"] if c.get("model_type") == "mistral" else None)
    if window is None:
        return None
    if c.get("model_type") in ("qwen2", "qwen3", "gemma3_text") or any(a.startswith("Qwen") for a in c.get("architectures") or []):
        types = layer_types(c)
        if "sliding_attention" not in types or "full_attention" in types:
            return None  # full attention, or a mix: per-layer cache geometry (local_layers) follows the model
    return int(window)


@_one_line(where_arg=1)
def check_attention_window(d: dict[str, Any], where: str, keys: int) -> None:
    """Refuse a model whose own sliding window is shorter than the keys one query of the exported graph
    attends to (slots + chunk: the whole cache and the chunk). Such a model attends to fewer tokens
    than the graph would even while the stream fits the cache, so the export would not be the model.
    A window at least that long (or None) is full attention for every query the graph can run: the
    graph's own sink + rolling window is then the only limit, as for Llama."""
    window = attention_window(d)
    if window is not None and window < keys:
        raise ModelError(
            f"{where}: the model's sliding_window {window} is shorter than the {keys} tokens one query attends "
            f"to in this cache (slots + chunk); export a cache of at most {window} (sink + pinned + window + chunk)"
        )


@_one_line(where_arg=0)
def vision_params_from_config(path: str | Path) -> int:
    """Parameter estimate of a LLaVA-style vision tower + projector (0 when the config has none).

    CLIP/SigLIP ViT with hidden h, MLP i, L layers, patch p, image s, c channels, n = (s/p)^2 patches:
        patch embedding c*p*p*h (+h bias) + position embeddings (n+1)*h + class token h + 2 LayerNorms
        + L * (4*(h*h + h) attention + 2*2h LayerNorms + h*i + i + i*h + h MLP)
    plus LLaVA's projector Linear(h, D) + GELU + Linear(D, D), with biases, D = text hidden size.
    Within ~1% of the real towers (CLIP ViT-L/14-336: 303.5M); other tower families differ.
    """
    d, where = read_config(path)
    v = d.get("vision_config")
    if not isinstance(v, dict):
        return 0
    if mrope_family(d) is not None:
        return _qwen2_vl_vision_params(v, where)
    if idefics3_family(d) is not None:
        return _idefics3_vision_params(d, v, where)
    v = {**_VISION_DEFAULTS, **v}
    try:
        h, i, layers = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])
        p, s, ch = int(v["patch_size"]), int(v["image_size"]), int(v["num_channels"])
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: vision_config has a non-integer size ({e})") from e
    n = (s // p) ** 2
    embed = ch * p * p * h + h + (n + 1) * h + h + 2 * 2 * h
    layer = 4 * (h * h + h) + 2 * 2 * h + (h * i + i) + (i * h + h)
    text = d["text_config"] if isinstance(d.get("text_config"), dict) else d
    text_hidden = int(text.get("hidden_size", _TEXT_DEFAULTS["llama"]["hidden_size"]))
    projector = (h * text_hidden + text_hidden) + (text_hidden * text_hidden + text_hidden)
    return embed + layers * layer + projector


@_one_line(where_arg=0)
def image_tokens_from_config(path: str | Path, frame: tuple[int, int] | None = None) -> int:
    """Cache slots one camera frame takes (the image region): (image / patch)^2 patch tokens, plus
    the CLS token unless LLaVA's "default" feature strategy drops it (0 when there is no vision).
    Qwen2-VL: the merged patch grid of a frame of `frame` (height, width) pixels (default: the size
    its processor keeps nearest to a 640x480 camera frame), read with the folder's image processor.
    Idefics3 / SmolVLM: (max_image_size / patch)^2 / scale_factor^2 (the processor without image
    splitting)."""
    d, where = read_config(path)
    v = d.get("vision_config")
    if not isinstance(v, dict):
        return 0
    if mrope_family(d) is not None:
        from cabinlm.source.processor import read_qwen2_vl_processor  # the export's own reading (stdlib)

        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return read_qwen2_vl_processor(folder, frame, v).image_tokens
    if idefics3_family(d) is not None:
        from cabinlm.source.processor import read_idefics3_processor  # the export's own reading (stdlib)

        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return read_idefics3_processor(folder, {**_IDEFICS3_VISION_DEFAULTS, **v}, d.get("scale_factor", 2), frame).image_tokens
    v = {**_VISION_DEFAULTS, **v}
    patches = (int(v["image_size"]) // int(v["patch_size"])) ** 2
    has_cls = v.get("model_type", "clip_vision_model") != "siglip_vision_model"
    keep_cls = has_cls and d.get("vision_feature_select_strategy", "default") != "default"
    return patches + int(keep_cls)


def _qwen2_vl_vision_params(v: dict[str, Any], where: str) -> int:
    """Qwen2-VL's tower: patch embedding 3*T*p*p*E (no bias), depth x (2 LayerNorms, qkv and proj with
    biases, MLP E -> r*E -> E with biases), the merger (LayerNorm, Linear(E m^2, E m^2), Linear(E m^2, D)).
    Qwen2-VL-2B's tower (embed 1280, depth 32, D 1536) counts 665M. Qwen2.5-VL's (its vision_config
    has out_hidden_size): RMSNorms (E each), a gated MLP E -> I -> E with biases on all three."""
    try:
        qwen25 = "out_hidden_size" in v
        E = int(v.get("hidden_size", 1280) if qwen25 else v.get("embed_dim", 1280))
        layers, ratio = int(v.get("depth", 32)), int(v.get("mlp_ratio", 4))
        p, T, m = int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2)), int(v.get("spatial_merge_size", 2))
        D = int(v.get("out_hidden_size", 3584)) if qwen25 else int(v.get("hidden_size", 3584))
        inter = int(v.get("intermediate_size", 3420)) if qwen25 else ratio * E
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: vision_config has a non-integer size ({e})") from e
    norms = 2 * E if qwen25 else 2 * 2 * E
    mlp = 3 * E * inter + 2 * inter + E if qwen25 else (E * inter + inter) + (inter * E + E)
    block = norms + (3 * E * E + 3 * E) + (E * E + E) + mlp
    wide = E * m * m
    return 3 * T * p * p * E + layers * block + (E if qwen25 else 2 * E) + (wide * wide + wide) + (wide * D + D)


# Idefics3VisionConfig() defaults (transformers 5), for vision_config blocks that leave keys out.
_IDEFICS3_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, image_size=224,
                                 patch_size=32, num_channels=3)  # fmt: skip


def _idefics3_vision_params(d: dict[str, Any], v: dict[str, Any], where: str) -> int:
    """Idefics3's / SmolVLM's tower: a SigLIP encoder (patch embedding c*p*p*h + h, (s/p)^2 position
    rows, L x (4 (h*h + h) attention + 2 LayerNorms 2*2h + MLP h*i + i + i*h + h), the post LayerNorm
    2h) and the connector's projection Linear(h r^2, D) without bias, r = scale_factor."""
    v = {**_IDEFICS3_VISION_DEFAULTS, **v}
    try:
        h, i, layers = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])
        p, s, ch, r = int(v["patch_size"]), int(v["image_size"]), int(v["num_channels"]), int(d.get("scale_factor", 2))
        text = d["text_config"] if isinstance(d.get("text_config"), dict) else {}
        D = int(text.get("hidden_size", _TEXT_DEFAULTS["llama"]["hidden_size"]))
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: vision_config has a non-integer size ({e})") from e
    embed = ch * p * p * h + h + (s // p) ** 2 * h
    layer = 4 * (h * h + h) + 2 * 2 * h + (h * i + i) + (i * h + h)
    return embed + layers * layer + 2 * h + h * r * r * D
