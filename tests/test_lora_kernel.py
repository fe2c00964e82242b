"""cabinlm's LoraTerms / LoraSwiGLUTerms kernels (kernels/lora_terms.cc), on their own, against numpy:
the adapter terms (x A^T) B^T in each targeted projection's columns (float64 reference, within float32
rounding); every seat's rows with its own factors, bit for bit what that seat's rows get alone, and a
chunk's rows bit for bit its one-row runs; zero factors leaving y bit for bit (-0.0 included); the
SwiGLU input computed inside; a malformed node refused in one line. For the library of this machine's
CPU (AVX-512 here) and, on x86-64, the one for a CPU that stops at AVX2 (x86-64-v3), which must agree
bit for bit; `make test-arm` runs this file on the NEON library under emulation."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from cabinlm.engines.ort_fused import kernels, single_op
from cabinlm.engines.ort_fused.kernels.compiler import compile_library

K, R = 72, 20  # both with a tail past their 16-float pieces
WIDTHS = (40, 16, 24)  # a q|k|v matrix's projections (columns in groups of 16, and a tail)


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def library(request, tmp_path_factory) -> Path:
    handed = os.environ.get("CABINLM_TEST_KERNEL_LIBRARY")  # make test-arm: the cross-compiled NEON library
    if handed:
        if request.param != "native":
            pytest.skip("under emulation: the library handed over only")
        return Path(handed)
    if request.param == "x86-64-v3" and kernels.host_machine() != "x86_64":
        pytest.skip("x86-64-v3 is an x86 CPU level")
    return compile_library(tmp_path_factory.mktemp(f"lora-{request.param}"), request.param).path


def session(library, targets: int, seats: int, swiglu: bool = False):
    """One LoraTerms node over y (1, n, N), x (1, n, K or 2 K), its columns and seat_tokens, and an A
    and a B per seat and targeted projection, all fed."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    factors = [f"{ab}{s}.{t}" for s in range(max(seats, 1)) for t in range(targets) for ab in "ab"]
    node = helper.make_node(kernels.LORA_SWIGLU_OP if swiglu else kernels.LORA_OP, ["y", "x", "columns", "seat_tokens",
                            *factors], ["out"], domain=kernels.DOMAIN)  # fmt: skip
    ins = [helper.make_tensor_value_info("y", f, [1, "n", "N"]), helper.make_tensor_value_info("x", f, [1, "n", "K"]),
           helper.make_tensor_value_info("columns", i64, ["P"]), helper.make_tensor_value_info("seat_tokens", i64, ["S"])]
    ins += [helper.make_tensor_value_info(name, f, [None, None]) for name in factors]
    model = single_op.model([node], ins, [helper.make_tensor_value_info("out", f, None)], name="lora")
    return single_op.session(model, library=library, threads=2)


def run(sess, y, x, columns, seat_tokens, factors) -> np.ndarray:
    feeds = {"y": y[None], "x": x[None], "columns": np.asarray(columns, np.int64),
             "seat_tokens": np.asarray(seat_tokens, np.int64)}  # fmt: skip
    names = [i.name for i in sess.get_inputs()][4:]
    feeds.update(zip(names, [a for seat in factors for pair in seat for a in pair]))
    return sess.run(None, feeds)[0][0]


def adapter(rng, widths, scale=0.3, k=K, r=R):
    return [(rng.standard_normal((r, k)).astype(np.float32) * scale, rng.standard_normal((w, r)).astype(np.float32) * scale)
            for w in widths]  # fmt: skip


def reference(y, x, columns, pairs) -> np.ndarray:
    out = y.astype(np.float64)
    for c, (a, b) in zip(columns, pairs):
        out[:, c : c + len(b)] += (x.astype(np.float64) @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    return out


@pytest.mark.parametrize("rank", [R, 16, 32])  # 16, 32: the kernel's paths for ranks known when compiled
def test_lora_terms_adds_each_targeted_projections_term_in_its_columns(library, rank):
    rng = np.random.default_rng(1)
    n, N = 5, sum(WIDTHS)
    y, x = rng.standard_normal((n, N)).astype(np.float32), rng.standard_normal((n, K)).astype(np.float32)
    columns = [0, WIDTHS[0] + WIDTHS[1]]  # q and v targeted, k not
    pairs = adapter(rng, (WIDTHS[0], WIDTHS[2]), r=rank)
    got = run(session(library, 2, 0), y, x, columns, [], [pairs])
    want = reference(y, x, columns, pairs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, WIDTHS[0] : WIDTHS[0] + WIDTHS[1]], y[:, WIDTHS[0] : WIDTHS[0] + WIDTHS[1]])  # k: y
    assert np.abs(got - y).max() > 0.1


@pytest.mark.parametrize("rank", [R, 16])
def test_each_seats_rows_are_what_they_are_alone_and_a_chunks_rows_its_one_row_runs(library, rank):
    """Three seats (rows 2, 1, 3; the last with zero factors) in one node against each alone, bit for
    bit; a seat's chunk against its rows one at a time, bit for bit."""
    rng = np.random.default_rng(2)
    counts, N = (2, 1, 3), sum(WIDTHS)
    y, x = rng.standard_normal((6, N)).astype(np.float32), rng.standard_normal((6, K)).astype(np.float32)
    columns = [0, WIDTHS[0], WIDTHS[0] + WIDTHS[1]]
    seats = [adapter(rng, WIDTHS, r=rank), adapter(rng, WIDTHS, scale=2.0, r=rank),
             [(np.zeros((rank, K), np.float32), np.zeros((w, rank), np.float32)) for w in WIDTHS]]
    together = run(session(library, 3, 3), y, x, columns, counts, seats)
    alone = session(library, 3, 0)
    start = 0
    for c, pairs in zip(counts, seats):
        rows = slice(start, start + c)
        np.testing.assert_array_equal(together[rows], run(alone, y[rows], x[rows], columns, [], [pairs]))
        for i in range(start, start + c):
            np.testing.assert_array_equal(together[i : i + 1], run(alone, y[i : i + 1], x[i : i + 1], columns, [], [pairs]))
        start += c
    np.testing.assert_array_equal(together[3:], y[3:])  # zero factors: y itself


def test_zero_factors_leave_y_bit_for_bit_negative_zeros_included(library):
    rng = np.random.default_rng(3)
    y = rng.standard_normal((4, sum(WIDTHS))).astype(np.float32)
    y[0, :5] = -0.0
    x = rng.standard_normal((4, K)).astype(np.float32)
    zeros = [(np.zeros((R, K), np.float32), np.zeros((w, R), np.float32)) for w in WIDTHS]
    got = run(session(library, 3, 0), y, x, [0, WIDTHS[0], WIDTHS[0] + WIDTHS[1]], [], [zeros])
    np.testing.assert_array_equal(got.view(np.int32), y.view(np.int32))


def test_lora_swiglu_terms_take_silu_of_gate_times_up(library):
    rng = np.random.default_rng(4)
    n, D, I = 3, 32, 64  # noqa: E741
    y = rng.standard_normal((n, D)).astype(np.float32)
    gate_up = (rng.standard_normal((n, 2 * I)) * 3).astype(np.float32)
    g, u = gate_up[:, :I].astype(np.float64), gate_up[:, I:].astype(np.float64)
    pairs = adapter(rng, (D,), k=I)
    got = run(session(library, 1, 0, swiglu=True), y, gate_up, [0], [], [pairs])
    np.testing.assert_allclose(got, reference(y, (g / (1 + np.exp(-g)) * u), [0], pairs), rtol=1e-4, atol=1e-4)


def test_x86_64_v3_and_this_cpus_library_agree_bit_for_bit(tmp_path):
    if kernels.host_machine() != "x86_64" or os.environ.get("CABINLM_TEST_KERNEL_LIBRARY"):
        pytest.skip("two x86 libraries compiled here")
    rng = np.random.default_rng(5)
    counts, N = (3, 2), sum(WIDTHS)
    y, x = rng.standard_normal((5, N)).astype(np.float32), rng.standard_normal((5, K)).astype(np.float32)
    libraries = []
    for march in ("native", "x86-64-v3"):
        (tmp_path / march).mkdir()
        libraries.append(compile_library(tmp_path / march, march).path)
    for rank in (R, 16):  # the generic rank's path and rank 16's
        seats = [adapter(rng, WIDTHS, r=rank), adapter(rng, WIDTHS, r=rank)]
        got = [run(session(lib, 3, 2), y, x, [0, WIDTHS[0], WIDTHS[0] + WIDTHS[1]], counts, seats) for lib in libraries]
        np.testing.assert_array_equal(got[0], got[1])


def test_a_malformed_node_is_refused_in_one_line(library):
    rng = np.random.default_rng(6)
    y, x = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((2, K)).astype(np.float32)
    pairs = adapter(rng, (64,))
    with pytest.raises(Exception, match="LoraTerms: seat_tokens adds up to 3 rows, y has 2"):
        run(session(library, 1, 2), y, x, [0], [2, 1], [pairs, pairs])
    with pytest.raises(Exception, match=r"LoraTerms: seat 0, projection 0: A \(20, 72\) and B \(64, 20\) at column 8"):
        run(session(library, 1, 0), y, x, [8], [], [pairs])
