"""Perplexity of each weight format against float32 weights (docs/benchmarks.md).

    python benchmarks/weights_ppl.py TEXT ART [ART ...] [--tokens 4096]

Chunked perplexity (64-token chunks, eviction active past the cache) of the first N tokens of TEXT
through each artifact, with block-quantized weights run both ways: int8 activations (ONNX Runtime's
MatMulNBits accuracy level 4, the default) and float32 activations (level 0). A fused cpu build
(`cabinlm build`) runs once, at the accuracy level it was built with (its manifest's build says).
"""


import argparse

from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import chunked_perplexity
from cabinlm.manifest import load_manifest
from cabinlm.engines.ort_fused.spec import FusedSettings

ap = argparse.ArgumentParser()
ap.add_argument("text")
ap.add_argument("artifacts", nargs="+")
ap.add_argument("--tokens", type=int, default=4096)
a = ap.parse_args()
base = None
print("| artifact | weights | source | activations | perplexity | vs float32 weights |")
print("|---|---|---|---|---:|---:|")
for art in a.artifacts:
    m = load_manifest(art)
    ids = Tokenizer(f"{art}/tokenizer.json").encode(open(a.text, encoding="utf-8").read(), add_special_tokens=True)[: a.tokens]
    src = m.quality.get("weights", {})
    how = f"{src.get('imported', 0)} imported / {src.get('quantized', 0)} quantized" if src else "float32"
    levels = [("float32", None)] if m.weights == "fp32" else [("int8 (level 4)", "4"), ("float32 (level 0)", "0")]
    if m.runtime_spec.facts_as(FusedSettings) is not None:
        fused = m.runtime_spec.facts_as(FusedSettings)
        how = f"fused build, Q4_1 minimums {fused.minimums}"
        levels = [(f"level {fused.accuracy_level} (built in)", None)]
    for label, level in levels:
        cfg = {"session.qdq_matmulnbits_accuracy_level": level} if level else None
        ppl = chunked_perplexity(Decoder(art, threads=2, session_config=cfg), ids).ppl
        if base is None and m.weights == "fp32":
            base = ppl
        rel = f"{(ppl / base - 1) * 100:+.2f}%" if base else "—"
        print(f"| {art} | {m.weights} | {how} | {label} | {ppl:.4f} | {rel} |", flush=True)
