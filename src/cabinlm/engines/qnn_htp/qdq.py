"""16-bit activations on the HTP (`cabinlm build --activations a16`): the HTP-ready float
graph of an int8-KV export made a calibrated QDQ graph, as Qualcomm's own v73 deployments run.

    HTP-ready graph (graph.py: fused RMSNorms, float token table, the uint8 cache of uint8_kv, its
      keys rotated when written: rotated_graph.rotate_cached_keys, a16_float_graph)
      ─ weight blocks as float matrices (float_weights: exactly the export's dequantized blocks,
        a GGUF Q4_1 block's offset folded in: one MatMul of the true weights, not two that cancel)
      ─ calibration: the CPU runs the float graph over the calibration text, the runtime's own
        cache bookkeeping feeding it (a16_feeds.calibration_feeds), every activation's range recorded
      ─ onnxruntime.quantization's QNN QDQ quantizer: activations uint16 (asymmetric, per tensor),
        weight matrices int8 per output channel, the LM head's too, then re-quantized from the float
        matrices as symmetric int8 or int4 blocks of 32 (a16_weights.block_weights; int4: the head int8)
      ─ the cache I/O stays uint8 (zero point 128, one scale per tensor, tied: graph.uint8_kv;
        a16_kv_io: float_kv_io before the quantizer, strip_kv_io after it); masks floored (floor_masks)
      ─ the check (a16_feeds.stream_fidelity): the QDQ graph against the float graph over held-out
        text, both fed by the runtime on the CPU; refused below MIN_FIDELITY / above MAX_PERPLEXITY_RATIO

Invariants: graph inputs and outputs keep their types (the runtime feeds float masks and reads
float logits; their Quantize / Dequantize run on the HTP, CPU fallback off), so the runtime and its
buffers are those of the uint8-cache fp16 build; the cache's uint8 codes enter the 16-bit graph
through a DequantizeLinear with the cache's own scale, and the new K/V leave it through a
QuantizeLinear with the same scale and zero point (strip_kv_io checks both). With rotated keys the
new keys are rotated before that QuantizeLinear and neither the cache nor the chunk's keys are
rotated after their DequantizeLinear, so QK^T reads 8-bit keys (16-bit queries x 8-bit keys, as
Qualcomm's own w4a16 graphs do; un-rotated keys would be rotated into 16-bit keys and a 16x16 matmul).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx
from onnx import numpy_helper

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import BuildError
from cabinlm.engines.qnn_htp.a16_feeds import calibration_feeds, stream_fidelity
from cabinlm.engines.qnn_htp.a16_kv_io import float_kv_io, rewire, strip_kv_io
from cabinlm.engines.qnn_htp import a16_weights
from cabinlm.engines.qnn_htp.a16_weights import WEIGHT_FORMATS, block_weights
from cabinlm.engines.qnn_htp.graph import BLOCK, _consts, _consumers, _values

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

# benchmarks only: the quantizer's own per-output-channel weights ("int8" / "int16" / "int4") kept in place of
# the blocks the build takes (a16_weights). int8 blocks: SmolLM2's QDQ graph 77.59 against its float graph's
# 77.36, int8 per channel 85.29 (512 tokens of tests/data/prose.txt)
PER_CHANNEL: str | None = None
ZERO, MASK_MIN = "htp/zero", "htp/mask_min"
MASK_FLOOR = 512.0  # floor_masks
MAX_CALIB_TOKENS = 512  # the calibration text's first tokens run through the float graph


A16_MIN_ARCH = 73  # a16 is built for HTP v73+ only (a16_refusal)


def a16_refusal(profile: DeviceProfile, kv: str) -> str | None:
    """Why this profile / export cannot have --activations a16 (None: it can)."""
    if profile.htp_arch < A16_MIN_ARCH:
        # measured: the x86 simulator's v68 compiles the tiny model's a16 graph; what refuses it is
        # Qualcomm's own support (AI Hub's LLM export, github.com/quic/ai-hub-models:
        # qai_hub_models/models/_shared/llm/export.py), which the simulator cannot show
        return (f"--activations a16 is for HTP v{A16_MIN_ARCH}+ (sa8775p); {profile.name} is v{profile.htp_arch}, where "
                "Qualcomm ships fp16 activations (AI Hub's export refuses w4a16 on SA8295P; 16-bit layer norms and "
                "matmuls are validated from v73 on): build it with --activations fp16")  # fmt: skip
    if kv != "int8":
        return (f"--activations a16 keeps the KV cache 8-bit (uint8, one scale per tensor); this export holds {kv} "
                "KV: re-export with --kv int8")  # fmt: skip
    return None


def float_weights(model: onnx.ModelProto) -> tuple[int, int]:
    """Every DequantizeLinear(block_size 32, axis 0) of an initializer replaced by the float matrix it
    computes, w[k, n] = (q[k, n] - z[k // 32, n]) * s[k // 32, n] (+ offset[k // 32, n]): the quantizer
    re-quantizes the matrices per output channel. Returns (matrices, offsets folded).

    A Q4_1 matrix (export/decoder.py linear: GGUF's per-block minimum) is two MatMuls whose sum is the
    product, x @ (s q) + blocksum(x) @ offset; with q in 0..15 each term carries the block's mean
    weight times x's block sum, and the two cancel to the (much smaller) product. Quantized to 16 bits
    apart, each term rounds and clips on its own range, and on text outside the calibration one term
    clips where the other does not: SmolLM2's QDQ graph lost the model (perplexity 1.5e9 in
    the simulator). So the offset is folded into the matrix, one MatMul of the true weights:

        x ─ MatMul(s q) ─────────────────────────────┐
        x ─ Reshape(T, K/32, 32) ─ ReduceSum ─ MatMul(offset) ─ Add   ->   x ─ MatMul(s q + offset)
    """
    g = model.graph
    consts = _consts(model)
    users = _consumers(model)
    producer = {o: n for n in g.node for o in n.output}
    count = folded = 0
    drop: set[tuple[str, str]] = set()  # (op_type, first output): protobuf wrappers' id()s are reused
    new: list[onnx.TensorProto] = []
    for dq in g.node:
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in consts:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
        if attrs.get("block_size") != BLOCK or attrs.get("axis", 1) != 0:
            continue
        q = _values(consts[dq.input[0]]).astype(np.float32)
        s = numpy_helper.to_array(consts[dq.input[1]]).astype(np.float32)
        z = (_values(consts[dq.input[2]]).astype(np.float32) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(s))
        w = (q - np.repeat(z, BLOCK, axis=0)[: q.shape[0]]) * np.repeat(s, BLOCK, axis=0)[: q.shape[0]]  # (K, N)
        offset = _q4_1_offset(dq, users, producer, consts)
        if offset is not None:
            table, nodes, add = offset
            w = w + np.repeat(numpy_helper.to_array(consts[table]).astype(np.float32), BLOCK, axis=0)[: q.shape[0]]
            (mm,) = users[dq.output[0]]
            drop.update((n.op_type, n.output[0]) for n in nodes)  # the Add, the offset's MatMul, its ReduceSum (+ Reshape)
            mm.output[0] = add.output[0]  # the one MatMul writes what the Add wrote
            folded += 1
        new.append(numpy_helper.from_array(w.astype(np.float32), dq.output[0]))
        drop.add((dq.op_type, dq.output[0]))
        count += 1
    if count:
        kept = [n for n in g.node if (n.op_type, n.output[0]) not in drop]
        del g.node[:]
        g.node.extend(kept)
        still = {i for n in g.node for i in n.input}
        kept_inits = [t for t in g.initializer if t.name in still]
        del g.initializer[:]
        g.initializer.extend(kept_inits + new)
    return count, folded


def _q4_1_offset(dq: onnx.NodeProto, users, producer, consts) -> tuple[str, list[onnx.NodeProto], onnx.NodeProto] | None:
    """For the block-quantized matrix dq, the export's Q4_1 offset term (float_weights' diagram):
    (the offset initializer (K/32, N), the nodes that compute and add it, the Add); None: no offset."""
    mms = users.get(dq.output[0], [])
    if len(mms) != 1 or mms[0].op_type != "MatMul" or mms[0].input[1] != dq.output[0]:
        return None
    mm = mms[0]
    adds = users.get(mm.output[0], [])
    if len(adds) != 1 or adds[0].op_type != "Add":
        return None
    add = adds[0]
    other = producer.get(add.input[1] if add.input[0] == mm.output[0] else add.input[0])
    if other is None or other.op_type != "MatMul" or other.input[1] not in consts:
        return None
    sums = producer.get(other.input[0])
    blocks = producer.get(sums.input[0]) if sums is not None and sums.op_type == "ReduceSum" else None
    if blocks is None or blocks.op_type != "Reshape" or blocks.input[0] != mm.input[0]:
        return None
    shape = tuple(consts[other.input[1]].dims)
    K, N = tuple(consts[dq.input[0]].dims)
    if shape != (K // BLOCK, N):
        raise BuildError(f"{other.name}: a Q4_1 offset of shape {shape}, not (K/32, N) = ({K // BLOCK}, {N}); re-export")
    nodes = [add, other] + ([sums] if len(users[sums.output[0]]) == 1 else [])
    nodes += [blocks] if len(users[blocks.output[0]]) == 1 and len(nodes) == 3 else []
    return other.input[1], nodes, add


def calibration_ids(artifact: Path, manifest, text: Path | None) -> tuple[list[int], str]:
    """The calibration tokens (contract/calibration.py's: the built-in prose + in-car dialogue mix, or
    the user's file), tokenized with the artifact's tokenizer: of its first 60% (the export's
    calibration part), the first and the last MAX_CALIB_TOKENS / 2 (all of it when shorter). The
    built-in mix is prose then dialogue: the ranges see both, the chat template's tokens among them
    (the first 512 alone were prose, and a16_feeds.stream_fidelity's held-out dialogue left them).
    Returns (ids, description of the source)."""
    ids, _, source = _calibration_split(artifact, manifest, text)
    half = MAX_CALIB_TOKENS // 2
    return list(ids if len(ids) <= MAX_CALIB_TOKENS else ids[:half] + ids[-half:]), source


def held_out_ids(artifact: Path, manifest, text: Path | None) -> list[int]:
    """Tokens the calibration never saw, for stream_fidelity: the export's held-back 40% of the same
    source (the built-in mix: in-car dialogue, then prose), its first max(2 chunks, 64) + 1."""
    _, held, _ = _calibration_split(artifact, manifest, text)
    return list(held[: max(2 * manifest.cache.chunk, 64) + 1])


def _calibration_split(artifact: Path, manifest, text: Path | None) -> tuple[list[int], list[int], str]:
    from tokenizers import Tokenizer

    from cabinlm.contract.calibration import calibration_tokens

    tok = Tokenizer.from_file(str(artifact / manifest.files[FileRole.TOKENIZER].path))
    loaded = SimpleNamespace(tokenizer=SimpleNamespace(backend_tokenizer=tok))
    return calibration_tokens(loaded, manifest.chat, text)


def ids_sha256(ids: list[int]) -> str:
    """The checksum the export records for its calibration ids (int64, little-endian)."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def floor_masks(model: onnx.ModelProto) -> list[str]:
    """Each additive attention mask input floored at -MASK_FLOOR before the graph reads it. The
    runtime's masked value (io_spec.MASK_VALUE, -1e30) as a 16-bit range would leave the scores it is
    added to a step of ~1e25: every unmasked score the same number. -MASK_FLOOR still gives a masked
    slot a weight of exp(-MASK_FLOOR + score range) ~ 0. Returns the inputs floored."""
    from cabinlm.contract import io_spec as io

    g = model.graph
    done = []
    for t in g.input:
        if t.name in (io.ATTENTION_MASK, io.LOCAL_ATTENTION_MASK):
            floored = f"{t.name}/floored"
            rewire(g, t.name, floored)
            g.node.insert(0, onnx.helper.make_node("Clip", [t.name, MASK_MIN, ZERO], [floored], name=f"htp/{floored}"))
            done.append(t.name)
    if done:
        g.initializer.extend([numpy_helper.from_array(np.array(-MASK_FLOOR, np.float32), MASK_MIN),
                              numpy_helper.from_array(np.array(0.0, np.float32), ZERO)])  # fmt: skip
    return done


class _Reader:
    """onnxruntime.quantization's CalibrationDataReader over recorded feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)



def quantize_a16(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], kv: dict[str, float], workdir: Path,
                 weights: str = "int8") -> tuple[onnx.ModelProto, dict[str, int]]:
    """The QDQ graph (module docstring) of the float graph `model`, calibrated on `feeds`, its matrices
    `weights` (a16_weights.WEIGHT_FORMATS) blocks. Returns (graph, a16_weights.block_weights' counts)."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # every intermediate typed (onnx's own inference stops at ORT's SimplifiedLayerNormalization):
    # the quantizer quantizes only tensors whose type it knows
    model = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    matrices = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 2} if PER_CHANNEL is None else {}
    src = workdir / "a16.float.onnx"  # saving moves the model's tensors out of it
    onnx.save_model(model, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=src.name + ".data", size_threshold=1024)  # fmt: skip
    # int8 per channel, the token table's form; the matrices' blocks replace them after (block_weights)
    weight = {"int16": QuantType.QInt16, "int8": QuantType.QInt8, "int4": QuantType.QInt4, None: QuantType.QInt8}[PER_CHANNEL]
    config = get_qnn_qdq_config(str(src), _Reader(feeds), activation_type=QuantType.QUInt16, weight_type=weight,
                                per_channel=True, weight_symmetric=True)  # fmt: skip
    config.use_external_data_format = True
    overrides = config.extra_options.setdefault("TensorQuantOverrides", {})
    for name, scale in kv.items():  # the cache's tensors: uint8, their own tied scale, zero point 128
        overrides[name] = [{"quant_type": QuantType.QUInt8, "scale": np.array(scale, np.float32),
                            "zero_point": np.array(128, np.uint8)}]  # fmt: skip
    dst = workdir / "a16.qdq.onnx"
    quantize(str(src), str(dst), config)
    q = onnx.load(str(dst))
    strip_kv_io(q, kv)
    if PER_CHANNEL is not None:
        return q, {"weight_blocks": 0, "weight_blocks_int8": 0}
    bits = {"int8": 8, "int4": 4}[weights]
    return q, block_weights(q, matrices, bits, a16_weights.HEAD_BITS if bits == 4 else None)


# The check's floors (a16_feeds.stream_fidelity, held-out text through the runtime): the graph that lost
# SmolLM2 (perplexity 1.9e9) and the tiny Q4_1 model (correlation 0.43) fail both by far
MIN_FIDELITY = 0.95  # the QDQ graph's logits against the float graph's, correlation over every row
# int4 weights: their rounding alone moves the logits (SmolLM2's int4 QDQ graph 0.908 on the held-out dialogue,
# 0.936 over 512 tokens of prose, perplexity +21% / +2.5%); the broken graphs
# above still fail by far
MIN_FIDELITY_INT4 = 0.85
MAX_PERPLEXITY_RATIO = 1.25  # the QDQ graph's perplexity over the float graph's, the same text


def a16_float_graph(artifact: Path, manifest) -> tuple[onnx.ModelProto, dict, dict[str, float], bool]:
    """The float graph the quantizer calibrates (the module docstring's first steps): the HTP-ready
    rewrites, the float matrices, the uint8 cache (graph.uint8_kv) holding rotated keys where the
    layout allows (spec.builds_rotated_keys: rotated_graph.rotate_cached_keys, the keys' scales the
    rotation pairs' bound), the masks floored. Returns (graph, rewrites' counts, the cache's
    {input name: scale}, whether it holds rotated keys)."""
    from cabinlm.engines.onnxruntime.offline import read_graph
    from cabinlm.engines.qnn_htp.graph import float_embedding, fuse_rms_norms, per_tensor_kv_scales, uint8_kv
    from cabinlm.engines.qnn_htp.rotated_graph import rotate_cached_keys, rotated_key_scales
    from cabinlm.contract.engines.qnn import builds_rotated_keys

    lay = manifest.cache
    model = read_graph(artifact, manifest)
    rewrites = {"rms_norms": fuse_rms_norms(model), "float_embedding": int(float_embedding(model))}
    rewrites["float_weights"], rewrites["offsets_folded"] = float_weights(model)
    rotated = builds_rotated_keys(manifest)
    scales_of = rotated_key_scales if rotated else per_tensor_kv_scales
    scales = scales_of(manifest.kv_scales.array("keys"), manifest.kv_scales.array("values"), lay.layers)
    uint8_kv(model, scales)
    if rotated:  # the cache's keys rotated when written: QK^T reads the 8-bit keys as the cache holds them
        rotate_cached_keys(model, lay.head_dim)
    rewrites["masks_floored"] = len(floor_masks(model))
    return model, rewrites, scales, rotated


def a16_graph(artifact: Path, manifest, calib: Path | None, workdir: Path, log: Callable[[str], None] = lambda s: None,
              weights: str = "int8") -> tuple[onnx.ModelProto, dict, dict[str, float], dict]:
    """The whole pipeline (module docstring) for an int8-KV export, its matrices `weights` blocks
    (a16_weights.WEIGHT_FORMATS). Returns (the QDQ graph, the rewrites' counts, the cache's
    {input name: scale}, the calibration's record for the manifest). The cache holds rotated keys
    where spec.builds_rotated_keys says so (a16_float_graph)."""
    if weights not in WEIGHT_FORMATS:
        raise BuildError(f"--a16-weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    model, rewrites, scales, rotated = a16_float_graph(artifact, manifest)
    rotated_scales = scales if rotated else None  # the runtime's refresh on the CPU rounds with them (a16_feeds)
    ids, source = calibration_ids(artifact, manifest, calib)
    feeds = calibration_feeds(model, artifact, manifest, ids, rotated_scales)
    reference = model.SerializeToString()  # the float graph, uint8 cache I/O: the fidelity check's reference
    kv = float_kv_io(model, scales)
    for f in feeds:  # the recorded uint8 cache as the float cache the quantizer's graph reads
        for name in kv:
            if name in f:
                f[name] = (f[name].astype(np.float32) - 128.0) * np.float32(kv[name])
    log(f"calibrating 16-bit activations on {len(ids)} tokens ({source}), {len(feeds)} runs of the float graph")
    q, blocks = quantize_a16(model, feeds, kv, workdir, weights)
    rewrites.update(blocks)
    del feeds, model
    held = held_out_ids(artifact, manifest, calib)
    fid = stream_fidelity(reference, q, artifact, manifest, held, rotated_scales)
    corr, (ppl_f, ppl_q) = fid["correlation"], fid["perplexity"]
    bar = MIN_FIDELITY_INT4 if weights == "int4" else MIN_FIDELITY
    if corr < bar or not ppl_q <= ppl_f * MAX_PERPLEXITY_RATIO:
        raise BuildError(f"the 16-bit graph does not follow the float graph over {len(held)} held-out tokens through the "
                         f"runtime on the CPU (logit correlation {corr:.3f}, at least {bar}; perplexity {ppl_q:.4g} "
                         f"against {ppl_f:.4g}, at most {MAX_PERPLEXITY_RATIO}x): per-tensor 16-bit ranges "
                         + ("or int4 weight blocks lose this model; build it with --a16-weights int8 or --activations fp16"
                            if weights == "int4" else "lose this model; build it with --activations fp16"))  # fmt: skip
    rewrites["fidelity"] = round(corr, 5)
    rewrites["fidelity_perplexity"] = [round(ppl_f, 4), round(ppl_q, 4)]
    rewrites["fidelity_tokens"] = len(held)
    calibration = {"source": source, "tokens": len(ids), "ids_sha256": ids_sha256(ids),
                   "method": "min-max per tensor (onnxruntime.quantization, QNN QDQ config)"}  # fmt: skip
    return q, rewrites, scales, calibration
