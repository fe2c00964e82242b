"""cabinlm's kernel library as a build carries it: compiled by `cabinlm build` for the profile's CPU,
listed in the manifest with its sha256, and checked by the runtime before ONNX Runtime opens it.

What tests/test_kernels.py cannot catch, because it runs the kernels in the process that compiled them:
a build copied to a machine with no compiler and no cache; a library that was damaged or swapped
after the build (which ONNX Runtime would dlopen: a signal, not an error); a compiler that says it
succeeded and wrote nothing usable; an onnxruntime older than the C API the library was compiled for
(here for real: the lowest onnxruntime pyproject.toml allows, in a venv of its own, `make ort-lowest`);
and the C API table the kernels index, which must be the one tools/gen_ort_api.py derives from
onnxruntime's header."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cabinlm.engines.backend import BackendError
from cabinlm.engines.build import BuildError, build_artifact
from cabinlm.engines.ort_fused import kernels
from cabinlm.engines.ort_fused.kernels.compiler import KernelError, compile_library, cpu_flags, find_compiler, predefined_macros
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.manifest import load_manifest
from cabinlm.profiles import load_profile
from cabinlm.profiles.schema import parse_profile
from cabinlm.runtime import Decoder

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = dict(sink=2, pinned=10, window=16, chunk=4)  # tests/test_kernels.py's: the export is shared
IDS = [5, 17, 42, 99, 3, 250, 7, 8, 120, 64, 33, 2, 19, 77, 150, 201, 11, 90, 45, 6, 13]
LOWEST = ROOT / ".venv" / "ort-lowest" / "bin" / "python"  # `make ort-lowest`


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def logits_of(folder: Path) -> np.ndarray:
    dec = Decoder(folder)
    return np.concatenate([dec.feed(np.asarray(IDS[i : i + 3]), all_logits=True) for i in range(0, len(IDS), 3)])


FEED = """
import sys, numpy as np
from cabinlm.runtime import Decoder
ids = [int(i) for i in sys.argv[2].split(",")]
dec = Decoder(sys.argv[1])
np.save(sys.argv[3], np.concatenate([dec.feed(np.asarray(ids[i:i + 3]), all_logits=True) for i in range(0, len(ids), 3)]))
"""


@pytest.fixture(scope="module")
def own_build(load, tiny_llama_dir, export_to, tmp_path_factory) -> Path:
    """A fused build of the tiny Llama with int8 KV: cabinlm's attention kernel, its library in the folder."""
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    out = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("own") / "build")
    assert load_manifest(out).build.facts.kernels is not None
    return out


def copy_of(build: Path, where: Path) -> Path:
    shutil.copytree(build, where)
    return where


def tripwire(folder: Path, marker: Path) -> Path:
    """A folder whose g++, c++ and clang++ only record that they were run."""
    folder.mkdir()
    for name in ("g++", "c++", "clang++", "tripwire"):
        (folder / name).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marker}\nexit 1\n")
        (folder / name).chmod(0o755)
    return folder


# --- the runtime needs no compiler and reads no cache ---------------------------------------------


@pytest.mark.parametrize("machine", ["no compiler", "compilers that record being run"])
def test_a_copied_build_runs_with_no_compiler_and_an_empty_cache(own_build, tmp_path, machine):
    car = copy_of(own_build, tmp_path / "car")
    cache = tmp_path / "cache"
    cache.mkdir()
    marker = tmp_path / "compiler-was-run"
    if machine == "no compiler":
        env = dict(os.environ, CXX="/bin/false", PATH=str(tmp_path / "empty"), CABINLM_CACHE=str(cache))
    else:
        bin_ = tripwire(tmp_path / "bin", marker)
        env = dict(os.environ, CXX=str(bin_ / "tripwire"), PATH=str(bin_), CABINLM_CACHE=str(cache))
    assert shutil.which("g++", path=env["PATH"]) in (None, str(tmp_path / "bin" / "g++"))
    done = subprocess.run([sys.executable, "-c", FEED, str(car), ",".join(map(str, IDS)), str(tmp_path / "logits.npy")],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), logits_of(own_build))  # the same library, bit for bit
    assert not marker.exists(), marker.read_text()  # no compiler was started
    assert list(cache.iterdir()) == []  # and no cache written or needed


# --- a damaged library is one line, never a signal -------------------------------------------------


def damage(lib: Path, how: str, other: Path) -> None:
    data = lib.read_bytes()
    if how == "missing":
        lib.unlink()
    elif how == "empty":
        lib.write_bytes(b"")
    elif how == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif how == "bit-flipped":
        lib.write_bytes(data[:4000] + bytes([data[4000] ^ 0x10]) + data[4001:])
    elif how == "another build's":
        shutil.copyfile(other, lib)
    elif how == "another build's, same size":  # what a size check cannot see
        other_data = other.read_bytes()
        lib.write_bytes((other_data + b"\0" * len(data))[: len(data)])
    elif how == "a folder":
        lib.unlink()
        lib.mkdir()
    else:
        raise ValueError(how)


DAMAGE = ["missing", "empty", "truncated", "bit-flipped", "another build's", "another build's, same size", "a folder"]


@pytest.fixture(scope="module")
def other_library(tmp_path_factory) -> Path:
    """Another build's library: the plain C++ paths (what a build for an older CPU carries)."""
    return compile_library(tmp_path_factory.mktemp("other"), defines=("CABINLM_GENERIC",)).path


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_library_is_refused_in_one_line_by_the_cli(own_build, other_library, tmp_path, how):
    car = copy_of(own_build, tmp_path / "car")
    damage(car / kernels.LIBRARY, how, other_library)
    text = tmp_path / "text.txt"
    text.write_text("The driver asked the assistant for the route. " * 4)
    cli = Path(sys.executable).parent / "cabinlm"
    done = subprocess.run([str(cli), "perplexity", str(car), "--text", str(text)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, CXX="/bin/false"))  # fmt: skip
    assert done.returncode > 0, (done.returncode, done.stderr)  # an exit code, not a signal (< 0)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert kernels.LIBRARY in lines[0], lines[0]
    # a size that differs is caught first by load_manifest's check of every listed file (its advice:
    # "re-export"); what it cannot see, by the runtime's sha256 ("run `cabinlm build` again")
    assert re.search(r"cabinlm build|copy the whole folder|re-export", lines[0]), lines[0]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_library_is_a_backend_error_before_any_session_opens(own_build, other_library, tmp_path, monkeypatch, how):
    """With the manifest read before the damage (so its size check cannot catch it first): the
    runtime's own check refuses the file, and ONNX Runtime never gets to open a session."""
    car = copy_of(own_build, tmp_path / "car")
    manifest = load_manifest(car)
    damage(car / kernels.LIBRARY, how, other_library)

    def no_session(*args, **kwargs):
        raise AssertionError("an ONNX Runtime session was opened over a damaged library")

    monkeypatch.setattr(ort, "InferenceSession", no_session)
    with pytest.raises(BackendError) as e:
        Decoder(car, manifest)
    message = str(e.value)
    assert "\n" not in message and kernels.LIBRARY in message and "run `cabinlm build` again" in message, message


def test_a_build_made_before_the_library_came_with_it_is_refused(own_build, tmp_path):
    car = copy_of(own_build, tmp_path / "car")
    d = json.loads((car / "manifest.json").read_text())
    del d["build"]["fused"]["kernels"], d["files"]["kernel_library"]  # as a build made before wrote it
    (car / "manifest.json").write_text(json.dumps(d))
    assert FusedSettings.from_dict(d["build"]["fused"]).kernels is None  # still read
    with pytest.raises(BackendError, match=r"lists no kernel library .*; run `cabinlm build` again$"):
        Decoder(car)


@pytest.mark.parametrize("change,refusal", [
    (dict(ort_api=99), r"need onnxruntime's C API version 99 .* install onnxruntime>=1\.99$"),
    (dict(machine="aarch64"), r"is for aarch64 CPUs, this machine is .*; run `cabinlm build` again"),
    (dict(cpu_flags=("avx512f", "made_up_feature")), r"uses made_up_feature, which this CPU lacks; run `cabinlm build` again"),
])  # fmt: skip
def test_a_library_this_onnxruntime_or_cpu_cannot_run_is_refused(own_build, monkeypatch, change, refusal):
    from cabinlm.engines.ort_fused import kernel_library

    if "cpu_flags" in change and kernel_library.host_cpu_flags() is None:
        pytest.skip("this system does not list its CPU's features (/proc/cpuinfo)")
    manifest = load_manifest(own_build)
    fused = manifest.build.facts
    spec = dataclasses.replace(manifest.build, facts=dataclasses.replace(fused, kernels=dataclasses.replace(fused.kernels, **change)))
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: pytest.fail("a session was opened"))
    with pytest.raises(BackendError, match=refusal):
        Decoder(own_build, dataclasses.replace(manifest, build=spec))


def test_register_refuses_an_onnxruntime_older_than_its_c_api_version(tmp_path):
    """register.cc gets no table of the version it needs: an error status naming both versions (not a
    silent success that registers nothing)."""
    newer = int(ort.__version__.split(".")[1]) + 1
    lib = compile_library(tmp_path, defines=(f"CABINLM_REQUIRE_API_VERSION={newer}",)).path
    so = ort.SessionOptions()
    with pytest.raises(Exception, match=rf"need onnxruntime's C API version {newer} \(onnxruntime >= 1\.{newer}\); "
                                        rf"this onnxruntime is {re.escape(ort.__version__)}"):  # fmt: skip
        so.register_custom_ops_library(str(lib))


# --- the build machine ----------------------------------------------------------------------------


def fake_compiler(folder: Path, writes: str, real: str) -> Path:
    """A "compiler" that answers --version and the preprocessor through `real`, exits 0 on a compile,
    and writes `writes` there: nothing, bytes that are no library, or half of a real one."""
    folder.mkdir()
    half = folder / "half.so"
    lib = compile_library(folder).path
    half.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])
    lib.unlink()
    write = {"nothing": ":", "garbage": 'echo "not a library" > "$out"', "half a library": f'cp {half} "$out"'}[writes]
    cxx = folder / "fake-c++"
    cxx.write_text(f"""#!/bin/sh
case " $* " in *" --version "*) echo "fake-c++ 1.0 ({writes})"; exit 0;; *" -dumpmachine "*|*" -dM "*) exec {real} "$@";; esac
out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
{write}
exit 0
""")
    cxx.chmod(0o755)
    return cxx


@pytest.mark.parametrize("writes", ["nothing", "garbage", "half a library"])
def test_a_compiler_that_exits_0_without_a_library_is_a_build_error_and_poisons_nothing(load, tiny_llama_dir, export_to,
                                                                                        tmp_path, monkeypatch, writes):
    real = find_compiler().path
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path / "bin", writes, real)))
    cache = tmp_path / "cache"
    monkeypatch.setenv("CABINLM_CACHE", str(cache))
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    with pytest.raises(BuildError, match=r"fake-c\+\+ exited 0 but wrote no (loadable )?library"):
        build_artifact(art, load_profile("cpu"), tmp_path / "refused", attention_kernel="cabinlm")
    assert not (tmp_path / "refused" / "manifest.json").exists()
    assert not (tmp_path / "refused" / kernels.LIBRARY).exists()
    assert not [p for p in (tmp_path / "refused").iterdir() if p.name.startswith(".kernels-")]  # no work folder left
    assert not list(cache.glob("kernels/*/library.json"))  # nothing cached: the next build does not take it
    logs: list[str] = []
    kept = build_artifact(art, load_profile("cpu"), tmp_path / "kept", log=logs.append)  # auto: ONNX Runtime's kernels
    assert load_manifest(kept).build.facts.attention_kernel == "onnxruntime"
    assert any("kept ONNX Runtime's GroupQueryAttention: cabinlm's kernels cannot be had" in line for line in logs)


def test_the_compile_cache_is_used_only_while_its_bytes_are_what_was_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("CABINLM_CACHE", str(tmp_path / "cache"))
    for name in "abc":
        (tmp_path / name).mkdir()
    first = compile_library(tmp_path / "a")
    again = compile_library(tmp_path / "b")
    assert again.cached and again.facts == first.facts
    (entry,) = (tmp_path / "cache" / "kernels").iterdir()
    cached = entry / kernels.LIBRARY
    data = bytearray(cached.read_bytes())
    data[3000] ^= 0xFF
    cached.write_bytes(bytes(data))  # damaged in the cache
    fresh = compile_library(tmp_path / "c")
    assert not fresh.cached and fresh.facts.sha256 == first.facts.sha256  # compiled again, not copied
    assert sha256_of((tmp_path / "c" / kernels.LIBRARY).read_bytes()) == first.facts.sha256
    assert sha256_of(cached.read_bytes()) == first.facts.sha256  # and the entry written anew


def test_the_profile_names_the_cpu_the_kernels_are_compiled_for(load, tiny_llama_dir, export_to, own_build, tmp_path):
    """A car whose CPU stops at AVX2 (cpu_march x86-64-v3): the build's library uses no AVX-512, runs
    here and gives the native build's logits bit for bit; a CPU this machine cannot run is kept
    out of the build (it runs what it builds), or refused where insisted on."""
    if kernels.host_machine() != "x86_64":
        pytest.skip("the CPU levels named here are x86's")
    text = (Path(load_profile.__code__.co_filename).parent / "builtin" / "cpu.toml").read_text()

    def profile(march: str):
        return parse_profile(text.replace('cpu_march = "native"', f'cpu_march = "{march}"'), f"cpu-{march}.toml")

    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    v3 = build_artifact(art, profile("x86-64-v3"), tmp_path / "v3")
    lib = load_manifest(v3).build.facts.kernels
    assert lib.march == "x86-64-v3" and "avx2" in lib.cpu_flags and not [f for f in lib.cpu_flags if f.startswith("avx512")]
    assert lib.sha256 != load_manifest(own_build).build.facts.kernels.sha256
    assert np.array_equal(logits_of(v3), logits_of(own_build))  # the kernels' sums run in fixed lanes on every path

    cxx = find_compiler().path
    host = set(cpu_flags(predefined_macros(cxx, "native")))
    beyond = next((m for m in ("sapphirerapids", "graniterapids", "diamondrapids")
                   if _knows(cxx, m) and not set(cpu_flags(predefined_macros(cxx, m))) <= host), None)  # fmt: skip
    if beyond is None:
        pytest.skip("this machine runs every CPU level tried")
    logs: list[str] = []
    kept = build_artifact(art, profile(beyond), tmp_path / "beyond", log=logs.append)
    assert load_manifest(kept).build.facts.attention_kernel == "onnxruntime"
    assert any(f"cannot compile cabinlm's kernels for -march={beyond} here" in line for line in logs), logs
    with pytest.raises(BuildError, match=f"-march={beyond} uses .*which this machine's CPU lacks"):
        build_artifact(art, profile(beyond), tmp_path / "insisted", attention_kernel="cabinlm")


def _knows(cxx: str, march: str) -> bool:
    try:
        predefined_macros(cxx, march)
    except KernelError:
        return False
    return True


# --- the C API table -------------------------------------------------------------------------------


def test_the_api_header_is_what_the_generator_derives_from_onnxruntimes_header():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_ort_api.py"), "--check"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    generated = (kernels.HERE / "ort_api_entries.h").read_text()
    source = (ROOT / "third_party" / "onnxruntime" / "onnxruntime_c_api.h").read_bytes()
    assert f"// sha256 {sha256_of(source)}" in generated
    version = int(re.search(rb"#define ORT_API_VERSION (\d+)", source).group(1))
    assert kernels.api_version() == version
    # the lowest onnxruntime pyproject.toml allows serves that version (onnxruntime 1.N serves 1..N)
    assert int(lowest_onnxruntime().split(".")[1]) == version


SYNTHETIC = """
#define ORT_API_VERSION 7
#define _In_
#define ORT_API_CALL
#define NO_EXCEPTION
#define ORT_MUST_USE_RESULT
#define ORT_API2_STATUS(NAME, ...) _Check_return_ OrtStatusPtr(ORT_API_CALL* NAME)(__VA_ARGS__) NO_EXCEPTION ORT_MUST_USE_RESULT
#define ORT_CLASS_RELEASE(X) void(ORT_API_CALL * Release##X)(Ort##X * input)
typedef enum OrtErrorCode { ORT_OK, ORT_FAIL = 5, ORT_INVALID_ARGUMENT } OrtErrorCode;
typedef enum ONNXTensorElementDataType { A, B } ONNXTensorElementDataType;
struct OrtApi;  /* struct OrtApi { a comment is not the struct } */
struct OrtApi {
  OrtStatus*(ORT_API_CALL* CreateStatus)(OrtErrorCode code, _In_ const char* msg)NO_EXCEPTION;
  ORT_API2_STATUS(Unused, _In_ const char* s /* ; inside a comment */);
  ORT_CLASS_RELEASE(Status);
%s
  ORT_API2_STATUS(KernelContext_ParallelFor, _In_ const OrtKernelContext* c, _In_ void (*fn)(void*, size_t), size_t n, size_t b, void* d);
};
"""


def test_the_generator_numbers_macro_declared_entries_and_refuses_a_conditional_table(tmp_path):
    """Slots counted through comments, macro expansion (## pasting included) and nested parentheses;
    a table whose numbering would depend on #ifdef is refused."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_ort_api
    finally:
        sys.path.remove(str(ROOT / "tools"))
    slots = {s.name: s for s in gen_ort_api.parse_slots(SYNTHETIC % "")}
    assert [slots[n].index for n in ("CreateStatus", "Unused", "ReleaseStatus", "KernelContext_ParallelFor")] == [0, 1, 2, 3]
    assert slots["ReleaseStatus"].signature == "void (*)(OrtStatus* input)"
    assert slots["KernelContext_ParallelFor"].signature == ("OrtStatus* (*)(const OrtKernelContext* c, void (*fn)(void*, size_t), "
                                                           "size_t n, size_t b, void* d)")  # fmt: skip
    assert gen_ort_api.parse_enum(SYNTHETIC, "OrtErrorCode") == [("ORT_OK", 0), ("ORT_FAIL", 5), ("ORT_INVALID_ARGUMENT", 6)]
    header = tmp_path / "conditional.h"
    header.write_text(SYNTHETIC % "#ifdef SOME_BUILD\n  ORT_API2_STATUS(Optional, int x);\n#endif")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_ort_api.py"), "--header", str(header), "--out",
                           str(tmp_path / "out.h")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "preprocessor conditional" in done.stderr and not (tmp_path / "out.h").exists()


# --- the lowest onnxruntime pyproject.toml allows ------------------------------------------------

RUN_IN_OTHER_ORT = """
import sys, numpy as np, onnxruntime as ort
model, lib, feeds, out = sys.argv[1:5]
so = ort.SessionOptions()
so.intra_op_num_threads = 2
try:
    so.register_custom_ops_library(lib)
except Exception as e:
    print("REFUSED", ort.__version__, str(e).strip().splitlines()[0])
    sys.exit(0)
s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
inputs = dict(np.load(feeds))
np.savez(out, version=ort.__version__, **dict(zip([o.name for o in s.get_outputs()], s.run(None, inputs))))
print("RAN", ort.__version__)
"""


def kernels_graph(folder: Path) -> tuple[Path, dict]:
    """One session holding the three operators, with fixed random inputs."""
    import onnx
    from onnx import TensorProto, helper

    from cabinlm.engines.ort_fused import single_op
    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout

    rng = np.random.default_rng(0)
    H, HKV, D, ROWS, n, F, K, N = 6, 2, 32, 40, 5, 20, 96, 32
    q = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = rng.uniform(1e-3, 2e-2, (K // 32, N)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(-2, 15, (K // 32, N))).astype(np.float16).astype(np.float32)
    blob = block_q4_layout(q, d, m)
    bias = np.zeros((n, F + n), np.float32)
    bias[:, F:] = np.where(np.tri(n, dtype=bool), 0, -1e30)
    angles = rng.random((ROWS, D // 2)) * 6
    feeds = dict(qkv=rng.standard_normal((1, n, (H + 2 * HKV) * D)).astype(np.float32),
                 keys=rng.integers(-120, 121, (1, HKV, ROWS, D)).astype(np.int8),
                 values=rng.integers(-120, 121, (1, HKV, ROWS, D)).astype(np.int8),
                 seqlens_k=np.array([F + n - 1], np.int32), total=np.array(F + n, np.int32),
                 cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32),
                 position_ids=np.arange(F, F + n)[None].astype(np.int64), bias=bias[None, None],
                 k_scale=(rng.random(HKV * D) * 0.03 + 0.02).astype(np.float32),
                 v_scale=(rng.random(HKV * D) * 0.03 + 0.01).astype(np.float32),
                 x=rng.standard_normal((1, 3, K)).astype(np.float32), gu=rng.standard_normal((1, 3, 2 * K)).astype(np.float32))  # fmt: skip
    f = TensorProto.FLOAT
    types = {k: helper.np_dtype_to_tensor_dtype(v.dtype) for k, v in feeds.items()}
    inputs = [helper.make_tensor_value_info(k, types[k], list(v.shape)) for k, v in feeds.items()]
    att = list(feeds)[:11]
    nodes = [helper.make_node(kernels.ATTENTION_OP, att, ["attention"], domain=kernels.DOMAIN),
             helper.make_node(kernels.MATMUL_OP, ["x", "w"], ["matmul"], domain=kernels.DOMAIN),
             helper.make_node(kernels.SWIGLU_MATMUL_OP, ["gu", "w"], ["swiglu"], domain=kernels.DOMAIN)]  # fmt: skip
    outputs = [helper.make_tensor_value_info(o, f, None) for o in ("attention", "matmul", "swiglu")]
    model = single_op.model(nodes, inputs, outputs, [onnx.numpy_helper.from_array(blob, "w")], name="kernels")
    path = folder / "kernels.onnx"
    onnx.save(model, str(path))
    np.savez(folder / "feeds.npz", **feeds)
    return path, feeds


def lowest_onnxruntime() -> str:
    """"1.20": the lower bound of pyproject.toml's onnxruntime requirement."""
    text = (ROOT / "pyproject.toml").read_text()
    (bound,) = re.findall(r'"onnxruntime>=(\d+\.\d+)"', text)
    return bound


def run_in(python: str, model: Path, lib: Path, folder: Path, tag: str) -> tuple[str, dict]:
    out = folder / f"{tag}.npz"
    done = subprocess.run([python, "-c", RUN_IN_OTHER_ORT, str(model), str(lib), str(folder / "feeds.npz"), str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1], (dict(np.load(out)) if out.exists() else {})


def test_the_library_runs_in_the_lowest_onnxruntime_allowed(tmp_path):
    """The library a build carries (compiled against the C API of onnxruntime 1.20) runs in onnxruntime
    1.20 as in the pinned release, bit for bit; compiled for a later C API, 1.20 refuses it in words."""
    if not LOWEST.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{LOWEST} is missing: `make test` creates it (make ort-lowest)")
        print(f"\nskipped: {LOWEST} is missing (create it with `make ort-lowest`)")
        pytest.skip(f"{LOWEST} is missing; create it with `make ort-lowest`")
    model, _ = kernels_graph(tmp_path)
    lib = compile_library(tmp_path).path
    low, got = run_in(str(LOWEST), model, lib, tmp_path, "lowest")
    here, want = run_in(sys.executable, model, lib, tmp_path, "pinned")
    bound = lowest_onnxruntime()
    assert low.startswith(f"RAN {bound}."), low  # the venv holds the lowest release pyproject.toml allows
    assert here == f"RAN {ort.__version__}"
    for name in ("attention", "matmul", "swiglu"):
        np.testing.assert_array_equal(got[name], want[name])

    newer = int(bound.split(".")[1]) + 1
    (tmp_path / "newer").mkdir()
    too_new = compile_library(tmp_path / "newer", defines=(f"CABINLM_REQUIRE_API_VERSION={newer}",)).path
    refused, _ = run_in(str(LOWEST), model, too_new, tmp_path, "refused")
    assert refused.startswith("REFUSED") and f"C API version {newer}" in refused and f"this onnxruntime is {bound}." in refused, refused
