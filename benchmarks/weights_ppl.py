"""Perplexity of each weight format against float32 weights (docs/results.md#kv-and-weight-formats).

    python benchmarks/weights_ppl.py TEXT ART [ART ...] [--tokens 4096] [--records FILE]

Chunked perplexity (the artifact's chunk, eviction active past the cache) of the first N tokens of
TEXT through each artifact, with block-quantized weights run both ways: int8 activations (ONNX
Runtime's MatMulNBits accuracy level 4, the default) and float32 activations (level 0). A fused cpu
build (`cabinlm build`) runs once, at the accuracy level it was built with (its manifest says). The
first float32-weights artifact is the reference of the last column. --records FILE appends one
record per row (bench/records.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cabinlm.bench.records import Recorder
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.manifest import load_manifest
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import chunked_perplexity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text", type=Path)
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--records", type=Path, default=None, help="append one record per row to this JSON-lines file")
    a = ap.parse_args()
    rec = Recorder("benchmarks/weights_ppl.py")
    base = None
    print("| artifact | weights | activations | perplexity | vs float32 weights |")
    print("|---|---|---|---:|---:|")
    for art in a.artifacts:
        m = load_manifest(art)
        text = a.text.read_text(encoding="utf-8")
        ids = Tokenizer(art / m.files["tokenizer"].path).encode(text, add_special_tokens=True)[: a.tokens]
        levels = [("float32", None)] if m.weights == "fp32" else [("int8 (level 4)", "4"), ("float32 (level 0)", "0")]
        fused = m.runtime_spec.facts_as(FusedSettings)
        if fused is not None:
            levels = [(f"level {fused.accuracy_level} (built in)", None)]
        for label, level in levels:
            cfg = {"session.qdq_matmulnbits_accuracy_level": level} if level else None
            params = {"weights": m.weights, "activations": label, "tokens": len(ids), "text": a.text.name}
            with rec.run(params, artifact=art, threads=a.threads) as figures:
                ppl = chunked_perplexity(Decoder(art, threads=a.threads, session_config=cfg), ids).ppl
                if base is None and m.weights == "fp32":
                    base = ppl
                figures["ppl"] = round(ppl, 4)
                figures["vs_fp32_pct"] = round((ppl / base - 1) * 100, 3) if base else None
            rel = f"{(ppl / base - 1) * 100:+.2f}%" if base else "—"
            print(f"| {art.name} | {m.weights} | {label} | {ppl:.4f} | {rel} |", flush=True)
    rec.write_to(a.records)


if __name__ == "__main__":
    main()
