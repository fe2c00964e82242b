"""The decoder graph's inputs and outputs, declared once: the exporter builds them, the runtime binds
them, the manifest records them. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cabinlm.contract.layout import CacheLayout


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. Symbolic dims: "tokens" (1..chunk), "total" (slots + tokens),
    "local_total" (a local layer's ring slots + tokens) and "rows" (1..tokens, the tokens that get logits)."""

    name: str
    dtype: str  # ONNX element type name, e.g. "float", "int64", "float16"
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class DecoderIO:
    """The decoder graph's inputs and outputs: declared here, used by the exporter and the runtime."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    def with_tokens(self, tokens: int, layout: CacheLayout) -> DecoderIO:
        """The same I/O with the token range fixed (static-shape builds: a prefill and a decode graph)."""

        def fix(t: TensorSpec) -> TensorSpec:
            dims = {"tokens": tokens, "total": layout.slots + tokens, "local_total": layout.local_slots + tokens,
                    "rows": tokens}  # fmt: skip
            return TensorSpec(t.name, t.dtype, tuple(dims.get(d, d) if isinstance(d, str) else d for d in t.shape))

        return DecoderIO(tuple(map(fix, self.inputs)), tuple(map(fix, self.outputs)))


# Graph I/O names. One cache tensor per layer: the runtime binds views of its single
# (layers, kv_heads, slots, head_dim) buffer, so the graph never slices (copies) the whole cache.
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
CACHE_POSITION_IDS = "cache_position_ids"
ATTENTION_MASK = "attention_mask"
MASK_VALUE = -1e30  # the attention mask's additive value for a slot a token must not see (0.0: it may see it)
LOGIT_ROWS = "logit_rows"
LOGITS = "logits"
# The local layers' own ring (CacheLayout.local_layers): ranks and mask over their w slots.
LOCAL_POSITION_IDS = "local_position_ids"
LOCAL_CACHE_POSITION_IDS = "local_cache_position_ids"
LOCAL_ATTENTION_MASK = "local_attention_mask"


def key_cache_name(layer: int) -> str:
    return f"key_cache.{layer}"


def value_cache_name(layer: int) -> str:
    return f"value_cache.{layer}"


def new_key_name(layer: int) -> str:
    return f"new_key.{layer}"


def new_value_name(layer: int) -> str:
    return f"new_value.{layer}"


def value_scale_name(layer: int) -> str:
    return f"value_scale.{layer}"


def new_value_scale_name(layer: int) -> str:
    return f"new_value_scale.{layer}"


def new_key_source_name(layer: int) -> str:
    """A rotated-key build's un-rotated copy of the chunk's keys (decoder_io(rotated_keys=True))."""
    return f"new_key_source.{layer}"


IMAGE_EMBEDS = "image_embeds"
IMAGE_MASK = "image_mask"


# Switchable LoRA adapters (contract/adapters.py): per layer l and target projection t, its A and B.
def lora_a_name(layer: int, target: str) -> str:
    return f"lora_a.{layer}.{target}"


def lora_b_name(layer: int, target: str) -> str:
    return f"lora_b.{layer}.{target}"


def lora_inputs(rank: int, targets: tuple[str, ...], layers: int, shapes: dict[str, tuple[int, int]]) -> tuple[TensorSpec, ...]:
    """The adapter inputs of an export with --lora-rank `rank`: for every layer, for every target t
    (shapes[t] = (out, in) of its weight), A then B:
      lora_a.{l}.{t}   float  (rank, in)    A, zero-padded to the rank
      lora_b.{l}.{t}   float  (out, rank)   B times the adapter's scaling, zero-padded
    added to the projection as (x A^T) B^T; all zeros: exactly the base model."""
    specs = []
    for layer in range(layers):
        for t in targets:
            out, inp = shapes[t]
            specs += [TensorSpec(lora_a_name(layer, t), "float", (rank, inp)),
                      TensorSpec(lora_b_name(layer, t), "float", (out, rank))]  # fmt: skip
    return tuple(specs)


# Tensors inside the exported graph that builds rely on (engines/), named here and used by the
# exporter (export/decoder.py), so that no build finds them by matching patterns.
#
#   weight_name(None, "embed_tokens")        the token table (float32), or its blocks (below)
#   weight_name(None, "final_norm.weight"), weight_name(None, "lm_head")
#   weight_name(l, part), part in LAYER_WEIGHTS: a layer's matrices, norms and q|k|v bias
#   + QUANT_SUFFIXES for block-quantized matrices: codes, scales, and the optional int4 zero points
#     or GGUF Q4_1 block minimums (export/wquant.py)
LAYER_WEIGHTS = ("input_norm.weight", "qkv", "qkv_bias", "q_norm.weight", "k_norm.weight", "o", "attn_out_norm.weight",
                 "post_norm.weight", "gate_up", "down", "mlp_out_norm.weight")  # fmt: skip
# The parts only some families have (Qwen2's bias, Qwen3's and Gemma 3's q / k norms, Gemma 3's output norms).
OPTIONAL_LAYER_WEIGHTS = frozenset({"qkv_bias", "q_norm.weight", "k_norm.weight", "attn_out_norm.weight",
                                    "mlp_out_norm.weight"})  # fmt: skip
QUANT_SUFFIXES = (".q", ".scale", ".zero_point", ".offset")


def weight_name(layer: int | None, part: str) -> str:
    return part if layer is None else f"layers.{layer}.{part}"


def cached_key_rope(layer: int) -> str:
    """The exported subgraph that rotates layer's cached keys with cache_position_ids (ONNX node
    names, the GraphBuilder's "n/" prefix included): the Add that yields the rotated keys is named
    this, its four parts this + "/" + CACHED_KEY_ROPE_PARTS[i]; input of the first: the keys."""
    return f"n/layers.{layer}/rope_kc"


CACHED_KEY_ROPE_PARTS = ("half", "rot", "xcos", "rsin")  # Split, Concat, Mul (x cos), Mul (rot x sin)


def chunk_key_rope(layer: int) -> str:
    """The exported subgraph that rotates the chunk's keys with position_ids (as cached_key_rope)."""
    return f"n/layers.{layer}/rope_kn"


def query_rope(layer: int) -> str:
    """The exported subgraph that rotates the chunk's queries (the softmax scale in its tables)."""
    return f"n/layers.{layer}/rope_q"


@dataclass(frozen=True)
class DecoderShape:
    """What every engine's graph contract is computed from: the cache layout and the model's sizes.
    An engine's facts (contract/engines/) turn it into that engine's DecoderIO; a plain export's is
    exported()."""

    layout: CacheLayout
    num_heads: int
    vocab_size: int
    index_dtype: str = "int64"
    embed_dim: int = 0  # image rows' width (0: a text model)
    mrope: bool = False  # Qwen2-VL's multimodal positions
    lora: tuple[TensorSpec, ...] = ()  # switchable adapters' inputs (lora_inputs), () without

    def exported(self, cache_dtype: str | None = None, rotated_keys: bool = False) -> DecoderIO:
        """The exported graph's contract (decoder_io), with a cache dtype / rotated keys of an engine's own."""
        return decoder_io(self.layout, self.vocab_size, self.index_dtype, self.embed_dim, mrope=self.mrope,
                          cache_dtype=cache_dtype, rotated_keys=rotated_keys, lora=self.lora)  # fmt: skip


def decoder_io(layout: CacheLayout, vocab_size: int, index_dtype: str = "int64", embed_dim: int = 0,
               mrope: bool = False, cache_dtype: str | None = None, rotated_keys: bool = False,
               lora: tuple[TensorSpec, ...] = ()) -> DecoderIO:
    """The graph contract for a layout.

    inputs (index = int64, or int32 for TensorRT targets, whose bindings need INT32 before 9.0)
      input_ids           index  (tokens,)                    the chunk's token ids
      position_ids        index  (tokens,)                    the chunk's RoPE positions (ranks)
      cache_position_ids  index  (slots,)                     each slot's RoPE position (rank)
      attention_mask      float  (tokens, slots + tokens)     additive: 0 attend, -1e30 masked
      logit_rows          index  (rows,)                      which of the chunk's tokens get logits
      key_cache.{l}       kv     (kv_heads, slots, head_dim)  un-rotated keys
      value_cache.{l}     kv     (kv_heads, slots, head_dim)
    and, for a layout with local layers (their key_cache / value_cache / value_scale hold R = w
    slots, the ring, instead of `slots`):
      local_position_ids        index (tokens,)               the chunk's ranks in the local rings
      local_cache_position_ids  index (R,)                    each ring slot's rank
      local_attention_mask      float (tokens, R + tokens)   additive, as attention_mask
    outputs
      logits              float  (rows, vocab)               (prefill: the last token; scoring: all)
      new_key.{l}         kv     (kv_heads, tokens, head_dim) the chunk's un-rotated keys
      new_value.{l}       kv     (kv_heads, tokens, head_dim)
    and, for int8 / fp8 KV (symmetric; x = q * scale):
      value_scale.{l}     fp16   (kv_heads, slots, 1)         per-token value scales
      new_value_scale.{l} fp16   (kv_heads, tokens, 1)        the chunk's value scales
    Key scales are per (layer, kv head, channel), calibrated at export and held by the graph:
    keys are stored un-rotated, so their channels keep stable ranges whatever the position.
    cache_dtype (a build's own cache, e.g. "uint8" for the HTP's 8-bit KV, engines/qnn_htp): the
    key_cache / value_cache / new_key / new_value type, one static scale per tensor held by the
    graph, so no value_scale inputs or outputs.
    rotated_keys (the HTP's uint8 cache with rotated keys, engines/qnn_htp/rotated_graph.py; uint8
    cache_dtype only): the cache holds keys rotated once, at their virtual positions, so no
    position_ids and no cache_position_ids; instead
      rope_cos, rope_sin  float  (tokens, head_dim / 2)      the chunk's rotation at L + i + E (E: window
                                                             evictions so far), times the RoPE factor,
                                                             computed by the runtime in float64
    and one more output per layer
      new_key_source.{l}  fp16   (kv_heads, tokens, head_dim) the chunk's keys un-rotated: the copy the
                                                             runtime re-rotates sink / pinned keys from
    and, for vision-language models (embed_dim = the language model's hidden size):
      image_embeds        float  (tokens, embed_dim)          rows used where image_mask is true
      image_mask          bool   (tokens, 1)                  true: the token is an image token
    and, for multimodal RoPE (mrope: Qwen2-VL), three position components (time, row, column) each:
      position_ids        index  (3, tokens)                  the chunk's (docs/vlm.md: ranks, grid offsets)
      cache_position_ids  index  (3, slots)                   each slot's
    and, last, an export's switchable LoRA inputs (lora: lora_inputs(...)), lora_a.{l}.{t} / lora_b.{l}.{t}.
    """
    kv = cache_dtype or layout.kv_dtype.onnx_name
    h, d = layout.kv_heads, layout.head_dim
    if index_dtype not in ("int64", "int32"):
        raise ValueError(f"index_dtype must be int64 or int32, got {index_dtype!r}")
    if rotated_keys and (cache_dtype != "uint8" or mrope or layout.local_layers or embed_dim):
        raise ValueError("rotated_keys: the HTP's uint8 cache of a text model without local layers only")
    if rotated_keys:
        positions = [TensorSpec(ROPE_COS, "float", ("tokens", d // 2)), TensorSpec(ROPE_SIN, "float", ("tokens", d // 2))]
    else:
        positions = [TensorSpec(POSITION_IDS, index_dtype, (3, "tokens") if mrope else ("tokens",)),
                     TensorSpec(CACHE_POSITION_IDS, index_dtype, (3, layout.slots) if mrope else (layout.slots,))]  # fmt: skip
    inputs = [
        TensorSpec(INPUT_IDS, index_dtype, ("tokens",)),
        *positions,
        TensorSpec(ATTENTION_MASK, "float", ("tokens", "total")),
        TensorSpec(LOGIT_ROWS, index_dtype, ("rows",)),
    ]
    if layout.local_layers:
        inputs += [TensorSpec(LOCAL_POSITION_IDS, index_dtype, ("tokens",)),
                   TensorSpec(LOCAL_CACHE_POSITION_IDS, index_dtype, (layout.local_slots,)),
                   TensorSpec(LOCAL_ATTENTION_MASK, "float", ("tokens", "local_total"))]  # fmt: skip
    outputs = [TensorSpec(LOGITS, "float", ("rows", vocab_size))]
    for layer in range(layout.layers):
        n = layout.layer_slots(layer)
        inputs.append(TensorSpec(key_cache_name(layer), kv, (h, n, d)))
        inputs.append(TensorSpec(value_cache_name(layer), kv, (h, n, d)))
        outputs.append(TensorSpec(new_key_name(layer), kv, (h, "tokens", d)))
        outputs.append(TensorSpec(new_value_name(layer), kv, (h, "tokens", d)))
    if layout.quantized and cache_dtype is None:
        for layer in range(layout.layers):
            inputs.append(TensorSpec(value_scale_name(layer), "float16", (h, layout.layer_slots(layer), 1)))
            outputs.append(TensorSpec(new_value_scale_name(layer), "float16", (h, "tokens", 1)))
    if rotated_keys:
        outputs += [TensorSpec(new_key_source_name(layer), "float16", (h, "tokens", d)) for layer in range(layout.layers)]
    if embed_dim:
        inputs.append(TensorSpec(IMAGE_EMBEDS, "float", ("tokens", embed_dim)))
        inputs.append(TensorSpec(IMAGE_MASK, "bool", ("tokens", 1)))
    inputs += lora
    return DecoderIO(tuple(inputs), tuple(outputs))


# The fused-attention contract of cpu builds (engines/ort_fused/graph.py): ONNX Runtime's GroupQueryAttention
# reads the cache and writes the chunk's rotated, quantized K/V into the cache's scratch rows itself.
ROPE_COS = "rope_cos"
ROPE_SIN = "rope_sin"
ATTENTION_BIAS = "attention_bias"
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
# The sink and pinned keys for the next step, rotated at their rank + the evictions after this step
# (engines/onnxruntime/rotated.py): a small side computation the decode step carries, in the same kernel pool.
REFRESH_SOURCE = "refresh_source"
REFRESH_POSITION_IDS = "refresh_position_ids"
REFRESH_COS = "refresh_cos"
REFRESH_SIN = "refresh_sin"
REFRESH_KEYS = "refresh_keys"
# cabinlm's attention kernel (builds whose rows can be one-token steps): the sink and pinned keys
# rotated inside the kernel, per row, from the runtime's un-rotated copy, and each row's slot.
KEY_SOURCE = "key_source"
SOURCE_COS = "source_cos"
SOURCE_SIN = "source_sin"
ROW_SLOTS = "row_slots"
LOCAL_ROW_SLOTS = "local_row_slots"  # the same for the local layers' rings
# The local layers' own (CacheLayout.local_layers): their rotation, bias and lengths over their ring.
LOCAL_ROPE_COS = "local_rope_cos"
LOCAL_ROPE_SIN = "local_rope_sin"
LOCAL_ATTENTION_BIAS = "local_attention_bias"
LOCAL_SEQLENS_K = "local_seqlens_k"
LOCAL_TOTAL_SEQUENCE_LENGTH = "local_total_sequence_length"


def present_key_name(layer: int) -> str:
    return f"present_key.{layer}"


def present_value_name(layer: int) -> str:
    return f"present_value.{layer}"


def qkv_name(layer: int) -> str:
    return f"qkv.{layer}"


def fused_decoder_io(layout: CacheLayout, num_heads: int, vocab_size: int, present: bool = True,
                     steps: bool = False, embed_dim: int = 0, lora: tuple[TensorSpec, ...] = ()) -> DecoderIO:
    """The graph contract of a fused-attention build (slots N, chunk C, F = slots in use, 1 + the
    highest one; rows 0..N-1 of the buffers are the slots, rows N..N+C-1 scratch):

    inputs
      input_ids              int64  (tokens,)
      position_ids           int64  (1, tokens)            rows of rope_cos / rope_sin for the chunk
      rope_cos, rope_sin     float  (N + C, head_dim / 2)  the chunk's rotation, computed by the runtime
      attention_bias         float  (1, 1, tokens, total)  additive, total = F + tokens: the first F
                                                             slots' mask, then the chunk (causal)
      seqlens_k              int32  (1,)                    F + tokens - 1
      total_sequence_length  int32  ()                      F + tokens
      logit_rows             int64  (rows,)
      key_cache.{l}          kv     (1, kv_heads, N + C, head_dim)  keys rotated at write time
      value_cache.{l}        kv     (1, kv_heads, N + C, head_dim)
    outputs
      logits                 float  (rows, vocab)
      present_key.{l}, present_value.{l}: the cache buffers themselves (bound to the inputs' memory);
                             the chunk's K/V land in rows F .. F + tokens - 1 (empty slots, or scratch).
                             present=False (cabinlm's own attention kernel): no such outputs, the kernel
                             writes those rows of the key_cache / value_cache inputs in place
      qkv.{l}                float  (1, tokens, (heads + 2 kv_heads) head_dim)  the chunk's un-rotated q|k|v
    and, apart from the decoder, the sink / pinned keys' rotation for the next step (P = their rows;
    not with steps=True):
      refresh_source         float  (1, layers * kv_heads, P, head_dim)  their un-rotated keys ÷ key scales
      refresh_position_ids   int64  (1, P)                  rows of refresh_cos / refresh_sin
      refresh_cos, refresh_sin float (P, head_dim / 2)
      refresh_keys           kv     (1, layers * kv_heads, P, head_dim)  rotated (int8: rounded, +-127)
    int8 KV: static per-channel scales (keys per rotation pair), held by the graph.
    steps=True (cabinlm's attention kernel, kernels/int8_kv_attention.cc: a chunk's rows can be its
    one-token steps, after the window has turned over too), instead of the refresh_* side inputs:
      key_source             float  (1, layers * kv_heads, sink + pinned [+ image + recall], head_dim)  the
                                                             sink / pinned keys, un-rotated (the runtime's copy); with
                                                             a recall region every slot's before the window
      source_cos, source_sin float  (versions, K, head_dim / 2)  their rotation at rank + E, for the
                                                             first K = sink + pinned fill rows: one
                                                             version for every row, or one per row
      row_slots              int64  (tokens,)               the slot each row goes to (F, F+1, ... for
                                                             the chunk semantics)
    and, for a layout with local layers (whose key_cache / value_cache hold R + C rows, R = w the
    ring; layers * kv_heads above counts the global layers only: local layers have no sink or pinned keys):
      local_rope_cos, local_rope_sin  float (R + C, head_dim / 2)  the chunk's rotation in the rings
                                                                   (rows 0..tokens-1: at its stream indices)
      local_attention_bias   float  (1, 1, tokens, local_total)    the first F_l ring slots, then the chunk
      local_seqlens_k        int32  (1,)                           F_l + tokens - 1
      local_total_sequence_length int32 ()                         F_l + tokens
      local_row_slots        int64  (tokens,)  (steps=True) each row's ring slot, as row_slots
    and, for a vision-language model (embed_dim > 0), decoder_io's image_embeds / image_mask;
    and, last, an export's switchable LoRA inputs (lora: lora_inputs(...)), as decoder_io takes them.
    """
    kv = layout.kv_dtype.onnx_name
    h, d = layout.kv_heads, layout.head_dim
    rows = layout.slots + layout.chunk
    refreshed = len(layout.global_layers) * h
    inputs = [
        TensorSpec(INPUT_IDS, "int64", ("tokens",)),
        TensorSpec(POSITION_IDS, "int64", (1, "tokens")),
        TensorSpec(ROPE_COS, "float", (rows, d // 2)),
        TensorSpec(ROPE_SIN, "float", (rows, d // 2)),
        TensorSpec(ATTENTION_BIAS, "float", (1, 1, "tokens", "total")),
        TensorSpec(SEQLENS_K, "int32", (1,)),
        TensorSpec(TOTAL_SEQUENCE_LENGTH, "int32", ()),
        TensorSpec(LOGIT_ROWS, "int64", ("rows",)),
    ]
    if steps:
        # every slot before the window with a recall region (a frame's rows then among them), else sink + pinned
        source_rows = layout.window_start if layout.recall else layout.sink + layout.pinned
        inputs += [TensorSpec(KEY_SOURCE, "float", (1, refreshed, source_rows, d)),
                   TensorSpec(SOURCE_COS, "float", ("versions", "pinned_rows", d // 2)),
                   TensorSpec(SOURCE_SIN, "float", ("versions", "pinned_rows", d // 2)),
                   TensorSpec(ROW_SLOTS, "int64", ("tokens",))]  # fmt: skip
    else:
        inputs += [TensorSpec(REFRESH_SOURCE, "float", (1, refreshed, "pinned_rows", d)),
                   TensorSpec(REFRESH_POSITION_IDS, "int64", (1, "pinned_rows")),
                   TensorSpec(REFRESH_COS, "float", ("pinned_rows", d // 2)),
                   TensorSpec(REFRESH_SIN, "float", ("pinned_rows", d // 2))]  # fmt: skip
    if layout.local_layers:
        ring_rows = layout.local_slots + layout.chunk
        inputs += [TensorSpec(LOCAL_ROPE_COS, "float", (ring_rows, d // 2)),
                   TensorSpec(LOCAL_ROPE_SIN, "float", (ring_rows, d // 2)),
                   TensorSpec(LOCAL_ATTENTION_BIAS, "float", (1, 1, "tokens", "local_total")),
                   TensorSpec(LOCAL_SEQLENS_K, "int32", (1,)),
                   TensorSpec(LOCAL_TOTAL_SEQUENCE_LENGTH, "int32", ())]  # fmt: skip
        if steps:
            inputs.append(TensorSpec(LOCAL_ROW_SLOTS, "int64", ("tokens",)))
    outputs = [TensorSpec(LOGITS, "float", ("rows", vocab_size))]
    if not steps:
        outputs.append(TensorSpec(REFRESH_KEYS, kv, (1, refreshed, "pinned_rows", d)))
    for layer in range(layout.layers):
        n = layout.layer_slots(layer) + layout.chunk
        inputs.append(TensorSpec(key_cache_name(layer), kv, (1, h, n, d)))
        inputs.append(TensorSpec(value_cache_name(layer), kv, (1, h, n, d)))
        if present:
            outputs.append(TensorSpec(present_key_name(layer), kv, (1, h, n, d)))
            outputs.append(TensorSpec(present_value_name(layer), kv, (1, h, n, d)))
        outputs.append(TensorSpec(qkv_name(layer), "float", (1, "tokens", (num_heads + 2 * h) * d)))
    if embed_dim:
        inputs.append(TensorSpec(IMAGE_EMBEDS, "float", ("tokens", embed_dim)))
        inputs.append(TensorSpec(IMAGE_MASK, "bool", ("tokens", 1)))
    inputs += lora
    return DecoderIO(tuple(inputs), tuple(outputs))


# -- seats decoding together (a fused cpu build's batched graphs, engines/ort_fused) ----------------
SEAT_TOKENS = "seat_tokens"
SHARED_BY_SEATS = (INPUT_IDS, LOGIT_ROWS)  # the inputs every seat's rows share; every other input is one seat's


def seat_name(name: str, seat: int) -> str:
    """Seat `seat`'s own copy of a per-seat input in a batched graph: "key_cache.3" -> "key_cache.3.seat1"."""
    return f"{name}.seat{seat}"


HIDDEN = "hidden"  # the final norm's rows, which the LM head turns into logits


def seats_io(io: DecoderIO, seats: int, hidden_size: int, head: bool = False) -> DecoderIO:
    """The contract of a graph that runs `seats` seats' chunks in one run, from the one-seat contract
    `io` (fused_decoder_io(steps=True)). The seats' rows are stacked, seat 0's first, through every
    weight matmul; the attention reads each seat's own inputs:

      input_ids       int64  (tokens,)    every seat's chunk, seat after seat (tokens = the sum)
      seat_tokens     int64  (seats,)     how many of those rows each seat has (each >= 1)
      logit_rows      int64  (rows,)      rows of the stacked chunk that get logits
      X.seat{s}       every other input X of `io`, seat s's own (its cache, rotation rows, bias,
                      lengths, row slots, LoRA adapter inputs ...); its "tokens" dimension is seat s's own
                      ("tokens.seat{s}")
    outputs
      hidden          float  (rows, hidden_size)  the final norm of those rows: the LM head's input
                                                  (head_io: one LM head graph for every batch size)
        or, with head (the head in the graph itself: cabinlm's BlockQ8MatMul)
      logits          float  (rows, vocab)        as `io`, those rows' logits
      qkv.{l}         float  (1, tokens, width)   as `io`, the stacked rows"""
    if seats < 2:
        raise ValueError(f"a batched graph runs 2 or more seats, got {seats}")

    def own(t: TensorSpec, s: int) -> TensorSpec:
        dims = tuple(seat_name(d, s) if isinstance(d, str) else d for d in t.shape)
        return TensorSpec(seat_name(t.name, s), t.dtype, dims)

    inputs = [t for t in io.inputs if t.name in SHARED_BY_SEATS] + [TensorSpec(SEAT_TOKENS, "int64", (seats,))]
    for s in range(seats):
        inputs += [own(t, s) for t in io.inputs if t.name not in SHARED_BY_SEATS]
    outputs = [TensorSpec(HIDDEN, "float", ("rows", hidden_size)) if t.name == LOGITS and not head else t for t in io.outputs]
    return DecoderIO(tuple(inputs), tuple(outputs))


def head_io(hidden_size: int, vocab_size: int) -> DecoderIO:
    """The LM head on its own (a fused build with batched graphs): hidden (rows, hidden_size) -> logits
    (rows, vocab), the one-seat graph's head with the same weights."""
    return DecoderIO((TensorSpec(HIDDEN, "float", ("rows", hidden_size)),), (TensorSpec(LOGITS, "float", ("rows", vocab_size)),))
