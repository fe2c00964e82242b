"""Qwen2-VL and Qwen2.5-VL: the image processor at one fixed frame size, and the vision tower as a
fixed-shape graph (Qwen2.5-VL's window attention included: build_qwen2_vl_vision).

A camera frame has one size per artifact (`frame`, pixels, multiples of patch x merge): the vision
graph then always sees the same patch grid, and its rotary table and the patch merger's windows are
constants. The processor's own rule (smart_resize: the frame's aspect ratio kept, the pixel count
inside [min_pixels, max_pixels], each side a multiple of patch x merge) picks the default from a
640x480 camera frame, and the default is always a size that rule leaves as it is (default_frame);
a frame the processor would itself resize to another size is refused.

    pixel_values (N, C*T*p*p)      the processor's flattened patches, N = (H/p)(W/p) in merge-window order
    ─ MatMul W_patch (Conv3d over one patch, no bias) ─ (N, E)
    ─ depth x [ LayerNorm ─ qkv (+bias) ─ q, k: 2-D RoPE (row, col of each patch; constants)
                ─ softmax(q k^T / sqrt(hd)) v over all N patches ─ proj ─ + x
                ─ LayerNorm ─ fc1 ─ act ─ fc2 ─ + x ]
    ─ merger: LayerNorm ─ (N/m^2, E*m^2) ─ Linear ─ GELU ─ Linear ─ image_embeds (I, D), I = N/m^2

Qwen2.5-VL: RMSNorm for each LayerNorm, down(silu(gate(x)) * up(x)) for the MLP, and
    (N, E) ─ Gather window_order ─ blocks (those not in fullatt_block_indexes: + window_mask (N, N))
    ─ merger ─ Gather window_order_back ─ image_embeds in row-major grid order

The image tokens are the merged grid (H/(p m)) x (W/(p m)) in row-major order: the decoder's M-RoPE
gives token k the grid offsets (row k // cols, col k % cols) (contract/slots.py, docs/vlm.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from cabinlm.contract.errors import ModelError
from cabinlm.export.graph import GraphBuilder
from cabinlm.source.processor import Qwen2VLProcessor, read_qwen2_vl_processor, smart_resize  # noqa: F401 - re-exported
from cabinlm.export.vision import IMAGE_EMBEDS, PIXELS, _activation

ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


@dataclass(frozen=True)
class Qwen2VLGeometry:
    image_size: int  # the frame's height (VisionSpec.image_size); the frame is (height, width)
    patch_size: int
    image_tokens: int
    embed_dim: int
    frame: tuple[int, int]
    grid: tuple[int, int]


def vision_position_ids(rows: int, cols: int, merge: int) -> np.ndarray:
    """(N, 2) int64: each patch's (row, col) in the processor's order (merge windows of m x m,
    row-major inside each window, windows row-major)."""
    r = np.arange(rows)[:, None].repeat(cols, 1)
    c = np.arange(cols)[None, :].repeat(rows, 0)

    def windows(x: np.ndarray) -> np.ndarray:
        return x.reshape(rows // merge, merge, cols // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    return np.stack([windows(r), windows(c)], axis=1).astype(np.int64)


def window_order(rows: int, cols: int, merge: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window attention for one frame: (N,) the patches in window order (each merge
    group of m x m patches kept together; windows of `window` x `window` merge groups, row-major,
    the last ones cut at the grid's edge), and (N,) each patch's window in that order."""
    gh, gw = rows // merge, cols // merge
    unit = merge * merge
    nh, nw = -(-gh // window), -(-gw // window)
    groups, sizes = [], []
    for wi in range(nh):
        for wj in range(nw):
            cell = [r * gw + c for r in range(wi * window, min(gh, (wi + 1) * window))
                    for c in range(wj * window, min(gw, (wj + 1) * window))]  # fmt: skip
            if cell:
                groups += cell
                sizes.append(len(cell) * unit)
    order = (np.asarray(groups, dtype=np.int64)[:, None] * unit + np.arange(unit)).reshape(-1)
    return order, np.repeat(np.arange(len(sizes)), sizes)


def build_qwen2_vl_vision(model, proc: Qwen2VLProcessor, opset: int = 17) -> tuple[GraphBuilder, Qwen2VLGeometry]:
    """model: a transformers Qwen2VLForConditionalGeneration or Qwen2_5_VLForConditionalGeneration
    (float32). Qwen2.5-VL's tower differs in three ways, each a constant of the fixed frame: RMSNorm
    for LayerNorm, a gated SiLU MLP, and window attention (the patches reordered into windows after
    the patch embedding, every block but `fullatt_block_indexes` attending within its window through
    a constant additive mask, the merged tokens put back in row-major order after the merger)."""
    import torch

    visual = model.model.visual
    vcfg = model.config.vision_config
    E, heads = visual.patch_embed.embed_dim, vcfg.num_heads
    hd = E // heads
    p, m, T = proc.patch, proc.merge, proc.temporal
    rows, cols = proc.frame[0] // p, proc.frame[1] // p
    N = rows * cols
    D = model.config.text_config.hidden_size
    windowed = hasattr(visual, "fullatt_block_indexes")  # Qwen2.5-VL

    def t(x) -> np.ndarray:
        return x.detach().float().numpy()

    # The tower's 2-D rotary table for this grid, computed by the model's own module: (N, hd) each.
    pos = torch.from_numpy(vision_position_ids(rows, cols, m))
    with torch.no_grad():
        cos, sin = visual.rotary_pos_emb(torch.zeros(N, E), pos)
    cos, sin = t(cos), t(sin)
    half = hd // 2
    sin = sin * np.concatenate([-np.ones(half), np.ones(half)]).astype(np.float32)  # rotate_half's sign
    full_blocks = set(range(len(visual.blocks)))
    if windowed:  # patches in window order from the patch embedding on: rotary rows too, and a window mask
        order, window_of = window_order(rows, cols, m, vcfg.window_size // m // p)
        cos, sin = cos[order], sin[order]
        full_blocks = set(visual.fullatt_block_indexes)

    g = GraphBuilder("cabinlm_vision", opset=opset)
    g.input(PIXELS, TensorProto.FLOAT, (N, 3 * T * p * p))
    w_patch = t(visual.patch_embed.proj.weight).reshape(E, -1).T  # Conv3d over exactly one patch = a MatMul
    x = g.op("MatMul", PIXELS, g.weight("patch_embed.weight", np.ascontiguousarray(w_patch)), name="patch_embed")
    if windowed:
        x = g.op("Gather", x, g.weight("window_order", order), axis=0, name="patch_embed/windows")
    if len(full_blocks) < len(visual.blocks):
        same = window_of[:, None] == window_of[None, :]
        window_mask = g.weight("window_mask", np.where(same, 0.0, -1e30).astype(np.float32))  # (N, N) additive
    cos_c, sin_c = g.weight("rope_cos", cos), g.weight("rope_sin_signed", sin)

    def layer_norm(x: str, ln, name: str) -> str:
        if not hasattr(ln, "bias"):  # Qwen2.5-VL's RMSNorm: x / sqrt(mean(x^2) + eps) * w
            var = g.reduce("ReduceMean", g.op("Pow", x, g.const(2.0)), [-1], name=f"{name}/var")
            rms = g.op("Sqrt", g.op("Add", var, g.const(float(ln.variance_epsilon))), name=f"{name}/rms")
            return g.op("Mul", g.op("Div", x, rms), g.weight(f"{name}.weight", t(ln.weight)), name=name)
        return g.op("LayerNormalization", x, g.weight(f"{name}.weight", t(ln.weight)), g.weight(f"{name}.bias", t(ln.bias)),
                    axis=-1, epsilon=ln.eps, name=name)  # fmt: skip

    def linear(x: str, lin, name: str) -> str:
        y = g.op("MatMul", x, g.weight(f"{name}.weight", np.ascontiguousarray(t(lin.weight).T)), name=f"{name}/mm")
        return g.op("Add", y, g.weight(f"{name}.bias", t(lin.bias)), name=name) if lin.bias is not None else y

    def rope(x: str, name: str) -> str:  # x (heads, N, hd): x cos + rotate_half(x) sin
        x1, x2 = g.split(x, [half, half], axis=-1, name=f"{name}/half")
        rot = g.op("Concat", x2, x1, axis=-1, name=f"{name}/rot")
        return g.op("Add", g.op("Mul", x, cos_c), g.op("Mul", rot, sin_c), name=name)

    for i, blk in enumerate(visual.blocks):
        pre = f"vision.{i}"
        h = layer_norm(x, blk.norm1, f"{pre}.norm1")
        qkv = linear(h, blk.attn.qkv, f"{pre}.qkv")  # (N, 3E): q|k|v, each heads x hd
        q, k, v = (g.op("Transpose", g.op("Reshape", part, g.ints([-1, heads, hd])), perm=[1, 0, 2], name=f"{pre}/{nm}")
                   for part, nm in zip(g.split(qkv, [E, E, E], axis=1, name=f"{pre}/split"), "qkv"))  # fmt: skip
        q = g.op("Mul", rope(q, f"{pre}/rope_q"), g.const(hd**-0.5), name=f"{pre}/q_scaled")
        k = rope(k, f"{pre}/rope_k")
        scores = g.op("MatMul", q, g.op("Transpose", k, perm=[0, 2, 1]), name=f"{pre}/scores")  # (heads, N, N)
        if i not in full_blocks:  # within each window only
            scores = g.op("Add", scores, window_mask, name=f"{pre}/windowed")
        probs = g.op("Softmax", scores, axis=-1, name=f"{pre}/probs")
        ctx = g.op("Reshape", g.op("Transpose", g.op("MatMul", probs, v), perm=[1, 0, 2]), g.ints([-1, E]), name=f"{pre}/ctx")
        x = g.op("Add", x, linear(ctx, blk.attn.proj, f"{pre}.proj"), name=f"{pre}/attn_res")
        h = layer_norm(x, blk.norm2, f"{pre}.norm2")
        if hasattr(blk.mlp, "gate_proj"):  # Qwen2.5-VL: down(act(gate(h)) * up(h)), biases on all three
            if vcfg.hidden_act != "silu":
                raise ModelError(f"vision hidden_act {vcfg.hidden_act!r}: Qwen2.5-VL's tower graph implements silu")
            gate = linear(h, blk.mlp.gate_proj, f"{pre}.gate")
            h = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), linear(h, blk.mlp.up_proj, f"{pre}.up"), name=f"{pre}/swiglu")
            x = g.op("Add", x, linear(h, blk.mlp.down_proj, f"{pre}.down"), name=f"{pre}/mlp_res")
        else:
            h = _activation(g, linear(h, blk.mlp.fc1, f"{pre}.fc1"), f"{pre}/act", vcfg.hidden_act)
            x = g.op("Add", x, linear(h, blk.mlp.fc2, f"{pre}.fc2"), name=f"{pre}/mlp_res")
    merger = visual.merger
    x = g.op("Reshape", layer_norm(x, merger.ln_q, "merger.ln_q"), g.ints([-1, E * m * m]), name="merger/windows")
    x = _activation(g, linear(x, merger.mlp[0], "merger.fc1"), "merger/act", "gelu")
    x = linear(x, merger.mlp[2], "merger.fc2")
    if windowed:  # the merged tokens back in row-major grid order
        back = np.argsort(order.reshape(-1, m * m)[:, 0] // (m * m)).astype(np.int64)
        x = g.op("Gather", x, g.weight("window_order_back", back), axis=0, name="merger/row_major")
    g.output(x, IMAGE_EMBEDS, TensorProto.FLOAT, (proc.image_tokens, D))
    geometry = Qwen2VLGeometry(image_size=proc.frame[0], patch_size=p, image_tokens=proc.image_tokens, embed_dim=D,
                               frame=proc.frame, grid=proc.grid)  # fmt: skip
    return g, geometry


def mrope_section(model) -> tuple[int, ...]:
    """The text model's M-RoPE sections (t, h, w), in RoPE frequency pairs; they add up to head_dim / 2."""
    text = model.model.language_model
    section = tuple(int(s) for s in text.rotary_emb.mrope_section)
    half = text.rotary_emb.inv_freq.shape[0]
    if len(section) != 3 or sum(section) != half:
        raise ModelError(f"mrope_section {list(section)} must be 3 sections adding up to head_dim / 2 = {half}")
    return section
