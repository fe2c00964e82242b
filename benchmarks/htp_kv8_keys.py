"""The HTP's uint8 KV cache (one scale per tensor, zero point 128): which keys to quantize, un-rotated
(as the exported graph caches them; the graph rotates every slot) or rotated (as the fused cpu build
and Qualcomm's own graphs cache them). Perplexity of the model in PyTorch (float32, full causal
attention over the text, no eviction) with its keys and values rounded as each cache would hold them
(docs/architecture.md, "The HTP's 8-bit cache"); "values" rounds the values alone (what the keys add
is the difference):

    python benchmarks/htp_kv8_keys.py smollm2-135m --text tests/data/prose.txt --tokens 512

Scales: the export's calibration (export/calibration.py's default text, export/kvquant.calibrate_kv_amax),
reduced to one per (layer, K or V): the largest channel's absmax / 127, un-rotated keys from the keys'
channels, rotated keys from the rotation pairs' bound (the rotated key's largest possible channel).
A fake quantization in PyTorch, not the HTP: it isolates what the choice of keys costs.
"""

import argparse
import json

import numpy as np
import torch

from cabinlm.export import kvquant
from cabinlm.export.calibration import calibration_tokens
from cabinlm.export.models import load_model
from cabinlm.export.template import resolve_chat_template

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--text", default="tests/data/prose.txt")
ap.add_argument("--tokens", type=int, default=512)
a = ap.parse_args()

loaded = load_model(a.model)
model, layers = loaded.model, loaded.text_model.layers
cfg = model.config
hkv, dh = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
calib, _, source = calibration_tokens(loaded, resolve_chat_template(loaded.tokenizer), None)
stats = kvquant.calibrate_kv_amax(model, layers, calib, hkv, dh)
scale = {k: stats[k].reshape(len(layers), -1).max(axis=1) / 127.0 for k in stats}  # one per layer
ids = loaded.tokenizer(open(a.text).read(), add_special_tokens=True)["input_ids"][: a.tokens]


def fq(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.clamp(torch.round(x / s), -127, 127) * s


mod = __import__(type(layers[0].self_attn).__module__, fromlist=["apply_rotary_pos_emb"])
original_rope = mod.apply_rotary_pos_emb
state = {"mode": None, "layer": 0, "rope_calls": 0}


def rope(q, k, cos, sin, *args, **kw):
    q, k = original_rope(q, k, cos, sin, *args, **kw)
    i = state["layer"]
    state["rope_calls"] += 1
    if state["mode"] == "rotated":
        k = fq(k, float(scale["rotated_keys"][i]))
    return q, k


mod.apply_rotary_pos_emb = rope


def hooks(mode: str):
    handles = []
    for i, layer in enumerate(layers):
        at = layer.self_attn

        def pre(_m, _inp, i=i):
            state["layer"] = i

        def key(_m, _inp, out, i=i):
            return fq(out, float(scale["keys"][i])) if mode == "unrotated" else out

        def value(_m, _inp, out, i=i):
            return fq(out, float(scale["values"][i])) if mode != "fp32" else out

        handles += [at.register_forward_pre_hook(pre), at.k_proj.register_forward_hook(key),
                    at.v_proj.register_forward_hook(value)]  # fmt: skip
    return handles


rows = {}
for mode in ("fp32", "values", "unrotated", "rotated"):  # values: only the values rounded
    state["mode"], state["rope_calls"] = mode, 0
    hs = hooks(mode)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    for h in hs:
        h.remove()
    assert state["rope_calls"] == len(layers), "the rotary function was not the one patched"
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    rows[mode] = {"ppl": round(float(torch.exp(nll)), 4), "top1": logits.argmax(-1)}
ref = rows["fp32"]["top1"]
out = {"model": a.model, "tokens": len(ids), "calibration": f"{source}, {len(calib)} tokens",
       "mean_scale_ratio_rotated_over_unrotated": round(float(np.mean(scale["rotated_keys"] / scale["keys"])), 3)}
for mode, r in rows.items():
    out[mode] = {"ppl": r["ppl"], "vs_fp32": f"{(r['ppl'] / rows['fp32']['ppl'] - 1) * 100:+.2f}%",
                 "top1_agreement": round(float((r["top1"] == ref).float().mean()), 4)}
print(json.dumps(out, indent=1))
