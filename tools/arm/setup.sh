#!/usr/bin/env bash
# The emulated arm64 environment `make test-arm` runs in, set up once and cached (idempotent: each
# step is skipped when its result is there). Correctness only: emulation says nothing about speed.
#
#   the host       qemu-user-static (runs aarch64 code), g++-aarch64-linux-gnu (cabinlm build's cross
#                  compiler for ARM profiles), debootstrap: Debian packages, through apt
#   binfmt_misc    aarch64 ELF files run through /usr/bin/qemu-aarch64-static (flag F: the
#                  interpreter is opened now, so it also runs inside the chroot)
#   ROOT           a minimal arm64 Debian bookworm (Python 3.11), under $CABINLM_CACHE/arm64
#   ROOT/opt/v     a venv with PyPI's aarch64 wheels of the runtime's packages and pytest (downloaded
#                  here by the host's pip, installed there offline: pip resolves nothing under emulation)
#
# Usage: tools/arm/setup.sh [PYTHON]   (PYTHON: the host venv's python, for `pip download`)
# Needs root (apt, debootstrap, binfmt_misc, chroot). Takes about 5 minutes the first time.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${1:-$REPO/.venv/bin/python}
CACHE=${CABINLM_CACHE:-$HOME/.cache/cabinlm}/arm64
ROOT=$CACHE/root
WHEELS=$CACHE/wheels
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The runtime's packages at the versions the project pins (constraints.txt), and what the tests import.
PACKAGES=(onnxruntime numpy onnx tokenizers typer Pillow llguidance jsonschema pytest)

say() { echo "test-arm setup: $*"; }

missing=()
for tool in qemu-aarch64-static:qemu-user-static aarch64-linux-gnu-g++:g++-aarch64-linux-gnu debootstrap:debootstrap; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
done
if ((${#missing[@]})); then
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  say "registering qemu-aarch64-static for aarch64 ELF files (binfmt_misc)"
  printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
    > /proc/sys/fs/binfmt_misc/register
fi

if [ ! -e "$ROOT/.cabinlm-rootfs" ]; then
  say "debootstrap arm64 bookworm into $ROOT (about 3 minutes)"
  rm -rf "$ROOT"
  mkdir -p "$ROOT"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv bookworm "$ROOT" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -5 "$CACHE/debootstrap.log"; exit 1; }
  touch "$ROOT/.cabinlm-rootfs"
fi

stamp=$ROOT/opt/v/.installed
want="$(grep -E "^($(IFS='|'; echo "${PACKAGES[*]}"))==" "$REPO/constraints.txt" | sort | tr '\n' ' ')setuptools>=77"
if [ ! -e "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "aarch64 wheels: $want"
  "$PY" -m pip download --quiet --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 --platform manylinux_2_26_aarch64 \
    --platform manylinux2014_aarch64 --platform any -c "$REPO/constraints.txt" -d "$WHEELS" "${PACKAGES[@]}" \
    2>&1 | grep -v "is ignored" || true
  # what installs the project itself there (pip --no-build-isolation; pyproject.toml asks setuptools>=68; its SPDX licence string, >=77)
  "$PY" -m pip download --quiet --only-binary=:all: --no-deps -d "$WHEELS" "setuptools>=77" 2>&1 | grep -v "is ignored" || true
  rm -rf "$ROOT/opt/v" "$ROOT/opt/wheels"
  cp -r "$WHEELS" "$ROOT/opt/wheels"
  chroot "$ROOT" /usr/bin/python3 -m venv /opt/v
  chroot "$ROOT" /opt/v/bin/pip install --quiet --no-index --find-links /opt/wheels "${PACKAGES[@]}" "setuptools>=77"
  echo "$want" > "$stamp"
fi
say "ready: $ROOT ($(chroot "$ROOT" /opt/v/bin/python -c 'import onnxruntime, platform; print(platform.machine(), "onnxruntime", onnxruntime.__version__)' 2>/dev/null))"
