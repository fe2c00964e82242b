"""GGUF block types -> cabinlm's block format (wquant.QuantMatrix: blocks of 32 along K).

Decoders, in numpy, of the raw block bytes a GGUF tensor stores (`GGUFReader(...).tensors[i].data`,
one row of blocks per output feature), following llama.cpp's `dequantize_row_*` (ggml-quants.c):

    type  bytes/block  elements  value                                  -> QuantMatrix
    Q8_0  34           32        d * q          (q int8)                int8, scale d                exact
    Q4_0  18           32        d * (q - 8)    (q 0..15)               int4, zero point 8           exact
    Q4_1  20           32        d * q + m      (q 0..15)               int4, offset m               exact
    Q5_0  22           32        d * (q - 16)   (q 0..31)               int8 codes q - 16, scale d   exact
    Q5_1  24           32        d * q + m      (q 0..31)               int8, scale d, offset m      exact
    Q4_K  144          256       d*sc_j * q - dmin*m_j  (8 sub-blocks of 32, 6-bit sc / m)
                                                                        int4, scale d*sc, offset -dmin*m   exact
    Q5_K  176          256       as Q4_K with q 0..31                   int8, scale d*sc, offset -dmin*m   exact
    Q6_K  210          256       d*sc_j * (q - 32)  (16 sub-blocks of 16, int8 sc)
                                                                        int8, re-quantized (below)

A 4-bit type imported at 8 bits keeps its codes (int8 0..15 or q - 8): exact too.

Exactness. QuantMatrix holds its scales and offsets as float32. Every scale here is a float16 times
an integer of at most 8 bits (d * sc, dmin * m, d * gcd), which float32 holds exactly (11 + 8 bits
of significand), so the QuantMatrix dequantizes to the very float32 values gguf-py's
`gguf.quants.dequantize` (and llama.cpp's float path) computes: same products, same order.

Q6_K. A block of 32 along K spans two 16-element sub-blocks, each with its own int8 scale sc1, sc2.
With g = gcd(|sc1|, |sc2|) the block is d*g * (q*sc/g): exact whenever every code q*sc/g fits in
int8 (|.| <= 127, e.g. equal scales). Otherwise the block is re-rounded from its float values:
scale = absmax / 127, codes round-half-even (wquant.quantize_int8's rule): an error of at most half
a step (absmax / 254) per weight.
"""

from __future__ import annotations

import numpy as np

from cabinlm.contract.errors import ModelError
from cabinlm.export.wquant import BLOCK, QuantMatrix

QK_K = 256

# ggml type -> (elements per block, bytes per block)
BLOCK_SIZES = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}  # fmt: skip
SUPPORTED = tuple(BLOCK_SIZES)
# the width each type imports at by default: its codes fit in int4, or need int8
NATIVE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}
# types imported bit for bit at their width (Q6_K: only the blocks whose two scales allow it)
EXACT = frozenset(SUPPORTED) - {"Q6_K"}


def refuse(name: str, ggml_type: str) -> ModelError:
    return ModelError(f"{name}: GGUF type {ggml_type} cannot be imported as blocks (supported: {', '.join(SUPPORTED)})")


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _blocks(raw: np.ndarray, ggml_type: str, k: int, name: str) -> np.ndarray:
    """raw (N, bytes per row) -> (N, blocks per row, bytes per block)."""
    per, size = BLOCK_SIZES[ggml_type]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or k % per or raw.shape[1] != k // per * size:
        raise ModelError(f"{name}: {ggml_type} rows of {raw.shape[-1]} bytes do not hold {k} inputs")
    return raw.reshape(raw.shape[0], k // per, size)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums (llama.cpp get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32): ggml's order, weights 0..15 low nibbles, 16..31 high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: 4 bytes (a little-endian uint32) -> bit j of weight j, (..., 32)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def decode(raw: np.ndarray, ggml_type: str, k: int, name: str = "tensor"):
    """Raw block rows -> (codes (N, K) int16, scale (N, K/32) float32, offset (N, K/32) float32 or
    None, 16-element sub-scales (Q6_K: (N, K/16) float32, else None)), value = scale * code + offset
    per block of 32 (Q6_K: sub_scale * code per 16; scale is then None)."""
    if ggml_type not in BLOCK_SIZES:
        raise refuse(name, ggml_type)
    b = _blocks(raw, ggml_type, k, name)
    n, nb = b.shape[:2]
    if ggml_type == "Q8_0":
        return b[..., 2:].view(np.int8).reshape(n, k).astype(np.int16), _f16(b[..., 0:2]), None, None
    if ggml_type in ("Q4_0", "Q4_1"):
        head = 2 if ggml_type == "Q4_0" else 4
        q = _nibbles32(b[..., head:]).astype(np.int16)
        if ggml_type == "Q4_0":
            return (q - 8).reshape(n, k), _f16(b[..., 0:2]), None, None
        return q.reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), None
    if ggml_type in ("Q5_0", "Q5_1"):
        head = 2 if ggml_type == "Q5_0" else 4
        qh = _high_bits32(b[..., head : head + 4])
        q = (_nibbles32(b[..., head + 4 :]) | (qh << 4)).astype(np.int16)
        if ggml_type == "Q5_0":
            return (q - 16).reshape(n, k), _f16(b[..., 0:2]), None, None
        return q.reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), None
    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (N, nb)
        sc, mn = _scale_min_k4(b[..., 4:16])  # (N, nb, 8)
        if ggml_type == "Q4_K":
            qs = b[..., 16:144].reshape(n, nb, 4, 32)  # 32 bytes per pair of sub-blocks
            q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32)  # sub-block 2j low, 2j+1 high
        else:
            qh = b[..., 16:48]  # (N, nb, 32): bit j of byte l is weight l of sub-block j
            qs = b[..., 48:176].reshape(n, nb, 4, 32)
            q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32)
            hi = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q = q | (hi << 4)
        scale = d[..., None] * sc.astype(np.float32)  # exact: f16 x 6 bits
        offset = -(dmin[..., None] * mn.astype(np.float32))
        return q.astype(np.int16).reshape(n, k), scale.reshape(n, -1), offset.reshape(n, -1), None
    # Q6_K: ql[128], qh[64], scales[16] int8, d f16
    ql, qh = b[..., 0:128].reshape(n, nb, 2, 64), b[..., 128:192].reshape(n, nb, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # (N, nb, 16)
    d = _f16(b[..., 208:210])
    lo = np.stack(
        [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3
    )  # (N, nb, 2, 4, 32)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    q = (lo | (hi << 4)).astype(np.int16) - 32  # element h*128 + s*32 + l
    sub = d[..., None] * sc  # (N, nb, 16), exact: f16 x int8
    return q.reshape(n, k), None, None, sub.reshape(n, -1)


def dequantize(raw: np.ndarray, ggml_type: str, k: int, name: str = "tensor") -> np.ndarray:
    """Raw block rows (N, bytes per row) -> float32 (N, K), as the file stores it (rows = outputs)."""
    q, scale, offset, sub = decode(raw, ggml_type, k, name)
    n = q.shape[0]
    if sub is not None:
        return (sub.reshape(n, -1, 1) * q.reshape(n, -1, 16).astype(np.float32)).reshape(n, k)
    w = scale.reshape(n, -1, 1) * q.reshape(n, -1, BLOCK).astype(np.float32)
    if offset is not None:
        w = w + offset.reshape(n, -1, 1)
    return w.reshape(n, k)


def _q6k_to_int8(raw: np.ndarray, k: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows -> int8 codes (N, K), scale (N, K/32) float32, exact-block mask (N, K/32)."""
    b = _blocks(raw, "Q6_K", k, name)
    n, nb = b.shape[:2]
    q, _, _, sub = decode(raw, "Q6_K", k, name)
    sc = b[..., 192:208].view(np.int8).astype(np.int32).reshape(n, nb * 8, 2)  # per block of 32: (sc1, sc2)
    d = np.repeat(_f16(b[..., 208:210]), 8, axis=1)  # (N, K/32)
    g = np.gcd(np.abs(sc[..., 0]), np.abs(sc[..., 1]))
    g = np.where(g == 0, 1, g)
    qb = q.reshape(n, nb * 8, 2, 16).astype(np.int32)
    codes = (qb * (sc // g[..., None])[..., None]).reshape(n, nb * 8, BLOCK)
    exact = np.abs(codes).max(axis=-1) <= 127
    scale = d * g.astype(np.float32)  # exact: f16 x 7 bits
    # the rest: re-rounded from the float values (absmax / 127, round half to even)
    w = (sub.reshape(n, -1, 1) * q.reshape(n, -1, 16).astype(np.float32)).reshape(n, nb * 8, BLOCK)
    amax = np.abs(w).max(axis=-1)
    rscale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    rcodes = np.clip(np.rint(w / rscale[..., None]), -127, 127)
    codes = np.where(exact[..., None], codes, rcodes).astype(np.int8)
    scale = np.where(exact, scale, rscale).astype(np.float32)
    return codes.reshape(n, k), scale, exact


def to_quant_matrix(
    raw: np.ndarray, ggml_type: str, k: int, bits: int | None = None, name: str = "tensor"
) -> QuantMatrix:
    """GGUF block rows (N outputs, bytes per row) -> QuantMatrix (K, N) at `bits` (None: the type's
    own width, NATIVE_BITS). 4-bit types widen to int8 exactly; an 8-bit type cannot narrow to int4
    (ValueError: the caller re-quantizes). Unsupported types: ModelError naming the tensor."""
    if ggml_type not in BLOCK_SIZES:
        raise refuse(name, ggml_type)
    bits = NATIVE_BITS[ggml_type] if bits is None else bits
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if bits == 4 and NATIVE_BITS[ggml_type] != 4:
        raise ValueError(f"{name}: {ggml_type} codes need 8 bits; it cannot be imported as int4")
    if ggml_type == "Q6_K":
        codes, scale, _ = _q6k_to_int8(raw, k, name)
        return QuantMatrix(q=codes.T.copy(), scale=scale.T.copy(), zero_point=None, offset=None, bits=8)
    q, scale, offset, _ = decode(raw, ggml_type, k, name)
    n = q.shape[0]
    off = None if offset is None else np.ascontiguousarray(offset.T, dtype=np.float32)
    if bits == 8:
        return QuantMatrix(q=q.astype(np.int8).T.copy(), scale=scale.T.copy(), zero_point=None, offset=off, bits=8)
    if ggml_type == "Q4_0":  # wquant's convention for Q4_0: codes 0..15 with zero point 8
        zp = np.full((k // BLOCK, n), 8, dtype=np.uint8)
        return QuantMatrix(
            q=(q + 8).astype(np.uint8).T.copy(), scale=scale.T.copy(), zero_point=zp, offset=None, bits=4
        )
    return QuantMatrix(q=q.astype(np.uint8).T.copy(), scale=scale.T.copy(), zero_point=None, offset=off, bits=4)


def q6k_exact_fraction(raw: np.ndarray, k: int) -> float:
    """The share of Q6_K's blocks of 32 that import bit for bit (the rest are re-rounded)."""
    return float(_q6k_to_int8(raw, k, "tensor")[2].mean())


def widen(m: QuantMatrix) -> QuantMatrix:
    """An int4 QuantMatrix as int8 blocks with the same values (codes q - zero point; the same scales
    and offsets): exact. An int8 one is returned as it is."""
    if m.bits == 8:
        return m
    q = m.q.astype(np.int16)
    if m.zero_point is not None:
        q = q - np.repeat(m.zero_point.astype(np.int16), BLOCK, axis=0)
    return QuantMatrix(q=q.astype(np.int8), scale=m.scale, zero_point=None, offset=m.offset, bits=8)


def join(parts: list[QuantMatrix], log=lambda s: None, what: str = "matrices") -> QuantMatrix:
    """wquant.concat of q|k|v or gate|up; parts of different widths (a GGUF's int4 Q4_K beside its
    int8 Q5_0, say) are joined at the wider width, the int4 parts widened exactly (widen), and logged."""
    from cabinlm.export import wquant

    if len({m.bits for m in parts}) > 1:
        log(
            f"{what}: parts of {' / '.join(f'int{m.bits}' for m in parts)} joined as int8 (the int4 parts widened exactly)"
        )
        parts = [widen(m) for m in parts]
    return wquant.concat(parts)
