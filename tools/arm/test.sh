#!/usr/bin/env bash
# `make test-arm`: cabinlm's kernels and the fused cpu engine on aarch64, under emulation.
#
#   1. tools/arm/setup.sh          the emulated arm64 Debian with the runtime's aarch64 wheels (cached)
#   2. the project                 src/, tests/ and pyproject.toml of this working tree, installed
#                                  into the root's venv (pip, no dependencies: the wheels are there)
#   3. the build machine (x86_64)  tests/test_arm.py: the sa8775p CPU build (`cabinlm build --engine
#                                  cpu`, kernels cross-compiled), the streaming reference's logits and
#                                  the NEON / plain C++ libraries, handed over in ROOT/opt/exchange
#   4. aarch64, emulated           tests/test_arm.py (the NEON path asserted, NEON vs plain C++ and the
#                                  block arithmetic, the build vs the reference), tests/test_kernels.py's
#                                  kernel tests on the NEON library (those that need no compiler or torch)
#                                  and tests/test_kernel_steps.py (a verified chunk's rows as steps);
#                                  tests/test_grammar.py (llguidance's masks: tool calls, JSON replies)
#
# Correctness only: emulation is tens of times slower than the chip and says nothing about its speed.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
CACHE=${CABINLM_CACHE:-$HOME/.cache/cabinlm}/arm64
ROOT=$CACHE/root
SRC=/opt/cabinlm      # the project inside the root
EXCHANGE=/opt/exchange

"$HERE/setup.sh" "$PY"

echo "test-arm: installing the project into $ROOT$SRC"
rm -rf "$ROOT$SRC"
mkdir -p "$ROOT$SRC"
(cd "$REPO" && tar --exclude=__pycache__ --exclude='*.egg-info' -cf - pyproject.toml README.md src tests) \
  | tar -C "$ROOT$SRC" -xf -
chroot "$ROOT" /opt/v/bin/pip install --quiet --no-deps --no-index --find-links /opt/wheels --no-build-isolation "$SRC" \
  2>&1 | grep -v "is ignored" || true
chroot "$ROOT" /opt/v/bin/python -c "import cabinlm.runtime" >/dev/null 2>&1 \
  || { echo "test-arm: the project does not import in the arm64 root"; exit 1; }

echo "test-arm: the build machine cross-compiles and hands over (tests/test_arm.py, $(uname -m))"
(cd "$REPO" && CABINLM_ARM_EXCHANGE="$ROOT$EXCHANGE" "$PY" -m pytest -q -p no:cacheprovider tests/test_arm.py)

echo "test-arm: under emulation (aarch64, qemu-user)"
# /proc mounted (ONNX Runtime opens external weights through /proc/self/fd; its /proc/cpuinfo is the
# host's, whose x86 flags the runtime's CPU check does not read for aarch64), never /sys (ONNX
# Runtime's cpuinfo crashes on the host's /sys under qemu; without it, it only warns).
# PYTHONDONTWRITEBYTECODE: the copy stays as copied.
if ! mountpoint -q "$ROOT/proc"; then
  mount -t proc proc "$ROOT/proc"
  trap 'umount "$ROOT/proc"' EXIT
fi
chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/v/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1 \
  CABINLM_ARM_EXCHANGE=$EXCHANGE CABINLM_TEST_KERNEL_LIBRARY=$EXCHANGE/neon/libcabinlm_kernels.so \
  /bin/bash -o pipefail -c "cd $SRC && python -m pytest -v -p no:cacheprovider -W ignore::pytest.PytestUnraisableExceptionWarning \
    tests/test_arm.py tests/test_kernels.py tests/test_kernel_steps.py tests/test_block_q8.py tests/test_lora_kernel.py tests/test_grammar.py --deselect 'tests/test_kernels.py::test_block_q4_matmul_computes_the_q4_1_product[generic]' \
    --deselect 'tests/test_block_q8.py::test_block_q8_matmul_computes_the_int8_block_product[generic]' \
    --deselect tests/test_block_q8.py::test_the_smollm2_build_runs_its_head_in_every_graph_and_gathers_the_embedding_from_its_tiles \
    --deselect tests/test_kernels.py::test_int8_builds_take_the_kernel_and_fall_back_where_it_cannot_be_had \
    --deselect tests/test_kernels.py::test_smollm2_q4_1_builds_take_the_matmul_kernel 2>&1 | grep -v '^Error in cpuinfo\|cpuinfo warning\|cpuinfo_initialize'"
