"""How quantized weight blocks are laid out for the kernels that run them: ONNX Runtime's
MatMulNBits (4-bit packing, GGUF Q4_1 blocks as 8-bit codes with zero points) and cabinlm's own
BlockQ4MatMul (kernels/block_q4_matmul.cc). Pure numpy; the same codes, scales and minimums as the
export, re-arranged (and, for q4_1_as_int8, re-expressed as its docstring bounds)."""

from __future__ import annotations

import numpy as np

BLOCK = 32  # weights per block along K, every format here


def pack4(q: np.ndarray) -> np.ndarray:
    """(..., even) values 0..15 -> (..., even / 2) bytes, first value in the low nibble."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def block_q4_layout(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray | None:
    """4-bit blocks (w = d * q + m) in the layout of cabinlm's BlockQ4MatMul
    (kernels/block_q4_matmul.cc): per tile of 16 columns and block of 32 rows, 256 bytes of codes
    (byte 4 c + i of the j-th 64 holds column c's rows 4 j + i in its low nibble and 4 (j + 4) + i in
    its high one), then the 16 scales and the 16 minimums: as float16 where every scale and minimum
    is one (a GGUF Q4_1's always are: 320 bytes a tile block), else as float32 (384 bytes). The same
    codes, scales and minimums as given; None where the shape is not tiles of 16 columns by blocks of
    32 rows.

    q (K, N) codes 0..15; scale, offset (K / 32, N). Returns uint8 (N / 16, K / 32, 320 or 384)."""
    K, N = q.shape
    if N % 16 or K % BLOCK:
        return None
    scale, offset = np.asarray(scale, np.float32), np.asarray(offset, np.float32)
    d16, m16 = scale.astype(np.float16), offset.astype(np.float16)
    half = np.array_equal(d16.astype(np.float32), scale) and np.array_equal(m16.astype(np.float32), offset)
    d, m = (d16, m16) if half else (scale, offset)
    T, nb = N // 16, K // BLOCK
    c = q.astype(np.uint8).reshape(nb, 8, 4, T, 16)  # (block, j, i, tile, column): row 32 b + 4 j + i
    packed = c[:, :4] | (c[:, 4:] << 4)  # (block, j < 4, i, tile, column)
    codes = packed.transpose(3, 0, 1, 4, 2).reshape(T, nb, 256)  # byte 64 j + 4 c + i
    width = 16 * d.itemsize
    d = d.reshape(nb, T, 16).transpose(1, 0, 2).copy().view(np.uint8).reshape(T, nb, width)
    m = m.reshape(nb, T, 16).transpose(1, 0, 2).copy().view(np.uint8).reshape(T, nb, width)
    return np.ascontiguousarray(np.concatenate([codes, d, m], axis=2))


def q4_zero_points_as_minimums(scale: np.ndarray, zero_point: np.ndarray | None, offset: np.ndarray | None) -> np.ndarray:
    """The minimum m of 4-bit blocks w = d * (q - z) + offset as BlockQ4MatMul holds them (w = d * q + m):
    m = offset - z d, in float32 (z an integer 0..15; no zero point: 0, no offset: 0)."""
    m = np.zeros_like(scale, dtype=np.float32) if offset is None else offset.astype(np.float32)
    if zero_point is not None:
        m = (m - zero_point.astype(np.float32) * scale.astype(np.float32)).astype(np.float32)
    return m


def block_q8_layout(q: np.ndarray, scale: np.ndarray) -> np.ndarray | None:
    """Symmetric int8 blocks (w = s * q, q in -127..127) in the layout of cabinlm's BlockQ8MatMul
    (kernels/block_q8_matmul.cc): per tile of 16 columns and block of 32 rows, 512 bytes of codes
    (byte 64 j + 4 c + i holds column c's row 4 j + i, as q + 128), then the 16 scales as float32.
    The same codes and scales as the export; None where the shape is not tiles of 16 columns by
    blocks of 32 rows or a code is -128 (then the kernel does not apply).

    q (K, N) int8 codes; scale (K / 32, N). Returns uint8 (N / 16, K / 32, 576)."""
    K, N = q.shape
    if N % 16 or K % BLOCK or q.dtype != np.int8 or (q == -128).any():
        return None
    T, nb = N // 16, K // BLOCK
    c = (q.astype(np.int16) + 128).astype(np.uint8).reshape(nb, 8, 4, T, 16)  # (block, j, i, tile, column)
    codes = c.transpose(3, 0, 1, 4, 2).reshape(T, nb, 512)  # byte 64 j + 4 c + i
    s = np.ascontiguousarray(scale, dtype=np.float32).reshape(nb, T, 16).transpose(1, 0, 2).copy().view(np.uint8)
    return np.ascontiguousarray(np.concatenate([codes, s.reshape(T, nb, 64)], axis=2))


def q4_1_as_int8(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 blocks (w = d * q + m, q in 0..15) re-expressed as 8-bit blocks with an integer zero
    point, w' = s * (q8 - z), without a block-sum kernel for the minimum.

    s = d / k with the largest k <= 17 for which the block, zero included, fits 256 codes: the 16
    levels keep their spacing exactly (k codes apart) and the whole block moves by one constant, the
    minimum's rounding to the finer grid, at most s / 2 = d / (2k). A block holding zero (every block
    of a trained model's weights) gets k = 17: d / 34. A block far from zero (none in the models
    measured) falls back to s = its span / 255, each value rounded alone (at most s / 2). A constant
    block is exact.

    q (K, N) codes; scale, offset (K / 32, N). Returns q8 (K, N) uint8, s and z (K / 32, N)."""
    K, N = q.shape
    nb = K // BLOCK
    qb = q.reshape(nb, BLOCK, N).astype(np.int64)
    d, m = scale.astype(np.float64), offset.astype(np.float64)
    qlo, qhi = qb.min(axis=1), qb.max(axis=1)
    s = np.zeros((nb, N))
    z = np.zeros((nb, N), np.int64)
    k_of = np.zeros((nb, N), np.int64)  # 0: not placed on a finer grid yet
    for k in range(17, 0, -1):
        sk = d / k
        t = np.rint(np.divide(m, sk, out=np.zeros_like(m), where=d > 0))  # the minimum, in codes of sk
        zk = np.clip(-(k * qlo + t), 0, 255)
        fits = (d > 0) & (k_of == 0) & (k * qlo + t + zk >= 0) & (k * qhi + t + zk <= 255)
        s, z, k_of = np.where(fits, sk, s), np.where(fits, zk, z), np.where(fits, k, k_of)
    q8 = k_of[:, None, :] * qb + np.rint(np.divide(m, s, out=np.zeros_like(m), where=s > 0))[:, None, :] + z[:, None, :]
    w = d[:, None, :] * qb + m[:, None, :]
    lo, hi = np.minimum(w.min(axis=1), 0), np.maximum(w.max(axis=1), 0)
    far = (d > 0) & (k_of == 0)
    flat = d == 0  # one level: m itself, 127 codes from the zero point
    s = np.where(far, (hi - lo) / 255, s)
    s = np.where(flat, np.maximum(np.abs(m), np.finfo(np.float32).tiny) / 127, s)
    z = np.where(far, np.clip(np.rint(-lo / np.where(far, s, 1)), 0, 255), np.where(flat, 128, z))
    other = np.clip(np.rint(w / s[:, None, :]) + z[:, None, :], 0, 255)
    q8 = np.where((far | flat)[:, None, :], other, q8)
    return q8.reshape(K, N).astype(np.uint8), s.astype(np.float32), z.astype(np.uint8)
