"""Idefics3 and SmolVLM (transformers' Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration):
the SigLIP-style vision tower, the pixel shuffle and the connector's projection as a fixed-shape
graph for one square frame (the processor without image splitting: source/processor.py).

    pixel_values (1, 3, S, S) ─ Conv patch p, stride p (+bias) ─ (N, E), N = (S/p)^2
    ─ + position rows (constant: the rows the tower's bucketed position ids pick for this frame)
    ─ L x [ LayerNorm ─ q k v ─ softmax(q k^T / sqrt(hd)) v over all N patches ─ out_proj ─ + x
            ─ LayerNorm ─ fc1 ─ gelu (tanh) ─ fc2 ─ + x ]          (export/vision.py encoder_layers)
    ─ post LayerNorm
    ─ pixel shuffle, r = scale_factor (the patch grid g x g, g = S/p):
        (g, g/r, E r) ─ Transpose 1,0,2 ─ (g/r, g/r, E r^2) ─ Transpose 1,0,2 ─ (I, E r^2), I = (g/r)^2
    ─ MatMul (modality_projection, no bias) ─ image_embeds (I, D)

The decoder is the text model's (Llama: SmolLM2, Llama 3), with ranks as positions; the image tokens
sit in the pinned image region like LLaVA's, between <fake_token_around_image><global-img> and
<fake_token_around_image> (VisionSpec.image_prefix / image_suffix), as the processor expands one image.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from cabinlm.contract.errors import ModelError
from cabinlm.export.graph import GraphBuilder
from cabinlm.source.processor import IDEFICS3_IMAGE_PREFIX, IDEFICS3_IMAGE_SUFFIX, Idefics3Processor
from cabinlm.export.vision import IMAGE_EMBEDS, _t, encoder_layers, layer_norm, patch_tokens

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


@dataclass(frozen=True)
class Idefics3Geometry:
    image_size: int  # the square frame's side
    patch_size: int
    image_tokens: int
    embed_dim: int


def position_rows(embeddings, side: int) -> np.ndarray:
    """(N,) int64: the position-embedding row of each patch of a side x side frame with no padding,
    computed by the tower's own bucketing (Idefics3VisionEmbeddings: fractional coordinates of the
    patch grid bucketed into num_patches_per_side^2 positions; 0 .. N-1 when the frame is the tower's
    image_size)."""
    import torch

    grid = side // embeddings.patch_size
    per_side = embeddings.num_patches_per_side
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    frac = torch.clamp(torch.arange(grid, dtype=torch.float32) * (1.0 / torch.tensor(float(grid))), max=1.0 - 1e-6)
    bucket = torch.bucketize(frac, boundaries, right=True)
    return (bucket[:, None] * per_side + bucket[None, :]).reshape(-1).numpy().astype(np.int64)


def build_idefics3_vision(model, proc: Idefics3Processor, opset: int = 17) -> tuple[GraphBuilder, Idefics3Geometry]:
    """model: a transformers Idefics3ForConditionalGeneration or SmolVLMForConditionalGeneration (float32)."""
    cfg = model.config
    vcfg = cfg.vision_config
    tower, connector = model.model.vision_model, model.model.connector
    S, p, r, E = proc.frame, proc.patch, proc.scale, vcfg.hidden_size
    if p != vcfg.patch_size or r != cfg.scale_factor:
        raise ModelError(f"the processor was read for patch {p} / scale {r}, the model has {vcfg.patch_size} / {cfg.scale_factor}")
    grid = S // p
    I, D = proc.image_tokens, cfg.text_config.hidden_size

    g = GraphBuilder("cabinlm_vision", opset=opset)
    emb = tower.embeddings
    x = patch_tokens(g, emb, S, p, E)  # (N, E) row-major, N = grid^2
    rows = _t(emb.position_embedding.weight)[position_rows(emb, S)]
    x = g.op("Add", x, g.weight("position_embedding", np.ascontiguousarray(rows)), name="embeddings")
    x = encoder_layers(g, x, tower.encoder.layers, vcfg)
    x = layer_norm(g, x, tower.post_layernorm, "post_layernorm", vcfg.layer_norm_eps)
    # Idefics3Connector.pixel_shuffle for one image, the batch dimension dropped
    x = g.op("Reshape", x, g.ints([grid, grid // r, E * r]), name="shuffle/cols")
    x = g.op("Transpose", x, perm=[1, 0, 2], name="shuffle/t1")
    x = g.op("Reshape", x, g.ints([grid // r, grid // r, E * r * r]), name="shuffle/rows")
    x = g.op("Transpose", x, perm=[1, 0, 2], name="shuffle/t2")
    x = g.op("Reshape", x, g.ints([I, E * r * r]), name="shuffle")
    proj = connector.modality_projection.proj
    x = g.op("MatMul", x, g.weight("connector.weight", np.ascontiguousarray(_t(proj.weight).T)), name="connector")
    if proj.bias is not None:
        x = g.op("Add", x, g.weight("connector.bias", _t(proj.bias)), name="connector/bias")
    g.output(x, IMAGE_EMBEDS, TensorProto.FLOAT, (I, D))
    return g, Idefics3Geometry(image_size=S, patch_size=p, image_tokens=I, embed_dim=D)


def image_wrapping(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids Idefics3's processor writes before and after one image's <image> tokens, as the
    model's tokenizer encodes them: <fake_token_around_image><global-img> and <fake_token_around_image>.
    Both sit between special tokens in the processor's text, so encoding them alone gives its ids."""
    tok = tokenizer.backend_tokenizer
    prefix = tuple(tok.encode(IDEFICS3_IMAGE_PREFIX, add_special_tokens=False).ids)
    suffix = tuple(tok.encode(IDEFICS3_IMAGE_SUFFIX, add_special_tokens=False).ids)
    if len(suffix) != 1 or prefix[:1] != suffix:
        raise ModelError(f"the tokenizer has no single token {IDEFICS3_IMAGE_SUFFIX} (it encodes it as {list(suffix)}); "
                         "an Idefics3 / SmolVLM folder's tokenizer holds it: save the model's processor with it")  # fmt: skip
    return prefix, suffix
