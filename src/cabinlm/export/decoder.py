"""The fixed-shape decoder: a compact Llama/Qwen2 decoder (RMSNorm, RoPE, grouped-query attention,
SwiGLU) written as an ONNX graph over weights taken from a `transformers` model.

One decoder layer, T = chunk tokens, N = cache slots, H = heads, Hkv = KV heads, G = H / Hkv:

    x (T, D) ─ RMSNorm ─ MatMul W_qkv (+bias) ─ Split ─┬─ q (T, H*Dh) ─ (H, T, Dh) ─ RoPE(pos, x 1/sqrt(Dh))
                                                       ├─ k (T, Hkv*Dh) ─ (Hkv, T, Dh) ──────────────> new_key.l
                                                       └─ v ─────────── (Hkv, T, Dh) ──────────────> new_value.l
    key_cache.l (Hkv, N, Dh) ─ RoPE(cache_pos) ─ Kc      k ─ RoPE(pos) ─ Kn
    q^T (Hkv, Dh, G*T) ─ scores = [Kc q^T ; Kn q^T] (Hkv, N+T, G*T) + mask^T ─ Softmax over keys
    ─ probs^T (Hkv, G*T, N+T) ─ [p_cache | p_chunk] ─ p_cache @ value_cache.l + p_chunk @ v
    ─ (T, H*Dh) ─ W_o ─ + x ─ RMSNorm ─ MatMul W_gate|up ─ Split ─ SiLU(gate) * up ─ W_down ─ + x

Keys are cached un-rotated and rotated inside the graph with the positions of this step, which is
what lets positions be cache ranks (StreamingLLM) without ever re-rotating stored data. The cache
and the chunk are attended separately and joined only at the small score tensor, so the cache is
never concatenated or transposed (each was a full copy per layer per step); grouped attention
lets the G query heads of a group share their K/V instead of repeating them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from cabinlm import manifest as mf
from cabinlm.export import kvquant as kvq
from cabinlm.export.graph import ELEM, GraphBuilder
from cabinlm.manifest import CacheLayout, ModelSpec


@dataclass
class LayerWeights:
    input_norm: np.ndarray  # (D,)
    qkv: np.ndarray  # (D, (H + 2 Hkv) Dh), q|k|v columns
    qkv_bias: np.ndarray | None  # ((H + 2 Hkv) Dh,)
    o: np.ndarray  # (H Dh, D)
    post_norm: np.ndarray  # (D,)
    gate_up: np.ndarray  # (D, 2 I), gate|up columns
    down: np.ndarray  # (I, D)


@dataclass
class DecoderWeights:
    embed: np.ndarray  # (V, D)
    layers: list[LayerWeights]
    final_norm: np.ndarray  # (D,)
    lm_head: np.ndarray | None  # (V, D); None when tied to embed
    inv_freq: np.ndarray  # (Dh / 2,) RoPE inverse frequencies (any static scaling applied)
    rope_scaling: float  # multiplies cos and sin (1.0 unless the RoPE type says otherwise)
    key_scales: np.ndarray | None = None  # (layers, Hkv, Dh) per-channel key scales, int8 / fp8 KV only


def build_decoder(
    spec: ModelSpec,
    layout: CacheLayout,
    w: DecoderWeights,
    opset: int = 17,
    index_dtype: str = "int64",
    embed_dim: int = 0,
) -> GraphBuilder:
    """embed_dim > 0: a vision-language decoder, whose image tokens take rows of image_embeds."""
    g = GraphBuilder("cabinlm_decoder", opset=opset)
    io = mf.decoder_io(layout, spec.vocab_size, index_dtype, embed_dim)
    for t in io.inputs:
        g.input(t.name, ELEM[t.dtype], t.shape)
    kv_elem = ELEM[layout.kv_dtype.onnx_name]
    kv_is_float32 = kv_elem == TensorProto.FLOAT
    if layout.quantized and w.key_scales is None:
        raise ValueError("int8 / fp8 KV needs calibrated key scales")
    if layout.kv_dtype == mf.KVDType.FP8 and opset < 19:
        raise ValueError("fp8 KV needs opset 19 or newer (float8 QuantizeLinear)")

    H, Hkv, Dh = spec.num_heads, spec.num_kv_heads, spec.head_dim
    G = H // Hkv
    eps = g.const(spec.rms_norm_eps)

    def rms_norm(x: str, weight: np.ndarray, name: str) -> str:
        # x / sqrt(mean(x^2) + eps) * w: the pattern ONNX Runtime fuses into one kernel.
        var = g.reduce("ReduceMean", g.op("Pow", x, g.const(2.0), name=f"{name}/sq"), [-1], name=f"{name}/var")
        rms = g.op("Sqrt", g.op("Add", var, eps, name=f"{name}/eps"), name=f"{name}/rms")
        return g.op("Mul", g.op("Div", x, rms, name=f"{name}/div"), g.weight(f"{name}.weight", weight), name=name)

    half = Dh // 2
    # rotate_half(x) = [-x2, x1] = [x2, x1] * [-1 | +1]: the sign lives in the sin table. (Split and
    # Concat, not a Gather over the last axis: ONNX Runtime's Gather there is several times slower.)
    sign = np.concatenate([-np.ones(half), np.ones(half)]).astype(np.float32).reshape(1, -1)

    def rotary_tables(pos: str, scale: float, name: str) -> tuple[str, str]:
        # pos (n,) -> cos (n, Dh), signed sin (n, Dh), HF's "rotate_half" convention.
        p = g.op("Unsqueeze", g.op("Cast", pos, to=TensorProto.FLOAT), g.ints([1]), name=f"{name}/pos")
        freqs = g.op("Mul", p, g.const(w.inv_freq.reshape(1, -1).astype(np.float32)), name=f"{name}/freqs")
        emb = g.op("Concat", freqs, freqs, axis=1, name=f"{name}/emb")
        cos = g.op("Cos", emb, name=f"{name}/cos")
        sin = g.op("Mul", g.op("Sin", emb, name=f"{name}/sin"), g.const(sign * scale), name=f"{name}/sin_signed")
        if scale != 1.0:
            cos = g.op("Mul", cos, g.const(scale), name=f"{name}/cos_scaled")
        return cos, sin

    def rope(x: str, cos: str, sin: str, name: str) -> str:
        # x (heads, n, Dh): x * cos + rotate_half(x) * sin
        x1, x2 = g.split(x, [half, half], axis=-1, name=f"{name}/half")
        rot = g.op("Concat", x2, x1, axis=-1, name=f"{name}/rot")
        return g.op("Add", g.op("Mul", x, cos, name=f"{name}/xcos"), g.op("Mul", rot, sin, name=f"{name}/rsin"), name=name)

    # Shared by all layers: RoPE tables for the cached keys, the chunk's keys, and the chunk's
    # queries (with the softmax scale 1/sqrt(Dh) folded in); the mask laid out for K.q^T scores.
    c_cos, c_sin = rotary_tables(mf.CACHE_POSITION_IDS, w.rope_scaling, "rope_cache")
    n_cos, n_sin = rotary_tables(mf.POSITION_IDS, w.rope_scaling, "rope_chunk")
    q_cos, q_sin = rotary_tables(mf.POSITION_IDS, w.rope_scaling / np.sqrt(Dh), "rope_q")
    mask_t = g.op("Unsqueeze", g.op("Transpose", mf.ATTENTION_MASK, perm=[1, 0]), g.ints([1]), name="mask_t")  # (N+T,1,T)
    N = layout.slots

    x = g.op("Gather", g.weight("embed_tokens", w.embed), mf.INPUT_IDS, axis=0, name="embed")  # (T, D)
    if embed_dim:  # image tokens: the vision graph's embeddings instead of the table's row
        x = g.op("Where", mf.IMAGE_MASK, mf.IMAGE_EMBEDS, x, name="embed_with_image")
    for i, lw in enumerate(w.layers):
        p = f"layers.{i}"
        h = rms_norm(x, lw.input_norm, f"{p}.input_norm")
        qkv = g.op("MatMul", h, g.weight(f"{p}.qkv", lw.qkv), name=f"{p}/qkv")
        if lw.qkv_bias is not None:
            qkv = g.op("Add", qkv, g.weight(f"{p}.qkv_bias", lw.qkv_bias), name=f"{p}/qkv_bias")
        q, k, v = g.split(qkv, [H * Dh, Hkv * Dh, Hkv * Dh], axis=1, name=f"{p}/split_qkv")
        q = g.op("Transpose", g.op("Reshape", q, g.ints([-1, H, Dh])), perm=[1, 0, 2], name=f"{p}/q")  # (H,T,Dh)
        k = g.op("Transpose", g.op("Reshape", k, g.ints([-1, Hkv, Dh])), perm=[1, 0, 2], name=f"{p}/k")
        v = g.op("Transpose", g.op("Reshape", v, g.ints([-1, Hkv, Dh])), perm=[1, 0, 2], name=f"{p}/v")

        # The new tokens' un-rotated K/V leave the graph; the runtime writes them into its buffers.
        # Quantized once here, when written; the chunk itself attends to its unquantized K/V.
        k_cache, v_cache = mf.key_cache_name(i), mf.value_cache_name(i)
        v_scales = None  # per-slot value scales, folded into the attention probabilities below
        kv_shape = (Hkv, "tokens", Dh)
        if layout.quantized:
            k_scale = g.weight(f"{p}.key_scale", w.key_scales[i][:, None, :].astype(np.float32))  # (Hkv,1,Dh)
            g.output(kvq.quantize(g, k, k_scale, layout.kv_dtype), mf.new_key_name(i), kv_elem, kv_shape)
            v_q, v_scale16, v_scale = kvq.quantize_per_token(g, v, layout.kv_dtype, f"{p}/v_scale")
            g.output(v_q, mf.new_value_name(i), kv_elem, kv_shape)
            g.output(v_scale16, mf.new_value_scale_name(i), TensorProto.FLOAT16, (Hkv, "tokens", 1))
            k_cache = kvq.dequantize(g, k_cache, k_scale, layout.kv_dtype)
            v_cache = kvq.dequantize(g, v_cache, g.const(1.0), layout.kv_dtype)  # unit scale: see v_scales
            scales = g.op("Cast", mf.value_scale_name(i), to=TensorProto.FLOAT, name=f"{p}/v_cache_scale")  # (Hkv,N,1)
            v_scales = g.op("Transpose", scales, perm=[0, 2, 1], name=f"{p}/v_scale_t")  # (Hkv,1,N)
        elif kv_is_float32:
            g.output(k, mf.new_key_name(i), kv_elem, kv_shape)
            g.output(v, mf.new_value_name(i), kv_elem, kv_shape)
        else:
            g.output(g.op("Cast", k, to=kv_elem), mf.new_key_name(i), kv_elem, kv_shape)
            g.output(g.op("Cast", v, to=kv_elem), mf.new_value_name(i), kv_elem, kv_shape)
            k_cache = g.op("Cast", k_cache, to=TensorProto.FLOAT, name=f"{p}/k_cache_f32")
            v_cache = g.op("Cast", v_cache, to=TensorProto.FLOAT, name=f"{p}/v_cache_f32")

        # Attention over the cache and over the chunk, joined only at the (small) scores, so the
        # cache is neither concatenated nor transposed: scores are K . q^T, (keys, queries).
        kc = rope(k_cache, c_cos, c_sin, f"{p}/rope_kc")  # (Hkv, N, Dh)
        kn = rope(k, n_cos, n_sin, f"{p}/rope_kn")  # (Hkv, T, Dh)
        q = rope(q, q_cos, q_sin, f"{p}/rope_q")  # (H, T, Dh), scaled
        q_t = g.op("Transpose", g.op("Reshape", q, g.ints([Hkv, -1, Dh])), perm=[0, 2, 1], name=f"{p}/q_t")  # (Hkv,Dh,G*T)
        scores = g.op("Concat", g.op("MatMul", kc, q_t), g.op("MatMul", kn, q_t), axis=1, name=f"{p}/scores")  # (Hkv,N+T,G*T)
        scores = g.op("Add", g.op("Reshape", scores, g.ints([0, 0, G, -1])), mask_t, name=f"{p}/masked")  # (Hkv,N+T,G,T)
        probs = g.op("Softmax", scores, axis=1, name=f"{p}/probs")
        probs = g.op("Transpose", g.op("Reshape", probs, g.ints([0, 0, -1])), perm=[0, 2, 1], name=f"{p}/probs_t")  # (Hkv,G*T,N+T)
        p_cache = g.op("Slice", probs, g.ints([0]), g.ints([N]), g.ints([2]), name=f"{p}/p_cache")
        p_chunk = g.op("Slice", probs, g.ints([N]), g.ints([2**62]), g.ints([2]), name=f"{p}/p_chunk")
        if v_scales is not None:
            p_cache = g.op("Mul", p_cache, v_scales, name=f"{p}/p_cache_scaled")
        ctx = g.op("Add", g.op("MatMul", p_cache, v_cache), g.op("MatMul", p_chunk, v), name=f"{p}/ctx")  # (Hkv,G*T,Dh)
        ctx = g.op("Reshape", ctx, g.ints([H, -1, Dh]), name=f"{p}/ctx_heads")
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[1, 0, 2]), g.ints([-1, H * Dh]), name=f"{p}/ctx_flat")
        x = g.op("Add", x, g.op("MatMul", ctx, g.weight(f"{p}.o", lw.o), name=f"{p}/o"), name=f"{p}/attn_res")

        h = rms_norm(x, lw.post_norm, f"{p}.post_norm")
        gate, up = g.split(
            g.op("MatMul", h, g.weight(f"{p}.gate_up", lw.gate_up), name=f"{p}/gate_up"),
            [lw.down.shape[0], lw.down.shape[0]],
            axis=1,
            name=f"{p}/split_gate_up",
        )
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up, name=f"{p}/swiglu")
        x = g.op("Add", x, g.op("MatMul", act, g.weight(f"{p}.down", lw.down), name=f"{p}/down"), name=f"{p}/mlp_res")

    h = rms_norm(x, w.final_norm, "final_norm")
    if w.lm_head is None:  # tied: reuse the embedding table, weights held once
        logits = g.op("Gemm", h, "embed_tokens", transB=1, name="lm_head")
    else:
        logits = g.op("Gemm", h, g.weight("lm_head", w.lm_head), transB=1, name="lm_head")
    g.output(logits, mf.LOGITS, TensorProto.FLOAT, ("tokens", spec.vocab_size))

    # Graph outputs in the declared order.
    order = {t.name: i for i, t in enumerate(io.outputs)}
    g.outputs.sort(key=lambda vi: order[vi.name])
    return g
