"""The fixed-shape decoder: a compact Llama-like decoder (RMSNorm, RoPE, grouped-query attention,
SwiGLU) written as an ONNX graph over weights taken from a `transformers` model. One graph serves
Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (RMSNorm of each q / k head over head_dim, the
parenthesized steps below), Phi-3 (its fused q|k|v and gate|up are the graph's own layout) and
Gemma 3 (embeddings scaled by sqrt(D), q / k norms, the attention output and the MLP output normed
again before their residual adds ("sandwich" norms, [bracketed] below), GELU-tanh for SiLU, its
own softmax scale, and local layers: see "Local layers" below).

One decoder layer, T = chunk tokens, N = cache slots, H = heads, Hkv = KV heads, G = H / Hkv:

    x (T, D) ─ RMSNorm ─ MatMul W_qkv (+bias) ─ Split ─┬─ q (T, H*Dh) ─ (H, T, Dh) (─ RMSNorm) ─ RoPE(pos, x 1/sqrt(Dh))
                                                       ├─ k (T, Hkv*Dh) ─ (Hkv, T, Dh) (─ RMSNorm) ───> new_key.l
                                                       └─ v ─────────── (Hkv, T, Dh) ──────────────> new_value.l
    key_cache.l (Hkv, N, Dh) ─ RoPE(cache_pos) ─ Kc      k ─ RoPE(pos) ─ Kn
    q^T (Hkv, Dh, G*T) ─ scores = [Kc q^T ; Kn q^T] (Hkv, N+T, G*T) + mask^T ─ Softmax over keys
    ─ probs^T (Hkv, G*T, N+T) ─ [p_cache | p_chunk] ─ p_cache @ value_cache.l + p_chunk @ v
    ─ (T, H*Dh) ─ W_o [─ RMSNorm] ─ + x ─ RMSNorm ─ MatMul W_gate|up ─ Split ─ act(gate) * up ─ W_down [─ RMSNorm] ─ + x

Local layers (CacheLayout.local_layers: the model attends within its last w tokens there) read the
same graph with their own inputs: a ring of w slots per layer (key_cache.l of (Hkv, w, Dh)),
local_cache_position_ids / local_position_ids (ranks inside the ring and the chunk), the
local_attention_mask (which also hides ring tokens w or more tokens before each chunk token),
and their own RoPE frequencies (Gemma 3: base 10k where global layers use 1M).

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

from cabinlm.contract import manifest as mf
from cabinlm.export import kvquant as kvq
from cabinlm.export import wquant
from cabinlm.export.wquant import QuantMatrix
from cabinlm.export.graph import ELEM, GraphBuilder
from cabinlm.contract.adapters import SwitchableLora, target_shapes
from cabinlm.contract.manifest import CacheLayout, ModelSpec


Matrix = np.ndarray | QuantMatrix  # float32 (in, out), or block-quantized (export/wquant.py)


@dataclass
class LayerWeights:
    input_norm: np.ndarray  # (D,)
    qkv: Matrix  # (D, (H + 2 Hkv) Dh), q|k|v columns
    qkv_bias: np.ndarray | None  # ((H + 2 Hkv) Dh,)
    o: Matrix  # (H Dh, D)
    post_norm: np.ndarray  # (D,)
    gate_up: Matrix  # (D, 2 I), gate|up columns
    down: Matrix  # (I, D)
    q_norm: np.ndarray | None = None  # (Dh,) Qwen3, Gemma 3: RMSNorm of each query head, before RoPE
    k_norm: np.ndarray | None = None  # (Dh,) Qwen3, Gemma 3: RMSNorm of each key head, before RoPE (keys are cached normed)
    attn_out_norm: np.ndarray | None = None  # (D,) Gemma 3: RMSNorm of the attention output, before its residual add
    mlp_out_norm: np.ndarray | None = None  # (D,) Gemma 3: RMSNorm of the MLP output, before its residual add


@dataclass
class DecoderWeights:
    embed: np.ndarray | QuantMatrix  # (V, D) float32, or quantized as the (D, V) output projection
    layers: list[LayerWeights]
    final_norm: np.ndarray  # (D,)
    lm_head: Matrix | None  # (V, D) float32 or (D, V) quantized; None when tied to embed
    inv_freq: np.ndarray  # (Dh / 2,) RoPE inverse frequencies (any static scaling applied)
    rope_scaling: float  # multiplies cos and sin (1.0 unless the RoPE type says otherwise)
    key_scales: np.ndarray | None = None  # (layers, Hkv, Dh) per-channel key scales, int8 / fp8 KV only
    weight_format: str = "fp32"  # fp32, int8 or int4 (what the matrices hold; the manifest records it)
    weight_source: dict | None = None  # quantized formats: how many matrices were imported / quantized
    embed_scale: float = 1.0  # Gemma 3: the token table's rows times sqrt(D) (the tied output projection unscaled)
    activation: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (Gemma 3)
    query_scale: float | None = None  # the softmax scale on q.k (None: 1 / sqrt(Dh); Gemma 3: query_pre_attn_scalar^-1/2)
    local_inv_freq: np.ndarray | None = None  # local layers' own RoPE frequencies (None: inv_freq)
    local_rope_scaling: float = 1.0

    @property
    def quantized(self) -> bool:
        return any(isinstance(m, QuantMatrix) for m in (self.embed, *(l.qkv for l in self.layers)))


def build_decoder(
    spec: ModelSpec,
    layout: CacheLayout,
    w: DecoderWeights,
    opset: int = 17,
    index_dtype: str = "int64",
    embed_dim: int = 0,
    mrope_section: tuple[int, ...] = (),
    lora: SwitchableLora | None = None,
) -> GraphBuilder:
    """embed_dim > 0: a vision-language decoder, whose image tokens take rows of image_embeds.
    mrope_section (Qwen2-VL's multimodal RoPE): positions have three components (time, row, column)
    and RoPE frequency pair j turns with the component of the section j falls in (below).
    lora: switchable adapter inputs (contract/adapters.py): each targeted projection's output gets
    + (x A^T) B^T from the inputs lora_a.{l}.{t} (R, in) and lora_b.{l}.{t} (out, R)."""
    g = GraphBuilder("cabinlm_decoder", opset=opset)
    shapes = target_shapes(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size)
    lora_io = lora.inputs(spec.num_layers, shapes) if lora is not None else ()
    io = mf.decoder_io(layout, spec.vocab_size, index_dtype, embed_dim, mrope=bool(mrope_section), lora=lora_io)
    if mrope_section and (layout.local_layers or sum(mrope_section) != spec.head_dim // 2):
        raise ValueError(f"mrope_section {list(mrope_section)}: 3 sections adding up to head_dim / 2 = "
                         f"{spec.head_dim // 2}, without local layers")  # fmt: skip
    if w.activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation {w.activation!r}: the graph implements silu and gelu_tanh")
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

    if w.quantized and opset < 21:
        raise ValueError("block-quantized weights need opset 21 or newer (DequantizeLinear block_size)")

    def linear(x: str, m: Matrix, name: str) -> str:
        """x (T, K) @ W (K, N). Quantized: DequantizeLinear (blocks of 32 along K) -> MatMul, which
        ONNX Runtime fuses into MatMulNBits; a Q4_1 offset adds blocksum(x) @ offset."""
        if isinstance(m, np.ndarray):
            return g.op("MatMul", x, g.weight(name, m), name=f"{name}/matmul")
        K, N = m.shape
        elem = TensorProto.UINT4 if m.bits == 4 else TensorProto.INT8
        data = wquant.pack_uint4(m.q) if m.bits == 4 else np.ascontiguousarray(m.q, np.int8).tobytes()
        ins = [g.raw(f"{name}.q", elem, (K, N), data), g.weight(f"{name}.scale", m.scale)]
        if m.zero_point is not None:
            ins.append(g.raw(f"{name}.zero_point", elem, m.zero_point.shape, wquant.pack_uint4(m.zero_point)))
        wt = g.op("DequantizeLinear", *ins, axis=0, block_size=wquant.BLOCK, name=f"{name}/dq")
        y = g.op("MatMul", x, wt, name=f"{name}/matmul")
        if m.offset is not None:
            blocks = g.op("Reshape", x, g.ints([-1, K // wquant.BLOCK, wquant.BLOCK]), name=f"{name}/blocks")
            sums = g.op("ReduceSum", blocks, g.ints([-1]), keepdims=0, name=f"{name}/block_sums")  # (T, K/32)
            y = g.op("Add", y, g.op("MatMul", sums, g.weight(f"{name}.offset", m.offset), name=f"{name}/offset"), name=f"{name}/with_offset")
        return y

    def embedding(ids: str) -> str:
        """Rows of the token table; a quantized table is gathered as integers and scaled per block."""
        if isinstance(w.embed, np.ndarray):
            return g.op("Gather", g.weight("embed_tokens", w.embed), ids, axis=0, name="embed")
        m = w.embed  # (D, V) as the output projection; the table is its transpose
        D, V = m.shape
        nb = D // wquant.BLOCK

        def rows(name: str, table: np.ndarray) -> str:
            t = g.weight(name, np.ascontiguousarray(table.T))
            return g.op("Gather", t, ids, axis=0, name=f"{name}/gather")

        q = g.op("Cast", rows("embed_tokens.q", m.q), to=TensorProto.FLOAT, name="embed/q_f32")
        q = g.op("Reshape", q, g.ints([-1, nb, wquant.BLOCK]), name="embed/blocks")
        if m.zero_point is not None:
            q = g.op("Sub", q, g.op("Unsqueeze", g.op("Cast", rows("embed_tokens.zero_point", m.zero_point), to=TensorProto.FLOAT), g.ints([2])))
        x = g.op("Mul", q, g.op("Unsqueeze", rows("embed_tokens.scale", m.scale), g.ints([2])), name="embed/scaled")
        if m.offset is not None:
            x = g.op("Add", x, g.op("Unsqueeze", rows("embed_tokens.offset", m.offset), g.ints([2])), name="embed/offset")
        return g.op("Reshape", x, g.ints([-1, D]), name="embed")

    def activation(gate: str, name: str) -> str:
        if w.activation == "silu":
            return g.op("Mul", gate, g.op("Sigmoid", gate), name=f"{name}/silu")
        # GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), standard ops only
        # (the Gelu op's approximate="tanh" needs opset 20, older than DRIVE OS's TensorRT parses)
        cube = g.op("Mul", g.op("Mul", gate, gate), gate, name=f"{name}/x3")
        inner = g.op("Mul", g.op("Add", gate, g.op("Mul", cube, g.const(0.044715))), g.const(float(np.sqrt(2 / np.pi))),
                     name=f"{name}/inner")  # fmt: skip
        t = g.op("Add", g.op("Tanh", inner), g.const(1.0), name=f"{name}/tanh1")
        return g.op("Mul", g.op("Mul", gate, t), g.const(0.5), name=f"{name}/gelu")

    half = Dh // 2
    # rotate_half(x) = [-x2, x1] = [x2, x1] * [-1 | +1]: the sign lives in the sin table. (Split and
    # Concat, not a Gather over the last axis: ONNX Runtime's Gather there is several times slower.)
    sign = np.concatenate([-np.ones(half), np.ones(half)]).astype(np.float32).reshape(1, -1)

    def rotary_tables(pos: str, scale: float, name: str, inv_freq: np.ndarray = w.inv_freq) -> tuple[str, str]:
        # pos (n,) -> cos (n, Dh), signed sin (n, Dh), HF's "rotate_half" convention.
        if mrope_section:  # pos (3, n): pair j turns with its section's component, (n, 3) @ (3, Dh/2)
            # pick[c, j] = inv_freq[j] where pair j is in section c, else 0: each sum holds one product
            # and two exact zeros, so the angles are the model's pos[c] * inv_freq[j] bit for bit.
            owner = np.repeat(np.arange(3), mrope_section)
            pick = np.where(owner[None, :] == np.arange(3)[:, None], inv_freq[None, :], 0).astype(np.float32)
            p = g.op("Transpose", g.op("Cast", pos, to=TensorProto.FLOAT), perm=[1, 0], name=f"{name}/pos")
            freqs = g.op("MatMul", p, g.const(pick), name=f"{name}/freqs")
        else:
            p = g.op("Unsqueeze", g.op("Cast", pos, to=TensorProto.FLOAT), g.ints([1]), name=f"{name}/pos")
            freqs = g.op("Mul", p, g.const(inv_freq.reshape(1, -1).astype(np.float32)), name=f"{name}/freqs")
        emb = g.op("Concat", freqs, freqs, axis=1, name=f"{name}/emb")
        cos = g.op("Cos", emb, name=f"{name}/cos")
        sin = g.op("Mul", g.op("Sin", emb, name=f"{name}/sin"), g.const(sign * scale), name=f"{name}/sin_signed")
        if scale != 1.0:
            cos = g.op("Mul", cos, g.const(scale), name=f"{name}/cos_scaled")
        return cos, sin

    def rope(x: str, cos: str, sin: str, name: str) -> str:
        # x (heads, n, Dh): x * cos + rotate_half(x) * sin
        # node names: mf.CACHED_KEY_ROPE_PARTS (builders rewrite the cached keys' rotation by them)
        x1, x2 = g.split(x, [half, half], axis=-1, name=f"{name}/half")
        rot = g.op("Concat", x2, x1, axis=-1, name=f"{name}/rot")
        return g.op("Add", g.op("Mul", x, cos, name=f"{name}/xcos"), g.op("Mul", rot, sin, name=f"{name}/rsin"), name=name)

    # Shared by all layers of a kind (global, local): RoPE tables for the cached keys, the chunk's
    # keys, and the chunk's queries (with the softmax scale folded in); the mask's score shapes.
    q_scale = w.query_scale if w.query_scale is not None else 1 / np.sqrt(Dh)

    @dataclass
    class Attending:
        """What a kind of layer attends with: its slots, mask and RoPE tables."""

        slots: int
        mask: str
        cache_rope: tuple[str, str]
        chunk_rope: tuple[str, str]
        query_rope: tuple[str, str]
        shape_grouped: str
        shape_flat: str

    def attending(slots: int, mask: str, cache_pos: str, pos: str, inv_freq: np.ndarray, scaling: float, kind: str) -> Attending:
        total = g.op("Shape", mask, start=1, name=f"{kind}keys_total")  # the key count N+T, once for all layers
        return Attending(
            slots, mask,
            rotary_tables(cache_pos, scaling, f"{kind}rope_cache", inv_freq),
            rotary_tables(pos, scaling, f"{kind}rope_chunk", inv_freq),
            rotary_tables(pos, scaling * q_scale, f"{kind}rope_q", inv_freq),
            g.op("Concat", g.ints([Hkv, G, -1]), total, axis=0, name=f"{kind}scores_grouped_shape"),
            g.op("Concat", g.ints([Hkv, -1]), total, axis=0, name=f"{kind}scores_flat_shape"),
        )  # fmt: skip

    kinds = {False: attending(layout.slots, mf.ATTENTION_MASK, mf.CACHE_POSITION_IDS, mf.POSITION_IDS, w.inv_freq,
                              w.rope_scaling, "")}  # fmt: skip
    if layout.local_layers:
        local_freq = w.local_inv_freq if w.local_inv_freq is not None else w.inv_freq
        local_scaling = w.local_rope_scaling if w.local_inv_freq is not None else w.rope_scaling
        kinds[True] = attending(layout.local_slots, mf.LOCAL_ATTENTION_MASK, mf.LOCAL_CACHE_POSITION_IDS,
                                mf.LOCAL_POSITION_IDS, local_freq, local_scaling, "local_")  # fmt: skip

    def adapted(y: str, x: str, layer: int, target: str) -> str:
        """y (T, out) + (x A^T) B^T, x (T, in) the projection's input, where the export takes adapter
        inputs on this target: two small Gemms of rank R. A and B of zeros add exact zeros, so y
        stays what it was bit for bit (contract/adapters.py)."""
        if lora is None or target not in lora.targets:
            return y
        p = f"layers.{layer}/lora_{target}"
        down = g.op("Gemm", x, mf.lora_a_name(layer, target), transB=1, name=f"{p}/a")  # (T, R)
        return g.op("Add", y, g.op("Gemm", down, mf.lora_b_name(layer, target), transB=1, name=f"{p}/b"), name=p)

    x = embedding(mf.INPUT_IDS)  # (T, D)
    if w.embed_scale != 1.0:  # Gemma 3: rows times sqrt(D), rounded to float32 as the model does
        x = g.op("Mul", x, g.const(np.float32(w.embed_scale)), name="embed_scaled")
    if embed_dim:  # image tokens: the vision graph's embeddings instead of the table's row
        x = g.op("Where", mf.IMAGE_MASK, mf.IMAGE_EMBEDS, x, name="embed_with_image")
    for i, lw in enumerate(w.layers):
        p = f"layers.{i}"
        h = rms_norm(x, lw.input_norm, mf.weight_name(i, "input_norm"))
        qkv = linear(h, lw.qkv, mf.weight_name(i, "qkv"))
        if lw.qkv_bias is not None:
            qkv = g.op("Add", qkv, g.weight(mf.weight_name(i, "qkv_bias"), lw.qkv_bias), name=f"{p}/qkv_bias")
        q, k, v = g.split(qkv, [H * Dh, Hkv * Dh, Hkv * Dh], axis=1, name=f"{p}/split_qkv")
        q, k, v = (adapted(y, h, i, t) for y, t in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
        q = g.op("Transpose", g.op("Reshape", q, g.ints([-1, H, Dh])), perm=[1, 0, 2], name=f"{p}/q")  # (H,T,Dh)
        k = g.op("Transpose", g.op("Reshape", k, g.ints([-1, Hkv, Dh])), perm=[1, 0, 2], name=f"{p}/k")
        v = g.op("Transpose", g.op("Reshape", v, g.ints([-1, Hkv, Dh])), perm=[1, 0, 2], name=f"{p}/v")
        if lw.q_norm is not None:  # Qwen3: RMSNorm over head_dim (the innermost axis) of q and k
            q = rms_norm(q, lw.q_norm, mf.weight_name(i, "q_norm"))
            k = rms_norm(k, lw.k_norm, mf.weight_name(i, "k_norm"))

        # The new tokens' un-rotated K/V leave the graph; the runtime writes them into its buffers.
        # Quantized once here, when written.
        k_cache, v_cache = mf.key_cache_name(i), mf.value_cache_name(i)
        v_scales = None  # per-slot value scales, folded into the attention probabilities below
        kv_shape = (Hkv, "tokens", Dh)
        # The chunk attends to its own K/V as the cache will hold them (quantized or cast, then read
        # back): a chunk of tokens then computes what feeding them one at a time computes, so prefill
        # chunks and speculative decoding's verified drafts match plain decoding.
        if layout.quantized:
            k_scale = g.weight(f"{p}.key_scale", w.key_scales[i][:, None, :].astype(np.float32))  # (Hkv,1,Dh)
            k_q = g.output(kvq.quantize(g, k, k_scale, layout.kv_dtype), mf.new_key_name(i), kv_elem, kv_shape)
            v_q, v_scale16, v_scale = kvq.quantize_per_token(g, v, layout.kv_dtype, f"{p}/v_scale")
            v_q = g.output(v_q, mf.new_value_name(i), kv_elem, kv_shape)
            v_scale16 = g.output(v_scale16, mf.new_value_scale_name(i), TensorProto.FLOAT16, (Hkv, "tokens", 1))
            if layout.kv_dtype == mf.KVDType.INT8:  # fp8: ONNX Runtime's optimizer cannot place this (float8 Transpose)
                k = kvq.dequantize(g, k_q, k_scale, layout.kv_dtype)
                v = kvq.dequantize(g, v_q, g.op("Cast", v_scale16, to=TensorProto.FLOAT, name=f"{p}/v_chunk_scale"),
                                   layout.kv_dtype)  # fmt: skip
            k_cache = kvq.dequantize(g, k_cache, k_scale, layout.kv_dtype)
            v_cache = kvq.dequantize(g, v_cache, g.const(1.0), layout.kv_dtype)  # unit scale: see v_scales
            scales = g.op("Cast", mf.value_scale_name(i), to=TensorProto.FLOAT, name=f"{p}/v_cache_scale")  # (Hkv,N,1)
            v_scales = g.op("Reshape", scales, g.ints([0, 1, -1]), name=f"{p}/v_scale_t")  # (Hkv,1,N)
        elif kv_is_float32:
            g.output(k, mf.new_key_name(i), kv_elem, kv_shape)
            g.output(v, mf.new_value_name(i), kv_elem, kv_shape)
        else:
            k_c = g.output(g.op("Cast", k, to=kv_elem), mf.new_key_name(i), kv_elem, kv_shape)
            v_c = g.output(g.op("Cast", v, to=kv_elem), mf.new_value_name(i), kv_elem, kv_shape)
            k = g.op("Cast", k_c, to=TensorProto.FLOAT, name=f"{p}/k_chunk_f32")
            v = g.op("Cast", v_c, to=TensorProto.FLOAT, name=f"{p}/v_chunk_f32")
            k_cache = g.op("Cast", k_cache, to=TensorProto.FLOAT, name=f"{p}/k_cache_f32")
            v_cache = g.op("Cast", v_cache, to=TensorProto.FLOAT, name=f"{p}/v_cache_f32")

        # Attention over the cache and over the chunk, joined only at the (small) scores, so the
        # cache is never concatenated: scores = q . K^T (a transposed-B MatMul, no copy of K), laid
        # out (Hkv, G*T, keys) so the softmax runs over the innermost axis.
        at = kinds[i in layout.local_layers]
        N = at.slots
        kc = rope(k_cache, *at.cache_rope, mf.cached_key_rope(i).removeprefix("n/"))  # (Hkv, N, Dh)
        kn = rope(k, *at.chunk_rope, mf.chunk_key_rope(i).removeprefix("n/"))  # (Hkv, T, Dh)
        q = rope(q, *at.query_rope, mf.query_rope(i).removeprefix("n/"))  # (H, T, Dh), scaled
        q_g = g.op("Reshape", q, g.ints([Hkv, -1, Dh]), name=f"{p}/q_groups")  # (Hkv, G*T, Dh): head h uses KV head h // G
        s_cache = g.op("MatMul", q_g, g.op("Transpose", kc, perm=[0, 2, 1], name=f"{p}/kc_t"), name=f"{p}/s_cache")
        s_chunk = g.op("MatMul", q_g, g.op("Transpose", kn, perm=[0, 2, 1], name=f"{p}/kn_t"), name=f"{p}/s_chunk")
        scores = g.op("Concat", s_cache, s_chunk, axis=2, name=f"{p}/scores")  # (Hkv, G*T, N+T)
        scores = g.op("Reshape", scores, at.shape_grouped, name=f"{p}/scores_g")  # (Hkv, G, T, N+T)
        scores = g.op("Add", scores, at.mask, name=f"{p}/masked")  # mask (T, N+T) broadcasts
        probs = g.op("Reshape", g.op("Softmax", scores, axis=-1, name=f"{p}/probs"), at.shape_flat, name=f"{p}/probs_flat")
        p_cache = g.op("Slice", probs, g.ints([0]), g.ints([N]), g.ints([2]), name=f"{p}/p_cache")
        p_chunk = g.op("Slice", probs, g.ints([N]), g.ints([2**62]), g.ints([2]), name=f"{p}/p_chunk")
        if v_scales is not None:
            p_cache = g.op("Mul", p_cache, v_scales, name=f"{p}/p_cache_scaled")
        ctx = g.op("Add", g.op("MatMul", p_cache, v_cache), g.op("MatMul", p_chunk, v), name=f"{p}/ctx")  # (Hkv,G*T,Dh)
        ctx = g.op("Reshape", ctx, g.ints([H, -1, Dh]), name=f"{p}/ctx_heads")
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[1, 0, 2]), g.ints([-1, H * Dh]), name=f"{p}/ctx_flat")
        o = adapted(linear(ctx, lw.o, mf.weight_name(i, "o")), ctx, i, "o_proj")
        if lw.attn_out_norm is not None:
            o = rms_norm(o, lw.attn_out_norm, mf.weight_name(i, "attn_out_norm"))
        x = g.op("Add", x, o, name=f"{p}/attn_res")

        h = rms_norm(x, lw.post_norm, mf.weight_name(i, "post_norm"))
        gate, up = g.split(
            linear(h, lw.gate_up, mf.weight_name(i, "gate_up")),
            [lw.down.shape[0], lw.down.shape[0]],
            axis=1,
            name=f"{p}/split_gate_up",
        )
        gate, up = adapted(gate, h, i, "gate_proj"), adapted(up, h, i, "up_proj")
        act = g.op("Mul", activation(gate, p), up, name=f"{p}/swiglu")
        mlp = adapted(linear(act, lw.down, mf.weight_name(i, "down")), act, i, "down_proj")
        if lw.mlp_out_norm is not None:
            mlp = rms_norm(mlp, lw.mlp_out_norm, mf.weight_name(i, "mlp_out_norm"))
        x = g.op("Add", x, mlp, name=f"{p}/mlp_res")

    # Logits only for the rows asked for (prefill: the last token; perplexity: all of them).
    x = g.op("Gather", x, mf.LOGIT_ROWS, axis=0, name="logit_rows")
    h = rms_norm(x, w.final_norm, "final_norm")
    head = w.embed if w.lm_head is None else w.lm_head
    if isinstance(head, QuantMatrix):
        logits = linear(h, head, "lm_head")
    elif w.lm_head is None:  # tied: reuse the embedding table, weights held once
        logits = g.op("Gemm", h, "embed_tokens", transB=1, name="lm_head")
    else:
        logits = g.op("Gemm", h, g.weight("lm_head", w.lm_head), transB=1, name="lm_head")
    g.output(logits, mf.LOGITS, TensorProto.FLOAT, ("rows", spec.vocab_size))

    # Graph outputs in the declared order.
    order = {t.name: i for i, t in enumerate(io.outputs)}
    g.outputs.sort(key=lambda vi: order[vi.name])
    return g
