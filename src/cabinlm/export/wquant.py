"""Block-quantized weights: int8 and int4 in blocks of 32 along the input dimension.

A weight matrix W (K inputs, N outputs) is stored as

    W[k, n] = scale[k // 32, n] * (q[k, n] - zero_point[k // 32, n]) + offset[k // 32, n]

with q int8 (int8, symmetric: zero point 0, no offset) or uint4 (int4). In the graph this is plain
ONNX: DequantizeLinear (opset 21, block_size 32, axis 0) feeding a MatMul, which ONNX Runtime fuses
into its MatMulNBits kernel and TensorRT (10+) reads as block-quantized weights. The optional
`offset` is GGUF Q4_1's per-block minimum, which no integer zero point can express exactly; the
graph adds it as blocksum(x) @ offset (x's sum over each block of 32 inputs), so a Q4_1 file is
imported bit-for-bit, with no second rounding.

Sources:
- GGUF blocks, imported as they are: Q8_0 (d, 32 x int8) -> int8; Q4_0 (d, 32 x 4 bit, value
  d * (q - 8)) -> int4 with zero point 8; Q4_1 (d, m, 32 x 4 bit, value d * q + m) -> int4 with offset.
- float32 weights, quantized here: int8 symmetric (scale = absmax / 127, round half to even), int4
  asymmetric with an integer zero point per block (scale = (max - min) / 15).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cabinlm.contract.precision import WeightFormat

BLOCK = 32


@dataclass
class QuantMatrix:
    """W (K, N) in blocks of BLOCK along K (see the module docstring)."""

    q: np.ndarray  # (K, N): int8, or uint8 holding 0..15 for int4
    scale: np.ndarray  # (K / BLOCK, N) float32
    zero_point: np.ndarray | None  # (K / BLOCK, N) uint8 (int4 only), None = 0
    offset: np.ndarray | None  # (K / BLOCK, N) float32 (GGUF Q4_1's minimum), None = 0
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        K, N = self.q.shape
        q = self.q.astype(np.float32).reshape(K // BLOCK, BLOCK, N)
        if self.zero_point is not None:
            q = q - self.zero_point.astype(np.float32)[:, None, :]
        w = q * self.scale[:, None, :]
        if self.offset is not None:
            w = w + self.offset[:, None, :]
        return w.reshape(K, N).astype(np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes as stored in the graph (packed int4, scales, zero points, offsets)."""
        n = self.q.size * self.bits // 8 + self.scale.nbytes
        if self.zero_point is not None:
            n += self.zero_point.size * self.bits // 8
        if self.offset is not None:
            n += self.offset.nbytes
        return n


def concat(mats: list[QuantMatrix]) -> QuantMatrix:
    """Join matrices with the same K and format along N (q|k|v, gate|up)."""
    bits = {m.bits for m in mats}
    if len(bits) != 1 or len({m.q.shape[0] for m in mats}) != 1:
        raise ValueError("can only join matrices with the same input size and format")

    def opt(field: str, dtype):
        parts = [getattr(m, field) for m in mats]
        if all(p is None for p in parts):
            return None
        return np.concatenate([p if p is not None else np.zeros(m.scale.shape, dtype) for p, m in zip(parts, mats)], axis=1)

    return QuantMatrix(
        q=np.concatenate([m.q for m in mats], axis=1),
        scale=np.concatenate([m.scale for m in mats], axis=1),
        zero_point=opt("zero_point", np.uint8),
        offset=opt("offset", np.float32),
        bits=bits.pop(),
    )


def _check_k(w: np.ndarray) -> None:
    if w.shape[0] % BLOCK:
        raise ValueError(f"input size {w.shape[0]} is not a multiple of the block size {BLOCK}")


def quantize_int8(w: np.ndarray) -> QuantMatrix:
    """Symmetric int8, blocks of 32 along K: q = round(w / s), s = absmax / 127."""
    _check_k(w)
    K, N = w.shape
    blocks = w.astype(np.float32).reshape(K // BLOCK, BLOCK, N)
    amax = np.abs(blocks).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, None, :]), -127, 127).astype(np.int8).reshape(K, N)
    return QuantMatrix(q=q, scale=scale, zero_point=None, offset=None, bits=8)


def quantize_int4(w: np.ndarray) -> QuantMatrix:
    """Asymmetric int4 with an integer zero point, blocks of 32 along K: the block's [min, max]
    (widened to include 0) spread over 0..15."""
    _check_k(w)
    K, N = w.shape
    blocks = w.astype(np.float32).reshape(K // BLOCK, BLOCK, N)
    lo = np.minimum(blocks.min(axis=1), 0.0)
    hi = np.maximum(blocks.max(axis=1), 0.0)
    scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(blocks / scale[:, None, :]) + zp[:, None, :], 0, 15).astype(np.uint8).reshape(K, N)
    return QuantMatrix(q=q, scale=scale, zero_point=zp, offset=None, bits=4)


def quantize(w: np.ndarray, fmt: WeightFormat) -> QuantMatrix:
    if fmt == WeightFormat.INT8:
        return quantize_int8(w)
    if fmt == WeightFormat.INT4:
        return quantize_int4(w)
    raise ValueError(f"no block quantization for {fmt}")


def pack_uint4(q: np.ndarray) -> bytes:
    """ONNX's 4-bit layout: element 2i in the low nibble of byte i, element 2i+1 in the high one."""
    flat = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


# -- GGUF blocks -----------------------------------------------------------------------------------

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def from_gguf_rows(raw: np.ndarray, ggml_type: str, k: int) -> QuantMatrix:
    """GGUF block rows (one row of blocks per output feature, as the file stores them) -> QuantMatrix
    (K, N). raw: (N, bytes per row) uint8."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    nb = k // BLOCK
    if ggml_type == "Q8_0":  # f16 d, 32 x int8
        blocks = raw.reshape(n, nb, 34)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, nb)
        q = blocks[:, :, 2:].copy().view(np.int8)  # (N, nb, 32)
        return QuantMatrix(q=q.reshape(n, k).T.copy(), scale=d.T.copy(), zero_point=None, offset=None, bits=8)
    if ggml_type in ("Q4_0", "Q4_1"):
        head = 2 if ggml_type == "Q4_0" else 4
        blocks = raw.reshape(n, nb, head + 16)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[:, :, head:]
        # ggml order: weights 0..15 in the low nibbles of the 16 bytes, 16..31 in the high nibbles
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        if ggml_type == "Q4_0":
            zp = np.full((nb, n), 8, dtype=np.uint8)
            return QuantMatrix(q=q.T.copy(), scale=d.T.copy(), zero_point=zp, offset=None, bits=4)
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return QuantMatrix(q=q.T.copy(), scale=d.T.copy(), zero_point=None, offset=m.T.copy(), bits=4)
    raise ValueError(f"GGUF type {ggml_type} cannot be imported as blocks (supported: {', '.join(GGUF_TYPES)})")


def permute_rows(m: QuantMatrix, order: np.ndarray) -> QuantMatrix:
    """Reorder output features (columns of W (K, N)): blocks run along K, so they stay whole."""
    pick = lambda a: None if a is None else np.ascontiguousarray(a[:, order])  # noqa: E731
    return QuantMatrix(q=pick(m.q), scale=pick(m.scale), zero_point=pick(m.zero_point), offset=pick(m.offset), bits=m.bits)
