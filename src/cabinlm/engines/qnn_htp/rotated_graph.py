"""The HTP's uint8 cache with rotated keys (docs/architecture.md "The rotated-key uint8
cache on the HTP"): a rewrite after graph.uint8_kv, so that the cache holds every key rotated once,
when written, at its virtual position v = rank + E (E: window tokens evicted before it), as the
fused cpu build does (engines/onnxruntime/rotated.py: why a query at L + E then sees every cached key
at the distance of the normative ranks).

Why: one scale per tensor costs un-rotated keys more than rotated ones (SmolLM2 in PyTorch with the
rounding alone: +5.93% perplexity against +2.81%, over 512 tokens of tests/data/prose.txt).

Per layer l, after uint8_kv (k: the chunk's un-rotated keys, s: the key cache's one scale):

    before   k ─ Div s ─ Clip ─ Q ─ new_key.l                DQ ─ Mul s ─ rope(chunk) ─ (scores)
             key_cache.l ─ DQ ─ Mul s ─ rope(cache_position_ids) ─ (scores)
    after    k ─ rope(rope_cos, rope_sin) ─ Div s ─ Clip ─ Q ─ new_key.l    DQ ─ Mul s ─ (scores)
             key_cache.l ─ DQ ─ Mul s ─ (scores)                     (the cache is K as it is)
             k ─ Cast fp16 ─ new_key_source.l                        (the sink / pinned copy)

and once for all layers, the chunk's rotation tables from the runtime's rows instead of position_ids:

    rope_cos (tokens, Dh/2) ─ Concat(·, ·) ─────────────── the keys' cos    ─ Mul q ─ the queries'
    rope_sin (tokens, Dh/2) ─ Concat(·, ·) ─ Mul sign ──── the keys' sin    ─ Mul q ─ the queries'

(sign = [-1] * Dh/2 + [1] * Dh/2, the export's rotate_half convention; q = the queries' factor over
the keys': the softmax scale.) s is the rotated keys' bound, rotated_key_scales: no rotation of a
key inside the calibrated per-channel range leaves it. position_ids and cache_position_ids leave the
graph (io_spec.decoder_io(rotated_keys=True)).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cabinlm.contract import io_spec as io
from cabinlm.contract.errors import BuildError
from cabinlm.engines.qnn_htp.graph import _consts, _prune, per_tensor_kv_scales


def pair_bounds(keys: np.ndarray) -> np.ndarray:
    """(layers, Hkv, Dh) per-channel key scales -> the bound of each rotation pair (i, i + Dh/2),
    sqrt(s_i^2 + s_(i+Dh/2)^2), written to both channels: a rotation moves a key's magnitude only
    inside a pair, so a key within its channels' ranges stays within this at every position."""
    k = np.asarray(keys, dtype=np.float64)
    half = k.shape[-1] // 2
    pair = np.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2)
    return np.concatenate([pair, pair], axis=-1)


def rotated_key_scales(keys: np.ndarray, values: np.ndarray, layers: int) -> dict[str, float]:
    """graph.per_tensor_kv_scales for a cache of rotated keys: each key tensor's scale is its largest
    pair bound (pair_bounds), values as before. Checked the same way (finite, within fp16)."""
    return per_tensor_kv_scales(pair_bounds(keys), values, layers)


def _toposort(g: onnx.GraphProto) -> None:
    """Order the nodes so each comes after the producers of its inputs (a rewire can break it)."""
    produced = {o: n for n in g.node for o in n.output}
    done: set[int] = set()
    order: list[onnx.NodeProto] = []
    for root in list(g.node):
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if id(n) in done:
                continue
            if expanded:
                done.add(id(n))
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((produced[i], False) for i in n.input if i in produced and id(produced[i]) not in done)
    del g.node[:]
    g.node.extend(order)


def _rename_uses(g: onnx.GraphProto, old: str, new: str, skip: set[int] = frozenset()) -> None:
    for n in g.node:
        if id(n) not in skip:
            n.input[:] = [new if x == old else x for x in n.input]


def _table(nodes: dict[str, onnx.NodeProto], rope: str, part: str, which: int) -> str:
    """The cos (which 1 of xcos) or signed sin (1 of rsin) table a rope subgraph multiplies by."""
    node = nodes.get(f"{rope}/{part}")
    if node is None:
        raise BuildError(f"the exported graph has no {rope}/{part!r}; re-export with this cabinlm")
    return node.input[which]


def _factor(consts, producer, sin_signed: str) -> np.ndarray:
    """The constant (1, Dh) the signed sin table was multiplied by: sign x the table's factor."""
    mul = producer.get(sin_signed)
    c = next((consts[i] for i in (mul.input if mul is not None and mul.op_type == "Mul" else ()) if i in consts), None)
    if c is None:
        raise BuildError(f"{sin_signed}: not the export's signed sin table; re-export with this cabinlm")
    return numpy_helper.to_array(c).astype(np.float64).reshape(-1)


def rotate_cached_keys(model: onnx.ModelProto, head_dim: int) -> list[str]:
    """The rewrite of the module docstring, in place, on a graph uint8_kv has rewritten. Returns the
    new_key_source outputs added."""
    g = model.graph
    consts = _consts(model)
    inputs = {t.name for t in g.input}
    if not {io.POSITION_IDS, io.CACHE_POSITION_IDS} <= inputs:
        raise BuildError("rotated keys: the graph has no position_ids / cache_position_ids (already rewritten?)")
    layers = sorted(int(n.split(".")[1]) for n in inputs if n.startswith("key_cache."))
    nodes = {n.name: n for n in g.node}
    producer = {o: n for n in g.node for o in n.output}
    half = head_dim // 2
    # the chunk's tables as the export computes them from position_ids (the same for every layer)
    k_cos, k_sin = _table(nodes, io.chunk_key_rope(0), "xcos", 1), _table(nodes, io.chunk_key_rope(0), "rsin", 1)
    q_cos, q_sin = _table(nodes, io.query_rope(0), "xcos", 1), _table(nodes, io.query_rope(0), "rsin", 1)
    k_f, q_f = _factor(consts, producer, k_sin), _factor(consts, producer, q_sin)
    if k_f.size != head_dim or not (np.sign(k_f) == np.sign(q_f)).all():
        raise BuildError(f"the rotary tables' factors ({k_f.size} channels) are not the export's; re-export")
    sign = np.sign(k_f).astype(np.float32).reshape(1, head_dim)
    q_scale = float(abs(q_f[0]) / abs(k_f[0]))  # the runtime's rows carry the RoPE factor; the queries add the softmax scale
    new_nodes = [
        helper.make_node("Concat", [io.ROPE_COS, io.ROPE_COS], ["htp/rope_k_cos"], name="n/htp/rope_k_cos", axis=1),
        helper.make_node("Concat", [io.ROPE_SIN, io.ROPE_SIN], ["htp/rope_sin2"], name="n/htp/rope_sin2", axis=1),
        helper.make_node("Mul", ["htp/rope_sin2", "htp/rope_sign"], ["htp/rope_k_sin"], name="n/htp/rope_k_sin"),
        helper.make_node("Mul", ["htp/rope_k_cos", "htp/rope_q_scale"], ["htp/rope_q_cos"], name="n/htp/rope_q_cos"),
        helper.make_node("Mul", ["htp/rope_k_sin", "htp/rope_q_scale"], ["htp/rope_q_sin"], name="n/htp/rope_q_sin"),
    ]  # fmt: skip
    inits = [numpy_helper.from_array(sign, "htp/rope_sign"), numpy_helper.from_array(np.array(q_scale, np.float32), "htp/rope_q_scale")]
    for old, new in ((k_cos, "htp/rope_k_cos"), (k_sin, "htp/rope_k_sin"), (q_cos, "htp/rope_q_cos"), (q_sin, "htp/rope_q_sin")):
        _rename_uses(g, old, new)
    sources = []
    for i in layers:
        kn, kc = io.chunk_key_rope(i), io.cached_key_rope(i)
        quant = producer.get(io.new_key_name(i))
        clip = quant and producer.get(quant.input[0])
        div = clip and producer.get(clip.input[0])
        if not (quant and quant.op_type == "QuantizeLinear" and clip.op_type == "Clip" and div.op_type == "Div"):
            raise BuildError(f"{io.new_key_name(i)}: not Div ─ Clip ─ QuantizeLinear (run graph.uint8_kv first)")
        for name in (kn, kc):
            if name not in nodes or f"{name}/half" not in nodes:
                raise BuildError(f"the exported graph has no {name!r}; re-export with this cabinlm")
        k_raw = div.input[0]  # (Hkv, T, Dh) the chunk's un-rotated keys
        k_read = nodes[f"{kn}/half"].input[0]  # the chunk's keys read back from new_key (DQ ─ Mul s)
        cache_read = nodes[f"{kc}/half"].input[0]  # the cache read back (DQ ─ Mul s)
        # the scores read the chunk's keys as the cache will hold them: rotated, rounded, read back
        _rename_uses(g, nodes[kn].output[0], k_read)
        _rename_uses(g, nodes[kc].output[0], cache_read)  # the cache holds keys rotated: no rotation
        for part in ("half", "xcos"):  # the chunk's rotation now reads the keys before rounding
            node = nodes[f"{kn}/{part}"]
            node.input[0] = k_raw
        div.input[0] = nodes[kn].output[0]
        src = io.new_key_source_name(i)
        new_nodes.append(helper.make_node("Cast", [k_raw], [src], name=f"n/{src}", to=TensorProto.FLOAT16))
        sources.append(src)
    g.node.extend(new_nodes)
    g.initializer.extend(inits)
    kept = [t for t in g.input if t.name not in (io.POSITION_IDS, io.CACHE_POSITION_IDS)]
    del g.input[:]
    g.input.extend(kept)
    g.input.extend([helper.make_tensor_value_info(io.ROPE_COS, TensorProto.FLOAT, ["tokens", half]),
                    helper.make_tensor_value_info(io.ROPE_SIN, TensorProto.FLOAT, ["tokens", half])])  # fmt: skip
    shapes = {o.name: o.type.tensor_type.shape for o in g.output}
    for layer, name in zip(layers, sources):  # new_key_source.l: (kv_heads, tokens, head_dim), as new_key.l
        out = helper.make_tensor_value_info(name, TensorProto.FLOAT16, None)
        out.type.tensor_type.shape.CopyFrom(shapes[io.new_key_name(layer)])
        g.output.append(out)
    _toposort(g)
    _prune(model)
    left = [n.name for n in g.node if {io.POSITION_IDS, io.CACHE_POSITION_IDS} & set(n.input)]
    if left:
        raise BuildError(f"rotated keys: {len(left)} node(s) still read the positions (first: {left[0]}); report this")
    return sources
