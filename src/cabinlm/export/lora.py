"""LoRA adapters, merged into a model's float weights before the export quantizes them.

    LoraRequest.parse("DIR[:SCALE]")       what `cabinlm export --lora` asks for
    read_adapter(path)    -> LoraAdapter   a PEFT folder or a llama.cpp GGUF LoRA file, parsed
    check_adapter(adapter, spec)           every factor pair against the model's projections (no weights needed)
    merge_adapter(model, adapter, scale)   W += scale * s * B @ A in place -> MergedLora, the manifest's record

A projection y = x W^T + b (nn.Linear, W of shape (out, in)) with an adapter becomes
y = x W^T + b + s * (x A^T) B^T, so merging adds s * B @ A to W:

    A  (r, in)    lora_A / .lora_a: the input side, rank r
    B  (out, r)   lora_B / .lora_b: the output side
    s             PEFT: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora;
                  GGUF: adapter.lora.alpha / r, or 1 where alpha is 0 (as llama.cpp scales it)

Merged before quantization, the adapter reaches every engine as ordinary weights. A projection is
named as the decoder's layers hold it: "layers.{i}.self_attn.q_proj", "layers.{i}.mlp.down_proj".
Reading needs numpy, safetensors and gguf; merging touches the transformers model (torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cabinlm.contract.adapters import TARGETS, SwitchableLora
from cabinlm.contract.errors import ModelError, OptionError
from cabinlm.contract.manifest import ModelSpec, file_sha256

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"

# Projection -> the layer's sub-module holding it. Phi-3 holds q|k|v and gate|up fused (qkv_proj, gate_up_proj).
PROJECTIONS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip
FUSED_PROJECTIONS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
FUSED_FAMILIES = ("Phi3ForCausalLM",)

# llama.cpp's tensor names (per layer) -> projection, and the GGUF architecture of each text family.
GGUF_PROJECTIONS = {
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
}  # fmt: skip
GGUF_FUSED_PROJECTIONS = {"attn_qkv": "qkv_proj", "attn_output": "o_proj", "ffn_up": "gate_up_proj", "ffn_down": "down_proj"}
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3",
}  # fmt: skip

# adapter_config.json fields that change what the adapter computes beyond W + s * B @ A: refused when set.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) rescales each weight column by a learned magnitude",
    "modules_to_save": "modules_to_save replaces whole modules",
    "rank_pattern": "rank_pattern gives modules their own rank",
    "alpha_pattern": "alpha_pattern gives modules their own alpha",
    "lora_bias": "lora_bias trains a bias of lora_B",
    "layer_replication": "layer_replication repeats layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies only after its tokens",
    "target_parameters": "target_parameters adapts raw parameters, not projections",
    "trainable_token_indices": "trainable_token_indices trains token embeddings",
    "use_qalora": "QA-LoRA (use_qalora) pools the inputs",
    "use_bdlora": "BD-LoRA (use_bdlora) is block-diagonal",
}

_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass(frozen=True)
class LoraRequest:
    """One adapter to merge: a PEFT folder or a GGUF LoRA file, and a multiplier on its own scaling."""

    path: Path
    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser())
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise OptionError(f"--lora {self.path}:{self.scale!r}: the scale must be a finite number, such as 1.0 or 0.5")
        object.__setattr__(self, "scale", float(self.scale))

    @classmethod
    def parse(cls, text: str) -> LoraRequest:
        """"DIR" or "DIR:SCALE" (a folder or file name may hold colons: only a number after the last one is a scale)."""
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                return cls(Path(head), float(tail))
            except ValueError:
                pass  # not a number: the colon belongs to the path
        return cls(Path(text))


@dataclass(frozen=True)
class LoraPair:
    """One projection's factors, float32. module: "layers.{i}.{self_attn|mlp}.{projection}"."""

    module: str
    a: np.ndarray  # (r, in)
    b: np.ndarray  # (out, r)
    scaling: float  # s: the adapter's own scale for this pair

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def layer(self) -> int:
        return int(self.module.split(".")[1])

    @property
    def projection(self) -> str:
        return self.module.rsplit(".", 1)[1]


@dataclass(frozen=True)
class LoraAdapter:
    """A parsed adapter: its factor pairs, and where they came from."""

    source: str  # the path as given
    format: str  # "peft" or "gguf"
    file: Path  # adapter_model.safetensors or the .gguf
    sha256: str  # of that file
    alpha: float
    rslora: bool
    pairs: tuple[LoraPair, ...]
    base_model: str | None = None  # PEFT's base_model_name_or_path
    architecture: str | None = None  # PEFT's auto_mapping.base_model_class, or the GGUF's general.architecture

    @property
    def rank(self) -> int:
        """The largest rank of its pairs (a PEFT adapter's every pair has the config's r)."""
        return max(p.rank for p in self.pairs)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({p.projection for p in self.pairs}))


@dataclass(frozen=True)
class MergedLora:
    """What an export records of a merged adapter (the manifest's quality.lora)."""

    request: LoraRequest
    source: str
    format: str
    file: str
    sha256: str
    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]
    modules: tuple[str, ...]  # every merged projection, "layers.{i}.self_attn.q_proj"
    base_model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "format": self.format, "file": self.file, "sha256": self.sha256,
                "rank": self.rank, "alpha": self.alpha, "rslora": self.rslora, "scale": self.request.scale,
                "targets": list(self.targets), "matrices": len(self.modules),
                **({"base_model": self.base_model} if self.base_model else {})}  # fmt: skip


def read_adapter(path: Path | str) -> LoraAdapter:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file; anything
    else, a missing or corrupt file, or an adapter kind that merging would change: ModelError."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _read_peft(path)
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path)
    if path.is_file():
        raise ModelError(f"--lora {path}: an adapter is a PEFT folder ({PEFT_CONFIG} + {PEFT_WEIGHTS}) or a GGUF LoRA "
                         "file (.gguf)")  # fmt: skip
    raise ModelError(f"--lora {path}: no such folder or file; give a PEFT adapter folder or a GGUF LoRA file")


def _read_peft(folder: Path) -> LoraAdapter:
    from safetensors import SafetensorError, deserialize

    cfg_path, weights = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not cfg_path.is_file():
        raise ModelError(f"--lora {folder}: no {PEFT_CONFIG}, so it is not a PEFT adapter folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"--lora {cfg_path}: not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ModelError(f"--lora {cfg_path}: not a JSON object")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise ModelError(f"--lora {folder}: peft_type {kind!r}; cabinlm merges LoRA adapters only (peft_type LORA)")
    for name, what in _UNSUPPORTED.items():
        if cfg.get(name):
            raise ModelError(f"--lora {folder}: {what}, which a merge of W + s * B @ A cannot hold; export the adapter "
                             f"without {name} (or merge it with PEFT's merge_and_unload and export that model)")  # fmt: skip
    if cfg.get("bias", "none") != "none":
        raise ModelError(f"--lora {folder}: bias {cfg['bias']!r} trains the base model's biases; cabinlm merges "
                         "adapters with bias 'none'")  # fmt: skip
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1 or isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ModelError(f"--lora {cfg_path}: r must be a positive whole number and lora_alpha a number, got r {r!r}, "
                         f"lora_alpha {alpha!r}")  # fmt: skip
    rslora = bool(cfg.get("use_rslora", False))
    # fan_in_fan_out describes Conv1D-style (in, out) weights; the decoders' projections are nn.Linear
    # (out, in), for which PEFT itself turns it off. The factors are stored the same way either way.
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    if not weights.is_file():
        raise ModelError(f"--lora {folder}: no {PEFT_WEIGHTS} (an adapter saved as .bin: load it with PEFT and "
                         "save_pretrained it again, which writes safetensors)")  # fmt: skip
    try:
        tensors = deserialize(weights.read_bytes())
    except (OSError, SafetensorError) as e:
        raise ModelError(f"--lora {weights}: not a readable safetensors file ({e}); save the adapter again") from e
    factors: dict[str, dict[str, np.ndarray]] = {}
    for key, t in tensors:
        m = _PEFT_KEY.search(key)
        if m is None:
            raise ModelError(f"--lora {weights}: tensor {key} is not a LoRA factor of an attention or MLP projection "
                             "(lora_A / lora_B of q/k/v/o_proj, gate/up/down_proj); cabinlm merges only those")  # fmt: skip
        layer, group, proj, side = m.groups()
        module = f"layers.{int(layer)}.{group}.{proj}"
        factors.setdefault(module, {})[side] = _array(t, key, weights)
    pairs = []
    for module in sorted(factors, key=_order):
        f = factors[module]
        if set(f) != {"A", "B"}:
            missing = "lora_B" if "A" in f else "lora_A"
            raise ModelError(f"--lora {weights}: {module} has no {missing}; the file is incomplete")
        a, b = f["A"], f["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ModelError(f"--lora {weights}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                             f"(r, in) and (out, r) with the config's r {r}")  # fmt: skip
        pairs.append(LoraPair(module, a, b, scaling))
    if not pairs:
        raise ModelError(f"--lora {weights}: holds no LoRA factors")
    mapping = cfg.get("auto_mapping") or {}
    return LoraAdapter(source=str(folder), format="peft", file=weights, sha256=file_sha256(weights), alpha=float(alpha),
                       rslora=rslora, pairs=tuple(pairs), base_model=cfg.get("base_model_name_or_path") or None,
                       architecture=mapping.get("base_model_class") if isinstance(mapping, dict) else None)  # fmt: skip


def _array(t: dict, key: str, where: Path) -> np.ndarray:
    """A safetensors entry (dtype, shape, raw little-endian bytes) as float32; bfloat16 is widened by hand
    (numpy has no bfloat16)."""
    kinds = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
    data = bytes(t["data"])
    if t["dtype"] == "BF16":
        x = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    elif t["dtype"] in kinds:
        x = np.frombuffer(data, kinds[t["dtype"]]).astype(np.float32)
    else:
        raise ModelError(f"--lora {where}: tensor {key} is {t['dtype']}; LoRA factors must be F32, F16 or BF16")
    return x.reshape(t["shape"])


def _order(module: str) -> tuple[int, str]:
    return int(module.split(".")[1]), module


def _read_gguf(path: Path) -> LoraAdapter:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ModelError(f"--lora {path}: not a readable GGUF file ({e})") from e

    def field(name: str):
        f = reader.fields.get(name)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ModelError(f"--lora {path}: a GGUF model, not a LoRA adapter (general.type {field('general.type')!r}, "
                         f"adapter.type {field('adapter.type')!r}; expected 'adapter' and 'lora')")  # fmt: skip
    if field("adapter.alora.invocation_tokens") is not None:
        raise ModelError(f"--lora {path}: {_UNSUPPORTED['alora_invocation_tokens']}, which a merge cannot hold")
    arch = field("general.architecture")
    fused = arch in ("phi3",)
    names = GGUF_FUSED_PROJECTIONS if fused else GGUF_PROJECTIONS
    alpha = float(field("adapter.lora.alpha") or 0.0)
    factors: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m.group(2) not in names:
            raise ModelError(f"--lora {path}: tensor {t.name} is not a LoRA factor of an attention or MLP projection "
                             f"({', '.join(f'blk.N.{n}.weight.lora_a / _b' for n in names)}); cabinlm merges only those")  # fmt: skip
        layer, name, side = m.groups()
        proj = names[name]
        module = f"layers.{int(layer)}.{PROJECTIONS.get(proj) or FUSED_PROJECTIONS[proj]}.{proj}"
        kind = t.tensor_type
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            x = np.array(t.data, dtype=np.float32)  # a copy: the reader's is a read-only map of the file
        else:
            try:
                x = dequantize(t.data, kind).astype(np.float32)
            except NotImplementedError as e:
                raise ModelError(f"--lora {path}: tensor {t.name} is {kind.name}, which gguf cannot de-quantize") from e
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml's ne is (in, rows): numpy's order is (rows, in)
        factors.setdefault(module, {})[side] = x.reshape(shape)
    pairs = []
    for module in sorted(factors, key=_order):
        f = factors[module]
        if set(f) != {"a", "b"}:
            raise ModelError(f"--lora {path}: {module} has no {'lora_b' if 'a' in f else 'lora_a'}; the file is incomplete")
        a, b = f["a"], f["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ModelError(f"--lora {path}: {module}: lora_a {a.shape} and lora_b {b.shape} disagree on the rank")
        r = a.shape[0]
        pairs.append(LoraPair(module, a, b, alpha / r if alpha else 1.0))
    if not pairs:
        raise ModelError(f"--lora {path}: holds no LoRA factors")
    return LoraAdapter(source=str(path), format="gguf", file=path, sha256=file_sha256(path), alpha=alpha, rslora=False,
                       pairs=tuple(pairs), architecture=arch)  # fmt: skip


def _unpermute(b: np.ndarray, heads: int) -> np.ndarray:
    """B's rows back in transformers' order: llama.cpp's converter interleaves the two RoPE halves of each
    head of q and k in "llama" files, on the output side (B's rows; A is untouched)."""
    n = b.shape[0]
    order = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(-1)
    return np.ascontiguousarray(b[order])


def projection_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection the family's layers hold."""
    q, kv, h, i = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, spec.intermediate_size
    if spec.architecture in FUSED_FAMILIES:
        return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * i, h), "down_proj": (h, i)}
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip


def check_adapter(adapter: LoraAdapter, spec: ModelSpec) -> LoraAdapter:
    """The adapter against the model (its ModelSpec: no weights needed): the architecture it names,
    each pair's layer, projection and shapes. Returns it with every pair in transformers' row order
    (a "llama" GGUF's q / k rows un-interleaved). A mismatch: ModelError naming the pair."""
    src = adapter.source
    if adapter.format == "gguf":
        want = GGUF_ARCHITECTURES.get(spec.architecture)
        if want is None:
            raise ModelError(f"--lora {src}: GGUF LoRA files are merged into the text families "
                             f"({', '.join(sorted(GGUF_ARCHITECTURES))}); the model is {spec.architecture}")  # fmt: skip
        if adapter.architecture != want:
            raise ModelError(f"--lora {src}: an adapter for GGUF architecture {adapter.architecture!r}, but the model "
                             f"({spec.architecture}) is {want!r}; use an adapter trained on this base model")  # fmt: skip
    elif adapter.architecture and adapter.architecture != spec.architecture:
        raise ModelError(f"--lora {src}: an adapter for {adapter.architecture} (its adapter_config.json), but the model "
                         f"is {spec.architecture}; use an adapter trained on this base model")  # fmt: skip
    shapes = projection_shapes(spec)
    heads = {"q_proj": spec.num_heads, "k_proj": spec.num_kv_heads}
    pairs = []
    for p in adapter.pairs:
        if p.projection not in shapes or p.module.split(".")[2] != (PROJECTIONS.get(p.projection) or FUSED_PROJECTIONS[p.projection]):
            raise ModelError(f"--lora {src}: targets {p.module}, which {spec.architecture} does not have (its layers "
                             f"hold {', '.join(shapes)}); use an adapter trained on this base model")  # fmt: skip
        if p.layer >= spec.num_layers:
            raise ModelError(f"--lora {src}: targets {p.module}, but the model has {spec.num_layers} layers "
                             f"(0..{spec.num_layers - 1}); use an adapter trained on this base model")  # fmt: skip
        out, inp = shapes[p.projection]
        if p.a.shape[1] != inp or p.b.shape[0] != out:
            raise ModelError(f"--lora {src}: {p.module}: lora_A {tuple(p.a.shape)} and lora_B {tuple(p.b.shape)} do not "
                             f"fit the model's {out} x {inp} weight (expected A (r, {inp}), B ({out}, r)); the adapter "
                             "was trained for another base model")  # fmt: skip
        if adapter.format == "gguf" and adapter.architecture == "llama" and p.projection in heads:
            p = LoraPair(p.module, p.a, _unpermute(p.b, heads[p.projection]), p.scaling)
        pairs.append(p)
    return dataclasses.replace(adapter, pairs=tuple(pairs))


def merge_adapter(layers: Any, adapter: LoraAdapter, request: LoraRequest,
                  log: Callable[[str], None] = lambda s: None) -> MergedLora:  # fmt: skip
    """W += scale * s * (B @ A) for each pair, in place, in float32 as PEFT's merge computes it.
    layers: the decoder's transformer layers (transformers modules); the adapter checked (check_adapter)."""
    import torch

    with torch.no_grad():
        for p in adapter.pairs:
            _, i, group, proj = p.module.split(".")
            w = getattr(getattr(layers[int(i)], group), proj).weight
            if tuple(w.shape) != (p.b.shape[0], p.a.shape[1]):  # check_adapter read the config; this is the module
                raise ModelError(f"--lora {adapter.source}: {p.module} is {tuple(w.shape)} in the loaded model, the "
                                 f"adapter's delta {(p.b.shape[0], p.a.shape[1])}")  # fmt: skip
            delta = torch.from_numpy(p.b) @ torch.from_numpy(p.a)
            w.add_(delta.to(w.dtype) * (p.scaling * request.scale))
    kinds = ", ".join(adapter.targets)
    log(f"merged LoRA {adapter.source} ({adapter.format}, rank {adapter.rank}, alpha {adapter.alpha:g}"
        f"{', rsLoRA' if adapter.rslora else ''}, scale {request.scale:g}) into {len(adapter.pairs)} matrices: {kinds}")  # fmt: skip
    return MergedLora(request=request, source=adapter.source, format=adapter.format, file=adapter.file.name,
                      sha256=adapter.sha256, rank=adapter.rank, alpha=adapter.alpha, rslora=adapter.rslora,
                      targets=adapter.targets, modules=tuple(p.module for p in adapter.pairs),
                      base_model=adapter.base_model)  # fmt: skip


def switchable(spec: ModelSpec, rank: int, targets: tuple[str, ...], vision: bool = False) -> SwitchableLora | None:
    """The adapter inputs an export with --lora-rank `rank` (0: none) declares on `targets`, or an
    OptionError for a model the graph cannot give them."""
    if not rank:
        return None
    if spec.architecture in FUSED_FAMILIES:
        raise OptionError(f"--lora-rank: {spec.architecture} holds q|k|v and gate|up fused, which takes no per-projection "
                          "adapter inputs yet; merge the adapter with --lora instead")  # fmt: skip
    if vision:
        raise OptionError("--lora-rank: switchable adapters are for text models (a camera frame's chunk cannot be run "
                          "again when a seat switches adapter); merge the adapter with --lora instead")  # fmt: skip
    return SwitchableLora(rank, targets)


def parse_targets(text: str) -> tuple[str, ...]:
    """--lora-targets "q,k,v,o,gate,up,down" or "all" (a projection also by its full name, q_proj)."""
    if text.strip() == "all":
        return TARGETS
    names = [t.strip() for t in text.split(",") if t.strip()]
    out = []
    for n in names:
        full = n if n.endswith("_proj") else f"{n}_proj"
        if full not in TARGETS:
            raise OptionError(f"--lora-targets {text}: {n!r} is not one of q, k, v, o, gate, up, down (or 'all')")
        out.append(full)
    if not out or len(set(out)) != len(out):
        raise OptionError(f"--lora-targets {text}: name each of q, k, v, o, gate, up, down at most once (or 'all')")
    return tuple(t for t in TARGETS if t in out)
