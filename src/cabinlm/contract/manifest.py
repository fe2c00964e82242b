"""The artifact manifest: the only contract between export, build and runtime.

Standard library only, so that every stage (and every tool that inspects an artifact) can read it.

    out/
      manifest.json        this file's Manifest, versioned
      decoder.onnx         the fixed-shape decoder graph (io = decoder_io(...))
      decoder.onnx.data    its weights (ONNX external data)
      tokenizer.json       a `tokenizers` file

`CacheLayout` (cabinlm.contract.layout) owns the cache geometry; `decoder_io` (cabinlm.contract.io_spec) declares the
graph's inputs and outputs; this module ties them to files, versions and checks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cabinlm.contract.adapters import SwitchableLora, adapter_role, target_shapes
from cabinlm.contract.errors import LayoutError, ManifestError
from cabinlm.contract.files import FileEntry, FileRole, file_sha256  # noqa: F401 - re-exported
from cabinlm.contract.io_spec import (  # noqa: F401 - re-exported: the manifest is where users look for the contract
    ATTENTION_BIAS,
    ATTENTION_MASK,
    CACHE_POSITION_IDS,
    CACHED_KEY_ROPE_PARTS,
    IMAGE_EMBEDS,
    IMAGE_MASK,
    INPUT_IDS,
    LOCAL_ATTENTION_BIAS,
    LOCAL_ATTENTION_MASK,
    LOCAL_CACHE_POSITION_IDS,
    LOCAL_POSITION_IDS,
    LOCAL_ROPE_COS,
    LOCAL_ROPE_SIN,
    LOCAL_SEQLENS_K,
    LOCAL_TOTAL_SEQUENCE_LENGTH,
    LOGIT_ROWS,
    LOGITS,
    POSITION_IDS,
    REFRESH_COS,
    REFRESH_KEYS,
    REFRESH_POSITION_IDS,
    REFRESH_SIN,
    REFRESH_SOURCE,
    ROPE_COS,
    ROPE_SIN,
    SEQLENS_K,
    TOTAL_SEQUENCE_LENGTH,
    DecoderIO,
    DecoderShape,
    TensorSpec,
    cached_key_rope,
    chunk_key_rope,
    decoder_io,
    fused_decoder_io,
    key_cache_name,
    lora_a_name,
    lora_b_name,
    new_key_name,
    new_key_source_name,
    new_value_name,
    new_value_scale_name,
    present_key_name,
    present_value_name,
    qkv_name,
    query_rope,
    value_cache_name,
    value_scale_name,
    weight_name,
)
from cabinlm.contract.buildspec import BuildSpec
from cabinlm.contract.layout import CacheLayout, KVDType  # noqa: F401 - re-exported
from cabinlm.contract.vision_spec import ImagePreprocess, VisionSpec  # noqa: F401 - re-exported

# 2: logit_rows input, block-quantized weights; 3: "attention" (fused cpu builds); 4: the build as
# typed data ("build"), RoPE tables and KV scales in the manifest (no build.json or key_scales.json
# read by the runtime)
FORMAT_VERSION = 4
SUPPORTED_VERSIONS = (4,)
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few hundred kB (KV scales included)
# What a calibrated KV scale can be (export/kvquant.py writes them): at least the smallest fp16
# subnormal (an all-zero channel's floor), at most the largest finite fp16 (a scale is stored as fp16).
KV_SCALE_RANGE = (2.0**-24, 65504.0)
# A RoPE table's inverse frequencies are base ** (-2i / head_dim) (1 for i = 0, smaller after), divided
# by a scaling factor where one applies; its cos / sin factor (YaRN's attention factor) is near 1.
MAX_ROPE_SCALE = 16.0
# RoPE variants whose inverse frequencies do not depend on the sequence length, so that a
# fixed-shape graph can hold them as constants (the exporter and the planner both check this).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# transformers class -> model_type. All are "Llama-like": RMSNorm, RoPE, GQA, gated MLP; Qwen2 adds q/k/v
# biases, Qwen3 RMSNorms of q and k per head, Phi-3 fuses q|k|v and gate|up (as the graph does anyway),
# Gemma 3 adds sandwich norms, GELU-tanh, scaled embeddings and local sliding-window layers.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
                           "Gemma3ForCausalLM": "gemma3_text"}  # fmt: skip
# Vision-language: a CLIP or SigLIP tower + projector in front of one of the text models above.
SUPPORTED_VLM_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava"}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of the exported decoder."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_embeddings: bool
    source: str = ""
    # Layers whose model attends within a sliding window of `sliding_window` tokens (itself included)
    # while the others attend to everything (Gemma 3's local layers); () when every layer is alike.
    local_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    # Family facts the graph bakes in and a build re-emitting the decoder needs (Gemma 3's differ):
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # the token table's rows are multiplied by this (Gemma 3: sqrt(hidden), in float32)
    attention_scale: float = 0.0  # the softmax scale on q.k (0: 1 / sqrt(head_dim))
    sandwich_norms: bool = False  # the attention and MLP outputs are RMS-normed before their residual adds

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"model.activation must be silu or gelu_tanh, got {self.activation!r}")
        for name in ("embed_scale", "attention_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:
                raise ValueError(f"model.{name} must be a non-negative number, got {v!r}")
        if isinstance(self.local_layers, list):  # from JSON
            object.__setattr__(self, "local_layers", tuple(self.local_layers))
        if any(type(i) is not int or not 0 <= i < self.num_layers for i in self.local_layers) or (
                type(self.sliding_window) is not int or self.sliding_window < 0 or bool(self.local_layers) != bool(self.sliding_window)):  # fmt: skip
            raise ValueError(f"model.local_layers {list(self.local_layers)!r} / sliding_window {self.sliding_window!r}: "
                             "layer indices below num_layers with a positive window, or neither")  # fmt: skip
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size", "max_positions"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or not 0 < value < 1 << 31:
                raise ValueError(f"model.{name} must be a positive whole number, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not isinstance(self.rms_norm_eps, (int, float)) or isinstance(self.rms_norm_eps, bool) or not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"model.rms_norm_eps must be a small positive number, got {self.rms_norm_eps!r}")
        if not isinstance(self.qkv_bias, bool) or not isinstance(self.tie_embeddings, bool):
            raise ValueError("model.qkv_bias and model.tie_embeddings must be true or false")

    def local_geometry(self, keys: int) -> dict[str, Any]:
        """CacheLayout's local_window / local_layers for a cache whose queries attend to `keys` tokens
        (slots + chunk): the local layers get their own ring when their window is shorter than that
        (else every query of the graph already sees only tokens the model lets it see, and one slot
        map serves all layers)."""
        if self.local_layers and self.sliding_window < keys:
            return {"local_window": self.sliding_window, "local_layers": self.local_layers}
        return {"local_window": 0, "local_layers": ()}


# The tool list's default wording, for models whose template renders no tools: the Hermes convention
# (the one Qwen2.5's template writes), which small instruct models read best.
DEFAULT_TOOLS_PREFIX = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
DEFAULT_TOOLS_SUFFIX = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call>"
)


# Llama 3.1's own words for its JSON calls (its template writes them when tools go in the system message).
LLAMA3_TOOLS_PREFIX = (
    "\n\nYou have access to the following functions. To call a function, please respond with JSON for a "
    "function call. Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name "
    "and its value}. Do not use variables.\n\n"
)
TOOL_CALL_STYLES = ("hermes", "llama3-json", "mistral")


@dataclass(frozen=True)
class ChatTemplate:
    """Chat-template pieces resolved at export, so that the runtime needs no jinja.

    A dialogue renders as
        system_prefix + SYSTEM + system_suffix
        user_prefix + USER + user_suffix + assistant_prefix + REPLY + assistant_suffix   (per turn)
    """

    system_prefix: str
    system_suffix: str
    user_prefix: str
    user_suffix: str
    assistant_prefix: str
    assistant_suffix: str
    default_system: str | None = None
    source: str = "model"  # "model" (rendered from the model's template) or "plain" (fallback)
    bos: str = ""  # fed once, pinned, before anything else: the tokenizer's BOS the template does not render
    # a user turn that opens with a camera frame, where the template renders it otherwise than
    # user_prefix (SmolVLM: "User:" before the image, "User: " before text); None: user_prefix
    image_user_prefix: str | None = None
    # Function calling (runtime/tools.py). The tool list joins the system prompt as
    #     SYSTEM + tools_prefix + TOOL_JSON (+ tools_separator + TOOL_JSON)* + tools_suffix
    # and the model writes its calls in its family's convention, tool_call_style: "hermes"
    # (<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>) or "llama3-json" ({"name": ...,
    # "parameters": {...}}) or "mistral" ([TOOL_CALLS] [{...}], control-token markers). tools_source: "model" (cut from the model's own template rendered with
    # tools: Qwen2.5, Qwen3) or "default" (these pieces, in the style's words). A tool result's turn:
    # tool_result_prefix + RESULTS + tool_result_suffix + assistant_prefix where the template gives
    # tool results a turn of their own (Llama's "ipython"); None: a user turn.
    tools_prefix: str = DEFAULT_TOOLS_PREFIX
    tools_separator: str = "\n"
    tools_suffix: str = DEFAULT_TOOLS_SUFFIX
    tools_source: str = "default"
    tool_call_style: str = "hermes"
    tool_result_prefix: str | None = None
    tool_result_suffix: str | None = None

    def __post_init__(self) -> None:
        if self.tools_source not in ("model", "default"):
            raise ValueError(f"chat.tools_source must be 'model' or 'default', got {self.tools_source!r}")
        if self.tool_call_style not in TOOL_CALL_STYLES:
            raise ValueError(f"chat.tool_call_style {self.tool_call_style!r} is not one this runtime writes "
                             f"({', '.join(TOOL_CALL_STYLES)})")  # fmt: skip
        if (self.tool_result_prefix is None) != (self.tool_result_suffix is None):
            raise ValueError("chat.tool_result_prefix and tool_result_suffix are given together or not at all")


@dataclass(frozen=True)
class RotaryTables:
    """The exported graph's RoPE: inverse frequencies (any static scaling applied) and the factor on
    cos and sin. Backends that rotate outside the graph (the fused build's cache) compute from these."""

    inv_freq: tuple[float, ...]  # (head_dim / 2,)
    scale: float = 1.0
    # the local layers' own RoPE (Gemma 3: base 10k where the global layers use 1M); () = inv_freq
    local_inv_freq: tuple[float, ...] = ()
    local_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("inv_freq", "local_inv_freq"):
            table = getattr(self, name)
            if not isinstance(table, (list, tuple)) or not all(_is_number(f) for f in table):
                raise ValueError(f"rotary.{name} must be a list of numbers")
            object.__setattr__(self, name, tuple(float(f) for f in table))
            if not all(0 < f <= 1 for f in getattr(self, name)):  # also refuses NaN and infinities
                bad = next(f for f in getattr(self, name) if not 0 < f <= 1)
                raise ValueError(f"rotary.{name} holds {bad!r}: an inverse frequency is in (0, 1] (base ** (-2i / "
                                 "head_dim), divided by any scaling factor)")
        for name in ("scale", "local_scale"):
            v = getattr(self, name)
            if not _is_number(v) or not 0 < v <= MAX_ROPE_SCALE:
                raise ValueError(f"rotary.{name} must be a number in (0, {MAX_ROPE_SCALE:g}], got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.local_inv_freq and len(self.local_inv_freq) != len(self.inv_freq):
            raise ValueError("rotary.local_inv_freq must have as many frequencies as inv_freq")

    def for_layer(self, local: bool) -> tuple[tuple[float, ...], float]:
        """(inverse frequencies, cos/sin factor) of a local or a global layer."""
        if local and self.local_inv_freq:
            return self.local_inv_freq, self.local_scale
        return self.inv_freq, self.scale


def _is_number(v: Any) -> bool:
    """A JSON number (not a bool, not a string that float() would read)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_channel(name: str, table, layout: CacheLayout) -> tuple:
    """A (layers, kv_heads, head_dim) table of scales in KV_SCALE_RANGE, as nested tuples."""
    shape = (layout.layers, layout.kv_heads, layout.head_dim)
    try:
        if not all(_is_number(x) for layer in table for head in layer for x in head):
            raise TypeError("not numbers")
        rows = tuple(tuple(tuple(float(x) for x in head) for head in layer) for layer in table)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"kv_scales.{name}: not a (layers, kv_heads, head_dim) table of numbers") from e
    if (len(rows), *{len(r) for r in rows}, *{len(h) for r in rows for h in r}) != shape:
        raise ValueError(f"kv_scales.{name}: expected shape {shape}")
    low, high = KV_SCALE_RANGE
    for i, r in enumerate(rows):
        for j, h in enumerate(r):
            bad = next((x for x in h if not low <= x <= high), None)  # also refuses NaN
            if bad is not None:
                raise ValueError(f"kv_scales.{name}[{i}][{j}] holds {bad!r}; a calibrated scale is a number in "
                                 f"[{low:g}, {high:g}] (positive, and an fp16)")
    return rows


@dataclass(frozen=True)
class KVScales:
    """Int8 / fp8 KV calibration, (layers, kv_heads, head_dim) each (x = q * scale):

    keys          per channel, un-rotated keys: the exported graph holds them as constants
    rotated_keys  per rotation pair (the two channels a rotation mixes share one), with headroom:
                  caches that hold keys rotated (the fused build)
    values        per channel: engines with static value scales (the fused build); the exported
                  graph quantizes values per token instead
    """

    keys: tuple
    rotated_keys: tuple
    values: tuple

    def check(self, layout: CacheLayout) -> KVScales:
        return KVScales(*(_per_channel(n, getattr(self, n), layout) for n in ("keys", "rotated_keys", "values")))

    def array(self, name: str):
        """One table as a float32 numpy array (imports numpy: runtime and build side only)."""
        import numpy as np

        return np.asarray(getattr(self, name), dtype=np.float32)


@dataclass
class Quality:
    """What the export measured and checked, and what a build measured: one section each. A
    section's contents are its measuring code's report (a JSON object); the sections are fixed."""

    kv: str | None = None  # the KV precision the export's quality gate measured
    calibration: dict[str, Any] | None = None  # the KV scales' calibration: its text, tokens, ids_sha256
    weights: dict[str, Any] | None = None  # the weights' format and source (imported GGUF blocks, the head)
    lora: dict[str, Any] | None = None  # an adapter merged at export (export/lora.py)
    gate: dict[str, Any] | None = None  # the quality gate: perplexity with the export's KV against fp32 KV
    dense_check: dict[str, Any] | None = None  # --verify: the graph against transformers
    build: dict[str, Any] | None = None  # a build's own figures (engines/output.py)

    def __post_init__(self) -> None:
        if self.kv is not None and not isinstance(self.kv, str):
            raise TypeError("quality.kv must be text or null")
        for f in dataclasses.fields(self):
            if f.name != "kv" and getattr(self, f.name) is not None and not isinstance(getattr(self, f.name), dict):
                raise TypeError(f"quality.{f.name} must be an object or null")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Any) -> Quality:
        if not isinstance(d, dict):
            raise TypeError("quality must be an object")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"quality has no section {sorted(unknown)[0]!r}")
        return cls(**d)


@dataclass(frozen=True)
class Target:
    """What the artifact was made for: the device profile it was exported or built for, the memory
    plan an export for that profile followed (profiles/planner.py's, as written), and for a build the
    export folder it was built from."""

    profile: str | None = None
    plan: dict[str, Any] | None = None
    built_from: str | None = None  # a build: the export folder, resolved when it was built

    def __post_init__(self) -> None:
        for name in ("profile", "built_from"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"target.{name} must be text or null")
        if self.plan is not None and not isinstance(self.plan, dict):
            raise TypeError("target.plan must be an object or null")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Any) -> Target | None:
        if d is None:
            return None
        if not isinstance(d, dict) or not set(d) <= {"profile", "plan", "built_from"}:
            raise TypeError("target must be an object with profile, plan, built_from")
        return cls(**d)


@dataclass
class Manifest:
    model: ModelSpec
    cache: CacheLayout
    chat: ChatTemplate
    stop_ids: list[int]
    files: dict[str, FileEntry]  # role -> file: "graph", "graph_data", "tokenizer"
    opset: int
    rope_inv_freq_source: str = "config"
    quality: Quality = field(default_factory=Quality)
    index_dtype: str = "int64"  # of input_ids / position_ids / cache_position_ids
    target: Target | None = None  # what it was exported or built for (None: a plain export for no profile)
    vision: VisionSpec | None = None  # vision-language models only
    weights: str = "fp32"  # fp32, int8 or int4 (blocks of 32; see export/wquant.py)
    rotary: RotaryTables | None = None
    kv_scales: KVScales | None = None  # int8 / fp8 KV
    build: BuildSpec | None = None  # None: a plain export (see runtime_spec)
    lora: SwitchableLora | None = None  # switchable LoRA adapter inputs (export --lora-rank), and a build's adapters
    format_version: int = FORMAT_VERSION
    cabinlm_version: str = ""

    @property
    def runtime_spec(self) -> BuildSpec:
        """How this artifact runs: its build, or for a plain export the exported graph on the CPU."""
        return self.build if self.build is not None else BuildSpec.for_export()

    @property
    def io(self) -> DecoderIO:
        """The graph contract of what runs: the build's engine facts say it (EngineFacts.decoder_io);
        a plain export, or a build whose engine records no facts, runs the exported graph."""
        shape = DecoderShape(self.cache, self.model.num_heads, self.model.vocab_size, self.index_dtype,
                             self.vision.embed_dim if self.vision else 0, mrope=self.vision is not None and self.vision.mrope,
                             lora=self.lora.inputs(self.model.num_layers, self.lora_shapes) if self.lora else ())
        facts = self.runtime_spec.facts
        return facts.decoder_io(shape) if facts is not None else shape.exported()

    @property
    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each projection an adapter input can target (contract/adapters.py)."""
        m = self.model
        return target_shapes(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "cabinlm_version": self.cabinlm_version,
            "model": dataclasses.asdict(self.model),
            "cache": self.cache.to_dict(),
            "io": self.io.to_dict(),
            "chat": dataclasses.asdict(self.chat),
            "stop_ids": list(self.stop_ids),
            "files": {k: dataclasses.asdict(v) for k, v in self.files.items()},
            "opset": self.opset,
            "rope_inv_freq_source": self.rope_inv_freq_source,
            "quality": self.quality.to_dict(),
            "index_dtype": self.index_dtype,
            "target": self.target.to_dict() if self.target is not None else None,
            "vision": dataclasses.asdict(self.vision) if self.vision else None,
            "weights": self.weights,
            "rotary": dataclasses.asdict(self.rotary) if self.rotary else None,
            "kv_scales": dataclasses.asdict(self.kv_scales) if self.kv_scales else None,
            "build": self.build.to_dict() if self.build else None,
            "lora": self.lora.to_dict() if self.lora else None,
        }

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = MANIFEST_NAME) -> Manifest:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object at the top level")
        version = d.get("format_version")
        if version not in SUPPORTED_VERSIONS:
            built = isinstance(d.get("target"), dict) and "built_from" in d["target"]
            again = "run `cabinlm export` and then `cabinlm build` again" if built else "run `cabinlm export` again"
            raise ManifestError(
                f"{where}: format_version {version!r} is not supported by this cabinlm "
                f"(supports {', '.join(map(str, SUPPORTED_VERSIONS))}); the artifact comes from another cabinlm "
                f"version: {again}"
            )
        try:
            cache = CacheLayout(**d["cache"])
            m = cls(
                model=ModelSpec(**d["model"]),
                cache=cache,
                chat=ChatTemplate(**d["chat"]),
                stop_ids=_stop_ids(d["stop_ids"], d["model"]),
                files={k: FileEntry(**v) for k, v in d["files"].items()},
                opset=int(d["opset"]),
                rope_inv_freq_source=str(d["rope_inv_freq_source"]),
                quality=Quality.from_dict(d["quality"]),
                index_dtype=str(d["index_dtype"]),
                target=Target.from_dict(d["target"]),
                vision=VisionSpec(**d["vision"]) if d["vision"] else None,
                weights=str(d["weights"]),
                rotary=RotaryTables(**d["rotary"]) if d["rotary"] is not None else None,
                kv_scales=KVScales(**d["kv_scales"]).check(cache) if d["kv_scales"] is not None else None,
                build=BuildSpec.from_dict(d["build"]) if d["build"] is not None else None,
                lora=SwitchableLora(**d["lora"]) if d.get("lora") else None,
                format_version=version,
                cabinlm_version=str(d["cabinlm_version"]),
            )
        except KeyError as e:
            raise ManifestError(f"{where}: missing field {e.args[0]!r}; the file is incomplete, re-export") from e
        except LayoutError as e:
            raise ManifestError(f"{where}: {e}") from e
        except (TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:  # a field of the wrong type or shape
            raise ManifestError(f"{where}: invalid content ({e}); re-export the model") from e
        if "io" not in d:
            raise ManifestError(f"{where}: missing field 'io'; the file is incomplete, re-export")
        if d["io"] != m.io.to_dict():
            raise ManifestError(
                f"{where}: the declared graph I/O does not match the cache layout it declares; the manifest was "
                "edited or is from another export or build: run `cabinlm export` (and `cabinlm build`) again"
            )
        if m.cache.quantized and m.kv_scales is None:
            raise ManifestError(f"{where}: {m.cache.kv_dtype.value} KV without its calibrated scales; re-export")
        if m.rotary is None or len(m.rotary.inv_freq) != m.cache.head_dim // 2:
            raise ManifestError(f"{where}: no RoPE table of head_dim / 2 = {m.cache.head_dim // 2} frequencies; re-export")
        for role in ("graph", "tokenizer"):
            if role not in m.files:
                raise ManifestError(f"{where}: no {role!r} file listed under 'files'; re-export")
        for a in m.lora.adapters if m.lora else ():
            if adapter_role(a.name) not in m.files:
                raise ManifestError(f"{where}: adapter {a.name!r} has no file listed under 'files'; run `cabinlm build` again")
        return m


def _stop_ids(ids: Any, model: Any) -> list[int]:
    """stop_ids: a non-empty list of token ids inside the vocabulary (a reply without a stop id, or with
    one the model never emits, runs on into a turn of its own making)."""
    vocab = model.get("vocab_size") if isinstance(model, dict) else None
    if type(vocab) is not int or vocab < 1:
        raise ValueError(f"model.vocab_size must be a positive whole number, got {vocab!r}")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"stop_ids must be a non-empty list of token ids, got {ids!r}"[:200])
    bad = next((i for i in ids if type(i) is not int or not 0 <= i < vocab), None)
    if bad is not None or any(type(i) is not int for i in ids):
        raise ValueError(f"stop_ids holds {bad!r}"[:100] + f": a stop id is a token id in 0..{vocab - 1}")
    return list(ids)


def _again(m: Manifest) -> str:
    """How to remake an artifact's files: a build's come from `cabinlm build`, an export's from `cabinlm export`."""
    return "run `cabinlm build` again" if m.build is not None else "re-export"


def load_manifest(folder: str | Path, check_files: bool = True) -> Manifest:
    """Read and validate DIR/manifest.json; with check_files, also that the files it lists are there."""
    folder = Path(folder)
    if not folder.exists():
        raise ManifestError(f"{folder}: no such folder; pass the folder `cabinlm export -o` wrote")
    if folder.is_file():  # every command reads the artifact's other files beside it: it takes the folder
        if folder.name == MANIFEST_NAME:
            raise ManifestError(f"{folder}: this is the artifact's manifest; pass the folder that holds it: {folder.parent}")
        raise ManifestError(f"{folder}: expected an artifact folder (with {MANIFEST_NAME}), got a file")
    path = folder / MANIFEST_NAME
    if not path.exists():
        raise ManifestError(
            f"{folder}: no {MANIFEST_NAME} here; this is not a cabinlm artifact (create one with `cabinlm export`)"
        )
    if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: not a manifest (a regular file of at most {MAX_MANIFEST_BYTES >> 20} MiB); re-export")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors, and Python's limit on an integer's digits
        raise ManifestError(f"{path}: corrupt manifest ({str(e)[:200]}); re-export the model") from e
    m = Manifest.from_dict(d, where=str(path))
    if check_files:
        again = _again(m)
        for role, entry in m.files.items():
            p = folder / entry.path
            if not p.exists():
                raise ManifestError(f"{path}: {role} file {entry.path!r} is missing; {again} or copy the whole folder")
            if not p.is_file():
                raise ManifestError(f"{path}: {role} file {entry.path!r} is not a regular file; {again}")
            size = p.stat().st_size
            if size != entry.bytes:
                raise ManifestError(
                    f"{path}: {role} file {entry.path!r} is {size} bytes but the manifest says {entry.bytes}; "
                    f"the files do not belong to this manifest, {again}"
                )
    return m


def verify_checksums(folder: str | Path, m: Manifest) -> None:
    """Full sha256 check of every file (slower; sizes are always checked by load_manifest)."""
    for role, entry in m.files.items():
        actual = FileEntry.of(Path(folder), entry.path).sha256
        if actual != entry.sha256:
            raise ManifestError(f"{folder}: {role} file {entry.path!r} fails its sha256 check; {_again(m)}")
