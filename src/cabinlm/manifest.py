"""The artifact manifest: the only contract between export, build and runtime.

Standard library only, so that every stage (and every tool that inspects an artifact) can read it.

    out/
      manifest.json        this file's Manifest, versioned
      decoder.onnx         the fixed-shape decoder graph (io = decoder_io(...))
      decoder.onnx.data    its weights (ONNX external data)
      tokenizer.json       a `tokenizers` file

`CacheLayout` owns the cache geometry: every byte count and the slot map derive from it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cabinlm.errors import LayoutError, ManifestError

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST_NAME = "manifest.json"
# RoPE variants whose inverse frequencies do not depend on the sequence length, so that a
# fixed-shape graph can hold them as constants (the exporter and the planner both check this).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# transformers class -> model_type. Both are "Llama-like": RMSNorm, RoPE, GQA, SwiGLU; Qwen2 adds q/k/v biases.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# Vision-language: a CLIP or SigLIP tower + projector in front of one of the text models above.
SUPPORTED_VLM_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava"}


class KVDType(str, enum.Enum):
    """Storage precision of the KV cache buffers."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def itemsize(self) -> int:
        return {"fp32": 4, "fp16": 2, "int8": 1, "fp8": 1}[self.value]

    @property
    def numpy_name(self) -> str:
        # fp8 is stored as raw uint8 bytes on the runtime side (numpy has no float8).
        return {"fp32": "float32", "fp16": "float16", "int8": "int8", "fp8": "uint8"}[self.value]

    @property
    def onnx_name(self) -> str:
        return {"fp32": "float", "fp16": "float16", "int8": "int8", "fp8": "float8e4m3fn"}[self.value]


@dataclass(frozen=True)
class CacheLayout:
    """Geometry of the fixed-size KV cache.

    Slot map of one layer's (kv_heads, slots, head_dim) buffer, slots = S + P + I + W:

        | sink: S | pinned: P | image: I  | window ring: W |
          first S   spans the   the current   the most recent W
          tokens    runtime     camera        unpinned tokens,
          of the    pins        frame (VLMs;  oldest overwritten
          stream    (system)    replaced by   first
                                the next)

    A chunk of up to C tokens attends to every cached token and to itself causally, then joins the
    cache. Positions are ranks in stream order, so the largest position ever used is S + P + W + C - 1.
    """

    sink: int
    pinned: int
    window: int
    chunk: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: KVDType = KVDType.FP32
    image: int = 0  # slots of one camera frame's tokens (0: a text-only model)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", KVDType(self.kv_dtype))
        for name in ("sink", "pinned", "image"):
            if getattr(self, name) < 0:
                raise LayoutError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "chunk", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk > self.window:
            # A chunk joins the ring after it has been processed; the ring must hold a whole chunk
            # so that no token of a chunk overwrites another token of the same chunk.
            raise LayoutError(
                f"--chunk {self.chunk} is larger than --window {self.window}: a prefill chunk must fit in "
                "the window; lower --chunk or raise --window"
            )

    @property
    def slots(self) -> int:
        """Cache slots per layer and KV head: sink + pinned + image + window."""
        return self.sink + self.pinned + self.image + self.window

    @property
    def max_position(self) -> int:
        """Exclusive upper bound of every RoPE position the graph will ever see."""
        return self.slots + self.chunk

    @property
    def image_start(self) -> int:
        return self.sink + self.pinned

    @property
    def window_start(self) -> int:
        return self.sink + self.pinned + self.image

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in (KVDType.INT8, KVDType.FP8)

    @property
    def scale_bytes_per_token(self) -> int:
        """Per-token scale bytes: quantized values carry one fp16 scale per (layer, KV head, token).
        Keys use per-channel scales calibrated at export: constants of the graph, not per token."""
        return self.layers * self.kv_heads * 2 if self.quantized else 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies over all layers: K and V data plus their per-token scales."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize + self.scale_bytes_per_token

    @property
    def key_scale_bytes(self) -> int:
        """Per-channel key scales (float32), held once by the graph (0 for unquantized KV)."""
        return self.layers * self.kv_heads * self.head_dim * 4 if self.quantized else 0

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        # (layers, kv_heads, slots, head_dim)
        return (self.layers, self.kv_heads, self.slots, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Runtime cache buffers: every slot's K, V and per-token scales."""
        return self.bytes_per_token * self.slots

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kv_dtype"] = self.kv_dtype.value
        return d


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


@dataclass(frozen=True)
class VisionSpec:
    """The vision graph of a vision-language model and how to prepare its input.

    preprocess (the model's image processor, resolved at export):
      resize: {"shortest_edge": n} or {"height": h, "width": w}; resample: a PIL filter number;
      crop: {"height", "width"} or None; rescale: factor or None; mean, std: per channel or None.
    """

    image_size: int
    patch_size: int
    image_tokens: int  # rows of the vision graph's image_embeds, slots of the cache's image region
    embed_dim: int
    image_token_id: int  # the placeholder id HF processors repeat image_tokens times
    preprocess: dict[str, Any]
    graph: str = "vision.onnx"  # role "vision_graph" in files


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. Symbolic dims: "tokens" (1..chunk) and "total" (slots + tokens)."""

    name: str
    dtype: str  # ONNX element type name, e.g. "float", "int64", "float16"
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class DecoderIO:
    """The decoder graph's inputs and outputs: declared here, used by the exporter and the runtime."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    def with_tokens(self, tokens: int, slots: int) -> DecoderIO:
        """The same I/O with the token range fixed (static-shape builds: a prefill and a decode graph)."""

        def fix(t: TensorSpec) -> TensorSpec:
            dims = {"tokens": tokens, "total": slots + tokens}
            return TensorSpec(t.name, t.dtype, tuple(dims.get(d, d) if isinstance(d, str) else d for d in t.shape))

        return DecoderIO(tuple(map(fix, self.inputs)), tuple(map(fix, self.outputs)))


# Graph I/O names. One cache tensor per layer: the runtime binds views of its single
# (layers, kv_heads, slots, head_dim) buffer, so the graph never slices (copies) the whole cache.
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
CACHE_POSITION_IDS = "cache_position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"


def key_cache_name(layer: int) -> str:
    return f"key_cache.{layer}"


def value_cache_name(layer: int) -> str:
    return f"value_cache.{layer}"


def new_key_name(layer: int) -> str:
    return f"new_key.{layer}"


def new_value_name(layer: int) -> str:
    return f"new_value.{layer}"


def value_scale_name(layer: int) -> str:
    return f"value_scale.{layer}"


def new_value_scale_name(layer: int) -> str:
    return f"new_value_scale.{layer}"


IMAGE_EMBEDS = "image_embeds"
IMAGE_MASK = "image_mask"


def decoder_io(layout: CacheLayout, vocab_size: int, index_dtype: str = "int64", embed_dim: int = 0) -> DecoderIO:
    """The graph contract for a layout.

    inputs (index = int64, or int32 for TensorRT targets, whose bindings need INT32 before 9.0)
      input_ids           index  (tokens,)                    the chunk's token ids
      position_ids        index  (tokens,)                    the chunk's RoPE positions (ranks)
      cache_position_ids  index  (slots,)                     each slot's RoPE position (rank)
      attention_mask      float  (tokens, slots + tokens)     additive: 0 attend, -1e30 masked
      key_cache.{l}       kv     (kv_heads, slots, head_dim)  un-rotated keys
      value_cache.{l}     kv     (kv_heads, slots, head_dim)
    outputs
      logits              float  (tokens, vocab)
      new_key.{l}         kv     (kv_heads, tokens, head_dim) the chunk's un-rotated keys
      new_value.{l}       kv     (kv_heads, tokens, head_dim)
    and, for int8 / fp8 KV (symmetric; x = q * scale):
      value_scale.{l}     fp16   (kv_heads, slots, 1)         per-token value scales
      new_value_scale.{l} fp16   (kv_heads, tokens, 1)        the chunk's value scales
    Key scales are per (layer, kv head, channel), calibrated at export and held by the graph:
    keys are stored un-rotated, so their channels keep stable ranges whatever the position.
    and, for vision-language models (embed_dim = the language model's hidden size):
      image_embeds        float  (tokens, embed_dim)          rows used where image_mask is true
      image_mask          bool   (tokens, 1)                  true: the token is an image token
    """
    kv = layout.kv_dtype.onnx_name
    h, n, d = layout.kv_heads, layout.slots, layout.head_dim
    if index_dtype not in ("int64", "int32"):
        raise ValueError(f"index_dtype must be int64 or int32, got {index_dtype!r}")
    inputs = [
        TensorSpec(INPUT_IDS, index_dtype, ("tokens",)),
        TensorSpec(POSITION_IDS, index_dtype, ("tokens",)),
        TensorSpec(CACHE_POSITION_IDS, index_dtype, (n,)),
        TensorSpec(ATTENTION_MASK, "float", ("tokens", "total")),
    ]
    outputs = [TensorSpec(LOGITS, "float", ("tokens", vocab_size))]
    for layer in range(layout.layers):
        inputs.append(TensorSpec(key_cache_name(layer), kv, (h, n, d)))
        inputs.append(TensorSpec(value_cache_name(layer), kv, (h, n, d)))
        outputs.append(TensorSpec(new_key_name(layer), kv, (h, "tokens", d)))
        outputs.append(TensorSpec(new_value_name(layer), kv, (h, "tokens", d)))
    if layout.quantized:
        for layer in range(layout.layers):
            inputs.append(TensorSpec(value_scale_name(layer), "float16", (h, n, 1)))
            outputs.append(TensorSpec(new_value_scale_name(layer), "float16", (h, "tokens", 1)))
    if embed_dim:
        inputs.append(TensorSpec(IMAGE_EMBEDS, "float", ("tokens", embed_dim)))
        inputs.append(TensorSpec(IMAGE_MASK, "bool", ("tokens", 1)))
    return DecoderIO(tuple(inputs), tuple(outputs))


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the artifact folder
    bytes: int
    sha256: str

    @classmethod
    def of(cls, folder: Path, relpath: str) -> FileEntry:
        p = folder / relpath
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        return cls(relpath, p.stat().st_size, h.hexdigest())


@dataclass
class Manifest:
    model: ModelSpec
    cache: CacheLayout
    chat: ChatTemplate
    stop_ids: list[int]
    files: dict[str, FileEntry]  # role -> file: "graph", "graph_data", "tokenizer"
    opset: int
    rope_inv_freq_source: str = "config"
    quality: dict[str, Any] = field(default_factory=dict)
    index_dtype: str = "int64"  # of input_ids / position_ids / cache_position_ids
    target: dict[str, Any] | None = None  # {"profile": name, "plan": {...}} when exported for a profile
    vision: VisionSpec | None = None  # vision-language models only
    format_version: int = FORMAT_VERSION
    cabinlm_version: str = ""

    @property
    def io(self) -> DecoderIO:
        embed_dim = self.vision.embed_dim if self.vision else 0
        return decoder_io(self.cache, self.model.vocab_size, self.index_dtype, embed_dim)

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
            "quality": self.quality,
            "index_dtype": self.index_dtype,
            "target": self.target,
            "vision": dataclasses.asdict(self.vision) if self.vision else None,
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
            raise ManifestError(
                f"{where}: format_version {version!r} is not supported by this cabinlm "
                f"(supports {', '.join(map(str, SUPPORTED_VERSIONS))}); re-export the model with this version"
            )
        try:
            m = cls(
                model=ModelSpec(**d["model"]),
                cache=CacheLayout(**d["cache"]),
                chat=ChatTemplate(**d["chat"]),
                stop_ids=[int(i) for i in d["stop_ids"]],
                files={k: FileEntry(**v) for k, v in d["files"].items()},
                opset=int(d["opset"]),
                rope_inv_freq_source=d.get("rope_inv_freq_source", "config"),
                quality=dict(d.get("quality", {})),
                index_dtype=d.get("index_dtype", "int64"),
                target=d.get("target"),
                vision=VisionSpec(**d["vision"]) if d.get("vision") else None,
                format_version=version,
                cabinlm_version=d.get("cabinlm_version", ""),
            )
        except KeyError as e:
            raise ManifestError(f"{where}: missing field {e.args[0]!r}; the file is incomplete, re-export") from e
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type or shape
            raise ManifestError(f"{where}: invalid content ({e}); re-export the model") from e
        if "io" in d and d["io"] != m.io.to_dict():
            raise ManifestError(
                f"{where}: the declared graph I/O does not match the cache layout it declares; "
                "the manifest was edited or is from another build, re-export"
            )
        for role in ("graph", "tokenizer"):
            if role not in m.files:
                raise ManifestError(f"{where}: no {role!r} file listed under 'files'; re-export")
        return m


def load_manifest(folder: str | Path, check_files: bool = True) -> Manifest:
    """Read and validate DIR/manifest.json; with check_files, also that the files it lists are there."""
    folder = Path(folder)
    if not folder.exists():
        raise ManifestError(f"{folder}: no such folder; pass the folder `cabinlm export -o` wrote")
    if folder.is_file():
        if folder.name == MANIFEST_NAME:
            folder = folder.parent
        else:
            raise ManifestError(f"{folder}: expected an artifact folder (with {MANIFEST_NAME}), got a file")
    path = folder / MANIFEST_NAME
    if not path.exists():
        raise ManifestError(
            f"{folder}: no {MANIFEST_NAME} here; this is not a cabinlm artifact (create one with `cabinlm export`)"
        )
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: corrupt manifest ({e}); re-export the model") from e
    m = Manifest.from_dict(d, where=str(path))
    if check_files:
        for role, entry in m.files.items():
            p = folder / entry.path
            if not p.exists():
                raise ManifestError(f"{path}: {role} file {entry.path!r} is missing; re-export or copy the whole folder")
            size = p.stat().st_size
            if size != entry.bytes:
                raise ManifestError(
                    f"{path}: {role} file {entry.path!r} is {size} bytes but the manifest says {entry.bytes}; "
                    "the files do not belong to this manifest, re-export"
                )
    return m


def verify_checksums(folder: str | Path, m: Manifest) -> None:
    """Full sha256 check of every file (slower; sizes are always checked by load_manifest)."""
    for role, entry in m.files.items():
        actual = FileEntry.of(Path(folder), entry.path).sha256
        if actual != entry.sha256:
            raise ManifestError(f"{folder}: {role} file {entry.path!r} fails its sha256 check; re-export")
