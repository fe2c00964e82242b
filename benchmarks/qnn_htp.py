"""Qualcomm HTP builds of one export, measured in Qualcomm's x86 HTP simulator against ONNX Runtime's
CPU provider (docs/benchmarks.md, section 15). The simulator is not the chip: its timings say
nothing about the car's speed and are not reported as such.

    python benchmarks/qnn_htp.py ART [ART ...] --reference FP32_ART --text tests/data/prose.txt \
        [--profiles sa8295p sa8775p] [--tokens 512] [--decode 200] [--json out.json]

For each artifact and profile:
  build     `cabinlm build ART --profile P` under /usr/bin/time -v: wall time, peak host memory
            (the build process's maximum resident set), the context binaries' sizes
  quality   chunked perplexity of the first --tokens tokens of --text (prefill chunks, the same
            semantics as the streamed measure) on the HTP build, on the same artifact on the CPU
            (float32 activations), and on the fp32 reference artifact on the CPU
  decode    --decode single-token steps through the HTP decode graph after a one-chunk prompt,
            teacher-forced on the text, against the same steps on the CPU: top-1 agreement
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cabinlm.manifest import load_manifest
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import chunked_perplexity
from cabinlm.engines.qnn_htp.spec import QnnSettings

EXACT = {"session.qdq_matmulnbits_accuracy_level": "0"}

ap = argparse.ArgumentParser()
ap.add_argument("artifacts", nargs="+")
ap.add_argument("--reference", required=True, help="an fp32-weight, fp32-KV export of the same model and layout")
ap.add_argument("--text", required=True)
ap.add_argument("--profiles", nargs="+", default=["sa8295p", "sa8775p"])
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--decode", type=int, default=200)
ap.add_argument("--out", default="out/qnn-bench")
ap.add_argument("--json")
a = ap.parse_args()

text = Path(a.text).read_text(encoding="utf-8")
ids = np.asarray(Tokenizer(Path(a.reference) / "tokenizer.json").encode(text, add_special_tokens=True)[: a.tokens])
ref = chunked_perplexity(Decoder(a.reference), ids)
print(f"reference {a.reference} (fp32 on the CPU): perplexity {ref.ppl:.3f} over {ref.tokens} tokens", flush=True)
rows = []


def build(art: str, profile: str, out: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "cabinlm", "build", art, "--profile", profile, "-o", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"build failed: {p.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    m = load_manifest(out)
    return {"wall_s": round(wall, 1), "peak_rss_bytes": rss, "binary_bytes": m.quality["build"]["binary_bytes"],
            "weights": m.build.facts_as(QnnSettings).weights, "weight_sharing": m.build.facts_as(QnnSettings).weight_sharing,
            "qairt": m.build.facts_as(QnnSettings).qairt_version, "check": m.build.facts_as(QnnSettings).check}  # fmt: skip


def decode_steps(folder, ids: np.ndarray, prompt: int, steps: int, **kw) -> tuple[np.ndarray, float]:
    if steps == 0:
        return np.zeros(0, np.int64), None
    dec = Decoder(folder, **kw)
    dec.feed(ids[:prompt])
    t0 = time.perf_counter()
    tops = [int(dec.step(ids[i : i + 1])[0].argmax()) for i in range(prompt, prompt + steps)]
    return np.asarray(tops), (time.perf_counter() - t0) / steps


for art in a.artifacts:
    cpu = chunked_perplexity(Decoder(art, session_config=EXACT), ids)
    chunk = load_manifest(art).cache.chunk
    cpu_tops, cpu_step = decode_steps(art, ids, chunk, a.decode, session_config=EXACT)
    for profile in a.profiles:
        out = Path(a.out) / f"{Path(art).name}-{profile}"
        b = build(art, profile, out)
        t0 = time.perf_counter()
        htp = chunked_perplexity(Decoder(out), ids)
        ppl_s = time.perf_counter() - t0
        tops, step_s = decode_steps(out, ids, chunk, a.decode)
        row = {"artifact": art, "profile": profile, **b, "ppl_htp": round(htp.ppl, 3), "ppl_cpu_same_artifact": round(cpu.ppl, 3),
               "ppl_reference_fp32": round(ref.ppl, 3), "tokens": int(ids.size), "decode_steps": a.decode,
               "top1_agreement": round(float((tops == cpu_tops).mean()), 4) if a.decode else None,
               "simulator_prefill_s_per_chunk": round(ppl_s / -(-(ids.size - 1) // chunk), 1),
               "simulator_decode_s_per_token": step_s and round(step_s, 2),
               "cpu_decode_s_per_token": cpu_step and round(cpu_step, 4)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)

print("\n| artifact | profile | weights | build s | peak host memory | binaries | ppl HTP (simulator) | ppl CPU, same artifact | ppl fp32 reference | top-1 agreement |")
print("|---|---|---|---:|---:|---|---:|---:|---:|---:|")
for r in rows:
    bins = ", ".join(f"{n / 1e6:.1f} MB" for n in r["binary_bytes"].values())
    print(f"| {Path(r['artifact']).name} | {r['profile']} | {r['weights']} | {r['wall_s']} | {r['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"| {bins} | {r['ppl_htp']} | {r['ppl_cpu_same_artifact']} | {r['ppl_reference_fp32']} | "
          + (f"{r['top1_agreement']:.1%} over {r['decode_steps']} |" if r["decode_steps"] else "not run |"))  # fmt: skip
if a.json:
    Path(a.json).write_text(json.dumps({"reference_ppl": ref.ppl, "rows": rows}, indent=1))
