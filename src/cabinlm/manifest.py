"""The artifact manifest: the only contract between export, build and runtime.

Standard library only, so that every stage (and every tool that inspects an artifact) can read it.

    out/
      manifest.json        this file's Manifest, versioned
      decoder.onnx         the fixed-shape decoder graph (io = decoder_io(...))
      decoder.onnx.data    its weights (ONNX external data)
      tokenizer.json       a `tokenizers` file

`CacheLayout` (cabinlm.layout) owns the cache geometry; `decoder_io` (cabinlm.io_spec) declares the
graph's inputs and outputs; this module ties them to files, versions and checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cabinlm.errors import ManifestError
from cabinlm.io_spec import (  # noqa: F401 - re-exported: the manifest is where users look for the contract
    ATTENTION_BIAS,
    ATTENTION_MASK,
    CACHE_POSITION_IDS,
    IMAGE_EMBEDS,
    IMAGE_MASK,
    INPUT_IDS,
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
    TensorSpec,
    decoder_io,
    fused_decoder_io,
    key_cache_name,
    new_key_name,
    new_value_name,
    new_value_scale_name,
    present_key_name,
    present_value_name,
    qkv_name,
    value_cache_name,
    value_scale_name,
)
from cabinlm.layout import CacheLayout, KVDType  # noqa: F401 - re-exported

FORMAT_VERSION = 3  # 2: logit_rows input, block-quantized weights; 3: "attention" (fused cpu builds)
SUPPORTED_VERSIONS = (2, 3)
ATTENTION_KINDS = ("graph", "fused")  # the exported graph's own attention / builders/ort_fused.py
MANIFEST_NAME = "manifest.json"
# RoPE variants whose inverse frequencies do not depend on the sequence length, so that a
# fixed-shape graph can hold them as constants (the exporter and the planner both check this).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# transformers class -> model_type. Both are "Llama-like": RMSNorm, RoPE, GQA, SwiGLU; Qwen2 adds q/k/v biases.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
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
    weights: str = "fp32"  # fp32, int8 or int4 (blocks of 32; see export/wquant.py)
    # "graph": the exported graph (un-rotated keys, the chunk's K/V as outputs); "fused": a cpu
    # build's fused attention (keys rotated when written, K/V written into the cache's scratch rows)
    attention: str = "graph"
    format_version: int = FORMAT_VERSION
    cabinlm_version: str = ""

    @property
    def io(self) -> DecoderIO:
        if self.attention == "fused":
            return fused_decoder_io(self.cache, self.model.num_heads, self.model.vocab_size)
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
            "weights": self.weights,
            "attention": self.attention,
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
                weights=str(d.get("weights", "fp32")),
                attention=str(d.get("attention", "graph")),
                format_version=version,
                cabinlm_version=d.get("cabinlm_version", ""),
            )
        except KeyError as e:
            raise ManifestError(f"{where}: missing field {e.args[0]!r}; the file is incomplete, re-export") from e
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type or shape
            raise ManifestError(f"{where}: invalid content ({e}); re-export the model") from e
        if m.attention not in ATTENTION_KINDS:
            raise ManifestError(f"{where}: unknown attention {m.attention!r} (known: {', '.join(ATTENTION_KINDS)}); rebuild")
        if "io" in d and d["io"] != m.io.to_dict():
            raise ManifestError(
                f"{where}: the declared graph I/O does not match the cache layout it declares; "
                + ("a fused build from an older cabinlm (its graph I/O changed since): run `cabinlm build` again"
                   if m.attention == "fused" else "the manifest was edited or is from another build, re-export")
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
