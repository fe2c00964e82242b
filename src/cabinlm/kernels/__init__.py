"""cabinlm's own ONNX Runtime kernels, compiled on the machine that runs them.

One library today, `int8_kv_attention.cc`: `ai.cabinlm::Int8KVAttention`, the fused cpu build's
attention over its int8 KV cache (the file's header says what it computes and what it guarantees).
It is C++ with no dependency but the compiler: the ONNX Runtime C API entries it calls are declared
in the file itself.

The library is compiled once per source, compiler and CPU (`-march=native`: the machine's own vector
instructions) into the cache folder (CABINLM_CACHE, default ~/.cache/cabinlm) under kernels/, by
`cabinlm build` and, where a build is copied to another machine, at its first load there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("int8_kv_attention.cc")
DOMAIN = "ai.cabinlm"
ATTENTION_OP = "Int8KVAttention"
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


def library() -> Path:
    """The compiled library for this machine: from the cache, or compiled now (a few seconds)."""
    cxx = _compiler()
    if cxx is None:
        raise KernelError("no C++ compiler found (CXX, g++, c++ or clang++) to compile cabinlm's attention kernel; "
                          "install one (Debian / Ubuntu: apt install g++), or build with --attention-kernel onnxruntime")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), _version(cxx), platform.machine(),
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
            done = subprocess.run([cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelError(f"{cxx} could not be run to compile {SOURCE.name} ({e}); set CXX to a working C++ compiler") from e
        if done.returncode != 0:
            raise KernelError(f"{cxx} could not compile {SOURCE.name} (exit {done.returncode}):\n{done.stderr.strip()[-2000:]}\n"
                              "build with --attention-kernel onnxruntime to use ONNX Runtime's own attention instead")
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
