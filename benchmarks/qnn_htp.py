"""Qualcomm HTP builds of one export, measured in Qualcomm's x86 HTP simulator against ONNX Runtime's
CPU provider (docs/results.md#the-htp-in-the-simulator). The simulator is not the chip: its timings say
nothing about the car's speed and are not reported as such.

    python benchmarks/qnn_htp.py ART [ART ...] --reference FP32_ART --text tests/data/prose.txt \
        [--profiles sa8295p sa8775p] [--tokens 512] [--decode 200] [--records FILE] \
        [--reuse] [--skip-ppl] [--decode-seconds S]

For each artifact and profile:
  build     `cabinlm build ART --profile P` under /usr/bin/time -v: wall time, peak host memory
            (the build process's maximum resident set), the context binaries' sizes. --reuse: a
            build already in --out is used as it is (its manifest's compile time and peak memory)
  quality   chunked perplexity of the first --tokens tokens of --text (prefill chunks, the same
            semantics as the streamed measure) on the HTP build, on the same artifact on the CPU
            (float32 activations), and on the fp32 reference artifact on the CPU; top-1 agreement of
            those teacher-forced positions (the prefill binary) with the reference's
  decode    --decode single-token steps through the HTP decode graph after a one-chunk prompt,
            teacher-forced on the text, against the same steps on the CPU (the same artifact, and
            the fp32 reference): top-1 agreement. --decode-seconds: the HTP's steps stop after S
            seconds (prompt included) and the steps done are compared; --skip-ppl: decode only
  between   every two rows' HTP builds (e.g. the 8-bit-KV and the fp16-KV builds of one model, given
            as two artifacts): top-1 agreement of their prefill positions and decode steps

--records FILE appends one record per artifact and profile (the HTP build's provenance; bench/records.py).
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

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder, flat
from cabinlm.contract.manifest import load_manifest
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import token_nll
from cabinlm.contract.engines.qnn import QnnSettings

EXACT = {"session.qdq_matmulnbits_accuracy_level": "0"}

ap = argparse.ArgumentParser()
ap.add_argument("artifacts", nargs="+")
ap.add_argument("--reference", required=True, help="an fp32-weight, fp32-KV export of the same model and layout")
ap.add_argument("--text", required=True)
ap.add_argument("--profiles", nargs="+", default=["sa8295p", "sa8775p"])
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--decode", type=int, default=200)
ap.add_argument("--out", default="out/qnn-bench")
ap.add_argument("--records", type=Path, default=None, help="append one record per artifact and profile here")
ap.add_argument("--reuse", action="store_true", help="use a build already under --out instead of building")
ap.add_argument("--decode-seconds", type=float, help="stop the HTP's decode steps after this long (the steps done are compared)")
ap.add_argument("--skip-ppl", action="store_true", help="no perplexity / prefill-position pass on the HTP builds")
a = ap.parse_args()

text = Path(a.text).read_text(encoding="utf-8")
ids = np.asarray(Tokenizer(Path(a.reference) / "tokenizer.json").encode(text, add_special_tokens=True)[: a.tokens])
if a.decode and ids.size < load_manifest(a.reference).cache.chunk + a.decode:
    raise SystemExit(f"--tokens {a.tokens} gives {ids.size} tokens: too few for a one-chunk prompt and --decode {a.decode} steps")


def quality(folder, **kw) -> tuple[float, np.ndarray]:
    """chunked perplexity (runtime/perplexity.chunked_perplexity's measure) and the top-1 token of every position"""
    dec = Decoder(folder, **kw)
    logits = dec.feed(ids[:-1], all_logits=True)
    nll = np.array([token_nll(logits[i], int(ids[i + 1])) for i in range(ids.size - 1)])
    return float(np.exp(nll.mean())), logits.argmax(-1)


ref_ppl, ref_prefill_tops = quality(a.reference)
print(f"reference {a.reference} (fp32 on the CPU): perplexity {ref_ppl:.3f} over {ids.size} tokens", flush=True)
rows = []
rec = Recorder("benchmarks/qnn_htp.py")


def build(art: str, profile: str, out: Path) -> dict:
    if a.reuse and (out / "manifest.json").exists():
        m = load_manifest(out)
        q = m.build.facts_as(QnnSettings)
        return {"wall_s": None, "compile_s": q.compile_seconds, "peak_rss_bytes": q.peak_host_bytes, "reused": True,
                "binary_bytes": m.quality.build["binary_bytes"], "weights": q.weights, "weight_sharing": q.weight_sharing,
                "qairt": q.qairt_version, "check": q.check}  # fmt: skip
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "cabinlm", "build", art, "--profile", profile, "-o", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"build failed: {p.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    m = load_manifest(out)
    return {"wall_s": round(wall, 1), "peak_rss_bytes": rss, "binary_bytes": m.quality.build["binary_bytes"],
            "weights": m.build.facts_as(QnnSettings).weights, "weight_sharing": m.build.facts_as(QnnSettings).weight_sharing,
            "qairt": m.build.facts_as(QnnSettings).qairt_version, "check": m.build.facts_as(QnnSettings).check}  # fmt: skip


def decode_steps(folder, ids: np.ndarray, prompt: int, steps: int, budget: float | None = None, **kw) -> tuple[np.ndarray, float]:
    if steps == 0:
        return np.zeros(0, np.int64), None
    dec = Decoder(folder, **kw)
    start = time.perf_counter()
    dec.feed(ids[:prompt])
    t0 = time.perf_counter()
    tops = []
    for i in range(prompt, prompt + steps):
        tops.append(int(dec.step(ids[i : i + 1])[0].argmax()))
        if budget is not None and time.perf_counter() - start > budget:
            break
    return np.asarray(tops), (time.perf_counter() - t0) / len(tops)


def agree(x: np.ndarray, y: np.ndarray) -> float | None:
    return round(float((np.asarray(x) == np.asarray(y)).mean()), 4) if len(x) else None


chunk = load_manifest(a.reference).cache.chunk
ref_tops, _ = decode_steps(a.reference, ids, chunk, a.decode)
for art in a.artifacts:
    cpu_ppl = float("nan") if a.skip_ppl else quality(art, session_config=EXACT)[0]
    chunk = load_manifest(art).cache.chunk
    cpu_tops, cpu_step = decode_steps(art, ids, chunk, a.decode, session_config=EXACT)
    for profile in a.profiles:
        out = Path(a.out) / f"{Path(art).name}-{profile}"
        start, load = utc_now(), load_average()
        b = build(art, profile, out)
        t0 = time.perf_counter()
        htp_ppl, prefill_tops = (float("nan"), np.zeros(0, np.int64)) if a.skip_ppl else quality(out)
        ppl_s = time.perf_counter() - t0
        tops, step_s = decode_steps(out, ids, chunk, a.decode, a.decode_seconds)
        row = {"artifact": art, "profile": profile, **b,
               "ppl_htp": None if a.skip_ppl else round(htp_ppl, 3), "ppl_cpu_same_artifact": None if a.skip_ppl else round(cpu_ppl, 3),
               "ppl_reference_fp32": round(ref_ppl, 3), "tokens": int(ids.size), "decode_steps": a.decode,
               "decode_steps_run": len(tops),
               "top1_agreement": agree(tops, cpu_tops[: len(tops)]), "top1_vs_reference_fp32": agree(tops, ref_tops[: len(tops)]),
               "prefill_positions": int(ids.size - 1), "prefill_top1_vs_reference_fp32": agree(prefill_tops, ref_prefill_tops),
               "simulator_prefill_s_per_chunk": round(ppl_s / -(-(ids.size - 1) // chunk), 1),
               "simulator_decode_s_per_token": step_s and round(step_s, 2),
               "cpu_decode_s_per_token": cpu_step and round(cpu_step, 4),
               "decode_tops": tops.tolist(), "prefill_tops": prefill_tops.tolist()}  # fmt: skip
        rows.append(row)
        rec.add({"profile": profile, "export": Path(art).name, "text": Path(a.text).name, "tokens": int(ids.size),
                 "decode": a.decode, "reference": Path(a.reference).name},
                {k: v for k, v in flat(row).items() if k not in ("artifact", "profile", "tokens", "decode_steps")},
                utc_start=start, loadavg_start=load, artifact=out)  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_tops")}), flush=True)

between = []
for i, r in enumerate(rows):
    for o in rows[i + 1 :]:
        between.append({"rows": [f"{Path(x['artifact']).name}-{x['profile']}" for x in (r, o)],
                        "prefill_top1": agree(r["prefill_tops"], o["prefill_tops"]) if len(r["prefill_tops"]) == len(o["prefill_tops"]) else None,
                        "decode_top1": agree(*(t[: min(len(r["decode_tops"]), len(o["decode_tops"]))] for t in (r["decode_tops"], o["decode_tops"])))})  # fmt: skip
        print(json.dumps(between[-1]), flush=True)
print("\n| artifact | profile | weights | build s | peak host memory | binaries | ppl HTP (simulator) | ppl CPU, same artifact | ppl fp32 reference | top-1 agreement |")
print("|---|---|---|---:|---:|---|---:|---:|---:|---:|")
for r in rows:
    bins = ", ".join(f"{n / 1e6:.1f} MB" for n in r["binary_bytes"].values())
    print(f"| {Path(r['artifact']).name} | {r['profile']} | {r['weights']} | {r['wall_s']} | {r['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"| {bins} | {r['ppl_htp']} | {r['ppl_cpu_same_artifact']} | {r['ppl_reference_fp32']} | "
          + (f"{r['top1_agreement']:.1%} over {r['decode_steps_run']} |" if r["decode_steps"] else "not run |"))  # fmt: skip
rec.write_to(a.records)
