"""The kernel library compiled on the build machine, by `cabinlm build` (never by the runtime).

    compile_library(folder, march)            folder/libcabinlm_kernels.so for the CPU `march` names,
                                              checked to be a library that loads here, with its facts
                                              (spec.KernelLibrary)
    compile_library(folder, march, machine)   the same for another architecture (a car's aarch64 CPU
                                              from an x86_64 build machine): cross-compiled, checked
                                              as an ELF file of that machine, its path read from the file
    registrable(path, facts)                  a library of the same sources this process can register

`march` is the compiler's -march: "native" (the build machine's own CPU), or a CPU or level the
compiler knows ("x86-64-v3", "icelake-server", "armv8.2-a+dotprod"). The library's CPU features are
read from the compiler's predefined macros for that -march (the macros the kernels' own #if's read),
recorded as /proc/cpuinfo flag names, and checked by the runtime against the CPU it runs on.

For this machine's architecture the build runs the fused decoder to check it, so it compiles only
for a CPU this machine can run. For another architecture it cannot run the library at all: the
compiler is the cross compiler for that machine (Debian / Ubuntu: g++-aarch64-linux-gnu), and the
library is checked under emulation (`make test-arm`) or on the car, not by the build.
A compile cache (CABINLM_CACHE/kernels/<key>/) spares the few seconds of a compile; an entry is used
only when its library still has the sha256 recorded when it was written, and only here: the runtime
reads the library from the build folder alone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from cabinlm.engines.ort_fused.kernels import HEADERS, ISAS, LIBRARY, MACHINE_ALIASES, SOURCES, api_version, host_machine
from cabinlm.contract.engines.fused import KernelLibrary
from cabinlm.contract.manifest import file_sha256

FLAGS = ("-O3", "-std=gnu++17", "-ffp-contract=fast", "-fPIC", "-shared", "-fvisibility=hidden")
FIX = "or build with --attention-kernel onnxruntime --matmul-kernel onnxruntime to keep ONNX Runtime's own kernels"

# The compiler's predefined feature macros -> the CPU feature names /proc/cpuinfo lists ("flags" on
# x86, "Features" on Arm). Only features a CPU can lack; a macro not listed here is not checked.
CPU_FLAG_OF_MACRO = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt", "__MOVBE__": "movbe", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512CD__": "avx512cd",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512IFMA__": "avx512ifma",
    "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVXVNNI__": "avx_vnni",
    "__GFNI__": "gfni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
    "__ARM_FEATURE_DOTPROD": "asimddp", "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp",
    "__ARM_FEATURE_MATMUL_INT8": "i8mm", "__ARM_FEATURE_SVE": "sve", "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16",
}  # fmt: skip
_ELF_MACHINE = {"x86_64": 62, "aarch64": 183, "armv7l": 40, "i686": 3, "riscv64": 243}
# Cross compilers tried for another architecture's CPU, after CABINLM_CXX_<MACHINE> (e.g.
# CABINLM_CXX_AARCH64), with the Debian / Ubuntu package that installs the first.
CROSS_COMPILERS = {"aarch64": (("aarch64-linux-gnu-g++",), "g++-aarch64-linux-gnu")}
ISA_TAG = b"cabinlm_block_q4_isa="  # block_q4_matmul.cc: the string cabinlm_block_q4_isa() returns the tail of


class KernelError(RuntimeError):
    """The kernel library cannot be compiled here: no compiler, a compiler that fails, or a CPU target
    this machine cannot run. The builder turns it into a BuildError or keeps ONNX Runtime's kernels."""


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str  # the whole --version text (the cache key); its first line goes into the manifest
    machine: str  # the CPU architecture it compiles for, as platform.machine() names it


@dataclass(frozen=True)
class Compiled:
    path: Path  # folder/LIBRARY
    facts: KernelLibrary
    cached: bool  # taken from the compile cache (verified) rather than compiled now


def find_compiler(machine: str | None = None) -> Compiler:
    """The C++ compiler for `machine`'s CPUs (None: this machine's): for this machine CXX if set (it
    is then the only one tried), else g++, c++ or clang++ on PATH; for another architecture
    CABINLM_CXX_<MACHINE> if set, else its cross compiler on PATH (CROSS_COMPILERS)."""
    if machine is not None and machine != host_machine():
        return _find_cross_compiler(machine)
    asked = os.environ.get("CXX")
    names = [asked] if asked else ["g++", "c++", "clang++"]
    path = next((shutil.which(n) for n in names if shutil.which(n)), None)
    if path is None:
        if asked:
            raise KernelError(f"CXX={asked} is not a program on this machine; set CXX to a C++ compiler, {FIX}")
        raise KernelError("no C++ compiler found (CXX, g++, c++ or clang++) to compile cabinlm's kernels; install one "
                          f"(Debian / Ubuntu: apt install g++), {FIX}")  # fmt: skip
    return _probe(path)


def _find_cross_compiler(machine: str) -> Compiler:
    var = f"CABINLM_CXX_{machine.upper()}"
    asked = os.environ.get(var)
    names, package = CROSS_COMPILERS.get(machine, ((), None))
    path = next((shutil.which(n) for n in ([asked] if asked else names) if shutil.which(n)), None)
    if path is None:
        if asked:
            raise KernelError(f"{var}={asked} is not a program on this machine; set it to a C++ compiler for {machine}, {FIX}")
        how = f"install one (Debian / Ubuntu: apt install {package}) or set {var}" if package else f"set {var} to one"
        raise KernelError(f"no C++ compiler for {machine} CPUs found ({', '.join(names) or var}) to cross-compile "
                          f"cabinlm's kernels for the profile's CPU from this {host_machine()} machine; {how}, {FIX}")  # fmt: skip
    cxx = _probe(path)
    if cxx.machine != machine:
        raise KernelError(f"{path} compiles for {cxx.machine} CPUs, not {machine}; set {var} to a compiler for {machine}, {FIX}")
    return cxx


@functools.lru_cache(maxsize=None)
def _probe(path: str) -> Compiler:
    version = _run([path, "--version"], path, "--version").stdout.strip()
    if not version:
        raise KernelError(f"{path} --version printed nothing: not a C++ compiler; set CXX to one, {FIX}")
    try:
        target = _run([path, "-dumpmachine"], path, "-dumpmachine").stdout.strip().split("-")[0].lower()
    except KernelError:
        target = host_machine()  # a compiler that cannot say compiles for the machine it runs on
    return Compiler(path, version, MACHINE_ALIASES.get(target, target) or host_machine())


def _run(cmd: list[str], cxx: str, what: str, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"{cxx} could not be run ({what}: {e}); set CXX to a working C++ compiler, {FIX}") from e
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise KernelError(f"{cxx} failed ({what}: {why}); set CXX to a working C++ compiler, {FIX}")
    return done


@functools.lru_cache(maxsize=None)
def predefined_macros(cxx: str, march: str) -> frozenset[str]:
    """The names the compiler predefines for -march=`march` (the ISA the kernels' #if's see)."""
    cmd = [cxx, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"{cxx} could not be run ({e}); set CXX to a working C++ compiler, {FIX}") from e
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise KernelError(f"{cxx} does not compile for -march={march} ({why}); set the profile's cpu_march to a CPU "
                          f"this compiler knows (e.g. native, x86-64-v3), {FIX}")  # fmt: skip
    return frozenset(m.group(1) for m in re.finditer(r"^#define (\w+)", done.stdout, re.M))


def cpu_flags(macros: frozenset[str]) -> tuple[str, ...]:
    return tuple(sorted({flag for macro, flag in CPU_FLAG_OF_MACRO.items() if macro in macros}))


def cannot_run_here(cxx: Compiler, march: str) -> str | None:
    """Why this machine cannot run code compiled for -march=`march` (None: it can)."""
    if cxx.machine != host_machine():
        return f"{cxx.path} compiles for {cxx.machine} CPUs, this machine is {host_machine()}"
    if march == "native":
        return None
    missing = sorted(set(cpu_flags(predefined_macros(cxx.path, march))) - set(cpu_flags(predefined_macros(cxx.path, "native"))))
    if missing:
        return f"-march={march} uses {', '.join(missing)}, which this machine's CPU lacks"
    return None


def compile_library(folder: Path, march: str = "native", defines: tuple[str, ...] = (), machine: str | None = None) -> Compiled:
    """folder/LIBRARY compiled for -march=`march`, checked (a shared library of the right machine that
    exports RegisterCustomOps and loads here), with the facts the manifest records.
    defines: preprocessor names for the compile (CABINLM_GENERIC: the plain C++ paths only, what a CPU
    without the vector instructions gets; tests use it and CABINLM_REQUIRE_API_VERSION).
    machine: the CPU architecture to compile for (None: this machine's); another one is cross-compiled
    and checked without being loaded (its BlockQ4MatMul path read from the file's ISA_TAG)."""
    cross = machine is not None and machine != host_machine()
    cxx = find_compiler(machine)
    if cross and march == "native":
        raise KernelError(f"-march=native names this {host_machine()} machine's CPU, not the profile's {machine} one; name "
                          f"it in the profile's cpu_march (e.g. armv8.2-a+dotprod), {FIX}")  # fmt: skip
    why = None if cross else cannot_run_here(cxx, march)
    if why:
        raise KernelError(f"cannot compile cabinlm's kernels for -march={march} here: {why}, and the build runs the "
                          f"fused decoder to check it; build on a machine whose CPU runs it, {FIX}")  # fmt: skip
    macros = predefined_macros(cxx.path, march)
    flags = (*FLAGS, f"-march={march}", *(f"-D{d}" for d in defines))
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), cxx.path, cxx.version, *sorted(macros)]).encode()).hexdigest()[:20]
    target = folder / LIBRARY
    hit = _from_cache(key, target)
    if hit is not None:
        return Compiled(target, hit, cached=True)
    work = Path(tempfile.mkdtemp(prefix=".kernels-", dir=folder))  # inside the build folder: removed below
    try:
        out = work / LIBRARY
        _run([cxx.path, *flags, "-o", str(out), *map(str, SOURCES)], cxx.path, "compiling cabinlm's kernels", timeout=600)
        isa = _check_library(out, cxx, loads=not cross)
        facts = KernelLibrary(file=LIBRARY, sha256=file_sha256(out), ort_api=api_version(), machine=cxx.machine, march=march,
                              cpu_flags=cpu_flags(macros), matmul_isa=isa, compiler=cxx.version.splitlines()[0].strip())  # fmt: skip
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _to_cache(key, target, facts)
    return Compiled(target, facts, cached=False)


@contextlib.contextmanager
def registrable(path: Path | None, facts: KernelLibrary | None) -> Iterator[Path | None]:
    """The build's library `path` where this process can register it; for one cross-compiled for
    another architecture, the plain C++ paths of the same sources compiled for this machine (in a
    scratch folder beside `path`, removed afterwards). What ONNX Runtime's offline optimization of a
    build registers: it reads the ai.cabinlm operators' schemas and never runs them (their inputs are
    activations, so nothing folds them); the build folder keeps the cross-compiled library only."""
    if path is None or facts is None or facts.machine == host_machine():
        yield path
        return
    from cabinlm.contract.errors import BuildError

    scratch = Path(tempfile.mkdtemp(prefix=".host-kernels-", dir=path.parent))
    try:
        try:
            twin = compile_library(scratch, "native", defines=("CABINLM_GENERIC",)).path
        except KernelError as e:
            raise BuildError(f"a build for {facts.machine} CPUs also compiles cabinlm's kernels for this {host_machine()} "
                             f"machine, for ONNX Runtime's offline pass over the graph, and that failed: {e}") from e  # fmt: skip
        yield twin
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def isa_of(data: bytes) -> str | None:
    """BlockQ4MatMul's path as the library's own bytes say (ISA_TAG), without loading it; None: no tag."""
    at = data.find(ISA_TAG)
    if at < 0:
        return None
    end = data.find(b"\0", at)
    return data[at + len(ISA_TAG) : end if end >= 0 else None].decode("ascii", "replace")


def _check_library(path: Path, cxx: Compiler, loads: bool = True) -> str:
    """BlockQ4MatMul's path in the library the compiler says it wrote, or a KernelError: a compiler that
    exits 0 without writing a loadable library must not become a build. loads=False (a library for
    another architecture): checked as an ELF file of that machine, its path read from the file."""
    if not path.is_file() or path.stat().st_size == 0:
        raise KernelError(f"{cxx.path} exited 0 but wrote no library ({path.name} is missing or empty); set CXX to a "
                          f"working C++ compiler, {FIX}")  # fmt: skip
    if sys.platform.startswith("linux"):
        problem = elf_problem(path.read_bytes(), cxx.machine)
        if problem:
            raise KernelError(f"{cxx.path} exited 0 but wrote no loadable library ({problem}); set CXX to a working C++ "
                              f"compiler, {FIX}")  # fmt: skip
    if not loads:
        tagged = isa_of(path.read_bytes())
        if tagged not in ISAS:
            raise KernelError(f"{cxx.path} exited 0 but its library does not say which BlockQ4MatMul path it holds "
                              f"(no {ISA_TAG.decode()} tag); set {f'CABINLM_CXX_{cxx.machine.upper()}'} to a working "
                              f"C++ compiler, {FIX}")  # fmt: skip
        return tagged
    # Loaded in a child process: whatever the file does when it loads cannot take the build down.
    probe = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.RegisterCustomOps; f = lib.cabinlm_block_q4_isa; "
             "f.restype = ctypes.c_char_p; print(f().decode())")  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelError(f"could not load the compiled kernel library to check it ({e})") from e
    isa = done.stdout.strip()
    if done.returncode != 0 or isa not in ISAS:
        why = f"signal {-done.returncode}" if done.returncode < 0 else (done.stderr.strip().splitlines() or [isa or "no answer"])[-1]
        raise KernelError(f"{cxx.path} exited 0 but its library does not load here ({why}); set CXX to a working C++ "
                          f"compiler, {FIX}")  # fmt: skip
    return isa


def elf_problem(data: bytes, machine: str) -> str | None:
    """What keeps `data` from being a shared library for `machine` that exports RegisterCustomOps
    (None: nothing). Reads the ELF header, the section table and the dynamic symbols, all bounds-checked."""
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return "not an ELF file"
    wide, end = data[4] == 2, "<" if data[5] == 1 else ">"
    head = struct.unpack_from(end + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"), data, 16)
    e_type, e_machine, shoff, shentsize, shnum = head[0], head[1], head[5], head[10], head[11]
    if e_type != 3:
        return "not a shared library"
    if machine in _ELF_MACHINE and e_machine != _ELF_MACHINE[machine]:
        return f"not for {machine} (ELF machine {e_machine})"
    sec_fmt, sym_fmt = (end + "IIQQQQIIQQ", end + "IBBHQQ") if wide else (end + "IIIIIIIIII", end + "IIIBBH")
    if shentsize < struct.calcsize(sec_fmt) or shoff + shnum * shentsize > len(data):
        return "truncated: its section table lies past the end of the file"
    sections = [struct.unpack_from(sec_fmt, data, shoff + i * shentsize) for i in range(shnum)]
    for s in sections:
        if s[1] != 11:  # SHT_DYNSYM
            continue
        offset, size, link = s[4], s[5], s[6]
        if link >= shnum or offset + size > len(data):
            return "truncated: its dynamic symbols lie past the end of the file"
        strtab = sections[link]
        names = data[strtab[4] : strtab[4] + strtab[5]]
        step = struct.calcsize(sym_fmt)
        for at in range(offset, offset + size - step + 1, step):
            sym = struct.unpack_from(sym_fmt, data, at)
            name_at, shndx = sym[0], (sym[3] if wide else sym[5])
            if names[name_at : name_at + 18] == b"RegisterCustomOps\0" and shndx != 0:
                return None
        return "it does not export RegisterCustomOps"
    return "it has no dynamic symbol table"


def _cache_dir() -> Path:
    return Path(os.environ.get("CABINLM_CACHE", Path.home() / ".cache" / "cabinlm")) / "kernels"


def _from_cache(key: str, target: Path) -> KernelLibrary | None:
    """The cached library copied to `target`, when the cache holds one whose bytes are still those
    recorded when it was compiled (and the copy's too); None otherwise (compile it)."""
    entry = _cache_dir() / key
    try:
        facts = KernelLibrary.from_dict(json.loads((entry / "library.json").read_text()))
        if not (entry / LIBRARY).is_file() or file_sha256(entry / LIBRARY) != facts.sha256:
            return None
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copyfile(entry / LIBRARY, tmp)
        if file_sha256(tmp) != facts.sha256:
            tmp.unlink()
            return None
        os.replace(tmp, target)
        return facts
    except (OSError, ValueError, TypeError):  # no entry, or an unreadable / damaged one: compile again
        return None


def _to_cache(key: str, library: Path, facts: KernelLibrary) -> None:
    """Keep a copy for the next build on this machine. The cache is a shortcut only: where it cannot
    be written, the next build compiles again."""
    entry = _cache_dir() / key
    try:
        entry.mkdir(parents=True, exist_ok=True)
        for name, write in ((LIBRARY, lambda p: shutil.copyfile(library, p)),
                            ("library.json", lambda p: p.write_text(json.dumps(facts.to_dict(), indent=1)))):  # fmt: skip
            tmp = entry / f".{name}.{os.getpid()}"
            write(tmp)
            os.replace(tmp, entry / name)  # atomic: a concurrent build of the same key writes the same bytes
    except OSError:
        return


def unavailable(march: str = "native", machine: str | None = None) -> str | None:
    """Why `cabinlm build` cannot compile the kernel library for -march=`march` (on `machine`'s CPUs,
    None: this machine's) here (None: it can)."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            compile_library(Path(folder), march, machine=machine)
        except KernelError as e:
            return str(e).splitlines()[0]
    return None
