"""The cpu build's fused decoder: the exported graph's weights re-emitted around ONNX Runtime's own
kernels, so that a decode step runs about 12 kernels per layer instead of about 80.

    x ─ SkipSimplifiedLayerNorm ─ MatMulNBits q|k|v (─ q / k norms) ─ GroupQueryAttention ─ MatMulNBits o
      ─ SkipSimplifiedLayerNorm ─ MatMulNBits gate|up ─ SiLU(gate) * up ─ MatMulNBits down

An engine-specific build, like a TensorRT engine: the exported graph stays plain ONNX, and this file
only rearranges its initializers (the same bytes, the GGUF blocks included, except a Q4_1 block's
float minimum: by default the block becomes 8-bit codes with an integer zero point, q4_1_as_int8).

How the cache semantics survive the fusion. GroupQueryAttention rotates the chunk's keys before it
stores them, so keys are cached *rotated*, at a virtual position v = rank + E, where E is the number
of window tokens evicted before the token was written (engines/onnxruntime/rotated.py):

  * a window token's rank drops by one at every later eviction (the evicted tokens are older), so
    its rank is always v - E_now: a query rotated at L + E_now (L = its rank) sees every window key
    at the distance of the ranks, L - rank, which is what the normative semantics ask;
  * sink and pinned tokens keep their rank while E grows, so the runtime re-writes their keys at
    rank + E_now before every step from an un-rotated float32 copy (the graph's qkv outputs): at
    most sink + pinned rows, never the window, and never from quantized data. A decode step computes
    the next step's copy on the side (refresh_* inputs, refresh_keys output), in the same kernel pool,
    so a steady dialogue runs no second session per token.

Positions are never large inside the graph: the runtime computes the chunk's cos / sin in float64
and passes them as inputs, so a dialogue of millions of tokens rotates as exactly as its first.

The new K/V are written by the kernel into rows N..N+tokens-1 of the (N + chunk)-row cache buffers
(past and present are the same memory); the runtime moves them into their slots (a few hundred
bytes per token and layer). Int8 KV uses static per-channel scales calibrated at export: keys per
rotation pair (a rotation moves magnitude only inside a pair), values per channel.

Qwen3's RMSNorm of each q / k head runs between the q|k|v projection and the attention kernel
(qk_norm in fused_model), so the kernel rotates and caches normed keys, as transformers does.
Gemma 3 adds its scaled embedding, its softmax scale (the kernel's `scale`), an RMSNorm on the
attention output and on the MLP output before each residual add, and FastGelu (its tanh
approximation) for SiLU.

Local layers (CacheLayout.local_layers) run the same kernel over their ring of R = w slots (+ C
scratch rows), with inputs of their own. Every stream token passes through a ring, so its tokens are
consecutive in the stream: they are rotated once, at their stream index, with the local RoPE table,
and a query at its stream index sees each at the model's own distance, for ever; nothing is
re-written. F_l = min(seen, R) slots are in use; a chunk lands in rows F_l.. (empty slots while the
ring fills, scratch rows after) and the runtime moves it into ring slots seen mod R. With a recall
region (docs/design.md, "The recall region") the region's slots follow the ring's, "seen" counts the
stream's tokens but the recalled ones, F_l = w + the region's fill while it holds text (each side
masking the other in the bias), and the region's keys are rotated at their places in it.

An export with switchable LoRA adapter inputs (--lora-rank): each targeted projection's term beside
its fused matrix, per seat in the batched graphs (adapter_graph.py); without them no adapter node.

Eligible: a text model (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), int8 or fp32 KV, dynamic shapes
(the cpu profile); the text decoder of a LLaVA-style, Idefics3 / SmolVLM or Qwen2-VL / 2.5-VL model
with fp32 KV (a frame's image_embeds replace the token rows, as exported; its keys are kept un-rotated
and re-rotated as the pinned ones are; M-RoPE through the runtime's cos / sin rows; a new frame turns
the window keys it moved: engines/ort_fused/frames.py). Anything else keeps the exported graph (engines/ort_fused/builder.py says which
and why).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from cabinlm.contract import io_spec
from cabinlm.contract import manifest as mf
from cabinlm.contract.errors import BuildError
from cabinlm.engines.ort_fused.adapter_graph import AdapterTerms
from cabinlm.engines.ort_fused.block_layouts import (BLOCK, block_q4_layout, block_q8_layout, pack4, q4_1_as_int8,
                                                     q4_zero_points_as_minimums)
from cabinlm.engines.ort_fused.node_builder import ExportedWeights, NodeBuilder
from cabinlm.contract.layout import KVDType
from cabinlm.contract.manifest import Manifest

MS = "com.microsoft"
FUSED_KV = (KVDType.INT8, KVDType.FP32)
FUSED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                       "Gemma3ForCausalLM")


def ineligible(manifest: Manifest) -> str | None:
    """Why this export cannot take the fused attention (None: it can)."""
    lay = manifest.cache
    vision = manifest.vision
    if vision is not None and lay.kv_dtype != KVDType.FP32:
        return (f"a vision-language model with {lay.kv_dtype.value} KV: a new camera frame lowers the ranks of the window "
                "tokens fed after the old one with no eviction, so their rotated keys must turn again, which would "
                "rotate quantized keys (quantize once, never re-rotate: docs/design.md, 'Quantized once'); fp32 KV takes "
                "the fused decoder")
    if lay.kv_dtype not in FUSED_KV:
        return f"{lay.kv_dtype.value} KV (the fused kernel takes int8 or fp32 KV)"
    if manifest.index_dtype != "int64":
        return "int32 indices"
    if manifest.model.architecture not in FUSED_ARCHITECTURES:
        return f"{manifest.model.architecture} (the fused decoder implements {', '.join(FUSED_ARCHITECTURES)})"
    return None


def fused_model(graph: onnx.ModelProto, manifest: Manifest, accuracy_level: int = 4,
                minimums: str = "int8", attention_kernel: str = "onnxruntime",
                matmul_kernel: str = "onnxruntime", seats: int = 0, adapters: bool = True) -> onnx.ModelProto:
    """The fused decoder (module docstring) built from the exported graph's initializers.

    minimums: how GGUF Q4_1 blocks (which carry a block minimum) run. "exact": 4-bit MatMulNBits plus
    the minimum through blocksum(x) @ minimum (two more kernels per matrix); "int8": 8-bit blocks with
    an integer zero point (q4_1_as_int8: the minimum rounds to 1/34 of a step), one kernel.

    attention_kernel (builders.AttentionKernel): "onnxruntime", GroupQueryAttention; "cabinlm",
    ai.cabinlm::Int8KVAttention over int8 KV, FloatKVAttention over fp32 KV (scales of 1)
    (kernels/int8_kv_attention.cc): the same inputs and results, a chunk computed as fast as one row
    per step allows, the cache written in place (the graph then has no present outputs:
    io_spec.fused_decoder_io(present=False)).

    matmul_kernel (builders.MatmulKernel): "cabinlm" runs each Q4_1 matrix whose scales and minimums
    are float16 (a GGUF's always are) on ai.cabinlm::BlockQ4MatMul (kernels/block_q4_matmul.cc),
    its 4-bit codes and minimums as exported, the down projection as BlockQ4SwiGLUMatMul (the SwiGLU
    computed in its kernel); `minimums` then applies to any other Q4_1 matrix. It also runs the LM
    head's symmetric int8 blocks on ai.cabinlm::BlockQ8MatMul (kernels/block_q8_matmul.cc), in the
    batched graphs too (then they end in logits, not at the final norm: no head graph of their own).

    seats: 0, the one-seat graph; 2 or more, the batched graph of that many seats (io_spec.seats_io,
    cabinlm's attention kernel only): the seats' rows stacked through every weight matmul, norm and
    activation (each computes row by row, so a seat's row is what it is alone), and per layer one
    attention node for every seat, each seat's rows over that seat's own inputs:

        qkv (1, tokens, width) ─ Int8KVSeatsAttention(qkv, seat_tokens, key_cache.l.seat0, ..., ... .seat{B-1}) ─ W_o
    (FloatKVSeatsAttention over fp32 KV). A vision-language decoder's image rows are each seat's own
    (image_embeds.seat{s}, image_mask.seat{s}), stacked as its token rows are (_seat_image_rows).
    Its weights are the one-seat graph's, under the same names (the build points both at one file).

    adapters: an export's switchable LoRA inputs (--lora-rank) and their terms (adapter_graph.py);
    False: the same decoder without them (what a seat without an adapter runs, bit for bit the
    adapter graph fed zeros)."""
    from cabinlm.contract.engines.fused import AttentionKernel, MatmulKernel, Minimums
    from cabinlm.engines.ort_fused import kernels

    minimums = Minimums(minimums)
    attention_kernel = AttentionKernel(attention_kernel)
    matmul_kernel = MatmulKernel(matmul_kernel)
    own_ops = False
    why = ineligible(manifest)
    if why:
        raise BuildError(f"the fused attention does not apply: {why}")
    spec, lay = manifest.model, manifest.cache
    H, Hkv, Dh, D = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    W = ExportedWeights(graph)
    b = NodeBuilder()
    eps = float(spec.rms_norm_eps)

    own_matrices: dict[str, tuple[str, str] | None] = {}

    def own_blocks(name: str) -> tuple[str, str] | None:
        """(cabinlm's kernel, its weight initializer) for block-quantized matrix `name`: 4-bit blocks
        (minimums, zero points or neither: w = d q + m) on BlockQ4MatMul, symmetric int8 blocks on
        BlockQ8MatMul; None where the build runs it on MatMulNBits (matmul_kernel "onnxruntime", 8-bit
        codes with zero points or minimums, a shape that is not tiles of 16 by blocks of 32) or it is
        not block-quantized. Laid out once per matrix."""
        nonlocal own_ops
        if name in own_matrices:
            return own_matrices[name]
        own_matrices[name] = None
        if matmul_kernel != MatmulKernel.CABINLM or not W.has(f"{name}.q"):
            return None
        q, scale = W.get(f"{name}.q"), W.get(f"{name}.scale").astype(np.float32)
        zero_point = W.get(f"{name}.zero_point") if W.has(f"{name}.zero_point") else None
        offset = W.get(f"{name}.offset").astype(np.float32) if W.has(f"{name}.offset") else None
        if q.dtype == np.int8:  # (8-bit codes with minimums, e.g. GGUF Q5_K / Q5_1: MatMulNBits)
            op, blob = kernels.Q8_MATMUL_OP, None if zero_point is not None or offset is not None else block_q8_layout(q, scale)
        else:
            op, blob = kernels.MATMUL_OP, block_q4_layout(q, scale, q4_zero_points_as_minimums(scale, zero_point, offset))
        if blob is None:
            return None
        own_ops = True
        own_matrices[name] = (op, b.weight(f"{name}.blocks", blob))
        return own_matrices[name]

    def own_head() -> str | None:
        """The LM head's symmetric int8 blocks laid out for cabinlm's BlockQ8MatMul (its initializer:
        every graph of the build reads it in place), or None where the head runs on MatMulNBits
        (matmul_kernel "onnxruntime", or a head with zero points, minimums or another shape)."""
        nonlocal own_ops
        if (matmul_kernel != MatmulKernel.CABINLM or not W.has("lm_head.q") or W.has("lm_head.zero_point")
                or W.has("lm_head.offset")):  # fmt: skip
            return None
        blob = block_q8_layout(W.get("lm_head.q"), W.get("lm_head.scale").astype(np.float32))
        if blob is None:
            return None
        own_ops = True
        return b.weight("lm_head.blocks8", blob)

    def linear(x: str, name: str, out: str | None = None, bias: str | None = None) -> str:
        """x (1, tokens, K) @ W: a GGUF Q4_1 matrix on cabinlm's BlockQ4MatMul (matmul_kernel
        "cabinlm"); otherwise MatMulNBits over the exported blocks (a Q4_1 block: 8-bit codes with
        zero points, or with minimums="exact" the 4-bit codes plus blocksum(x) @ offset: a MatMul by a
        block indicator, a MatMul and an Add), or MatMul for float32."""
        if not W.has(f"{name}.q"):
            y = b.op("MatMul", x, f"{name}", hint=name, out=None if bias else out)
            return b.op("Add", y, bias, out=out, hint=f"{name}/bias") if bias else y
        q = W.get(f"{name}.q")  # (K, N)
        K, N = q.shape
        nb = K // BLOCK
        scale = W.get(f"{name}.scale").astype(np.float32)  # (nb, N)
        offset = W.get(f"{name}.offset").astype(np.float32) if W.has(f"{name}.offset") else None
        own = own_blocks(name)
        if own is not None:
            y = b.op(own[0], x, own[1], domain=kernels.DOMAIN, hint=name, out=None if bias else out)
            return b.op("Add", y, bias, out=out, hint=f"{name}/bias") if bias else y
        if offset is not None and minimums == "int8":
            q8, s8, z8 = q4_1_as_int8(q, scale, offset)
            ins = [x, b.weight(f"{name}.nbits", q8.T.reshape(N, nb, BLOCK)), b.weight(f"{name}.nbits_scale", s8.T),
                   b.weight(f"{name}.nbits_zero_point", z8.T)]  # fmt: skip
            if bias is not None:
                ins += ["", bias]  # g_idx, bias
            attrs = dict(K=K, N=N, bits=8, block_size=BLOCK, accuracy_level=accuracy_level)
            return b.op("MatMulNBits", *ins, domain=MS, out=out, hint=name, **attrs)
        bits = 8 if q.dtype == np.int8 else 4
        if name in int8_blobs:  # the tied token table's blocks, already held for the embedding
            ins = [x, *int8_blobs[name]]
        else:
            if bits == 8:  # symmetric int8 -> MatMulNBits' 8-bit blocks, default zero point 128
                blob = (q.T.astype(np.int16) + 128).astype(np.uint8).reshape(N, nb, BLOCK)
            else:
                blob = pack4(q.T.reshape(N, nb, BLOCK))
            ins = [x, b.weight(f"{name}.nbits", blob), b.weight(f"{name}.nbits_scale", scale.T)]
        if W.has(f"{name}.zero_point"):  # int4 zero points, packed along the blocks
            zp = W.get(f"{name}.zero_point").T  # (N, nb)
            if nb % 2:
                zp = np.concatenate([zp, np.zeros((N, 1), zp.dtype)], axis=1)
            ins.append(b.weight(f"{name}.nbits_zero_point", pack4(zp)))
        elif bits == 4:
            # Without zero points MatMulNBits computes scale * (q - 8): a GGUF Q4_1 block (d * q + m)
            # is then d * (q - 8) + (m + 8 d), the minimum moved by 8 steps (exact in float32 for
            # fp16 d and m), which keeps the kernel on its zero-point-free path.
            base = np.zeros_like(scale) if offset is None else offset
            offset = (base + 8.0 * scale).astype(np.float32)
        if bias is not None:
            ins += ["", "", bias]  # zero_points (if absent), g_idx, bias
            if len(ins) == 7:  # zero points were given: drop the empty slot
                ins = ins[:4] + ["", bias]
        attrs = dict(K=K, N=N, bits=bits, block_size=BLOCK, accuracy_level=accuracy_level)
        if offset is None:
            return b.op("MatMulNBits", *ins, domain=MS, out=out, hint=name, **attrs)
        y = b.op("MatMulNBits", *ins, domain=MS, hint=name, **attrs)
        indicator = np.kron(np.eye(nb, dtype=np.float32), np.ones((BLOCK, 1), np.float32))  # (K, nb)
        sums = b.op("MatMul", x, b.const(indicator), hint=f"{name}/block_sums")
        shift = b.op("MatMul", sums, b.weight(f"{name}.nbits_offset", offset), hint=f"{name}/offset")
        return b.op("Add", y, shift, out=out, hint=f"{name}/offset")

    own_ops_allowed = spec.activation == "silu"  # BlockQ4SwiGLUMatMul computes SiLU(gate) * up inside
    # Embedding: as exported (a float table, or int8 / int4 rows scaled per block). A tied int8 table
    # (Gemma 3's 262k x 640 is 168 MB) is held once: the output projection's blocks (BlockQ8MatMul's
    # tiles, or MatMulNBits' (vocab, D / 32, 32) codes + 128) hold token v's embedding as column v, and
    # (vocab, D / 32) scales beside them, so the embedding gathers its rows from them, not a second copy.
    ids = mf.INPUT_IDS
    int8_blobs: dict[str, tuple[str, str]] = {}
    tied_int8 = (spec.tie_embeddings and W.has("lm_head.q") and W.get("lm_head.q").dtype == np.int8
                 and not W.has("lm_head.zero_point") and not W.has("lm_head.offset"))  # fmt: skip
    head8 = own_head()  # the LM head on BlockQ8MatMul (None: on MatMulNBits)
    if tied_int8:
        q = W.get("lm_head.q")  # (D, V)
        nb, V = D // BLOCK, q.shape[1]
        scales = b.weight("lm_head.nbits_scale", np.ascontiguousarray(W.get("lm_head.scale").astype(np.float32).T))
        if head8 is not None:
            # token v's codes from BlockQ8MatMul's tiles: tile v // 16, byte 64 j + 4 (v % 16) + i of
            # each block for its row 4 j + i (block_q8_layout), gathered without a second copy
            k = np.arange(BLOCK)
            within = np.broadcast_to(64 * (k // 4) + k % 4, (1, nb, BLOCK)).astype(np.int64)
            tiles = b.op("Gather", head8, b.op("Div", ids, b.const(np.array(16, np.int64))), axis=0)  # (T, nb, 576)
            column = b.op("Mul", b.op("Mod", ids, b.const(np.array(16, np.int64))), b.const(np.array(4, np.int64)))
            at = b.op("Add", b.op("Reshape", column, b.const(np.array([-1, 1, 1], np.int64))), b.const(within))
            codes = b.op("GatherElements", tiles, at, axis=2, hint="embed_codes")  # (T, nb, 32)
        else:
            blob = b.weight("lm_head.nbits", (q.T.astype(np.int16) + 128).astype(np.uint8).reshape(V, nb, BLOCK))
            int8_blobs["lm_head"] = (blob, scales)
            codes = b.op("Gather", blob, ids, axis=0)  # (T, nb, 32)
        rows = b.op("Cast", codes, to=TensorProto.FLOAT)
        rows = b.op("Sub", rows, b.const(np.array(128.0, np.float32)))
        rows = b.op("Mul", rows, b.op("Unsqueeze", b.op("Gather", scales, ids, axis=0), b.const(np.array([2], np.int64))))
        x = b.op("Reshape", rows, b.const(np.array([1, -1, D], np.int64)), hint="embed")
    elif W.has("embed_tokens"):
        b.weight("embed_tokens", W.get("embed_tokens"))
        x = b.op("Unsqueeze", b.op("Gather", "embed_tokens", ids, axis=0), b.const(np.array([0], np.int64)), hint="embed")
    else:
        q = W.get("embed_tokens.q")  # (V, D)
        nb = D // BLOCK
        b.weight("embed_tokens.q", q)
        xq = b.op("Reshape", b.op("Cast", b.op("Gather", "embed_tokens.q", ids, axis=0), to=TensorProto.FLOAT),
                  b.const(np.array([-1, nb, BLOCK], np.int64)))  # fmt: skip
        if W.has("embed_tokens.zero_point"):
            b.weight("embed_tokens.zero_point", W.get("embed_tokens.zero_point"))
            zp = b.op("Cast", b.op("Gather", "embed_tokens.zero_point", ids, axis=0), to=TensorProto.FLOAT)
            xq = b.op("Sub", xq, b.op("Unsqueeze", zp, b.const(np.array([2], np.int64))))
        b.weight("embed_tokens.scale", W.get("embed_tokens.scale"))
        sc = b.op("Gather", "embed_tokens.scale", ids, axis=0)
        xq = b.op("Mul", xq, b.op("Unsqueeze", sc, b.const(np.array([2], np.int64))))
        if W.has("embed_tokens.offset"):
            b.weight("embed_tokens.offset", W.get("embed_tokens.offset"))
            off = b.op("Gather", "embed_tokens.offset", ids, axis=0)
            xq = b.op("Add", xq, b.op("Unsqueeze", off, b.const(np.array([2], np.int64))))
        x = b.op("Reshape", xq, b.const(np.array([1, -1, D], np.int64)), hint="embed")

    if spec.embed_scale != 1.0:  # Gemma 3: the rows times sqrt(D), in float32 as the model computes it
        x = b.op("Mul", x, b.const(np.array(spec.embed_scale, np.float32)), hint="embed_scaled")
    embed_dim = manifest.vision.embed_dim if manifest.vision is not None else 0
    if embed_dim:  # a camera frame's tokens: the vision graph's rows instead of the table's (as exported)
        mask, embeds = _seat_image_rows(b, seats) if seats else (mf.IMAGE_MASK, mf.IMAGE_EMBEDS)
        x = b.op("Where", mask, b.op("Unsqueeze", embeds, b.const(np.array([0], np.int64))), x, hint="embed_with_image")

    def float_weight(name: str) -> str:
        return b.weight(name, W.get(name).astype(np.float32))

    def out_norm(y: str, i: int, part: str) -> str:
        """Gemma 3: RMSNorm of the attention / MLP output before its residual add (none for the others)."""
        name = mf.weight_name(i, f"{part}.weight")
        if not W.has(name):
            return y
        return b.op("SimplifiedLayerNormalization", y, float_weight(name), axis=-1, epsilon=eps, stash_type=1,
                    hint=f"layers.{i}/{part}")  # fmt: skip

    def qk_norm(qkv: str, i: int) -> str:
        """Qwen3: RMSNorm over head_dim of each q and k head, before GroupQueryAttention rotates them;
        the normed q|k|v is the qkv output, so the sink / pinned keys' refresh source is normed too.

            qkv (1, T, (H + 2 Hkv) Dh) ─ Split ─┬─ q ─ (1, T, H, Dh) ─ SimplifiedLayerNorm ─ (1, T, H Dh) ─┐
                                                ├─ k ─ (1, T, Hkv, Dh) ─ SimplifiedLayerNorm ─ (1, T, Hkv Dh) ─ Concat ─> qkv.{l}
                                                └─ v ──────────────────────────────────────────────────┘
        """
        p = f"layers.{i}"
        q, k, v = b.op("Split", qkv, b.const(np.array([H * Dh, Hkv * Dh, Hkv * Dh], np.int64)), outputs=3, axis=-1,
                       hint=f"{p}/split_qkv")  # fmt: skip

        def norm(x: str, heads: int, part: str) -> str:
            x = b.op("Reshape", x, b.const(np.array([0, 0, heads, Dh], np.int64)), hint=f"{p}/{part}_heads")
            x = b.op("SimplifiedLayerNormalization", x, float_weight(mf.weight_name(i, f"{part}.weight")), axis=-1,
                     epsilon=eps, stash_type=1, hint=f"{p}/{part}")  # fmt: skip
            return b.op("Reshape", x, b.const(np.array([0, 0, heads * Dh], np.int64)), hint=f"{p}/{part}_flat")

        return b.op("Concat", norm(q, H, "q_norm"), norm(k, Hkv, "k_norm"), v, axis=-1, out=mf.qkv_name(i))

    for i in range(lay.layers):  # float32 linears (fp32 exports) are used by name
        for part in ("qkv", "o", "gate_up", "down"):
            if W.has(mf.weight_name(i, part)):
                float_weight(mf.weight_name(i, part))
    quantized_kv = lay.kv_dtype == KVDType.INT8
    own_kernel = attention_kernel == AttentionKernel.CABINLM
    no_rows = None  # the local layers' empty rotation rows for the sink / pinned keys (made once)
    if seats and (not own_kernel or seats < 2):
        raise BuildError(f"a batched graph takes 2 or more seats on cabinlm's attention kernel, got {seats} seats on "
                         f"{attention_kernel.value}")
    if quantized_kv:
        kv_scales = {k: manifest.kv_scales.array(k) for k in ("rotated_keys", "values")}
    else:  # fp32 KV on cabinlm's kernel (FloatKVAttention): scales of 1 leave its arithmetic exact
        kv_scales = {k: np.ones((lay.layers, Hkv, Dh), np.float32) for k in ("rotated_keys", "values")}
    single_op, seats_op = ((kernels.ATTENTION_OP, kernels.SEATS_ATTENTION_OP) if quantized_kv else
                           (kernels.FLOAT_ATTENTION_OP, kernels.FLOAT_SEATS_ATTENTION_OP))  # fmt: skip
    I = spec.intermediate_size
    # switchable LoRA adapter inputs (export --lora-rank): their terms beside the projections (adapter_graph.py)
    lora = manifest.lora if adapters else None
    # on cabinlm's LoraTerms wherever the build carries its kernel library (either of its kernels taken)
    own_lora = attention_kernel == AttentionKernel.CABINLM or matmul_kernel == MatmulKernel.CABINLM
    terms = AdapterTerms(b, lora, seats, own_lora) if lora is not None else None
    own_ops = own_ops or (terms is not None and own_lora)
    widths = {"qkv": (H * Dh, Hkv * Dh, Hkv * Dh), "o": (D,), "gate_up": (I, I), "down": (D,)}

    def projection(x: str, i: int, matrix: str, out: str | None = None, bias: str | None = None) -> str:
        """linear() of layer i's fused matrix, plus its adapter terms where the export takes them."""
        name = mf.weight_name(i, matrix)
        if terms is None or not terms.targets(matrix):
            return linear(x, name, out=out, bias=bias)
        return terms.add(linear(x, name, bias=bias), x, i, matrix, widths[matrix], out=out)

    residual = None
    seat_inputs = mf.fused_decoder_io(lay, H, spec.vocab_size, present=False, steps=True).inputs if seats else ()
    for i in range(lay.layers):
        p = f"layers.{i}"
        norm = float_weight(mf.weight_name(i, "input_norm.weight"))
        if residual is None:
            h = b.op("SimplifiedLayerNormalization", x, norm, axis=-1, epsilon=eps, stash_type=1, hint=f"{p}/input_norm")
            residual = x
        else:
            h, _, _, residual = b.op("SkipSimplifiedLayerNormalization", x, residual, norm, outputs=4, domain=MS,
                                     epsilon=eps, hint=f"{p}/input_norm")  # fmt: skip
        bias = float_weight(mf.weight_name(i, "qkv_bias")) if W.has(mf.weight_name(i, "qkv_bias")) else None
        if W.has(mf.weight_name(i, "q_norm.weight")):
            qkv = qk_norm(projection(h, i, "qkv", bias=bias), i)
        else:
            qkv = projection(h, i, "qkv", out=mf.qkv_name(i), bias=bias)
        if i in lay.local_layers:  # the ring's own lengths, rotation and bias (module docstring)
            lengths = [mf.LOCAL_SEQLENS_K, mf.LOCAL_TOTAL_SEQUENCE_LENGTH, mf.LOCAL_ROPE_COS, mf.LOCAL_ROPE_SIN,
                       mf.POSITION_IDS, mf.LOCAL_ATTENTION_BIAS]  # fmt: skip
        else:
            lengths = [mf.SEQLENS_K, mf.TOTAL_SEQUENCE_LENGTH, mf.ROPE_COS, mf.ROPE_SIN, mf.POSITION_IDS, mf.ATTENTION_BIAS]
        if own_kernel:  # kernels/int8_kv_attention.cc: the inputs GroupQueryAttention takes, in its order
            # the kernel's softmax scale is 1 / sqrt(Dh); another (Gemma 3's query_pre_attn_scalar) is
            # folded into the queries (RoPE is linear), leaving the qkv output the runtime reads untouched
            ratio = float(spec.softmax_scale * np.sqrt(Dh))
            q_in = qkv
            if abs(ratio - 1.0) > 1e-7:
                cols = np.concatenate([np.full(H * Dh, ratio), np.ones(2 * Hkv * Dh)]).astype(np.float32)
                q_in = b.op("Mul", qkv, b.const(cols), hint=f"{p}/query_scale")
            ins = [q_in, mf.key_cache_name(i), mf.value_cache_name(i), *lengths,
                   b.weight(f"{p}.k_scale", kv_scales["rotated_keys"][i].reshape(Hkv * Dh).astype(np.float32)),
                   b.weight(f"{p}.v_scale", kv_scales["values"][i].reshape(Hkv * Dh).astype(np.float32))]  # fmt: skip
            if i not in lay.local_layers:  # rows as one-token steps: each row's slot, the sink / pinned keys per row
                _, j = lay.buffer_index(i)
                ins += [io_spec.KEY_SOURCE, io_spec.SOURCE_COS, io_spec.SOURCE_SIN, b.const(np.array([j], np.int64)),
                        io_spec.ROW_SLOTS]  # fmt: skip
            else:  # a ring: each row's ring slot; no sink / pinned keys (no rows of rotation: K = 0)
                if no_rows is None:
                    no_rows = b.const(np.zeros((1, 0, Dh // 2), np.float32))
                ins += [io_spec.KEY_SOURCE, no_rows, no_rows, b.const(np.array([0], np.int64)), io_spec.LOCAL_ROW_SLOTS]
            if not seats:
                att = b.op(single_op, *ins, domain=kernels.DOMAIN, hint=f"{p}/attention")
            else:  # one node: each seat's rows over its own cache, rotation rows, bias, lengths and slots
                per_seat = set(ins[1:]) & {t.name for t in seat_inputs}
                att = b.op(seats_op, q_in, io_spec.SEAT_TOKENS, *[io_spec.seat_name(n, s) if n in per_seat else n
                                                               for s in range(seats) for n in ins[1:]],
                           domain=kernels.DOMAIN, hint=f"{p}/attention.seats")  # fmt: skip
        else:
            gqa_in = [qkv, "", "", mf.key_cache_name(i), mf.value_cache_name(i), *lengths, ""]
            attrs = dict(num_heads=H, kv_num_heads=Hkv, scale=float(spec.softmax_scale), do_rotary=1, rotary_interleaved=0,
                         local_window_size=-1)  # fmt: skip
            if quantized_kv:
                gqa_in += [b.weight(f"{p}.k_scale", kv_scales["rotated_keys"][i].reshape(1, Hkv, 1, Dh)),
                           b.weight(f"{p}.v_scale", kv_scales["values"][i].reshape(1, Hkv, 1, Dh))]  # fmt: skip
                attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
            att, _, _ = b.op("GroupQueryAttention", *gqa_in, domain=MS, outputs=3, hint=f"{p}/attention", **attrs)
            b.nodes[-1].output[1] = mf.present_key_name(i)
            b.nodes[-1].output[2] = mf.present_value_name(i)
        o = out_norm(projection(att, i, "o"), i, "attn_out_norm")
        h, _, _, residual = b.op("SkipSimplifiedLayerNormalization", o, residual, float_weight(mf.weight_name(i, "post_norm.weight")),
                                 outputs=4, domain=MS, epsilon=eps, hint=f"{p}/post_norm")  # fmt: skip
        gate_up = projection(h, i, "gate_up")
        down = own_blocks(mf.weight_name(i, "down")) if own_ops_allowed else None
        if down is not None and down[0] == kernels.MATMUL_OP:  # silu(gate) * up inside the down projection's kernel
            x = b.op(kernels.SWIGLU_MATMUL_OP, gate_up, down[1], domain=kernels.DOMAIN, hint=f"{p}.down")
            if terms is not None and terms.targets("down"):  # its adapter term over SiLU(gate) * up computed beside
                x = terms.add_swiglu(x, gate_up, I, i, D)
        else:
            gate, up = b.op("Split", gate_up, b.const(np.array([I, I], np.int64)), outputs=2, axis=-1)
            if spec.activation == "gelu_tanh":  # FastGelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
                act = b.op("Mul", b.op("FastGelu", gate, domain=MS), up, hint=f"{p}/geglu")
            else:
                act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up, hint=f"{p}/swiglu")
            x = projection(act, i, "down")
        x = out_norm(x, i, "mlp_out_norm")
    x = b.op("Squeeze", b.op("Add", x, residual), b.const(np.array([0], np.int64)))
    x = b.op("Gather", x, mf.LOGIT_ROWS, axis=0, hint="logit_rows")
    h = b.op("SimplifiedLayerNormalization", x, float_weight("final_norm.weight"), axis=-1, epsilon=eps, stash_type=1,
             out=io_spec.HIDDEN)  # fmt: skip
    head = head8
    if head is not None:  # in every graph, the batched ones included: the kernel reads the blocks in place
        b.op(kernels.Q8_MATMUL_OP, h, head, domain=kernels.DOMAIN, out=mf.LOGITS, hint="lm_head")
    elif seats:
        pass  # a batched graph ends at the rows' final norm: the LM head runs apart (head_model)
    elif W.has("lm_head.q"):
        linear(h, "lm_head", out=mf.LOGITS)
    else:
        table = "lm_head" if W.has("lm_head") else "embed_tokens"
        if table == "lm_head":
            float_weight("lm_head")
        b.op("Gemm", h, table, transB=1, out=mf.LOGITS, hint="lm_head")

    if not own_kernel:  # the next step's sink / pinned keys on the side (own kernel: rotated inside it, per row)
        _rotation(b, lay, mf.REFRESH_SOURCE, mf.REFRESH_POSITION_IDS, mf.REFRESH_COS, mf.REFRESH_SIN, mf.REFRESH_KEYS)
    lora = lora.inputs(lay.layers, manifest.lora_shapes) if lora is not None else ()
    io = mf.fused_decoder_io(lay, H, spec.vocab_size, present=not own_kernel, steps=own_kernel, embed_dim=embed_dim,
                             lora=lora)  # fmt: skip
    if seats:
        io = io_spec.seats_io(io, seats, D, head=head is not None)
    elem = {"float": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32,
            "int8": TensorProto.INT8, "bool": TensorProto.BOOL}  # fmt: skip
    inputs = [helper.make_tensor_value_info(t.name, elem[t.dtype], list(t.shape)) for t in io.inputs]
    outputs = [helper.make_tensor_value_info(t.name, elem[t.dtype], list(t.shape)) for t in io.outputs]
    g = helper.make_graph(b.nodes, "cabinlm_decoder_fused", inputs, outputs, b.inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    if own_kernel or own_ops:
        opsets.append(helper.make_opsetid(kernels.DOMAIN, 1))
    return helper.make_model(g, opset_imports=opsets, producer_name="cabinlm", ir_version=10)


def _seat_image_rows(b: NodeBuilder, seats: int) -> tuple[str, str]:
    """A batched graph's image rows: each seat's image_mask (n_s, 1) and image_embeds (n_s, embed_dim),
    stacked seat after seat as input_ids is, so that row r of the stacked chunk takes its own seat's row."""
    mask = b.op("Concat", *[io_spec.seat_name(mf.IMAGE_MASK, s) for s in range(seats)], axis=0, hint="seats/image_mask")
    embeds = b.op("Concat", *[io_spec.seat_name(mf.IMAGE_EMBEDS, s) for s in range(seats)], axis=0, hint="seats/image_embeds")
    return mask, embeds


ROTATE_GRAPH = "decoder.rotate.onnx"


def _rotation(b: NodeBuilder, lay, source: str, position_ids: str, cos: str, sin: str, out: str) -> None:
    """RotaryEmbedding over the float32 sources, then (int8 KV) rounding half to even and saturation
    to +-127: the sink / pinned keys' refresh, in the decoder and in the rotation graph alike."""
    int8 = lay.kv_dtype == KVDType.INT8
    y = b.op("RotaryEmbedding", source, position_ids, cos, sin, domain=MS, interleaved=0, hint="rotate",
             out=None if int8 else out)  # fmt: skip
    if int8:
        clipped = b.op("Clip", y, b.const(np.array(-127.0, np.float32)), b.const(np.array(127.0, np.float32)))
        zero = b.const(np.array(0, np.int8))
        b.op("QuantizeLinear", clipped, b.const(np.array(1.0, np.float32)), zero, out=out)


def rotation_model(manifest: Manifest) -> onnx.ModelProto:
    """The runtime's refresh of the sink / pinned keys as one small graph: RotaryEmbedding over the
    float32 sources (already divided by the key scales: one scale per rotation pair commutes with the
    rotation), then int8 rounding (half to even) and saturation to +-127, for every layer and head
    at once. Inputs: source (1, layers * kv_heads, rows, head_dim), position_ids (1, rows), cos / sin
    (rows, head_dim / 2); output keys (1, layers * kv_heads, rows, head_dim) in the cache's type."""
    lay = manifest.cache
    b = NodeBuilder()
    _rotation(b, lay, "source", "position_ids", "cos", "sin", "keys")
    out_type = TensorProto.INT8 if lay.kv_dtype == KVDType.INT8 else TensorProto.FLOAT
    heads, d = len(lay.global_layers) * lay.kv_heads, lay.head_dim
    inputs = [helper.make_tensor_value_info("source", TensorProto.FLOAT, [1, heads, "rows", d]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "rows"]),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["rows", d // 2]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["rows", d // 2])]  # fmt: skip
    outputs = [helper.make_tensor_value_info("keys", out_type, [1, heads, "rows", d])]
    g = helper.make_graph(b.nodes, "cabinlm_rotate_pinned", inputs, outputs, b.inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             producer_name="cabinlm", ir_version=10)  # fmt: skip
