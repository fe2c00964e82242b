"""GGUF block types (export/gguf_quants.py) against gguf-py's own `gguf.quants.dequantize`: synthetic
blocks for every type (gguf-py quantizes Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1; the K-quants, which it only
de-quantizes, are built as random block bytes with finite float16 scales), and the real tensors of a
Gemma 3 270M Q4_K_M file when it is present (/tmp/g3/gemma-3-270m-q4_k_m.gguf, or $CABINLM_GGUF_K)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest

from cabinlm.contract.errors import ModelError
from cabinlm.export import gguf_quants, wquant
from cabinlm.export.wquant import QuantMatrix

RNG = np.random.default_rng(7)
REAL = Path(os.environ.get("CABINLM_GGUF_K", "/tmp/g3/gemma-3-270m-q4_k_m.gguf"))
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf-py writes these
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py only reads these
Q6K_TOLERANCE = 1 / 254  # a re-rounded Q6_K block: at most half a step of absmax / 127


def dequantize(m: QuantMatrix) -> np.ndarray:
    """A QuantMatrix (K, N) back to float32, written out here (not wquant's): (q - zp) * scale + offset."""
    K, N = m.q.shape
    q = m.q.astype(np.float32).reshape(K // 32, 32, N)
    if m.zero_point is not None:
        q = q - m.zero_point.astype(np.float32)[:, None, :]
    w = q * m.scale[:, None, :]
    if m.offset is not None:
        w = w + m.offset[:, None, :]
    return w.reshape(K, N)


def _f16_bytes(n: int, lo: float, hi: float) -> np.ndarray:
    return RNG.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def synthetic(kind: str, n: int = 8, k: int = 512) -> np.ndarray:
    """Raw block rows (n, bytes per row) of `kind`."""
    qt = gq.GGMLQuantizationType[kind]
    if kind in QUANTIZABLE:
        rows = RNG.standard_normal((n, k)).astype(np.float32) * RNG.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
        rows[:, :32] += 1.5  # a block far from zero (a Q4_1 / Q5_1 minimum well above it)
        rows[0, 32:64] = 0.0  # an all-zero block
        return gq.quantize(rows, qt)
    per, size = gguf_quants.BLOCK_SIZES[kind]
    nblocks = n * (k // per)
    b = RNG.integers(0, 256, (nblocks, size), dtype=np.uint8)  # codes and packed scales: any bits
    if kind in ("Q4_K", "Q5_K"):
        b[:, 0:2] = _f16_bytes(nblocks, 1e-4, 0.05)  # d
        b[:, 2:4] = _f16_bytes(nblocks, -0.01, 0.02)  # dmin
    else:  # Q6_K: d last; some blocks with equal or related sub-scales (imported exactly)
        b[:, 208:210] = _f16_bytes(nblocks, 1e-5, 0.01)
        sc = b[:, 192:208].view(np.int8)
        sc[: nblocks // 4, 1::2] = sc[: nblocks // 4, 0::2]
        sc[nblocks // 4 : nblocks // 2, 1::2] = 2
        sc[nblocks // 4 : nblocks // 2, 0::2] = -4
    return b.reshape(n, -1)


def check(raw: np.ndarray, kind: str, k: int) -> dict:
    """Decode `raw` every way this module can; compare with gguf-py; return the measured errors."""
    qt = gq.GGMLQuantizationType[kind]
    want = gq.dequantize(raw, qt)  # (N, K)
    assert want.shape == (raw.shape[0], k)
    own = gguf_quants.dequantize(raw, kind, k)
    np.testing.assert_array_equal(own, want)  # the float decode: bit for bit
    m = gguf_quants.to_quant_matrix(raw, kind, k)
    assert m.shape == (k, raw.shape[0]) and m.bits == gguf_quants.NATIVE_BITS[kind]
    assert m.scale.dtype == np.float32 and (m.offset is None or m.offset.dtype == np.float32)
    got = dequantize(m).T
    np.testing.assert_array_equal(m.dequantize().T, got)  # wquant's own dequantize agrees
    out = {"max_abs": float(np.abs(got - want).max())}
    if kind in gguf_quants.EXACT:
        np.testing.assert_array_equal(got, want)
    else:  # Q6_K: each block of 32 within half its step; exact blocks bit for bit
        blocks = lambda a: a.reshape(a.shape[0], -1, 32)
        amax = np.abs(blocks(want)).max(axis=-1, keepdims=True)
        err = np.abs(blocks(got) - blocks(want))
        assert np.all(err <= amax * Q6K_TOLERANCE * (1 + 1e-5) + 1e-12)
        exact = np.repeat(gguf_quants._q6k_to_int8(raw, k, "t")[2][..., None], 32, axis=-1)
        assert np.all(err[exact] == 0)
        out["rel_to_block_absmax"] = float((err / np.where(amax > 0, amax, 1)).max())
        out["exact_blocks"] = gguf_quants.q6k_exact_fraction(raw, k)
    if m.bits == 4:  # a 4-bit type at 8 bits: the same values
        m8 = gguf_quants.to_quant_matrix(raw, kind, k, bits=8)
        assert m8.bits == 8 and m8.q.dtype == np.int8
        np.testing.assert_array_equal(dequantize(m8).T, want)
        np.testing.assert_array_equal(dequantize(gguf_quants.widen(m)), dequantize(m8))
    else:
        with pytest.raises(ValueError, match="int4"):
            gguf_quants.to_quant_matrix(raw, kind, k, bits=4)
    return out


@pytest.mark.parametrize("kind", QUANTIZABLE + K_QUANTS)
def test_synthetic_blocks_decode_like_gguf_py(kind):
    res = check(synthetic(kind), kind, 512)
    if kind == "Q6_K":
        assert 0 < res["exact_blocks"] < 1  # the crafted equal / related sub-scales, and random ones


def test_legacy_types_match_wquants_import():
    """Q8_0 / Q4_0 / Q4_1 at their width: the same QuantMatrix as wquant.from_gguf_rows."""
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        raw = synthetic(kind, n=5, k=128)
        a, b = gguf_quants.to_quant_matrix(raw, kind, 128), wquant.from_gguf_rows(raw, kind, 128)
        for f in ("q", "scale", "zero_point", "offset"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), (kind, f)
            if x is not None:
                assert x.dtype == y.dtype, (kind, f)
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "IQ2_XS", "BF16", "F16", "IQ4_NL"])
def test_unsupported_types_are_refused_in_one_line(kind):
    raw = np.zeros((2, 64), np.uint8)
    for call in (lambda: gguf_quants.to_quant_matrix(raw, kind, 256, name="blk.3.ffn_down.weight"),
                 lambda: gguf_quants.dequantize(raw, kind, 256, name="blk.3.ffn_down.weight")):  # fmt: skip
        with pytest.raises(ModelError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "blk.3.ffn_down.weight" in msg and kind in msg


def test_wrong_row_size_is_refused():
    raw = synthetic("Q4_K", n=2, k=512)
    with pytest.raises(ModelError, match="blk.0.attn_output.weight: Q4_K rows"):
        gguf_quants.to_quant_matrix(raw, "Q4_K", 256, name="blk.0.attn_output.weight")


def test_mixed_widths_join_at_int8_exactly():
    """q|k|v or gate|up whose parts differ in width (Q4_K beside Q5_0): joined as int8, the int4 part
    widened with its values unchanged; parts of one width join as wquant.concat does."""
    a = gguf_quants.to_quant_matrix(synthetic("Q4_K", n=4, k=256), "Q4_K", 256)
    b = gguf_quants.to_quant_matrix(synthetic("Q5_0", n=3, k=256), "Q5_0", 256)
    c = gguf_quants.to_quant_matrix(synthetic("Q4_0", n=2, k=256), "Q4_0", 256)
    logged = []
    j = gguf_quants.join([a, b, c], logged.append, "blk.0 q|k|v")
    assert j.bits == 8 and j.zero_point is None and j.shape == (256, 9)
    np.testing.assert_array_equal(dequantize(j), np.concatenate([dequantize(a), dequantize(b), dequantize(c)], axis=1))
    assert len(logged) == 1 and "int4 / int8 / int4" in logged[0]
    same = gguf_quants.join([b, b], logged.append)
    assert same.bits == 8 and len(logged) == 1


# -- the real file ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_tensors():
    if not REAL.exists():
        msg = f"{REAL} is absent (a Gemma 3 270M Q4_K_M GGUF; set CABINLM_GGUF_K to another path)"
        print(f"skipping: {msg}")
        pytest.skip(msg)
    from gguf import GGUFReader

    return GGUFReader(str(REAL)).tensors


def test_real_file_every_block_tensor_decodes_like_gguf_py(real_tensors):
    """Every block tensor of the file (Q5_0, Q8_0, Q4_K, Q6_K; the token table's first 8192 rows)."""
    worst: dict[str, dict] = {}
    for t in real_tensors:
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            continue
        raw = np.asarray(t.data)[:8192]
        res = check(raw, kind, int(t.shape[0]))
        w = worst.setdefault(kind, {"tensors": 0})
        w["tensors"] += 1
        for key, v in res.items():
            w[key] = max(w.get(key, 0.0), v)
    print({k: v for k, v in sorted(worst.items())})
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(worst)
    assert worst["Q4_K"]["max_abs"] == worst["Q5_0"]["max_abs"] == worst["Q8_0"]["max_abs"] == 0.0
    assert worst["Q6_K"]["max_abs"] < 5e-3  # measured 2.8e-3 (ffn_down, values up to 0.74)


def test_real_file_blocks_through_models(real_tensors):
    """models.gguf_blocks / _gguf_matrix: each linear at its own width (int4 for Q4_K, int8 for Q5_0 /
    Q8_0 / Q6_K), and the Llama q / k un-permute keeps each row's blocks whole."""
    from types import SimpleNamespace

    from cabinlm.export import models

    spec = SimpleNamespace(head_dim=256)
    blocks = models.gguf_blocks(REAL, spec)
    assert blocks["blk.0.attn_output.weight"][0] == "Q4_K" and blocks["blk.0.ffn_down.weight"][0] == "Q6_K"
    o = models._gguf_matrix(blocks, "blk.0.attn_output.weight", 1024, None, 256)
    assert o.bits == 4 and o.offset is not None and o.shape == (1024, 640)
    q = models._gguf_matrix(blocks, "blk.0.attn_q.weight", 640, None, 256)
    assert q.bits == 8 and q.shape == (640, 1024)
    qp = models._gguf_matrix(blocks, "blk.0.attn_q.weight", 640, 4, 256)  # as for a Llama file
    order = np.arange(1024).reshape(4, 128, 2).swapaxes(2, 1).reshape(-1)
    np.testing.assert_array_equal(qp.dequantize(), q.dequantize()[:, order])
    down = models._gguf_matrix(blocks, "blk.0.ffn_down.weight", 2048, None, 256)
    assert down.bits == 8
