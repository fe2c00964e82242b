"""Where a model comes from: a built-in alias, a Hugging Face model folder, or a .gguf file.

Loading goes through `transformers` (which de-quantizes GGUF to float32); this module then turns the
loaded model into the plain numpy DecoderWeights the graph builder consumes. Its ModelSpec comes from
cabinlm.source.config, the parser `cabinlm plan` uses too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cabinlm.contract.errors import ModelError
from cabinlm.export import gguf_quants, wquant
from cabinlm.export.aliases import ALIASES, DEFAULT_MODEL, cache_dir, fetch_alias  # noqa: F401 - re-exported
from cabinlm.export.decoder import DecoderWeights, LayerWeights
from cabinlm.source.processor import image_processor_config, processor_files
from cabinlm.export.lora import MergedLora
from cabinlm.export.wquant import QuantMatrix
from cabinlm.contract.manifest import STATIC_ROPE_TYPES, ModelSpec
from cabinlm.source.config import idefics3_family, is_vlm, mrope_family, spec_from_config, spec_from_dict
from cabinlm.contract.precision import WeightFormat


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, float32, eval mode
    tokenizer: Any  # transformers tokenizer with a `backend_tokenizer`
    spec: ModelSpec
    source: str
    folder: Path | None = None  # where it was loaded from (the image processor's config lives there)
    gguf: Path | None = None  # the .gguf file, when the model came from one (its blocks can be imported)
    lora: MergedLora | None = None  # a LoRA adapter merged into the float weights (export/lora.py)

    @property
    def vlm(self) -> bool:
        return is_vlm(self.model.config.to_dict())

    @property
    def mrope(self) -> bool:
        """A multimodal-RoPE vision-language model (Qwen2-VL: export/qwen2_vl.py)."""
        return mrope_family(self.model.config.to_dict()) is not None

    @property
    def idefics3(self) -> bool:
        """An Idefics3 / SmolVLM vision-language model (export/idefics3.py)."""
        return idefics3_family(self.model.config.to_dict()) is not None

    @property
    def text_model(self) -> Any:
        """The decoder's transformer (LlamaModel, Qwen2Model, ...), for text models and VLMs alike."""
        return _text_model(self.model)


def _text_model(model) -> Any:
    """LLaVA and Qwen2-VL hold their text model as model.language_model, Idefics3 / SmolVLM as
    model.text_model, text models are it."""
    inner = model.model
    return getattr(inner, "language_model", None) or getattr(inner, "text_model", None) or inner


def resolve_source(source: str, log: Callable[[str], None] = lambda s: None) -> tuple[Path, str | None]:
    """MODEL argument -> (folder, gguf file name or None)."""
    if source in ALIASES:
        path = fetch_alias(source, log)
        return path.parent, path.name
    path = Path(source).expanduser()
    if not path.exists():
        known = ", ".join(sorted(ALIASES))
        raise ModelError(
            f"{source}: no such file or folder, and not a built-in model ({known}); "
            "pass a Hugging Face model folder, a .gguf file, or a built-in name"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{source}: a model file must be a .gguf; for a Hugging Face model pass its folder")
        return path.parent, path.name
    if not (path / "config.json").exists():
        raise ModelError(
            f"{source}: this folder has no config.json, so it is not a Hugging Face model folder "
            "(expected config.json, *.safetensors and tokenizer files)"
        )
    return path, None


def load_model(source: str, log: Callable[[str], None] = lambda s: None) -> LoadedModel:
    """Load MODEL as float32 with transformers (the export stage's only heavy dependency)."""
    folder, gguf = resolve_source(source, log)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf} if gguf else {}
    where = str(folder / gguf) if gguf else str(folder)
    try:
        config = AutoConfig.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{where}: cannot read the model configuration ({e})") from e
    # the same parser as `cabinlm plan`'s: an unsupported model is refused before its weights are read
    spec = dataclasses.replace(spec_from_dict(config.to_dict(), where), source=source if source in ALIASES else where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"{where}: cannot load a tokenizer ({e}); the folder needs tokenizer.json") from e
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ModelError(f"{where}: the tokenizer has no fast (tokenizers) backend; cabinlm needs tokenizer.json")
    if is_vlm(config.to_dict()):
        image_processor_config(folder)  # a missing or unreadable image processor is refused before the weights load
        if not getattr(tokenizer, "chat_template", None):
            template = processor_chat_template(folder)
            if template is not None:
                tokenizer.chat_template = template
                log(f"chat template: the processor's ({template[:40]!r}...)")
    log(f"loading {where} as float32")
    try:
        if is_vlm(config.to_dict()):
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"{where}: cannot load the weights ({e})") from e
    model.eval()
    text_model = _text_model(model)
    rope_types = text_model.rotary_emb.rope_type  # Gemma 3: {layer kind: type}
    bad = [r for r in (rope_types.values() if isinstance(rope_types, dict) else [rope_types]) if r not in STATIC_ROPE_TYPES]
    if bad:
        rope_type = bad[0]
        raise ModelError(
            f"{where}: RoPE type {rope_type!r} depends on the sequence length and cannot be baked into a "
            f"fixed-shape graph; supported: {', '.join(sorted(STATIC_ROPE_TYPES))}"
        )
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, source=spec.source, folder=folder,
                       gguf=folder / gguf if gguf else None)  # fmt: skip


def processor_chat_template(folder: Path) -> str | None:
    """A vision-language folder's chat template where its processor keeps it and the tokenizer does not
    read it: chat_template.json ({"chat_template": ...}, as SmolVLM's and older processors save it) or
    processor_config.json's "chat_template" (AutoProcessor reads both; AutoTokenizer only
    chat_template.jinja and tokenizer_config.json)."""
    for _, d in processor_files(folder, ("chat_template.json", "processor_config.json")):
        template = d.get("chat_template") if isinstance(d, dict) else None
        if isinstance(template, str) and template:
            return template
    return None


# GGUF tensor name (per layer) -> transformers module path, for the block import.
_GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def gguf_blocks(path: Path, spec: ModelSpec) -> dict[str, tuple[str, np.ndarray]]:
    """The GGUF tensors stored in a block type: name -> (ggml type, raw block rows). Types outside
    gguf_quants.SUPPORTED are listed too (decoder_weights logs them and quantizes from float32)."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind not in ("F32", "F16", "BF16", "F64"):
            out[t.name] = (kind, np.asarray(t.data))
    return out


def _gguf_matrix(blocks: dict, name: str, k: int, heads: int | None, head_dim: int, bits: int | None = None) -> QuantMatrix | None:
    """One GGUF linear as QuantMatrix (K inputs, N outputs), rows un-permuted for q / k (llama.cpp's
    converter interleaves the RoPE halves of q and k; transformers reverses it the same way). bits:
    None = the type's own width (gguf_quants.NATIVE_BITS), 8 = widened; an unsupported type: ModelError."""
    if name not in blocks:
        return None
    kind, raw = blocks[name]
    m = gguf_quants.to_quant_matrix(raw, kind, k, bits, name)
    if heads is not None:
        n = m.shape[1]
        order = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(-1)
        m = wquant.permute_rows(m, order)
    return m


def decoder_weights(loaded: LoadedModel, fmt: WeightFormat | str = WeightFormat.FP32, log: Callable[[str], None] = lambda s: None,
                    head: WeightFormat | str | None = None) -> DecoderWeights:  # fmt: skip
    """The loaded model's weights as the graph multiplies with them: float32 (in, out) arrays, or
    block-quantized matrices. From a .gguf, block tensors are imported as blocks (export/gguf_quants.py:
    Q4_0 / Q4_1 / Q4_K as 4-bit, or with int8 weights 8-bit; Q5_0 / Q5_1 / Q5_K / Q8_0 exactly as 8-bit;
    Q6_K re-rounded to 8-bit blocks of 32), the same numbers llama.cpp computes with but for Q6_K;
    other tensors are quantized from float32.

    head: the format of the token table and output projection of a quantized export. None: 8 bits
    (as llama.cpp's Q4 files keep them), or a .gguf's own blocks for int4 weights. "int4": 4-bit
    blocks (as onnxruntime-genai's int4 models hold the output projection); "int8": 8-bit. A .gguf's
    table is imported when its blocks have the asked width, else re-rounded from its float values."""
    fmt = WeightFormat(fmt)
    head_fmt = None if head is None else WeightFormat(head)
    if not fmt.in_graph:
        raise ValueError(f"{fmt.value} weights are an engine's build-time precision; a graph holds fp32, int8, int4")
    if head_fmt is not None and not (head_fmt.quantized and fmt.quantized):
        raise ValueError("head (the token table's width) is int8 or int4, for int8 or int4 weights")
    m = loaded.model
    text = loaded.text_model
    spec = loaded.spec

    def t(x) -> np.ndarray:
        return x.detach().to("cpu").float().numpy()

    gemma = spec.architecture == "Gemma3ForCausalLM"

    def norm(module) -> np.ndarray:
        """An RMSNorm's weight as the graph multiplies by it: Gemma's norms scale by (1 + weight)."""
        return t(module.weight) + np.float32(1.0) if gemma else t(module.weight)

    blocks = {}
    if fmt != WeightFormat.FP32 and loaded.gguf is not None:
        blocks = gguf_blocks(loaded.gguf, spec)
    counts = {"imported": 0, "quantized": 0}
    if loaded.lora is not None and blocks:
        # A merged matrix is W + delta: its float32 values are quantized here, the file's blocks of W unused.
        by_module = {module: name for name, module in _GGUF_LINEARS.items()}
        merged = {f"blk.{m.split('.')[1]}.{by_module[m.split('.', 2)[2]]}.weight" for m in loaded.lora.modules
                  if m.split(".", 2)[2] in by_module}  # fmt: skip
        counts["lora_requantized"] = len(merged & blocks.keys())
        blocks = {name: b for name, b in blocks.items() if name not in merged}

    def mat(module, gguf_name: str | None, heads: int | None = None):
        """(in, out) float32, or a QuantMatrix: imported from the GGUF when it holds this tensor's
        blocks in a type that matches the format, else quantized here."""
        if fmt == WeightFormat.FP32:
            return np.ascontiguousarray(t(module.weight).T)
        k = module.weight.shape[1]
        if gguf_name is not None and gguf_name in blocks:
            kind = blocks[gguf_name][0]
            # int4: each tensor at its own width (Q4_K / Q4_0 / Q4_1 int4; Q5_0 / Q5_K / Q6_K / Q8_0 int8);
            # int8: every type at 8 bits (exact; Q6_K re-rounded per block of 32, gguf_quants)
            if kind in gguf_quants.SUPPORTED:
                counts["imported"] += 1
                return _gguf_matrix(blocks, gguf_name, k, heads, spec.head_dim, 8 if fmt == WeightFormat.INT8 else None)
            log(f"{gguf_name}: GGUF type {kind} is not imported as blocks; quantized from float32")
        counts["quantized"] += 1
        return wquant.quantize(np.ascontiguousarray(t(module.weight).T), fmt)

    def cat(parts):
        return np.concatenate(parts, axis=1) if isinstance(parts[0], np.ndarray) else gguf_quants.join(parts, log)

    # llama.cpp interleaves the RoPE halves of q and k of its "llama" architecture (Mistral checkpoints
    # included), which transformers' GGUF loader reverses for that architecture only; other files
    # (Qwen2, Qwen3) keep transformers' order, so their blocks are imported as they are.
    permuted = spec.architecture == "LlamaForCausalLM"
    q_heads, k_heads = (spec.num_heads, spec.num_kv_heads) if permuted else (None, None)
    layers = []
    for i, layer in enumerate(text.layers):
        a, mlp = layer.self_attn, layer.mlp
        name = lambda n: f"blk.{i}.{n}.weight"  # noqa: E731
        bias = None
        if hasattr(a, "qkv_proj"):  # Phi-3: q|k|v in one matrix already (its GGUF blocks are not imported)
            qkv = mat(a.qkv_proj, None)
        else:
            qkv = cat([mat(a.q_proj, name("attn_q"), q_heads), mat(a.k_proj, name("attn_k"), k_heads),
                       mat(a.v_proj, name("attn_v"))])  # fmt: skip
            if a.q_proj.bias is not None:
                bias = np.concatenate([t(a.q_proj.bias), t(a.k_proj.bias), t(a.v_proj.bias)])
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate|up in one matrix, gate first (Phi3MLP's chunk(2))
            gate_up = mat(mlp.gate_up_proj, None)
        else:
            gate_up = cat([mat(mlp.gate_proj, name("ffn_gate")), mat(mlp.up_proj, name("ffn_up"))])
        qk_norm = getattr(a, "q_norm", None) is not None  # Qwen3, Gemma 3: RMSNorm over head_dim of q and k, before RoPE
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma 3: the attention and MLP outputs normed too
        layers.append(
            LayerWeights(
                input_norm=norm(layer.input_layernorm),
                qkv=qkv,
                qkv_bias=bias,
                o=mat(a.o_proj, name("attn_output")),
                post_norm=norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                gate_up=gate_up,
                down=mat(mlp.down_proj, name("ffn_down")),
                q_norm=norm(a.q_norm) if qk_norm else None,
                k_norm=norm(a.k_norm) if qk_norm else None,
                attn_out_norm=norm(layer.post_attention_layernorm) if sandwich else None,
                mlp_out_norm=norm(layer.post_feedforward_layernorm) if sandwich else None,
            )
        )
    head = m.lm_head.weight
    tied = head.data_ptr() == text.embed_tokens.weight.data_ptr()
    if fmt == WeightFormat.FP32:
        embed, lm_head = t(text.embed_tokens.weight), (None if tied else t(head))
    else:
        # The token table and output projection stay at 8 bits (as llama.cpp's Q4 files keep them)
        # unless the file itself holds them at 4, or `head` asks for a width.
        table_fmt = head_fmt or WeightFormat.INT8
        width = gguf_quants.NATIVE_BITS  # any supported type widens to 8 bits exactly; int4 only from a 4-bit type
        table_bits = head_fmt.bits if head_fmt is not None else (8 if fmt == WeightFormat.INT8 else None)

        def importable(src) -> bool:
            if src is None or src[0] not in width:
                return False
            return table_bits != 4 or width[src[0]] == 4

        embed_src = blocks.get("token_embd.weight")
        if importable(embed_src):
            embed = _gguf_matrix(blocks, "token_embd.weight", spec.hidden_size, None, spec.head_dim, table_bits)
            counts["imported"] += 1
        else:
            embed = wquant.quantize(np.ascontiguousarray(t(text.embed_tokens.weight).T), table_fmt)
            counts["quantized"] += 1
        lm_head = None
        if not tied:
            out_src = blocks.get("output.weight")
            if importable(out_src):
                lm_head = _gguf_matrix(blocks, "output.weight", spec.hidden_size, None, spec.head_dim, table_bits)
                counts["imported"] += 1
            else:
                lm_head = wquant.quantize(np.ascontiguousarray(t(head).T), table_fmt)
                counts["quantized"] += 1
        merged_note = (f" ({counts['lora_requantized']} of them merged with the LoRA adapter, so re-quantized)"
                       if counts.get("lora_requantized") else "")  # fmt: skip
        log(f"{fmt.value} weights: {counts['imported']} matrices imported from the GGUF blocks, "
            f"{counts['quantized']} quantized from float32{merged_note}; token table {embed.bits}-bit")  # fmt: skip
    rotary = text.rotary_emb
    if gemma:  # one RoPE per kind of layer: the global ("full_attention") layers' and the local ones'
        inv_freq, scaling = rotary.full_attention_inv_freq, rotary.full_attention_attention_scaling
        local_freq, local_scaling = t(rotary.sliding_attention_inv_freq).astype(np.float32), rotary.sliding_attention_attention_scaling
    else:
        inv_freq, scaling, local_freq, local_scaling = rotary.inv_freq, rotary.attention_scaling, None, 1.0
    return DecoderWeights(
        embed=embed,
        layers=layers,
        final_norm=norm(text.norm),
        lm_head=lm_head,
        inv_freq=t(inv_freq).astype(np.float32),
        rope_scaling=float(scaling),
        weight_format=fmt.value,
        weight_source={**counts, **({} if fmt == WeightFormat.FP32 else {"head": f"int{embed.bits}"})},
        embed_scale=spec.embed_scale,
        activation=spec.activation,
        query_scale=spec.attention_scale or None,
        local_inv_freq=local_freq,
        local_rope_scaling=float(local_scaling),
    )


def spec_for(source: str, log: Callable[[str], None] = lambda s: None) -> ModelSpec:
    """The ModelSpec of MODEL without loading its weights: a config.json, a model folder, a .gguf
    file or a built-in name (the last two read the GGUF metadata through transformers)."""
    path = Path(source).expanduser()
    if path.suffix == ".json" and path.is_file():
        return spec_from_config(path)
    folder, gguf = resolve_source(source, log)
    if gguf is None:
        return spec_from_config(folder)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{folder / gguf}: cannot read the model configuration ({e})") from e
    spec = spec_from_dict(config.to_dict(), str(folder / gguf))
    return dataclasses.replace(spec, source=source if source in ALIASES else str(folder / gguf))
