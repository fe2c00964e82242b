"""The baseline engines `cabinlm bench` knows: their names, configurations, the Python packages each
needs at run time and how to install them, whether each can run here, and the errors the baselines
raise. Shared by the caller side (bench/baselines.py) and the child side (bench/peers.py); imports
nothing but the standard library and cabinlm.contract.errors.

    hf         transformers, greedy decoding with its default growing cache, float32 weights
               de-quantized from the GGUF.
    llama.cpp  llama-cpp-python (low-level API) on the GGUF file itself; gguf-lookup adds its
               prompt-lookup speculative decoding.
    ort-genai  onnxruntime-genai, models built by its own model builder from the same de-quantized
               weights: int4, int4 with an int8 KV cache, fp32.
"""

from __future__ import annotations

import importlib.util

from cabinlm.contract.errors import CabinlmError

BASELINES = ("hf", "llama.cpp", "ort-genai")

# Configurations of each baseline; the first is the default when one is asked for by name only.
CONFIGS: dict[str, tuple[str, ...]] = {
    "hf": ("fp32",),
    # "gguf": the file's own weights (Q4_1 for the built-in model), f16 KV cache (llama.cpp's default).
    # "gguf-kv8": the same with a q8_0 KV cache (needs flash attention in llama.cpp).
    # "gguf-lookup": "gguf" with prompt-lookup speculative decoding, lossless under greedy decoding (the
    # lever cabinlm's own decoding has): drafts from llama-cpp-python's own LlamaPromptLookupDecoding
    # over the tokens so far, verified in one llama_decode with the logits of every row, the rejected
    # drafts' cells removed from the KV cache (bench/peers.py LlamaCppEngine.advance).
    "llama.cpp": ("gguf", "gguf-kv8", "gguf-lookup"),
    "ort-genai": ("int4", "int4-kv8", "fp32"),
}

# Every baseline first saves the GGUF as float32 transformers weights (bench/prepare.py): the tokenizer
# the script is rendered with, the hf baseline's model and the ort-genai builder's input.
PREPARE_MODULES = ("torch", "transformers", "gguf")

# What `python -m onnxruntime_genai.models.builder` (and its KV-cache calibration) imports when it
# starts (ml_dtypes through onnxruntime.quantization, whose int4 quantizer the builder uses): the
# onnxruntime-genai wheel declares only numpy and onnxruntime, so without these the builder dies on
# its first import. Each is in pyproject's `bench` extra (tests/test_baselines.py checks both this
# list and the extra against the installed builder's own import statements).
ORT_GENAI_BUILDER_MODULES = ("onnx_ir", "onnx", "ml_dtypes", "torch", "transformers", "safetensors", "tqdm")

# Import names each baseline needs, in the order they are checked.
MODULES: dict[str, tuple[str, ...]] = {
    "hf": PREPARE_MODULES,
    "llama.cpp": ("llama_cpp", *PREPARE_MODULES),
    "ort-genai": ("onnxruntime_genai", *ORT_GENAI_BUILDER_MODULES, "gguf"),
}

# Import name -> distribution name (what pip installs).
PACKAGES = {"torch": "torch", "transformers": "transformers", "gguf": "gguf", "llama_cpp": "llama-cpp-python",
            "onnxruntime_genai": "onnxruntime-genai", "onnx_ir": "onnx-ir", "onnx": "onnx",
            "ml_dtypes": "ml-dtypes", "safetensors": "safetensors", "tqdm": "tqdm"}  # fmt: skip

# Exact install commands (also in the error messages). llama-cpp-python compiles llama.cpp from source.
INSTALL = {
    "hf": "pip install 'cabinlm[export]' -c constraints.txt   (torch, transformers, gguf)",
    "llama.cpp": (
        "CMAKE_ARGS='-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF' CMAKE_BUILD_PARALLEL_LEVEL=2 "
        "pip install llama-cpp-python==0.3.36 -c constraints.txt   (compiles llama.cpp: about 7 min on 2 cores)"
    ),
    "ort-genai": (
        "pip install onnxruntime-genai==0.18.0 onnx-ir -c constraints.txt   (onnx-ir: its model builder's IR; "
        "every peer at once: `make bench-deps`)"
    ),
}


class BaselineError(CabinlmError):
    """A baseline engine cannot run, or its run failed."""


class BaselineUnavailable(BaselineError):
    """The optional package a baseline needs is not installed (the message has the install command)."""


def available(name: str) -> str | None:
    """None when the baseline can run here, else a one-line reason with the install command(s).
    Looks for the packages only (importlib.util.find_spec): imports none of them."""
    if name not in BASELINES:
        return f"unknown baseline {name!r}; known: {', '.join(BASELINES)}"
    missing = [m for m in MODULES[name] if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    pkgs = ", ".join(PACKAGES[m] for m in missing)
    verb = "is" if len(missing) == 1 else "are"
    why = ""
    if name == "ort-genai" and "onnxruntime_genai" not in missing:
        why = f" (onnxruntime-genai's model builder imports {'it' if len(missing) == 1 else 'them'})"
    elif name != "hf" and set(missing) <= set(PREPARE_MODULES):
        why = " (needed to read the GGUF once for the baselines)"
    # The export stack's own command for torch/transformers/gguf, the baseline's for the rest.
    commands = dict.fromkeys(INSTALL["hf"] if m in PREPARE_MODULES else INSTALL[name] for m in missing)
    return f"{pkgs} {verb} not installed{why}: {'; and '.join(commands)}"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
