"""The car's ARM CPUs: `cabinlm build --engine cpu` for an ARM profile cross-compiles cabinlm's kernels
for the CPU the profile names, and the build runs on aarch64, checked here under emulation.

Two halves, one per machine:

    the build machine (x86_64)   the sa8775p CPU build: its library is an aarch64 ELF file with the
                                 NEON dotprod BlockQ4MatMul, listed with its sha256; this machine
                                 refuses to run it in one line; every ARM profile names a CPU the
                                 cross compiler knows. With CABINLM_ARM_EXCHANGE set (`make test-arm`)
                                 it hands the emulator the build, the streaming reference's logits
                                 and two cross-compiled libraries (NEON, plain C++)
    aarch64 (`make test-arm`:    the libraries run the NEON paths (their own answer: dotprod for
    qemu-user, arm64 Debian)     sa8775p's -march, i8mm for Thor's); both are the plain C++ path and
                                 the build machine's own path bit for bit, and the float64 block
                                 arithmetic within float rounding; a chunk's rows are its one-token
                                 steps (i8mm: smmla for pairs, sdot alone); the sa8775p build follows
                                 the streaming reference within the conformance tolerance of the
                                 x86 int8-KV build

What tests/test_kernels.py cannot see on x86: it runs the library compiled for the machine it runs
on, so the NEON code and the cross compile are never exercised there (`make test-arm` also runs its
kernel tests under emulation, on the NEON library handed over here).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cabinlm.engines.ort_fused import kernels
from cabinlm.engines.ort_fused.kernels import compiler
from cabinlm.engines.ort_fused.kernels import host_machine
from cabinlm.profiles import cpu_engine, list_profiles, load_profile

PROFILE = "sa8775p"
MARCH = "armv8.2-a+dotprod"  # the sa8775p profile's cpu_march
I8MM_MARCH = "armv9-a+i8mm"  # the thor profile's: BlockQ4MatMul's i8mm path
ARM_LIBRARIES = {"neon": (MARCH, "neon-dotprod"), "i8mm": (I8MM_MARCH, "neon-i8mm")}
EXCHANGE = os.environ.get("CABINLM_ARM_EXCHANGE")  # the folder the build machine hands the emulator
ON_ARM = host_machine() == "aarch64"
on_the_build_machine = pytest.mark.skipif(ON_ARM, reason="cross-compiles from the build machine (x86_64)")
on_arm = pytest.mark.skipif(not ON_ARM, reason="runs on aarch64: `make test-arm` runs it under emulation")


def matmul_outputs(library: Path) -> dict[str, np.ndarray]:
    """BlockQ4MatMul, BlockQ4SwiGLUMatMul and BlockQ8MatMul through `library` on fixed cases (K x N =
    64 x 16, 160 x 64, 576 x 48; 1, 2, 3 and 7 rows; a block of zeros): {name: y}, and {name + "/x": x}."""
    from test_kernels import _matmul_session, _q4_case

    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout, block_q8_layout

    out = {}
    for K, N in ((64, 16), (160, 64), (576, 48)):
        q, d, m = _q4_case(K, N, seed=K + N)
        rng = np.random.default_rng(K)
        for swiglu in (False, True):
            session = _matmul_session(block_q4_layout(q, d, m), library, swiglu=swiglu)
            for rows in (1, 2, 3, 7):
                x = (rng.standard_normal((1, rows, K * (2 if swiglu else 1))) * 2).astype(np.float32)
                x[0, 0, :32] = 0.0  # a block of zeros: scale 0
                name = f"{K}x{N}{'-swiglu' if swiglu else ''}-{rows}"
                out[name], out[name + "/x"] = session.run(None, {"x": x})[0], x
        # BlockQ8MatMul, the LM head's kernel, on the same shapes
        from test_block_q8 import _q8_case

        head = _matmul_session(block_q8_layout(*_q8_case(K, N, seed=K * N)), library, op=kernels.Q8_MATMUL_OP)
        for rows in (1, 2, 3, 7):
            x = (rng.standard_normal((1, rows, K)) * 2).astype(np.float32)
            x[0, 0, :32] = 0.0
            name = f"{K}x{N}-q8-{rows}"
            out[name], out[name + "/x"] = head.run(None, {"x": x})[0], x
    return out


def isa_of_library(path: Path, kernel: str = "block_q4") -> str:
    """What the library itself says its BlockQ4MatMul path is, or (kernel="attention") its attention
    kernel's int8 conversion path (loaded here: this machine's only)."""
    f = getattr(ctypes.CDLL(str(path)), f"cabinlm_{kernel}_isa")
    f.restype = ctypes.c_char_p
    return f().decode()


# --- the build machine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arm_build(load, tiny_llama_dir, export_to, tmp_path_factory):
    """The tiny Llama with int8 KV (tests/test_backends.py's fused int8 case: its layout, float
    activations) built by the CLI for sa8775p's CPU, and its build log."""
    from test_backends import LAYOUT
    from test_cli import cabinlm

    why = compiler.unavailable(MARCH, "aarch64")
    if why is not None:
        pytest.skip(f"no aarch64 cross compiler here: {why}")
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    out = tmp_path_factory.mktemp("arm") / "sa8775p-cpu"
    p = cabinlm("build", art, "--profile", PROFILE, "--engine", "cpu", "-o", out, "--attention", "fused", "--accuracy-level", 0)
    assert p.returncode == 0, p.stderr
    return art, out, p.stderr


@on_the_build_machine
def test_an_arm_profiles_cpu_build_carries_kernels_cross_compiled_for_its_cpu(arm_build):
    from cabinlm.engines.ort_fused.kernels.compiler import elf_problem, isa_of
    from cabinlm.contract.manifest import load_manifest

    _, out, log = arm_build
    m = load_manifest(out)  # every file's sha256 checked, the library's included
    lib = m.build.facts.kernels
    assert m.runtime_spec.profile == f"{PROFILE}-cpu" and m.build.facts.attention_kernel == "cabinlm"
    assert (lib.machine, lib.march, lib.matmul_isa, lib.cpu_flags) == ("aarch64", MARCH, "neon-dotprod", ("asimddp",))
    assert lib.compiler.startswith("aarch64-linux-gnu-g++")
    data = (out / lib.file).read_bytes()
    assert m.files["kernel_library"].path == lib.file and m.files["kernel_library"].sha256 == lib.sha256
    assert elf_problem(data, "aarch64") is None and elf_problem(data, "x86_64") is not None  # an arm64 shared library
    assert isa_of(data) == "neon-dotprod"
    assert f"compiled for -march={MARCH} (aarch64" in log
    assert "not checked against the exported graph here: its kernels are for aarch64 CPUs" in log


@on_the_build_machine
def test_this_machine_refuses_the_arm_build_in_one_line(arm_build):
    from test_cli import assert_clean_error, cabinlm

    _, out, _ = arm_build
    text = out.parent / "text.txt"
    text.write_text("The driver asked for the route to the airport.")
    p = cabinlm("perplexity", out, "--text", text)
    assert_clean_error(p, "the build's kernel library is for aarch64 CPUs, this machine is x86_64")


@on_the_build_machine
def test_a_cross_build_with_no_compiler_for_this_machine_is_one_build_error(arm_build, tmp_path, monkeypatch):
    """ONNX Runtime's offline pass registers a copy of the kernels compiled for this machine: without
    a compiler for it the build stops with a BuildError that says so (not a traceback), and writes no
    manifest."""
    from cabinlm.engines.build import BuildError, build_artifact

    art, _, _ = arm_build
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(BuildError, match="also compiles cabinlm's kernels for this x86_64 machine"):
        build_artifact(art, cpu_engine(load_profile(PROFILE)), tmp_path / "out", attention="fused", accuracy_level=0)
    assert not (tmp_path / "out" / "manifest.json").exists()


@on_the_build_machine
def test_the_tag_says_what_the_library_says(tmp_path):
    """The ISA read from a cross-compiled file (never loaded) is the one the function returns: checked
    on this machine's own libraries, both paths."""
    from cabinlm.engines.ort_fused.kernels.compiler import compile_library, isa_of

    for name, defines in (("native", ()), ("generic", ("CABINLM_GENERIC",))):
        (tmp_path / name).mkdir()
        lib = compile_library(tmp_path / name, defines=defines)
        assert isa_of(lib.path.read_bytes()) == isa_of_library(lib.path) == lib.facts.matmul_isa


@on_the_build_machine
def test_this_machines_fast_path_is_the_plain_cpp_path_bit_for_bit(tmp_path):
    """The paths' shared arithmetic (exact integer sums, the same fused multiply-adds) on x86: AVX-512
    VNNI where this CPU has it against the plain C++ path, every case the emulated NEON run compares."""
    from cabinlm.engines.ort_fused.kernels.compiler import compile_library

    libs = {}
    for name, defines in (("native", ()), ("generic", ("CABINLM_GENERIC",))):
        (tmp_path / name).mkdir()
        libs[name] = compile_library(tmp_path / name, defines=defines)
    if libs["native"].facts.matmul_isa == "generic":
        pytest.skip("this CPU has no fast BlockQ4MatMul path")
    fast, plain = (matmul_outputs(libs[name].path) for name in ("native", "generic"))
    for name in fast:
        np.testing.assert_array_equal(fast[name], plain[name], err_msg=name)


@on_the_build_machine
def test_every_soc_profile_names_an_arm_cpu_with_the_dot_product(tmp_path):
    """Every built-in profile but the host's names an aarch64 CPU whose -march the cross compiler
    knows and gives the dot product (the NEON path); the cpu profile stays the build machine's."""
    from cabinlm.engines.ort_fused.kernels.compiler import find_compiler, predefined_macros

    cpu = load_profile("cpu")
    assert cpu_engine(cpu) is cpu and cpu.cpu_arch is None and cpu.kernels_march == "native"
    socs = [load_profile(n) for n in list_profiles() if n != "cpu"]
    assert socs and all(p.cpu_arch == "aarch64" and p.cpu for p in socs)
    if compiler.unavailable(MARCH, "aarch64") is not None:
        pytest.skip("no aarch64 cross compiler here")
    cxx = find_compiler("aarch64").path
    for p in socs:
        assert "__ARM_FEATURE_DOTPROD" in predefined_macros(cxx, p.cpu_march), p.name
        engine = cpu_engine(p)
        assert engine.execution_provider == "CPUExecutionProvider" and not engine.static_shapes
        assert (engine.name, engine.bandwidth_gbs, engine.budget_bytes) == (f"{p.name}-cpu", p.bandwidth_gbs, p.budget_bytes)


def test_a_profile_that_names_no_cpu_cannot_have_a_cpu_engine():
    from cabinlm.profiles.schema import ProfileError, parse_profile

    text = (Path(load_profile.__code__.co_filename).parent / "builtin" / f"{PROFILE}.toml").read_text()
    nameless = "\n".join(line for line in text.splitlines() if not line.startswith(("cpu_arch", "cpu_march")))
    with pytest.raises(ProfileError, match="does not name its CPU"):
        cpu_engine(parse_profile(nameless, "nameless.toml"))
    with pytest.raises(ProfileError, match="must name that CPU's ISA"):
        parse_profile(text.replace(f'cpu_march = "{MARCH}"', 'cpu_march = "native"'), "native.toml")
    with pytest.raises(ProfileError, match="not one of x86_64, aarch64"):
        parse_profile(text.replace('cpu_arch = "aarch64"', 'cpu_arch = "arm64e"'), "arm64e.toml")


@on_the_build_machine
@pytest.mark.skipif(not EXCHANGE, reason="hands the emulator its inputs: `make test-arm` sets CABINLM_ARM_EXCHANGE")
def test_hand_the_emulator_its_inputs(arm_build, load, tiny_llama_dir):
    """EXCHANGE/build (the sa8775p CPU build), EXCHANGE/expected.npz (the streaming reference's logits
    for tests/test_backends.py's stream), EXCHANGE/neon and /generic (the kernels cross-compiled with
    and without the NEON path, for the same -march), EXCHANGE/i8mm (for Thor's -march: the i8mm
    path), EXCHANGE/x86/matmul.npz (BlockQ4MatMul's
    outputs on this machine's own path, with their inputs)."""
    from test_backends import LAYOUT, STREAM, TOLERANCE, reference_logits

    from cabinlm.engines.ort_fused.kernels.compiler import compile_library
    from cabinlm.contract.layout import KVDType

    _, out, _ = arm_build
    folder = Path(EXCHANGE)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(out, folder / "build")
    ids = np.random.default_rng(7).integers(3, 300, sum(n for n, _ in STREAM))
    expected = reference_logits(load(str(tiny_llama_dir)).model, ids)
    np.savez(folder / "expected.npz", ids=ids, *expected)
    (folder / "stream.json").write_text(json.dumps({"stream": STREAM, "chunk": LAYOUT["chunk"], "window": LAYOUT["window"],
                                                    "tolerance": TOLERANCE[KVDType.INT8]}))  # fmt: skip
    for name, march, defines in (("neon", MARCH, ()), ("i8mm", I8MM_MARCH, ()), ("generic", MARCH, ("CABINLM_GENERIC",))):
        (folder / name).mkdir()
        compile_library(folder / name, march, defines=defines, machine="aarch64")
    (folder / "x86").mkdir()
    here = compile_library(folder / "x86")  # this machine's own path: its outputs, for the emulator to compare
    np.savez(folder / "x86" / "matmul.npz", isa=here.facts.matmul_isa, **matmul_outputs(here.path))


# --- aarch64 (under emulation) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def exchange() -> Path:
    if not EXCHANGE or not (Path(EXCHANGE) / "stream.json").is_file():
        pytest.fail("CABINLM_ARM_EXCHANGE names no folder the build machine wrote; run `make test-arm`")
    return Path(EXCHANGE)


@on_arm
def test_the_arm_libraries_run_blockq4matmuls_neon_paths(exchange):
    from cabinlm.contract.manifest import load_manifest

    build = exchange / "build"
    lib = load_manifest(build).build.facts.kernels
    assert lib.matmul_isa == "neon-dotprod" == isa_of_library(build / lib.file)  # the manifest and the code agree
    for name, (_, isa) in ARM_LIBRARIES.items():
        assert isa_of_library(exchange / name / kernels.LIBRARY) == isa
        assert isa_of_library(exchange / name / kernels.LIBRARY, "attention") == "neon"  # Int8KVAttention's NEON path
    assert isa_of_library(build / lib.file, "attention") == "neon"
    assert isa_of_library(exchange / "generic" / kernels.LIBRARY) == "generic"


@on_arm
@pytest.mark.parametrize("K,N", [(64, 16), (160, 64), (576, 48)])
def test_the_neon_path_is_the_plain_cpp_path_bit_for_bit_and_the_block_arithmetic(exchange, K, N):
    """The integer sums are exact and both paths add the float terms with the same fused
    multiply-adds, so they agree to the bit; and both are the float64 reference of the block
    arithmetic within float32 rounding (tests/test_kernels.py's bounds), the SwiGLU variant too."""
    from test_kernels import _matmul_session, _q4_case, _q4_reference

    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    q, d, m = _q4_case(K, N, seed=K + N)
    blob = block_q4_layout(q, d, m)
    rng = np.random.default_rng(K)
    for swiglu in (False, True):
        plain = _matmul_session(blob, exchange / "generic" / kernels.LIBRARY, swiglu=swiglu)
        neon = {name: _matmul_session(blob, exchange / name / kernels.LIBRARY, swiglu=swiglu) for name in ARM_LIBRARIES}
        for rows in (1, 2, 3, 7):
            x = (rng.standard_normal((1, rows, K * (2 if swiglu else 1))) * 2).astype(np.float32)
            x[0, 0, :32] = 0.0  # a block of zeros: scale 0
            y = plain.run(None, {"x": x})[0]
            for name, s in neon.items():
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], y, err_msg=name)
            act = x[0].astype(np.float64)
            if swiglu:
                g, u = act[:, :K], act[:, K:]
                act = g / (1 + np.exp(-g)) * u
            ref = _q4_reference(act.astype(np.float32), q, d, m)
            assert np.abs(y[0] - ref).max() <= (2e-3 if swiglu else 1e-5) * np.abs(ref).max()


@on_arm
@pytest.mark.parametrize("name", ARM_LIBRARIES)
def test_the_neon_path_gives_the_x86_paths_bits(exchange, name):
    """Across machines: the outputs the build machine's own path (AVX-512 VNNI there) gave on the same
    inputs, to the bit. The integer sums are exact, the float terms the same fused multiply-adds, and
    the activations' quantization and SwiGLU the same IEEE operations on both."""
    saved = np.load(exchange / "x86" / "matmul.npz")
    print(f"against the build machine's {saved['isa']} path")
    names = [n for n in saved.files if n != "isa" and not n.endswith("/x")]
    neon = matmul_outputs(exchange / name / kernels.LIBRARY)
    assert sorted(names) == sorted(n for n in neon if not n.endswith("/x"))
    for name in names:
        np.testing.assert_array_equal(neon[name + "/x"], saved[name + "/x"], err_msg=f"{name}: not the same inputs")
        np.testing.assert_array_equal(neon[name], saved[name], err_msg=name)


@on_arm
def test_the_neon_paths_rows_are_its_one_token_steps_bit_for_bit(exchange):
    from test_kernels import _matmul_session, _q4_case

    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    q, d, m = _q4_case(96, 32, seed=3)
    for name, swiglu in ((name, swiglu) for name in ARM_LIBRARIES for swiglu in (False, True)):
        s = _matmul_session(block_q4_layout(q, d, m), exchange / name / kernels.LIBRARY, swiglu=swiglu)
        x = np.random.default_rng(4).standard_normal((1, 9, 192 if swiglu else 96)).astype(np.float32)
        chunk = s.run(None, {"x": x})[0]
        steps = np.concatenate([s.run(None, {"x": x[:, i : i + 1]})[0] for i in range(9)], axis=1)
        assert np.array_equal(chunk, steps)


@on_arm
def test_the_sa8775p_cpu_build_follows_the_streaming_reference(exchange):
    """tests/test_backends.py's stream (sinks, pins, chunks that wrap the ring, hundreds of evictions)
    through the build the build machine made, against the reference's logits it computed there:
    within the int8-KV tolerance of the x86 fused build."""
    from cabinlm.runtime import Decoder

    meta = json.loads((exchange / "stream.json").read_text())
    saved = np.load(exchange / "expected.npz")
    ids, expected = saved["ids"], [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
    dec = Decoder(exchange / "build")
    assert dec.manifest.build.facts.attention_kernel == "cabinlm" and dec.device == "onnxruntime-cpu"
    errors, pos, chunk = [], 0, meta["chunk"]
    for n, pin in meta["stream"]:
        for start in range(pos, pos + n, chunk):
            got = dec.step(ids[start : min(start + chunk, pos + n)], pin=pin)
            errors.append(float(np.abs(got - expected[len(errors)]).max()))
        pos += n
    assert len(errors) == len(expected) and dec.cache.evicted > 8 * meta["window"]
    every, mean = meta["tolerance"]
    print(f"sa8775p cpu build under emulation vs the streaming reference: every feed {max(errors):.3f} (< {every}), "
          f"mean {np.mean(errors):.3f} (< {mean})")
    assert max(errors) < every and np.mean(errors) < mean, (max(errors), np.mean(errors))
