"""The vision graph of a LLaVA-style model: a CLIP or SigLIP vision transformer and the multimodal
projector, written as ONNX from the `transformers` model's weights, like the decoder.

    pixel_values (1, 3, S, S) ─ Conv patch p, stride p ─ (N, hid) [─ ++ CLS] ─ + positions [─ LayerNorm (CLIP)]
    ─ k pre-LN encoder layers (attention, MLP) ─ [drop CLS: "default"] ─ Linear ─ GELU ─ Linear ─ image_embeds (I, D)

k = the layer `vision_feature_layer` selects (LLaVA takes the second to last: -2), so the layers
after it are not exported at all. Fixed shape: one image of the processor's size per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from cabinlm.export.graph import GraphBuilder

PIXELS, IMAGE_EMBEDS = "pixel_values", "image_embeds"


@dataclass(frozen=True)
class VisionGeometry:
    image_size: int
    patch_size: int
    image_tokens: int  # rows of image_embeds = slots of the cache's image region
    embed_dim: int  # the language model's hidden size


def _t(x) -> np.ndarray:
    return x.detach().float().numpy()


def _activation(g: GraphBuilder, x: str, name: str, kind: str) -> str:
    if kind == "quick_gelu":  # x * sigmoid(1.702 x)
        return g.op("Mul", x, g.op("Sigmoid", g.op("Mul", x, g.const(1.702))), name=name)
    if kind == "gelu":  # exact: 0.5 x (1 + erf(x / sqrt 2))
        erf = g.op("Erf", g.op("Div", x, g.const(math.sqrt(2.0))))
        return g.op("Mul", g.op("Mul", x, g.const(0.5)), g.op("Add", erf, g.const(1.0)), name=name)
    if kind in ("gelu_pytorch_tanh", "gelu_new"):  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = g.op("Mul", g.op("Pow", x, g.const(3.0)), g.const(0.044715))
        inner = g.op("Mul", g.op("Add", x, cube), g.const(math.sqrt(2.0 / math.pi)))
        return g.op("Mul", g.op("Mul", x, g.const(0.5)), g.op("Add", g.op("Tanh", inner), g.const(1.0)), name=name)
    raise ValueError(f"activation {kind!r} is not supported in the vision graph")


def layer_norm(g: GraphBuilder, x: str, ln, name: str, eps: float) -> str:
    return g.op("LayerNormalization", x, g.weight(f"{name}.weight", _t(ln.weight)), g.weight(f"{name}.bias", _t(ln.bias)),
                axis=-1, epsilon=eps, name=name)  # fmt: skip


def linear(g: GraphBuilder, x: str, lin, name: str) -> str:
    y = g.op("MatMul", x, g.weight(f"{name}.weight", np.ascontiguousarray(_t(lin.weight).T)), name=f"{name}/mm")
    return g.op("Add", y, g.weight(f"{name}.bias", _t(lin.bias)), name=name) if lin.bias is not None else y


def patch_tokens(g: GraphBuilder, embeddings, image_size: int, patch: int, hid: int) -> str:
    """The graph's input pixel_values (1, 3, S, S) through the tower's patch embedding (a Conv of
    kernel and stride p, its bias if it has one) as rows (N, hid), N = (S / p)^2 patches in row-major
    order (CLIP / SigLIP: LLaVA's towers, Idefics3's)."""
    S, p = image_size, patch
    g.input(PIXELS, TensorProto.FLOAT, (1, 3, S, S))
    conv = embeddings.patch_embedding
    conv_in = [PIXELS, g.weight("patch_embedding.weight", _t(conv.weight))]
    if conv.bias is not None:
        conv_in.append(g.weight("patch_embedding.bias", _t(conv.bias)))
    x = g.op("Conv", *conv_in, kernel_shape=[p, p], strides=[p, p], name="patches")  # (1, hid, S/p, S/p)
    return g.op("Transpose", g.op("Reshape", x, g.ints([hid, (S // p) ** 2])), perm=[1, 0], name="patch_tokens")


def encoder_layers(g: GraphBuilder, x: str, layers, vcfg) -> str:
    """CLIP / SigLIP pre-LN encoder layers over x (N, hid), full attention over the N tokens (LLaVA's
    towers, Idefics3's): LayerNorm, q k v (q scaled by hd^-0.5), softmax, out_proj, + x; LayerNorm,
    fc1, activation, fc2, + x."""
    hid, heads, eps = vcfg.hidden_size, vcfg.num_attention_heads, vcfg.layer_norm_eps
    hd = hid // heads

    def heads_first(t: str, nm: str) -> str:  # (N, hid) -> (heads, N, hd)
        return g.op("Transpose", g.op("Reshape", t, g.ints([-1, heads, hd])), perm=[1, 0, 2], name=nm)

    for i, lyr in enumerate(layers):
        pre = f"vision.{i}"
        h = layer_norm(g, x, lyr.layer_norm1, f"{pre}.ln1", eps)
        a = lyr.self_attn
        q = heads_first(g.op("Mul", linear(g, h, a.q_proj, f"{pre}.q"), g.const(hd**-0.5)), f"{pre}/q")
        k = heads_first(linear(g, h, a.k_proj, f"{pre}.k"), f"{pre}/k")
        v = heads_first(linear(g, h, a.v_proj, f"{pre}.v"), f"{pre}/v")
        probs = g.op("Softmax", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 2, 1])), axis=-1, name=f"{pre}/probs")
        ctx = g.op("Reshape", g.op("Transpose", g.op("MatMul", probs, v), perm=[1, 0, 2]), g.ints([-1, hid]))
        x = g.op("Add", x, linear(g, ctx, a.out_proj, f"{pre}.o"), name=f"{pre}/attn_res")
        h = layer_norm(g, x, lyr.layer_norm2, f"{pre}.ln2", eps)
        h = _activation(g, linear(g, h, lyr.mlp.fc1, f"{pre}.fc1"), f"{pre}/act", vcfg.hidden_act)
        x = g.op("Add", x, linear(g, h, lyr.mlp.fc2, f"{pre}.fc2"), name=f"{pre}/mlp_res")
    return x


def build_vision(model, opset: int = 17) -> tuple[GraphBuilder, VisionGeometry]:
    """model: a transformers LlavaForConditionalGeneration (float32)."""
    cfg = model.config
    vcfg = cfg.vision_config
    tower = model.model.vision_tower
    tower = getattr(tower, "vision_model", tower)  # CLIPVisionModel / SiglipVisionModel wrap the transformer
    is_clip = hasattr(tower.embeddings, "class_embedding")
    strategy = cfg.vision_feature_select_strategy
    layer = cfg.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError("several vision feature layers are not supported; use one (e.g. -2)")
    n_layers = len(tower.encoder.layers)
    keep = layer if layer >= 0 else n_layers + 1 + layer  # hidden_states[0] is the encoder's input
    S, p, hid = vcfg.image_size, vcfg.patch_size, vcfg.hidden_size
    patches = (S // p) ** 2
    tokens = patches if (strategy == "default" and is_clip) or not is_clip else patches + 1
    if strategy == "default" and not is_clip:
        raise ValueError("vision_feature_select_strategy 'default' drops a CLS token this vision tower does not have")

    g = GraphBuilder("cabinlm_vision", opset=opset)
    emb = tower.embeddings
    x = patch_tokens(g, emb, S, p, hid)  # (N, hid)
    if is_clip:
        x = g.op("Concat", g.weight("class_embedding", _t(emb.class_embedding).reshape(1, hid)), x, axis=0)
    x = g.op("Add", x, g.weight("position_embedding", _t(emb.position_embedding.weight)), name="embeddings")
    if is_clip:
        x = layer_norm(g, x, tower.pre_layrnorm, "pre_layernorm", vcfg.layer_norm_eps)
    x = encoder_layers(g, x, tower.encoder.layers[:keep], vcfg)
    if strategy == "default":
        x = g.op("Slice", x, g.ints([1]), g.ints([patches + 1]), g.ints([0]), name="drop_cls")
    proj = model.model.multi_modal_projector
    x = _activation(g, linear(g, x, proj.linear_1, "projector.1"), "projector/act", cfg.projector_hidden_act)
    x = linear(g, x, proj.linear_2, "projector.2")
    D = cfg.text_config.hidden_size
    g.output(x, IMAGE_EMBEDS, TensorProto.FLOAT, (tokens, D))
    return g, VisionGeometry(image_size=S, patch_size=p, image_tokens=tokens, embed_dim=D)
