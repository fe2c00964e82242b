"""INT8 / FP8 (E4M3) KV quantization: graph pieces and key-scale calibration.

Symmetric, x = q * scale:
  keys    per (layer, KV head, channel), calibrated once at export. Keys are cached un-rotated, so a
          channel's range does not depend on the token's position (KVQuant's pre-RoPE finding);
  values  per (layer, KV head, token): absmax / QMAX, computed in the graph when the token is
          written, stored as fp16 next to the value (2 bytes per 64-byte head vector).

In the graph both are explicit QuantizeLinear / DequantizeLinear nodes with a unit scale, around a
Div / Mul by the real scale: the pattern TensorRT parses for explicit quantization, and the same
rounding (half to even) and saturation as a numpy reference. Stored data is never re-quantized.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from cabinlm.export.graph import GraphBuilder
from cabinlm.contract.manifest import KVDType

QMAX = {KVDType.INT8: 127.0, KVDType.FP8: 448.0}  # int8 symmetric range; largest finite E4M3FN
SCALE_FLOOR = 2.0**-24  # smallest fp16 subnormal: an all-zero vector gets a tiny, non-zero scale
SCALE_CEIL = 65504.0  # largest finite fp16: a scale must survive its fp16 storage (larger values saturate)
_ZERO_POINT_TYPE = {KVDType.INT8: TensorProto.INT8, KVDType.FP8: TensorProto.FLOAT8E4M3FN}


def _zero_point(g: GraphBuilder, kv: KVDType) -> str:
    # The zero point's type is the quantized type (int8 or float8e4m3fn); symmetric: always 0.
    return g.scalar(_ZERO_POINT_TYPE[kv], 0)


def quantize(g: GraphBuilder, x: str, scale: str, kv: KVDType) -> str:
    """x / scale, rounded (half to even) and saturated to the type's range."""
    y = g.op("Div", x, scale, name="kvq/div")
    if kv == KVDType.INT8:  # symmetric: -127..127 (QuantizeLinear alone would allow -128)
        y = g.op("Clip", y, g.const(-QMAX[kv]), g.const(QMAX[kv]), name="kvq/clip")
    return g.op("QuantizeLinear", y, g.const(1.0), _zero_point(g, kv), name="kvq/q")


def dequantize(g: GraphBuilder, q: str, scale: str, kv: KVDType) -> str:
    return g.op("Mul", g.op("DequantizeLinear", q, g.const(1.0), _zero_point(g, kv), name="kvq/dq"), scale)


def quantize_per_token(g: GraphBuilder, v: str, kv: KVDType, name: str) -> tuple[str, str, str]:
    """v (Hkv, T, Dh) -> (quantized v, fp16 scales (Hkv, T, 1), the same scales as float32).

    The scale is rounded to fp16 before it divides, so the stored scale is exactly the one used."""
    amax = g.reduce("ReduceMax", g.op("Abs", v, name=f"{name}/abs"), [-1], name=f"{name}/amax")
    scale = g.op("Clip", g.op("Div", amax, g.const(QMAX[kv])), g.const(SCALE_FLOOR), g.const(SCALE_CEIL), name=f"{name}/raw")
    scale16 = g.op("Cast", scale, to=TensorProto.FLOAT16, name=f"{name}/fp16")
    scale32 = g.op("Cast", scale16, to=TensorProto.FLOAT, name=f"{name}/f32")
    return quantize(g, v, scale32, kv), scale16, scale32


# Rotated keys (fused cpu builds) get twice the calibrated pair maximum as their range: text beyond
# the calibration set holds larger keys, and a clipped key costs more than a coarser step (SmolLM2,
# 1,500-3,000 tokens of two held-out texts: x1 +1.16% / +0.29% perplexity over fp32 KV, x2 +0.02% /
# +0.40%; x0.7 +5.2%). Values keep their calibrated maximum (x0.7 helped one text and hurt the other).
ROTATED_KEY_HEADROOM = 2.0


def key_scales_from_amax(amax: np.ndarray, kv: KVDType) -> np.ndarray:
    """(layers, Hkv, Dh) calibrated absmax -> per-channel scales."""
    return np.maximum(amax.astype(np.float32) / QMAX[KVDType(kv)], SCALE_FLOOR).astype(np.float32)


def calibrate_kv_amax(model, layers, ids: list[int], num_kv_heads: int, head_dim: int, chunk: int = 512) -> dict[str, np.ndarray]:
    """Absmax statistics of `layers` (the decoder layers of `model`) over `ids`, each (layers, Hkv, Dh):

      keys          per channel of the un-rotated keys (k_proj outputs, bias included; k_norm's for
                    Qwen3; the k columns of qkv_proj for Phi-3): the scales of
                    the exported graph, which caches keys un-rotated;
      rotated_keys  per rotation pair: max over tokens of sqrt(k[j]^2 + k[j + Dh/2]^2), written to both
                    channels of the pair. A rotation moves magnitude only inside a pair, so this bounds
                    the key's channels at any position: the scales of engines that cache rotated keys;
      values        per channel of the values (v_proj outputs): static value scales for those engines.

    The text runs densely in pieces of `chunk` tokens."""
    import torch

    stats = {k: np.zeros((len(layers), num_kv_heads, head_dim), dtype=np.float32) for k in ("keys", "rotated_keys", "values")}
    half = head_dim // 2

    def key_hook(i):
        def fn(_module, _inputs, out):
            k = out.detach().float().reshape(-1, num_kv_heads, head_dim)
            np.maximum(stats["keys"][i], k.abs().amax(dim=0).numpy(), out=stats["keys"][i])
            pair = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2).amax(dim=0).numpy()
            np.maximum(stats["rotated_keys"][i], np.concatenate([pair, pair], axis=-1), out=stats["rotated_keys"][i])

        return fn

    def value_hook(i):
        def fn(_module, _inputs, out):
            v = out.detach().float().reshape(-1, num_kv_heads, head_dim).abs().amax(dim=0).numpy()
            np.maximum(stats["values"][i], v, out=stats["values"][i])

        return fn

    kv = num_kv_heads * head_dim

    def fused(hook, start: int):  # Phi-3's qkv_proj: (..., (H + 2 Hkv) Dh), q|k|v; k starts at -2 kv, v at -kv
        def fn(module, inputs, out):
            n = out.shape[-1]
            return hook(module, inputs, out[..., n + start : n + start + kv])

        return fn

    handles = []
    for i, layer in enumerate(layers):
        a = layer.self_attn
        if hasattr(a, "qkv_proj"):
            handles += [a.qkv_proj.register_forward_hook(fused(key_hook(i), -2 * kv)),
                        a.qkv_proj.register_forward_hook(fused(value_hook(i), -kv))]  # fmt: skip
            continue
        # Qwen3: the cached keys are k_norm's outputs (the graph caches keys after the norm)
        keys = a.k_norm if getattr(a, "k_norm", None) is not None else a.k_proj
        handles += [keys.register_forward_hook(key_hook(i)), a.v_proj.register_forward_hook(value_hook(i))]
    try:
        with torch.no_grad():
            for start in range(0, len(ids), chunk):
                model(torch.tensor([ids[start : start + chunk]]))
    finally:
        for h in handles:
            h.remove()
    return stats


def calibrate_key_amax(model, layers, ids: list[int], num_kv_heads: int, head_dim: int, chunk: int = 512) -> np.ndarray:
    """Per-channel absmax of the un-rotated keys, (layers, Hkv, Dh) (see calibrate_kv_amax)."""
    return calibrate_kv_amax(model, layers, ids, num_kv_heads, head_dim, chunk)["keys"]
