"""cabinlm's kernels on every x86 path, bit for bit: the block matmuls (kernels/block_matmul.h)
against the plain C++ path (BlockQ4MatMul, BlockQ4SwiGLUMatMul, BlockQ8MatMul on odd tile counts, 1
to 8 rows and more: every group size the paths' row blocks leave; codes at both ends of their ranges,
blocks of zeros; float16 and float32 scales), a chunk's rows against one-row runs within each path;
and the attention kernel's AVX2 build against this CPU's own.

Each x86 path runs wherever this CPU can execute it: an AVX-512 machine runs the AVX2 library too.
The AVX-VNNI path (the VEX vpdpbusd) runs on a CPU with AVX-VNNI; on one without it but with AVX-512
VL and VNNI it runs with the EVEX vpdpbusd on 32 bytes in its place (the same operation), so that
its bookkeeping is checked on either kind of machine. A path this CPU cannot run is skipped with the
reason. The NEON paths are checked under emulation (tests/test_arm.py, `make test-arm`)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from test_block_q8 import _q8_case
from test_kernels import Case, _graph, _matmul_session, _q4_case, run

from cabinlm.engines.ort_fused import kernels
from cabinlm.engines.ort_fused.block_layouts import block_q4_layout, block_q8_layout
from cabinlm.engines.ort_fused.kernel_library import host_cpu_flags
from cabinlm.engines.ort_fused.kernels.compiler import FLAGS, KernelError, compile_library, find_compiler, isa_of

pytestmark = pytest.mark.skipif(kernels.host_machine() != "x86_64", reason="the x86 paths: this machine is not x86_64")

# path -> (the compiler's -march, defines, the CPU features it needs here beyond the -march's own)
PATHS = {
    "avx2": ("x86-64-v3", (), ()),
    "avx-vnni": ("alderlake", (), ()),
    "avx-vnni (EVEX stand-in)": ("x86-64-v3", ("CABINLM_AVX_VNNI_AS_AVX512VL",), ("avx512vl", "avx512_vnni")),
    "avx512-vnni": ("cascadelake", (), ()),
}
K, N = 224, 112  # 7 blocks, 7 tiles: the parallel units take two tiles each, the last one


@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    return compile_library(tmp_path_factory.mktemp("generic"), defines=("CABINLM_GENERIC",)).path


@pytest.fixture(scope="module", params=list(PATHS))
def path(request, tmp_path_factory):
    """(the path's name, its library), compiled as `cabinlm build` compiles it for that -march."""
    march, defines, needs = PATHS[request.param]
    lacking = sorted(set(needs) - (host_cpu_flags() or frozenset()))
    if lacking:
        pytest.skip(f"{request.param}: this CPU lacks {', '.join(lacking)}")
    try:
        compiled = compile_library(tmp_path_factory.mktemp("path"), march, defines=defines)
    except KernelError as e:
        pytest.skip(f"{request.param}: {str(e).splitlines()[0]}")
    assert compiled.facts.matmul_isa == request.param.split(" ")[0]
    return request.param, compiled.path


def _cases():
    rng = np.random.default_rng(11)
    q, d, m = _q4_case(K, N, seed=12)
    q4 = block_q4_layout(q, d, m)  # float16 scales and minimums
    q4_wide = block_q4_layout(q, d * np.float32(1.0001), m)  # float32 ones
    assert (q4.shape[-1], q4_wide.shape[-1]) == (320, 384)
    q8 = block_q8_layout(*_q8_case(K, N, seed=13))
    x = (rng.standard_normal((1, 13, K)) * 3).astype(np.float32)
    x[0, 0, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
    x[0, 1] = np.where(rng.random(K) < 0.5, 5.0, -5.0)  # every code +-127
    x[0, 2, :32] = -7.0  # a block of codes -127 ...
    x[0, 2, 32:64] = 7.0  # ... and one of +127
    gu = (rng.standard_normal((1, 13, 2 * K)) * 3).astype(np.float32)
    return [("BlockQ4MatMul", q4, kernels.MATMUL_OP, x), ("BlockQ4SwiGLUMatMul", q4, kernels.SWIGLU_MATMUL_OP, gu),
            ("BlockQ4MatMul, float32 scales", q4_wide, kernels.MATMUL_OP, x),
            ("BlockQ4SwiGLUMatMul, float32 scales", q4_wide, kernels.SWIGLU_MATMUL_OP, gu),
            ("BlockQ8MatMul", q8, kernels.Q8_MATMUL_OP, x)]  # fmt: skip


@pytest.mark.parametrize("case", range(5), ids=["q4", "q4-swiglu", "q4-f32", "q4-f32-swiglu", "q8"])
def test_each_path_gives_the_plain_paths_results_bit_for_bit(path, generic, case):
    name, lib = path
    what, blob, op, x = _cases()[case]
    ours = _matmul_session(blob, lib, width=x.shape[-1], op=op)
    plain = _matmul_session(blob, generic, width=x.shape[-1], op=op)
    for rows in (*range(1, 9), 13):  # every remainder of the row blocks (8, 4 and 2 rows), and more
        got, want = ours.run(None, {"x": x[:, :rows]})[0], plain.run(None, {"x": x[:, :rows]})[0]
        assert np.array_equal(got, want), f"{name} {what}, {rows} rows: differs from the plain path by {np.abs(got - want).max()}"


@pytest.mark.parametrize("case", range(5), ids=["q4", "q4-swiglu", "q4-f32", "q4-f32-swiglu", "q8"])
def test_each_paths_chunk_rows_are_its_one_row_runs(path, case):
    name, lib = path
    what, blob, op, x = _cases()[case]
    session = _matmul_session(blob, lib, width=x.shape[-1], op=op)
    chunk = session.run(None, {"x": x})[0]
    steps = np.concatenate([session.run(None, {"x": x[:, i : i + 1]})[0] for i in range(x.shape[1])], axis=1)
    assert np.array_equal(chunk, steps), f"{name} {what}"


@pytest.mark.parametrize("head_dim", [16, 32, 64])  # one, two and four vectors of 16 lanes a row
def test_the_attention_kernels_avx2_build_gives_this_cpus_results_bit_for_bit(head_dim, tmp_path, monkeypatch):
    """Int8KVAttention compiled for x86-64-v3 (its AVX2 vectors of 8 lanes) against this machine's own
    build (AVX-512 here): one-token steps and chunks, hidden slots, the output and the cache rows."""
    import test_kernels

    monkeypatch.setattr(test_kernels, "D", head_dim)
    try:
        v3 = compile_library(tmp_path, "x86-64-v3").path
    except KernelError as e:
        pytest.skip(f"avx2: {str(e).splitlines()[0]}")
    (tmp_path / "native").mkdir()
    native = compile_library(tmp_path / "native", "native").path
    ours, here = _graph("cabinlm", v3), _graph("cabinlm", native)
    for n, F, hidden in ((1, 0, (0, 0)), (1, 70, (3, 9)), (9, 30, (2, 6)), (17, 63, (1, 2)), (4, 1, (0, 1))):
        c = Case(np.random.default_rng(n * 31 + F), n, F, hidden)
        for got, want in zip(run(ours, c.feeds("cabinlm")), run(here, c.feeds("cabinlm"))):
            assert np.array_equal(got, want), (head_dim, n, F)


def test_the_avx_vnni_library_compiles_with_the_vex_instruction(tmp_path):
    """Wherever it runs: the block matmuls compiled for -march=alderlake (AVX-VNNI, no AVX-512) say
    their path and hold the VEX-encoded vpdpbusd, and no EVEX (AVX-512) instruction."""
    cxx = find_compiler()
    sources = [s for s in kernels.SOURCES if s.name in ("block_q4_matmul.cc", "block_q8_matmul.cc")]
    subprocess.run([cxx.path, *FLAGS, "-march=alderlake", "-c", *map(str, sources)], cwd=tmp_path, check=True,
                   capture_output=True)  # fmt: skip
    objects = sorted(tmp_path.glob("*.o"))
    assert len(objects) == 2 and isa_of(b"".join(o.read_bytes() for o in objects)) == "avx-vnni"
    dump = subprocess.run(["objdump", "-d", *map(str, objects)], check=True, capture_output=True, text=True).stdout
    assert "{vex} vpdpbusd" in dump
    assert "zmm" not in dump
