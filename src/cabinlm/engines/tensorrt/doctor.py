"""`cabinlm doctor BUNDLE`: the first command on a new board. Checks, in order, each one's outcome
a line of its own; a failed check stops the ones that need it.

    tensorrt   the tensorrt package imports (not just NVIDIA's type stubs); its version and API era
    cuda       the CUDA Python bindings (cuda-bindings, else pycuda) reach the driver
    gpu        GPU 0's name and compute capability
    bundle     the manifest, every file's sha256, and that this TensorRT can build the bundle
    engine     the engine is there for this TensorRT and GPU, or is built now (unless --no-build)
    logits     the engine against ONNX Runtime's CPU run of the same graph, over a short text:
               the same next token at >= MIN_AGREEMENT of the positions and max |logit diff| <= MAX_DIFF

The thresholds are a policy for an fp16 engine against an fp32 reference, not a measurement: no
engine has been compared yet (docs/tensorrt.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.engines.tensorrt import TensorRTSettings

MIN_AGREEMENT = 0.9
MAX_DIFF = 1.0
CHECK_TEXT = ("The driver asked the assistant for the fastest route to the airport, and whether the tunnel on the "
              "ring road was open tonight. ")  # fmt: skip


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "fail" | "skip"
    detail: str

    def line(self) -> str:
        return f"{self.status.upper():<4}  {self.name:<8} {self.detail}"


def diagnose(folder: Path, build: bool = True, report: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Run the checks on `folder` (a TensorRT bundle or engine build); `report` sees each as it ends."""
    from cabinlm.engines.tensorrt.builder import tensorrt_present

    checks: list[Check] = []

    def add(name: str, status: str, detail: str) -> bool:
        c = Check(name, status, detail)
        checks.append(c)
        report(c)
        return status == "ok"

    trt_version = ""
    if tensorrt_present():
        import tensorrt as trt

        trt_version = str(trt.__version__)
        from cabinlm.engines.tensorrt.api import api_era, parse_installed_version

        try:
            era = api_era(parse_installed_version(trt_version)).value
            add("tensorrt", "ok", f"TensorRT {trt_version} ({era} API)")
        except CabinlmError as e:
            add("tensorrt", "fail", str(e))
            trt_version = ""
    else:
        add("tensorrt", "fail", "the tensorrt Python package is not installed (it comes with DRIVE OS / JetPack; "
            "on a Jetson: `sudo apt install python3-libnvinfer`); nothing below can run without it")  # fmt: skip

    gpu = None
    try:
        from cabinlm.engines.tensorrt.cuda_mem import open_cuda

        gpu = open_cuda().info()
        add("cuda", "ok", f"CUDA driver {gpu.driver_version} through {gpu.library}")
        add("gpu", "ok", f"{gpu.name}, compute capability {gpu.compute_capability}, {gpu.total_bytes / 2**30:.1f} GiB")
    except CabinlmError as e:
        add("cuda", "fail", str(e))
        add("gpu", "skip", "no CUDA")

    manifest = None
    try:
        from cabinlm.contract.manifest import load_manifest, verify_checksums

        manifest = load_manifest(folder)
        settings = manifest.runtime_spec.facts_as(TensorRTSettings)
        if settings is None:
            raise CabinlmError(f"{folder} is not a TensorRT build (backend {manifest.runtime_spec.backend.value}); "
                               "make one with `cabinlm build ART --profile orin-x` (or jetson-*, thor)")  # fmt: skip
        verify_checksums(folder, manifest)
        detail = (f"profile {manifest.runtime_spec.profile}, TensorRT {settings.target_version}, {settings.state.value}, "
                  f"{len(manifest.files)} files match their sha256")  # fmt: skip
        if trt_version:
            from cabinlm.engines.tensorrt.api import parse_installed_version
            from cabinlm.engines.tensorrt.engine import effective_era

            era = effective_era(settings.api_era, parse_installed_version(trt_version))
            detail += f"; TensorRT {trt_version} builds it as {era.value}"
        add("bundle", "ok", detail)
    except CabinlmError as e:
        add("bundle", "fail", str(e))
        manifest = None

    if manifest is None or not trt_version or gpu is None:
        add("engine", "skip", "needs TensorRT, a GPU and a valid bundle (above)")
        add("logits", "skip", "needs the engine")
        return checks
    s = manifest.runtime_spec.facts_as(TensorRTSettings)
    assert s is not None
    fresh = s.built_with == trt_version and s.gpu is not None and s.gpu.compute_capability == gpu.compute_capability
    if not fresh:
        if not build:
            add("engine", "fail", f"no engine for TensorRT {trt_version} on SM {gpu.compute_capability}; "
                f"run `cabinlm build {folder}` (or doctor without --no-build)")  # fmt: skip
            add("logits", "skip", "needs the engine")
            return checks
        try:
            from cabinlm.engines.tensorrt.engine import build_engine

            manifest = build_engine(folder, manifest, lambda line: None)
        except CabinlmError as e:
            add("engine", "fail", str(e))
            add("logits", "skip", "needs the engine")
            return checks
    add("engine", "ok", f"{folder / s.engine_file} for TensorRT {trt_version} on {gpu.name}")
    try:
        add(*compare_logits(folder))
    except CabinlmError as e:
        add("logits", "fail", str(e))
    return checks


def compare_logits(folder: Path) -> tuple[str, str, str]:
    """The engine against ONNX Runtime's CPU provider running the bundle's own graph, every position
    of a short text (one prefill chunk at a time, then token by token)."""
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.runtime import Decoder, Tokenizer

    manifest = load_manifest(folder)
    reference = load_manifest(folder)
    reference.build = None  # the same graph file, run as a plain export: ONNX Runtime, CPU provider
    ids = np.asarray(Tokenizer(folder / manifest.files[FileRole.TOKENIZER].path).encode(CHECK_TEXT * 2, add_special_tokens=True)[:64])
    half = len(ids) // 2
    got_dec, ref_dec = Decoder(folder, manifest), Decoder(folder, reference)
    got = [got_dec.feed(ids[:half], all_logits=True).copy()]
    ref = [ref_dec.feed(ids[:half], all_logits=True).copy()]
    for t in ids[half:]:  # the decode profile
        got.append(got_dec.step(np.array([t]))[0][None].copy())
        ref.append(ref_dec.step(np.array([t]))[0][None].copy())
    g, r = np.concatenate(got), np.concatenate(ref)
    agreement = float((g.argmax(-1) == r.argmax(-1)).mean())
    diff = float(np.abs(g - r).max())
    ok = agreement >= MIN_AGREEMENT and diff <= MAX_DIFF
    detail = (f"{len(ids)} tokens ({half} as one prefill chunk, the rest one by one): the same next token at "
              f"{agreement:.0%} of positions (need {MIN_AGREEMENT:.0%}), max |logit diff| {diff:.3g} (need <= {MAX_DIFF})")  # fmt: skip
    return "logits", "ok" if ok else "fail", detail
