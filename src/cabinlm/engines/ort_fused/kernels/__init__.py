"""cabinlm's own ONNX Runtime kernels: compiled by `cabinlm build` into the build folder, checked and
registered by the runtime, which never compiles anything.

One library, operators in domain ai.cabinlm for the fused cpu build (each file's header says what
it computes and what it guarantees):

* `int8_kv_attention.cc`: `Int8KVAttention`, the attention over the int8 KV cache, and
  `FloatKVAttention`, the same over a float32 cache (fp32 KV builds, vision-language decoders among
  them); their `...SeatsAttention` twins run every seat of a batched graph in one node;
* `block_q4_matmul.cc`: `BlockQ4MatMul`, the layers' matmuls over GGUF Q4_1 blocks (4-bit codes,
  float16 scale and minimum) read as they are, and `BlockQ4SwiGLUMatMul`, the MLP's down projection
  of silu(gate) * up;
* `block_q8_matmul.cc`: `BlockQ8MatMul`, the LM head over symmetric int8 blocks (float32 scales),
  read in place from the one map of the weights by every graph of the build; `block_matmul.h`: what
  both block matmuls share (their operands, the rows' int8 codes, the walk over a tile's rows);
* `lora_terms.cc`: `LoraTerms`, a switchable LoRA adapter's terms (x A^T) B^T added into the
  columns of a fused projection's output, each seat's rows with that seat's factors, and
  `LoraSwiGLUTerms`, the same over silu(gate) * up for the down projection;
* `register.cc`: the entry point ONNX Runtime calls, which refuses an onnxruntime older than the C
  API version compiled for; `ort_api.h`: how the kernels reach ONNX Runtime's C API, through
  `ort_api_entries.h`, generated from onnxruntime_c_api.h by tools/gen_ort_api.py (no ONNX Runtime
  headers are needed to compile); `vector_math.h`: the portable float vectors both kernels use.

    compiler.compile_library(folder, march[, machine])   the build machine: folder/LIBRARY for a CPU (this
                                              machine's architecture, or cross-compiled for another), with its facts
    ort_fused.kernel_library.checked_library(folder, fused, version)   the runtime: the build's library, verified
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

from cabinlm.contract.engines.fused import MATMUL_ISAS

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("register.cc", "int8_kv_attention.cc", "block_q4_matmul.cc", "block_q8_matmul.cc",
                                         "lora_terms.cc"))
HEADERS = (HERE / "ort_api.h", HERE / "ort_api_entries.h", HERE / "vector_math.h", HERE / "block_matmul.h")
LIBRARY = "libcabinlm_kernels.so"  # the file in a build folder (manifest files: "kernel_library")
DOMAIN = "ai.cabinlm"
ATTENTION_OP = "Int8KVAttention"
SEATS_ATTENTION_OP = "Int8KVSeatsAttention"  # a batched graph's layer: every seat's rows over its own cache
FLOAT_ATTENTION_OP = "FloatKVAttention"  # the two above over a float32 cache (fp32 KV), scales of 1
FLOAT_SEATS_ATTENTION_OP = "FloatKVSeatsAttention"
MATMUL_OP = "BlockQ4MatMul"
SWIGLU_MATMUL_OP = "BlockQ4SwiGLUMatMul"  # the MLP's down projection, its SwiGLU included
Q8_MATMUL_OP = "BlockQ8MatMul"  # the LM head's symmetric int8 blocks, read in place
LORA_OP = "LoraTerms"  # a switchable adapter's terms beside a fused projection, per seat
LORA_SWIGLU_OP = "LoraSwiGLUTerms"  # the down projection's, over silu(gate) * up
MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64", "x64": "x86_64"}
ISAS = MATMUL_ISAS  # the block matmuls' paths: a library holds one (spec.MATMUL_ISAS)


def host_machine() -> str:
    """This machine's CPU architecture, named as Linux names it (x86_64, aarch64)."""
    m = platform.machine().lower()
    return MACHINE_ALIASES.get(m, m)


@functools.lru_cache(maxsize=None)
def api_version() -> int:
    """The onnxruntime C API version the kernels are compiled against (kApiVersion of the generated
    ort_api_entries.h: the ORT_API_VERSION of the onnxruntime_c_api.h it was generated from)."""
    m = re.search(r"constexpr uint32_t kApiVersion = (\d+);", (HERE / "ort_api_entries.h").read_text())
    if m is None:  # the file is generated: only an edit by hand can lose the line
        raise RuntimeError(f"{HERE / 'ort_api_entries.h'} has no kApiVersion; run `python tools/gen_ort_api.py`")
    return int(m.group(1))
