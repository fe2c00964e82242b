"""The runtime's side of the kernel library: the file a build lists, checked before anything opens it.

ONNX Runtime dlopens a registered library and calls into it, so a truncated or altered file can stop
the process with a signal, and code for a CPU feature this CPU lacks with SIGILL. Everything that can
be known without opening the file is therefore checked first, each refusal one line naming the fix:

    the build lists a library (FusedSettings.kernels)      else: made before the library came with builds
    onnxruntime >= 1.{ort_api}                             the C API version it was compiled against
    this machine's architecture and CPU features           what the compiler's -march let the code use
    the file: there, a regular file, the sha256 recorded   missing, a folder, truncated, bit-flipped, replaced

Nothing here compiles, and no cache is read: the library is the build folder's file or nothing.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from cabinlm.engines.backend import BackendError
from cabinlm.engines.ort_fused.kernels import host_machine
from cabinlm.contract.engines.fused import FusedSettings, KernelLibrary
from cabinlm.contract.manifest import file_sha256

AGAIN = "run `cabinlm build` again"


def onnxruntime_minor(version: str) -> int | None:
    """"1.20.1" -> 20 (onnxruntime 1.N serves C API versions 1..N); None for a version not 1.x."""
    m = re.match(r"1\.(\d+)", version)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str] | None:
    """This CPU's feature names as /proc/cpuinfo lists them (x86 "flags", Arm "Features"); None where
    the system does not say (then the features are not checked). Only the field of this machine's
    architecture is read: under user-mode emulation (qemu-user running aarch64 code on an x86_64 host)
    /proc/cpuinfo is the host's, whose x86 flags say nothing about the emulated CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    field = "flags" if host_machine() in ("x86_64", "i686") else "Features"
    m = re.search(rf"^{field}\s*:(.*)$", text, re.M)
    return frozenset(m.group(1).split()) if m else None


def check_runs_here(lib: KernelLibrary, where: Path, ort_version: str) -> None:
    """Refuse a library this onnxruntime, this machine or this CPU cannot run (one line, with the fix)."""
    minor = onnxruntime_minor(ort_version)
    if minor is None or minor < lib.ort_api:
        raise BackendError(f"{where}: cabinlm's kernels in this build need onnxruntime's C API version {lib.ort_api} "
                           f"(onnxruntime >= 1.{lib.ort_api}); this is onnxruntime {ort_version}: install "
                           f"onnxruntime>=1.{lib.ort_api}")  # fmt: skip
    if lib.machine != host_machine():
        raise BackendError(f"{where}: the build's kernel library is for {lib.machine} CPUs, this machine is "
                           f"{host_machine()}; {AGAIN} with a profile for this machine")  # fmt: skip
    have = host_cpu_flags()
    missing = sorted(set(lib.cpu_flags) - have) if have is not None else []
    if missing:
        raise BackendError(f"{where}: the build's kernel library was compiled for -march={lib.march} and uses "
                           f"{', '.join(missing)}, which this CPU lacks; {AGAIN} with a profile whose cpu_march "
                           "this CPU runs (cpu_march = \"native\" when building on this machine)")  # fmt: skip


def checked_library(folder: Path, fused: FusedSettings, ort_version: str) -> Path:
    """The build's kernel library, verified against the manifest (BuildSpec "fused.kernels"), or a
    BackendError before ONNX Runtime has seen the file."""
    lib = fused.kernels
    if lib is None:
        raise BackendError(f"{folder}: this build runs cabinlm's own kernels but lists no kernel library (it was made "
                           f"before the library came with the build); {AGAIN}")  # fmt: skip
    check_runs_here(lib, folder, ort_version)
    path = folder / lib.file
    if not path.exists():
        raise BackendError(f"{path}: the build's kernel library is missing; copy the whole build folder, or {AGAIN}")
    if not path.is_file():
        raise BackendError(f"{path}: the build's kernel library is not a regular file; {AGAIN}")
    try:
        digest = file_sha256(path)
    except OSError as e:
        raise BackendError(f"{path}: cannot read the build's kernel library ({e.strerror or e}); {AGAIN}") from e
    if digest != lib.sha256:
        raise BackendError(f"{path}: not the kernel library this build compiled (sha256 {digest[:16]}, the "
                           f"manifest says {lib.sha256[:16]}): damaged, truncated or replaced; {AGAIN}")  # fmt: skip
    return path
