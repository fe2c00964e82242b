"""Decode and prefill speed against the peers at several cache sizes (docs/benchmarks.md).

    python benchmarks/speed_vs_peers.py [--threads 2] [--decode 128] ART:CONTEXT [ART:CONTEXT ...]

For each ARTIFACT:CONTEXT pair: cabinlm fills its cache (CONTEXT tokens, eviction running once past
its slots) and decodes DECODE tokens, each timed; every installed peer (transformers, llama.cpp,
onnxruntime-genai in each of its configurations) prefills CONTEXT tokens of the same dialogue and
decodes DECODE tokens, in its own process, with the same thread count. Prints a markdown table and
writes the summaries as JSON next to the first artifact.
"""

import argparse
import json
from pathlib import Path

from cabinlm.bench import baselines as bl
from cabinlm.bench.runner import fixed_context_cabinlm, model_for_baselines
from cabinlm.bench.trace import summarize

ap = argparse.ArgumentParser()
ap.add_argument("pairs", nargs="+")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--decode", type=int, default=128)
ap.add_argument("--peers", default="llama.cpp,ort-genai,hf")
ap.add_argument("--out", default=None)
a = ap.parse_args()

rows = []
for pair in a.pairs:
    art, ctx = pair.rsplit(":", 1)
    ctx = int(ctx)
    s = summarize(fixed_context_cabinlm(art, threads=a.threads, decode=a.decode, context=ctx))
    s["context"] = ctx
    rows.append(s)
    print(f"cabinlm @ {ctx}: decode {s['decode_tok_s']} tok/s, prefill {s['prefill_tok_s']} tok/s", flush=True)
    model = model_for_baselines(Path(art))
    for peer in a.peers.split(","):
        if bl.available(peer):
            print(f"{peer}: {bl.available(peer)}", flush=True)
            continue
        try:
            t = bl.run_fixed_context(peer, model, context=ctx, decode=a.decode, threads=a.threads)
        except bl.BaselineError as e:
            print(f"{peer} @ {ctx}: failed: {str(e).splitlines()[0]}", flush=True)
            continue
        for summ in [summarize(t), *t.config.get("others", [])]:
            if "engine" not in summ:  # a configuration that failed: {"config", "error"}
                continue
            summ["context"] = ctx
            rows.append(summ)
            print(f"{peer} ({summ['config'].get('name')}) @ {ctx}: decode {summ['decode_tok_s']} tok/s, "
                  f"prefill {summ['prefill_tok_s']} tok/s, stopped: {summ['stopped']}", flush=True)

print("\n| engine | configuration | context | decode tok/s (median) | p99 ms | prefill tok/s |")
print("|---|---|---:|---:|---:|---:|")
for r in rows:
    c = r["config"]
    name = f"{c.get('weights')} weights, {c.get('kv')} KV, window {c.get('window')}" if r["engine"] == "cabinlm" else c.get("name")
    print(f"| {r['engine']} | {name} | {r['context']} | {r['decode_tok_s']} | {r['latency_ms_p99']} | {r['prefill_tok_s']} |")
out = Path(a.out or Path(a.pairs[0].rsplit(":", 1)[0]) / "speed_vs_peers.json")
out.write_text(json.dumps(rows, indent=1))
