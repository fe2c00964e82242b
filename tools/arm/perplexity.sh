#!/usr/bin/env bash
# SmolLM2-135M's perplexity on the first 64 tokens of a held-out text (tests/data/prose.txt), one
# export built twice: for this machine's CPU (the cpu profile) and for sa8775p's CPU (`--engine cpu`,
# cabinlm's kernels cross-compiled for aarch64, run in the emulated arm64 root of tools/arm/setup.sh).
# The figures docs/arm.md quotes. Correctness only: the emulated run's seconds say nothing about the chip.
#
# Usage: tools/arm/perplexity.sh   (after `make test-arm`, which sets up the root and installs the project)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CABIN=${CABIN:-$REPO/.venv/bin/cabinlm}
CACHE=${CABINLM_CACHE:-$HOME/.cache/cabinlm}/arm64
ROOT=$CACHE/root
WORK=$CACHE/smollm2          # the export and both builds (rebuilt each run)
TOKENS=${TOKENS:-64}

[ -x "$ROOT/opt/v/bin/cabinlm" ] || { echo "no cabinlm in the arm64 root: run \`make test-arm\` first"; exit 1; }
rm -rf "$WORK" "$ROOT/opt/smollm2"
mkdir -p "$WORK"
"$CABIN" export smollm2-135m -o "$WORK/export" --profile cpu --sink 4 --window 124
"$CABIN" build "$WORK/export" --profile cpu -o "$WORK/x86_64"
"$CABIN" build "$WORK/export" --profile sa8775p --engine cpu -o "$WORK/sa8775p"
mkdir -p "$ROOT/opt/smollm2"
cp -r "$WORK/sa8775p" "$ROOT/opt/smollm2/build"
cp "$REPO/tests/data/prose.txt" "$ROOT/opt/smollm2/prose.txt"

echo "x86_64 ($(uname -m), the cpu profile's build):"
"$CABIN" perplexity "$WORK/x86_64" --text "$REPO/tests/data/prose.txt" --max-tokens "$TOKENS" --json
if ! mountpoint -q "$ROOT/proc"; then
  mount -t proc proc "$ROOT/proc"
  trap 'umount "$ROOT/proc"' EXIT
fi
echo "aarch64 under emulation (the sa8775p CPU build):"
start=$(date +%s)
chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/v/bin:/usr/bin:/bin /bin/bash -o pipefail -c \
  "cabinlm perplexity /opt/smollm2/build --text /opt/smollm2/prose.txt --max-tokens $TOKENS --json 2>&1 \
   | grep -v '^Error in cpuinfo\|cpuinfo warning\|cpuinfo_initialize'"
echo "($(( $(date +%s) - start )) s under emulation)"
