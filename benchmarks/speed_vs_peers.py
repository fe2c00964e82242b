"""Decode and prefill speed against the peers at several cache sizes (docs/results.md#speed-against-the-peers,
and #gemma-3 for Gemma 3 builds).

    python benchmarks/speed_vs_peers.py [--threads 2] [--decode 128] ART:CONTEXT [ART:CONTEXT ...] [--records FILE]

For each ARTIFACT:CONTEXT pair: cabinlm fills its cache (CONTEXT tokens, eviction running once past
its slots) and decodes DECODE tokens, each timed; every installed peer (transformers, llama.cpp,
onnxruntime-genai in each of its configurations) prefills CONTEXT tokens of the same dialogue and
decodes DECODE tokens, in its own process, with the same thread count. Prints a markdown table;
--records FILE appends one record per engine, configuration and context (bench/records.py).
"""

import argparse
from pathlib import Path

from cabinlm.bench import baselines as bl
from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.bench.rounds import figures
from cabinlm.bench.runner import fixed_context_cabinlm, model_for_baselines
from cabinlm.bench.trace import summarize

ap = argparse.ArgumentParser()
ap.add_argument("pairs", nargs="+")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--decode", type=int, default=128)
ap.add_argument("--peers", default="llama.cpp,ort-genai,hf")
ap.add_argument("--records", type=Path, default=None, help="append one record per engine and context here")
a = ap.parse_args()

rec = Recorder("benchmarks/speed_vs_peers.py")
rows = []
for pair in a.pairs:
    art, ctx = pair.rsplit(":", 1)
    ctx = int(ctx)
    start, load = utc_now(), load_average()
    trace = fixed_context_cabinlm(art, threads=a.threads, decode=a.decode, context=ctx)
    rec.add({"runner": "cabinlm", "context": ctx, "decode": a.decode}, figures(trace), utc_start=start,
            loadavg_start=load, artifact=art, threads=a.threads)  # fmt: skip
    s = summarize(trace)
    s["context"] = ctx
    rows.append(s)
    print(f"cabinlm @ {ctx}: decode {s['decode_tok_s']} tok/s, prefill {s['prefill_tok_s']} tok/s", flush=True)
    model = model_for_baselines(Path(art))
    for peer in a.peers.split(","):
        if bl.available(peer):
            print(f"{peer}: {bl.available(peer)}", flush=True)
            continue
        start, load = utc_now(), load_average()
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
            rec.add({"runner": peer, "config": summ["config"].get("name"), "context": ctx, "decode": a.decode},
                    {k: v for k, v in summ.items() if k not in ("engine", "config")}, utc_start=start,
                    loadavg_start=load, engine=peer, threads=a.threads)  # fmt: skip
            print(f"{peer} ({summ['config'].get('name')}) @ {ctx}: decode {summ['decode_tok_s']} tok/s, "
                  f"prefill {summ['prefill_tok_s']} tok/s, stopped: {summ['stopped']}", flush=True)

print("\n| engine | configuration | context | decode tok/s (median) | p99 ms | prefill tok/s |")
print("|---|---|---:|---:|---:|---:|")
for r in rows:
    c = r["config"]
    name = f"{c.get('weights')} weights, {c.get('kv')} KV, window {c.get('window')}" if r["engine"] == "cabinlm" else c.get("name")
    print(f"| {r['engine']} | {name} | {r['context']} | {r['decode_tok_s']} | {r['latency_ms_p99']} | {r['prefill_tok_s']} |")
rec.write_to(a.records)
