"""The weight matrices of the 16-bit-activation graph (`cabinlm build --activations a16 --a16-weights`,
engines/qnn_htp/qdq.py): symmetric blocks of 32 along K, re-quantized from the float matrices.

    DequantizeLinear(w_q (K, N) int8, scale (N,), axis 1)                 the quantizer's, per channel
 -> DequantizeLinear(w_b (K, N) int8 | int4, scale (K/32, N), axis 0, block_size 32, no zero point)

"int8": every matrix int8 blocks (w8a16). "int4": every matrix int4 blocks (Qualcomm's w4a16 holds its
int4 weights in blocks too, LPBQ), the LM head int8 blocks (HEAD_BITS: their LM head is 8-bit as well).
The token table (a Gather, not a MatMul) keeps the quantizer's int8 per row.

Why symmetric: Qualcomm's compiler reads an asymmetric block's zero point as 0 (docs/architecture.md
"16-bit activations on the HTP": the int4 blocks' row of its weights table); symmetric int8 and int4
blocks compile and follow the CPU.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from cabinlm.engines.qnn_htp.graph import BLOCK, _consumers

WEIGHT_FORMATS = ("int8", "int4")  # --a16-weights
HEAD_BITS = 8  # the LM head's blocks under int4 weights (None: the head int4 as the rest)
# int4 codes -8..7; each block's scale absmax / c, c the one of these that rounds the block with the
# least squared error (sym_blocks)
INT4_DIVISORS = (8.0, 7.5, 7.0, 6.5, 6.0)


def sym_blocks(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """A float (K, N) matrix as symmetric blocks of 32 along K: (codes (K, N) int8, scale (K/32, N)).

    8 bits: scale = block absmax / 127, codes -127..127 (a GGUF Q8_0 block exactly).
    4 bits: codes -8..7, scale = block absmax / c (positive), c among INT4_DIVISORS, the one that
    rounds the block with the least squared error: c = 8 uses all 16 levels where the extreme is
    negative (a positive extreme clips to 7 steps), c = 7 never clips; smaller c trade the extreme's
    step for the others' (as llama.cpp's scale search does)."""
    K, N = w.shape
    b = w.astype(np.float32).reshape(K // BLOCK, BLOCK, N)
    absmax = np.abs(b).max(axis=1)  # (K/32, N)
    if bits == 8:
        scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
        return np.clip(np.rint(b / scale[:, None]), -127, 127).astype(np.int8).reshape(K, N), scale
    if bits != 4:
        raise ValueError(f"sym_blocks: 8 or 4 bits, got {bits}")
    absmax = np.where(absmax > 0, absmax, 1.0)
    best_err = best = None
    for c in INT4_DIVISORS:
        d = (absmax / c).astype(np.float32)
        err = ((np.clip(np.rint(b / d[:, None]), -8, 7) * d[:, None] - b) ** 2).sum(axis=1)
        if best is None:
            best, best_err = d, err
        else:
            better = err < best_err
            best, best_err = np.where(better, d, best), np.where(better, err, best_err)
    codes = np.clip(np.rint(b / best[:, None]), -8, 7).astype(np.int8).reshape(K, N)
    return codes, best.astype(np.float32)


def int4_tensor(codes: np.ndarray, name: str) -> onnx.TensorProto:
    """Signed int4 codes (-8..7, any shape) as an ONNX INT4 initializer: two codes a byte, the first
    in the low nibble (the ONNX spec's packing)."""
    flat = codes.astype(np.int8).ravel()
    nib = (flat & 0x0F).astype(np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    t = onnx.TensorProto()
    t.name, t.data_type = name, onnx.TensorProto.INT4
    t.dims.extend(codes.shape)
    t.raw_data = (nib[0::2] | (nib[1::2] << 4)).tobytes()
    return t


_PASS_THROUGH = ("DequantizeLinear", "QuantizeLinear", "Reshape", "Cast", "Identity", "Squeeze")


def lm_head(q: onnx.ModelProto, output: str = "logits") -> str | None:
    """The name of the DequantizeLinear output that is the LM head's weight: the MatMul found walking
    back from the logits over (de)quantization and shape nodes. None: no such MatMul."""
    producer = {o: n for n in q.graph.node for o in n.output}
    n = producer.get(output)
    while n is not None and n.op_type in _PASS_THROUGH:
        n = producer.get(n.input[0])
    return n.input[1] if n is not None and n.op_type == "MatMul" else None


def block_weights(q: onnx.ModelProto, matrices: dict[str, np.ndarray], bits: int = 8,
                  head_bits: int | None = None) -> dict[str, int]:
    """Each MatMul weight of the QDQ graph q (int8 per output channel, as onnxruntime's quantizer
    writes it) re-quantized from its float matrix (`matrices`, by the float graph's initializer name)
    as symmetric blocks of 32 along K (module docstring), `bits` wide, the LM head `head_bits` wide
    (None: `bits`). A GGUF Q8_0 matrix is int8 such blocks exactly; a Q4_1 block keeps a step of its
    own. Returns {"weight_blocks": matrices, "weight_blocks_int8": of them 8-bit}."""
    users = _consumers(q)
    head = lm_head(q)
    count = eight = 0
    for dq in q.graph.node:
        base = dq.input[0].removesuffix("_quantized")
        if dq.op_type != "DequantizeLinear" or base == dq.input[0] or base not in matrices:
            continue
        if not all(n.op_type == "MatMul" and n.input[1] == dq.output[0] for n in users.get(dq.output[0], [])):
            continue  # the token table's gather, not a matrix
        w = matrices[base]
        if w.shape[0] % BLOCK:
            continue
        b = head_bits if head_bits is not None and dq.output[0] == head else bits
        codes, scale = sym_blocks(w, b)
        name = f"{base}_block{b}"
        q.graph.initializer.extend([int4_tensor(codes, name) if b == 4 else numpy_helper.from_array(codes, name),
                                    numpy_helper.from_array(scale, f"{name}_scale")])  # fmt: skip
        dq.input[:] = [name, f"{name}_scale"]
        del dq.attribute[:]
        dq.attribute.extend([onnx.helper.make_attribute("axis", 0), onnx.helper.make_attribute("block_size", BLOCK)])
        count += 1
        eight += b == 8
    still = {i for n in q.graph.node for i in n.input}  # the per-channel codes and scales replaced
    kept = [t for t in q.graph.initializer if t.name in still]
    del q.graph.initializer[:]
    q.graph.initializer.extend(kept)
    return {"weight_blocks": count, "weight_blocks_int8": eight}
