"""The TensorRT-ready graph: the export, rewritten so that an fp16 engine cannot overflow, and for
strongly typed TensorRT (10.15+) with its precision written into the graph. Both rewrites keep the
graph plain ONNX at the export's opset (TensorRT 8.6 parses it) and runnable on ONNX Runtime's CPU
provider, which is how `cabinlm doctor` compares an engine with it.

1. fp16-safe RMSNorm (every TensorRT target). The export's decomposed RMSNorm squares the residual
   stream: SmolLM2's residual reaches ~2.2e4, its square ~5e8, far above fp16's 65504; the QNN HTP
   run of that graph in fp16 gave garbage in Qualcomm's simulator, and a weakly typed TensorRT engine
   built with the FP16 flag may run the same reduction in fp16 (8.6 does not always keep it in
   fp32). The rewrite divides each row by its own largest magnitude first, so every intermediate is
   bounded whatever the input, and the result is algebraically the same function:

     x (T, D) ─ Abs ─ ReduceMax(-1) ─ Max(·, FLOOR) ─ m (T, 1)       m >= max|x|, m >= FLOOR
     x ─ Div(m) ─ y                                                  |y| <= 1
     y ─ Mul(y) ─ ReduceMean(-1) ─ ms                                1/D <= ms <= 1 (the max element has y = 1)
     sqrt(eps) ─ Div(m) ─ Mul(self) ─ e2                             eps / m^2 <= eps / FLOOR^2
     ms + e2 ─ Sqrt ─ r;  y ─ Div(r) ─ Mul(weight) ─ out             |y / r| <= sqrt(D)

   y / r = (x/m) / sqrt(mean(x^2)/m^2 + eps/m^2) = x / sqrt(mean(x^2) + eps): exact in real
   arithmetic. In fp16, elements below 2^-12 of the row's maximum square to below fp16's smallest
   subnormal and drop out of the mean, a relative change below D * 2^-24. FLOOR keeps an all-zero
   row finite (m = 0 would divide by zero); for m < FLOOR the formula is still exact.

2. fp16 matrix products (strongly typed targets only). A strongly typed network runs each tensor in
   the type the graph gives it, so an fp32 graph would build an fp32 engine. The weight products
   (MatMul / Gemm with an initializer as the weight) get fp16 weights and fp16 inputs, their
   outputs cast back to float32; norms, RoPE, softmax and the residual stream stay fp32. The tied
   token table becomes fp16 once, and its Gather is cast back to float32.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cabinlm.contract import io_spec
from cabinlm.contract.errors import BuildError

FLOOR = 2.0**-6  # smallest row scale: eps / FLOOR^2 stays tiny (4096 * eps) and finite in fp16


def norm_names(layers: int) -> list[str]:
    """The RMSNorm blocks of the export, by the names of their weights (io_spec.weight_name): the
    Mul that applies the weight is the node "n/" + this, its parts "n/" + this + "/sq" etc."""
    parts = [p.removesuffix(".weight") for p in io_spec.LAYER_WEIGHTS if p.endswith("norm.weight")]
    return [io_spec.weight_name(layer, p) for layer in range(layers) for p in parts] + ["final_norm"]


_PARTS = (("sq", "Pow"), ("var", "ReduceMean"), ("eps", "Add"), ("rms", "Sqrt"), ("div", "Div"))


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def fp16_safe_norms(model: onnx.ModelProto, layers: int, eps: float) -> int:
    """Rewrite every RMSNorm of the export in place (module docstring, 1). Returns how many.
    Raises BuildError if a block is not the export's Pow / ReduceMean / Add / Sqrt / Div / Mul."""
    nodes = {n.name: n for n in model.graph.node}
    opset = _opset(model)
    g = model.graph
    floor, sqrt_eps = "trt_safe/floor", "trt_safe/sqrt_eps"
    g.initializer.extend([numpy_helper.from_array(np.array(FLOOR, dtype=np.float32), floor),
                          numpy_helper.from_array(np.array(np.sqrt(np.float32(eps)), dtype=np.float32), sqrt_eps)])  # fmt: skip
    if opset >= 18:  # ReduceMax / ReduceMean take `axes` as an input from opset 18
        g.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "trt_safe/axes"))
    replace: dict[int, list[onnx.NodeProto]] = {}  # id of the block's first node -> the new nodes
    drop: set[int] = set()
    weights = {i.name for i in g.initializer}
    optional = {p.removesuffix(".weight") for p in io_spec.OPTIONAL_LAYER_WEIGHTS}
    for base in norm_names(layers):
        mul = nodes.get(f"n/{base}")
        parts = [nodes.get(f"n/{base}/{suffix}") for suffix, _ in _PARTS]
        if f"{base}.weight" not in weights and base.rsplit(".", 1)[-1] in optional:
            continue  # a norm this family does not have (Qwen3's and Gemma 3's q / k norms, Gemma 3's output norms)
        if mul is None or any(p is None for p in parts):
            raise BuildError(f"the exported graph has no RMSNorm block {base!r} (Pow .. Mul named n/{base}/...); "
                             "export again with this cabinlm")  # fmt: skip
        blocks = [p for p in parts if p is not None]
        for node, (suffix, op) in zip(blocks, _PARTS):
            if node.op_type != op:
                raise BuildError(f"RMSNorm {base!r}: node n/{base}/{suffix} is {node.op_type}, expected {op}")
        if mul.op_type != "Mul":
            raise BuildError(f"RMSNorm {base!r}: node n/{base} is {mul.op_type}, expected Mul")
        x, weight, out = blocks[0].input[0], mul.input[1], mul.output[0]
        t = f"trt_safe/{base}"

        def reduce(op: str, src: str, dst: str) -> onnx.NodeProto:
            if opset >= 18:
                return helper.make_node(op, [src, "trt_safe/axes"], [dst], name=f"n/{dst}", keepdims=1)
            return helper.make_node(op, [src], [dst], name=f"n/{dst}", axes=[-1], keepdims=1)

        new = [
            helper.make_node("Abs", [x], [f"{t}/abs"], name=f"n/{t}/abs"),
            reduce("ReduceMax", f"{t}/abs", f"{t}/absmax"),
            helper.make_node("Max", [f"{t}/absmax", floor], [f"{t}/m"], name=f"n/{t}/m"),
            helper.make_node("Div", [x, f"{t}/m"], [f"{t}/y"], name=f"n/{t}/y"),
            helper.make_node("Mul", [f"{t}/y", f"{t}/y"], [f"{t}/y2"], name=f"n/{t}/y2"),
            reduce("ReduceMean", f"{t}/y2", f"{t}/ms"),
            helper.make_node("Div", [sqrt_eps, f"{t}/m"], [f"{t}/e"], name=f"n/{t}/e"),
            helper.make_node("Mul", [f"{t}/e", f"{t}/e"], [f"{t}/e2"], name=f"n/{t}/e2"),
            helper.make_node("Add", [f"{t}/ms", f"{t}/e2"], [f"{t}/r2"], name=f"n/{t}/r2"),
            helper.make_node("Sqrt", [f"{t}/r2"], [f"{t}/r"], name=f"n/{t}/r"),
            helper.make_node("Div", [f"{t}/y", f"{t}/r"], [f"{t}/normed"], name=f"n/{t}/normed"),
            helper.make_node("Mul", [f"{t}/normed", weight], [out], name=f"n/{base}"),  # the same name and output
        ]
        replace[id(blocks[0])] = new
        drop.update(id(n) for n in (*blocks, mul))
    kept: list[onnx.NodeProto] = []
    for node in g.node:  # the new block where the old one began: topological order is kept
        kept.extend(replace.get(id(node), []))
        if id(node) not in drop:
            kept.append(node)
    del g.node[:]
    g.node.extend(kept)
    return len(replace)


def fp16_matmuls(model: onnx.ModelProto) -> int:
    """Strongly typed targets: weight products in fp16 (module docstring, 2), in place; the model
    must hold its weights (onnx.load with external data). Returns how many products changed."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    users: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in g.node:
        for i, name in enumerate(node.input):
            users.setdefault(name, []).append((node, i))

    def is_weight_product(node: onnx.NodeProto) -> bool:
        w = inits.get(node.input[1]) if len(node.input) > 1 else None
        return node.op_type in ("MatMul", "Gemm") and w is not None and w.data_type == TensorProto.FLOAT

    products = [n for n in g.node if is_weight_product(n)]
    product_ids = {id(n) for n in products}
    weights = {n.input[1] for n in products}
    for name in sorted(weights):  # every other use must be a Gather (the tied token table) or another product
        for node, i in users[name]:
            if not (id(node) in product_ids and i == 1) and not (node.op_type == "Gather" and i == 0):
                raise BuildError(f"weight {name} is used by {node.op_type} {node.name} too; cannot make it fp16")
        arr = numpy_helper.to_array(inits[name]).astype(np.float16)
        inits[name].CopyFrom(numpy_helper.from_array(arr, name))
    new: dict[int, tuple[list[onnx.NodeProto], list[onnx.NodeProto]]] = {}  # id -> (before, after)
    for node in products:
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            raise BuildError(f"{node.name}: a Gemm with a bias is not converted (the export has none)")
        a, out = node.input[0], node.output[0]
        before = [helper.make_node("Cast", [a], [f"{out}/a16"], name=f"n/{out}/a16", to=TensorProto.FLOAT16)]
        after = [helper.make_node("Cast", [f"{out}/y16"], [out], name=f"n/{out}/y32", to=TensorProto.FLOAT)]
        node.input[0], node.output[0] = f"{out}/a16", f"{out}/y16"
        new[id(node)] = (before, after)
    for name in weights:
        for node, i in users[name]:
            if node.op_type == "Gather":
                out = node.output[0]
                node.output[0] = f"{out}/g16"
                cast = helper.make_node("Cast", [f"{out}/g16"], [out], name=f"n/{out}/g32", to=TensorProto.FLOAT)
                new[id(node)] = ([], [cast])
    kept: list[onnx.NodeProto] = []
    for node in g.node:
        before, after = new.get(id(node), ([], []))
        kept += [*before, node, *after]
    del g.node[:]
    g.node.extend(kept)
    return len(products)
