"""Top-1 agreement of an HTP build's decode steps, in Qualcomm's x86 HTP simulator, step by step
(docs/results.md#the-htp-in-the-simulator). A simulated decode step of SmolLM2 takes about a minute on
a workstation's CPU, so each step is written to --jsonl as soon as it is done: a run stopped early keeps
what it measured, and the summary line counts the steps actually run. --start N goes on from
step N of an earlier run: the prompt is then the text's first chunk + N tokens, fed in chunks to
both sides alike, and the new steps are appended to --jsonl.

    python benchmarks/htp_decode_top1.py HTP_BUILD --cpu ART --reference FP32_ART \
        --text tests/data/prose.txt [--steps 300] [--start N] --jsonl steps.jsonl [--records FILE]

After a one-chunk prompt, --steps single-token steps teacher-forced on --text run through
  the HTP build's decode graph (the simulator; its timings say nothing about the chip),
  ART, the export the build was made from, on ONNX Runtime's CPU provider (float32 activations),
  FP32_ART, an fp32-weight fp32-KV export of the same model and layout, on the CPU.
Per step: the three top-1 tokens, whether the HTP's equals the CPU's and the reference's, the
correlation of the HTP's logits with the CPU's, and the rank the HTP gives the CPU's top-1.
--records FILE appends, once every step is done, one record of the run: the steps and both
agreements, with the HTP build's provenance (bench/records.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.contract.manifest import load_manifest
from cabinlm.runtime import Decoder, Tokenizer

EXACT = {"session.qdq_matmulnbits_accuracy_level": "0"}

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("build", help="the HTP build (cabinlm build ART --profile sa8775p|sa8295p)")
ap.add_argument("--cpu", required=True, help="the export the build was made from")
ap.add_argument("--reference", required=True, help="an fp32-weight, fp32-KV export of the same model and layout")
ap.add_argument("--text", required=True)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--start", type=int, default=0, help="go on from this step of an earlier run (appends to --jsonl)")
ap.add_argument("--jsonl", required=True, help="one line per decode step, written as it is done")
ap.add_argument("--records", type=Path, default=None, help="append the run's record here when it is done")
a = ap.parse_args()
start, load = utc_now(), load_average()

chunk = load_manifest(a.build).cache.chunk
text = Path(a.text).read_text(encoding="utf-8")
ids = np.asarray(Tokenizer(Path(a.reference) / "tokenizer.json").encode(text, add_special_tokens=True))
first = chunk + a.start  # the first teacher-forced step's position; the prompt is ids[:first]
if ids.size < first + a.steps:
    raise SystemExit(f"{a.text} gives {ids.size} tokens: too few for a {first}-token prompt and --steps {a.steps}")


def cpu_logits(folder: str, **kw) -> np.ndarray:
    dec = Decoder(folder, **kw)
    dec.feed(ids[:first])
    # .copy(): a step's logits are a view of the backend's output buffer, which the next step rewrites
    return np.stack([dec.step(ids[i : i + 1])[0].copy() for i in range(first, first + a.steps)])


cpu = cpu_logits(a.cpu, session_config=EXACT)
ref_tops = cpu_logits(a.reference).argmax(-1)
print(f"CPU steps done ({a.steps}); the simulator's begin", flush=True)

htp = Decoder(a.build)
t0 = time.perf_counter()
htp.feed(ids[:first])
print(f"prompt of {first} tokens in the simulator: {time.perf_counter() - t0:.1f} s", flush=True)
same_cpu = same_ref = 0
with open(a.jsonl, "a" if a.start else "w") as out:
    for n, i in enumerate(range(first, first + a.steps)):
        t0 = time.perf_counter()
        lg = htp.step(ids[i : i + 1])[0].astype(np.float32)
        dt = time.perf_counter() - t0
        top, ctop, rtop = int(lg.argmax()), int(cpu[n].argmax()), int(ref_tops[n])
        same_cpu += top == ctop
        same_ref += top == rtop
        step = {"step": a.start + n, "position": i, "prompt_tokens": first, "htp_top1": top, "cpu_top1": ctop, "reference_top1": rtop,
               "same_as_cpu": top == ctop, "same_as_reference": top == rtop,
               "correlation_with_cpu": round(float(np.corrcoef(lg, cpu[n])[0, 1]), 6),
               "rank_of_cpu_top1": int((lg > lg[ctop]).sum()), "simulator_s": round(dt, 1)}  # fmt: skip
        out.write(json.dumps(step) + "\n")
        out.flush()
        print(f"step {n + 1}/{a.steps}: top-1 as the CPU's {same_cpu}/{n + 1} ({same_cpu / (n + 1):.2%}), "
              f"as the fp32 reference's {same_ref}/{n + 1}; {dt:.0f} s", flush=True)  # fmt: skip
rec = Recorder("benchmarks/htp_decode_top1.py")
rec.add({"export": Path(a.cpu).name, "reference": Path(a.reference).name, "text": Path(a.text).name, "start": a.start,
         "steps": a.steps},
        {"top1_as_cpu": same_cpu / a.steps, "top1_as_reference": same_ref / a.steps, "prompt_tokens": first},
        utc_start=start, loadavg_start=load, artifact=a.build)  # fmt: skip
rec.write_to(a.records)
