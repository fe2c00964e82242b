"""cabinlm's own ONNX Runtime kernels, compiled on the machine that runs them.

One library, operators in domain ai.cabinlm for the fused cpu build (each file's header says what
it computes and what it guarantees):

* `int8_kv_attention.cc`: `Int8KVAttention`, the attention over the int8 KV cache;
* `block_q4_matmul.cc`: `BlockQ4MatMul`, the layers' matmuls over GGUF Q4_1 blocks (4-bit codes,
  float16 scale and minimum) read as they are, and `BlockQ4SwiGLUMatMul`, the MLP's down projection
  of silu(gate) * up;
* `register.cc`: the entry point ONNX Runtime calls; `ort_api.h`: the ONNX Runtime C API entries
  the kernels call, declared by their place in the API's table (no ONNX Runtime headers needed);
  `vector_math.h`: the portable float vectors both kernels compute with.

The library is compiled once per source, compiler and CPU (`-march=native`: the machine's own vector
instructions) into the cache folder (CABINLM_CACHE, default ~/.cache/cabinlm) under kernels/, by
`cabinlm build` and, where a build is copied to another machine, at its first load there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("register.cc", "int8_kv_attention.cc", "block_q4_matmul.cc"))
HEADERS = (HERE / "ort_api.h", HERE / "vector_math.h")
DOMAIN = "ai.cabinlm"
ATTENTION_OP = "Int8KVAttention"
MATMUL_OP = "BlockQ4MatMul"
SWIGLU_MATMUL_OP = "BlockQ4SwiGLUMatMul"  # the MLP's down projection, its SwiGLU included
FLAGS = ("-O3", "-march=native", "-std=gnu++17", "-ffp-contract=fast", "-fPIC", "-shared", "-fvisibility=hidden")


class KernelError(RuntimeError):
    """The kernel library cannot be compiled here (no compiler, or the compiler failed)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=None)
def _version(cxx: str) -> str:
    """The compiler's --version text, asked once per process."""
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"{cxx} --version failed ({e}); set CXX to a working C++ compiler") from e


@functools.lru_cache(maxsize=None)
def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else its name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() or platform.machine()


def _cache() -> Path:
    return Path(os.environ.get("CABINLM_CACHE", Path.home() / ".cache" / "cabinlm")) / "kernels"


def library(defines: tuple[str, ...] = ()) -> Path:
    """The compiled library for this machine: from the cache, or compiled now (a few seconds).
    defines: preprocessor names set for the compile (CABINLM_GENERIC: the plain C++ paths only,
    what a CPU without the vector instructions gets; the tests run them here)."""
    cxx = _compiler()
    if cxx is None:
        raise KernelError("no C++ compiler found (CXX, g++, c++ or clang++) to compile cabinlm's kernels; "
                          "install one (Debian / Ubuntu: apt install g++), or build with --attention-kernel onnxruntime "
                          "--matmul-kernel onnxruntime")
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    flags = (*FLAGS, *(f"-D{name}" for name in defines))
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), _version(cxx), platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]  # fmt: skip
    out = _cache() / f"libcabinlm_kernels-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise KernelError(f"cannot write the compiled kernel into {out.parent} ({e.strerror or e}); "
                          "set CABINLM_CACHE to a writable folder") from e
    try:
        try:
            done = subprocess.run([cxx, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelError(f"{cxx} could not be run to compile cabinlm's kernels ({e}); set CXX to a working C++ compiler") from e
        if done.returncode != 0:
            raise KernelError(f"{cxx} could not compile cabinlm's kernels (exit {done.returncode}):\n{done.stderr.strip()[-2000:]}\n"
                              "build with --attention-kernel onnxruntime --matmul-kernel onnxruntime to use ONNX Runtime's own kernels instead")
        os.replace(tmp, out)  # atomic: a concurrent compile of the same key writes the same bytes
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def unavailable() -> str | None:
    """Why the kernel library cannot be had on this machine (None: it can)."""
    try:
        library()
    except KernelError as e:
        return str(e).splitlines()[0]
    return None


@functools.lru_cache(maxsize=None)
def matmul_isa(path: str | None = None) -> str:
    """The path BlockQ4MatMul was compiled with here: "avx512-vnni" (fast), or "generic" (plain C++,
    correct but slower than ONNX Runtime's MatMulNBits: the build then keeps MatMulNBits)."""
    lib = ctypes.CDLL(path or str(library()))
    fn = lib.cabinlm_block_q4_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()
