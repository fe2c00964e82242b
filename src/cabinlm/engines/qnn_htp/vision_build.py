"""The camera encoder of a vision-language artifact on the HTP: vision.onnx compiled by Qualcomm's
compiler into its own context binary for the profile's chip, beside the decoder's (builder.py).

    vision.onnx ─ compile (fp16, CPU fallback off) ─ vision.ctx.onnx + vision.ctx_qnn.bin
                     │                                   └─ one input in the HTP (x86: its simulator)
                     │                                      against ONNX Runtime's CPU provider
                     └─ a node the HTP rejects, a compiler error, or embeddings that do not follow
                        the CPU's: vision.onnx copied as it is, run on the CPU at run time

The vision graph has fixed shapes already (one frame size per artifact), so it compiles as it was
exported. Its binary holds its own weights (the tower shares none with the decoder), one binary that
the car and the x86 simulator both load. Where the tower runs, and why, is the manifest's
build.qnn.vision (spec.QnnSettings.vision):

    {"runs_on": "htp", "binary": "vision.ctx_qnn.bin", "activations": "fp16", "compile_seconds": 0.1,
     "check": {"relative_error": 0.002, "correlation": 0.99999}}
    {"runs_on": "cpu", "reason": "the HTP (sa8775p: v73) cannot run 1 node(s) of vision.onnx: n/x (Trilu)"}

At run time runtime/vision.open_encoder reads the files: role VISION_CONTEXT present -> the HTP.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import BuildError
from cabinlm.engines.output import BuildOutput
from cabinlm.engines.qnn_htp import plugin as qnn_plugin
from cabinlm.engines.qnn_htp.compile import binary_of, compile_graph, profile_provider

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

VISION_CTX = "vision.ctx.onnx"
VISION_CONTEXT, VISION_BINARY = FileRole.VISION_CONTEXT, FileRole.VISION_CONTEXT_BINARY
# The tower in fp16 against the CPU's fp32: the largest |difference| of the image embeddings over the
# largest |embedding|. Measured on the tiny test towers: 0.1% to 0.4% (benchmarks/vlm_htp.py); a
# tower that overflows fp16 is far off (near-random rows). Beyond this the tower stays on the CPU.
MAX_RELATIVE_ERROR = 0.05


def place_vision(output: BuildOutput, profile: DeviceProfile, log: Callable[[str], None]) -> dict[str, Any]:
    """Compile the artifact's vision tower for the profile's HTP and list its context model and
    binary in output; where it cannot run there, copy vision.onnx for the CPU instead. Returns the
    record for build.qnn.vision (module docstring)."""
    source = output.source
    src = output.artifact / source.files[FileRole.VISION_GRAPH].path
    ctx = output.path(VISION_CTX)
    _remove(ctx)  # an earlier build's: the compiler does not write over a context model
    t = time.perf_counter()
    log(f"compiling the vision tower ({src.name}) for HTP v{profile.htp_arch}, SoC {profile.soc_model} ...")
    try:
        reason, check = None, compile_and_check(src, ctx, profile)
    except BuildError as e:
        reason, check = _reason(str(e)), None
    seconds = round(time.perf_counter() - t, 1)
    if check is not None and not check["relative_error"] <= MAX_RELATIVE_ERROR:
        reason = (f"the compiled tower's image embeddings do not follow the CPU's (largest error "
                  f"{check['relative_error']:.3g} of the largest embedding, more than {MAX_RELATIVE_ERROR}; "
                  "a value overflows fp16)")  # fmt: skip
    if reason is not None:
        _remove(ctx)
        output.copy_if_present(FileRole.VISION_GRAPH, FileRole.VISION_DATA)
        log(f"the vision tower stays on the CPU (ONNX Runtime): {reason}")
        return {"runs_on": "cpu", "reason": reason}
    binary = context_binary(ctx)
    output.add(VISION_CONTEXT, VISION_CTX)
    output.add(VISION_BINARY, binary)
    log(f"  compiled in {seconds:.1f} s: {binary} {output.path(binary).stat().st_size / 1e6:.1f} MB; one input in the "
        f"HTP simulator against the CPU: largest error {check['relative_error']:.2g} of the largest embedding")  # fmt: skip
    return {"runs_on": "htp", "binary": binary, "activations": "fp16", "compile_seconds": seconds, "check": check}


def compile_and_check(src: Path, ctx: Path, profile: DeviceProfile) -> dict[str, float]:
    """Compile src into ctx (+ its binary) with the decoder's compile path, then run one input
    through it on the HTP and through src on the CPU: {relative_error, correlation}."""
    import onnxruntime as ort

    compile_graph(src, ctx, profile, share=False, last=True)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    cpu = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    pixels = check_frame(cpu.get_inputs()[0].shape)
    ref = cpu.run(None, {"pixel_values": pixels})[0].astype(np.float64)
    htp = qnn_plugin.open_context_session(ctx, profile_provider(profile), share=False)
    got = htp.run(None, {"pixel_values": pixels})[0].astype(np.float64)
    if got.shape != ref.shape or not np.isfinite(got).all():
        return {"relative_error": float("inf"), "correlation": 0.0}
    return {"relative_error": round(float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)), 6),
            "correlation": round(float(np.corrcoef(got.ravel(), ref.ravel())[0, 1]), 6)}  # fmt: skip


def check_frame(shape) -> np.ndarray:
    """A fixed random input of the tower's shape ((1, 3, S, S) pixels or Qwen2-VL's (N, 3 * T * p^2)
    patches), uniform in [-1, 1]: the range a frame takes after the processors' normalization (SigLIP's
    exactly, CLIP's and Qwen's within about [-1.8, 2.2])."""
    return np.random.default_rng(0).uniform(-1, 1, [int(d) for d in shape]).astype(np.float32)


def context_binary(ctx: Path) -> str:
    """The binary a compiled context model points at (checked to be EPContext nodes only)."""
    return binary_of(ctx)[0]


def _reason(message: str) -> str:
    """The compiler's complaint without the decoder's advice (compile.HTPRejected: "... CPU fallback is off")."""
    return message.split(". CPU fallback is off")[0]


def _remove(ctx: Path) -> None:
    """A failed or refused compile's context model and binary."""
    if ctx.is_file():
        try:
            (ctx.parent / context_binary(ctx)).unlink(missing_ok=True)
        except Exception:  # noqa: BLE001 - an unreadable half-written model: its binary's usual name below
            pass
        ctx.unlink()
    (ctx.parent / (ctx.stem + "_qnn.bin")).unlink(missing_ok=True)
