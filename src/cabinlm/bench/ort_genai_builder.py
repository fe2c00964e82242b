"""onnxruntime-genai's model builder, run on a configuration in the form it reads.

    python -m cabinlm.bench.ort_genai_builder -i HF -o OUT -p int4 -e cpu ...   (the builder's own arguments)

transformers 5 nests Gemma 3's RoPE per kind of layer (rope_parameters = {"full_attention": {...},
"sliding_attention": {...}}); the builder of onnxruntime-genai 0.18 reads the older flat form
(rope_parameters["rope_type"], rope_theta for the global layers, rope_local_base_freq for the local
ones) and stops with KeyError 'rope_type'. This runs the builder unchanged, with the configuration
it loads given the same values in that form: the model it builds is the same model. Any other
configuration passes through untouched.
"""

from __future__ import annotations

import runpy


def flat_rope(config):
    """Gemma 3's nested per-layer-type RoPE as the flat fields onnxruntime-genai's builder reads."""
    text = getattr(config, "text_config", None) or config
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and "sliding_attention" in params:
        full, local = params["full_attention"], params["sliding_attention"]
        text.rope_parameters = dict(full)
        text.rope_theta = full["rope_theta"]
        text.rope_local_base_freq = local["rope_theta"]
    return config


def main() -> None:
    from transformers import AutoConfig

    load = AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        return flat_rope(load(cls, *args, **kwargs))

    AutoConfig.from_pretrained = classmethod(from_pretrained)
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
