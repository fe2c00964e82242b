"""`cabinlm build`: an exported artifact -> what a device profile's engine loads."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Optional

import typer

from cabinlm.contract.engines.fused import AttentionKernel, MatmulKernel, Minimums
from cabinlm.engines.builder import Attention
from cabinlm.cli.common import info, load_profile
from cabinlm.contract.engines.tensorrt import TensorRTSettings


class EngineChoice(str, enum.Enum):
    """--engine: which of the chip's processors the build is for (default: the profile's engine)."""

    CPU = "cpu"  # the chip's application CPU (profiles.cpu_engine): the fused cpu build, kernels for its CPU


def build(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export`."),
    profile: Optional[str] = typer.Option(None, help="Device profile name or .toml file (default: cpu; for a TensorRT "
                                          "bundle, the profile it was made for)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Output folder, outside the export (a build never writes into its input) "
                                     "[default: ARTIFACT-build-PROFILE beside the export]."),
    attention: Attention = typer.Option(
        Attention.AUTO, help="cpu builds: 'fused' re-emits the decoder around ONNX Runtime's GroupQueryAttention and "
        "MatMulNBits kernels (a faster decode step; int8 / fp32 KV, text models); 'graph' keeps the exported "
        "graph; 'auto' fuses where it applies."),
    accuracy_level: int = typer.Option(4, help="Fused cpu builds: activations of the quantized matmuls, 4 = int8 "
                                       "(as llama.cpp computes), 0 = float32 (slower, exact to the weights)."),
    minimums: Minimums = typer.Option(
        Minimums.INT8, help="Fused cpu builds of a GGUF's Q4_1 blocks (4-bit codes plus a block minimum): 'int8' "
        "re-expresses each block as 8-bit codes with an integer zero point, the minimum rounded to 1/34 of the "
        "block's step (a faster decode step, more bytes of weights); 'exact' adds each minimum through "
        "block sums (two more kernels per matrix). Figures: docs/results.md."),
    attention_kernel: AttentionKernel = typer.Option(
        AttentionKernel.AUTO, help="Fused cpu builds: 'cabinlm' computes the attention over the cache with cabinlm's own "
        "kernel (C++, compiled here for the profile's cpu_march and carried by the build: needs g++ or clang++ on "
        "the build machine, none where the build runs; over int8 KV faster than "
        "ONNX Runtime's quantized-cache path, in prefill chunks and in decode steps; over fp32 KV it gives the build "
        "batched graphs for seats decoding together, camera frames included); 'onnxruntime' keeps ONNX Runtime's "
        "GroupQueryAttention; 'auto' takes cabinlm's for int8 KV where a compiler is found (fp32 KV: ONNX Runtime's)."),
    engine: Optional[EngineChoice] = typer.Option(
        None, "--engine", help="'cpu': build for the profile's application CPU instead of its engine (NPU / GPU): the "
        "fused cpu build through ONNX Runtime's CPU provider, cabinlm's kernels compiled for the CPU the profile names "
        "(cpu_arch, cpu_march; an ARM CPU's are cross-compiled with e.g. aarch64-linux-gnu-g++). Default: the profile's "
        "engine."),
    matmul_kernel: MatmulKernel = typer.Option(
        MatmulKernel.AUTO, help="Fused cpu builds of a GGUF's Q4_1 matrices: 'cabinlm' multiplies them with cabinlm's own "
        "kernel, reading the 4-bit codes and minimums as exported (half the bytes of --minimums int8, none of the "
        "rounding; compiled here like the attention kernel for the profile's CPU: AVX-512 VNNI, AVX-VNNI, AVX2 or Arm's "
        "dot product, the same results bit for bit on each, a chunk's rows its one-token steps); 'onnxruntime' keeps "
        "MatMulNBits (as --minimums says); 'auto' takes cabinlm's wherever its library compiles."),
    activations: str = typer.Option(
        "fp16", help="Snapdragon HTP builds: 'fp16' computes the float graph in fp16; 'a16' (experimental: its "
        "perplexity in Qualcomm's simulator is in docs/results.md, \"The HTP in the simulator\"; its speed on a chip "
        "is not measured) compiles a calibrated QDQ graph with "
        "16-bit integer activations, symmetric weight blocks of 32 (--a16-weights) and the uint8 KV cache of rotated keys (needs an --kv int8 "
        "export; HTP v73: sa8775p). docs/architecture.md \"16-bit activations on the HTP\"."),
    a16_weights: str = typer.Option(
        "int8", "--a16-weights", help="--activations a16: the weight matrices as symmetric blocks of 32, 'int8' (w8a16) "
        "or 'int4' (w4a16: int4 codes, the LM head int8 blocks: smaller binaries, more perplexity; nothing ran on an "
        "SA8775P). Figures: docs/results.md, \"The HTP in the simulator\"."),
    calib: Optional[Path] = typer.Option(None, help="--activations a16: calibration text (UTF-8, at least 256 tokens) "
                                         "[default: the built-in prose + in-car dialogue mix, as export's --calib]."),
    adapter: list[str] = typer.Option(
        [], "--adapter", metavar="NAME=DIR[:SCALE]",
        help="An export with --lora-rank: prepare a LoRA adapter (PEFT folder or GGUF LoRA file, scaled by SCALE on "
        "top of its own alpha / r) into the build under NAME, which `cabinlm chat --adapter NAME`, `cabinlm "
        "perplexity --adapter NAME` and serve's model BASE:NAME select. Repeatable. docs/lora.md."),
) -> None:
    """Build an exported artifact for a device: the cpu profile gets the decoder fused and optimized
    offline; Snapdragon targets (sa8295p, sa8775p) get the prefill and decode graphs compiled by
    Qualcomm's compiler into HTP context binaries (needs the `qnn` extra; on x86 they run in
    Qualcomm's HTP simulator); a user's static-shape CPU profile gets a static prefill + decode pair;
    TensorRT targets (orin-x, jetson-*, thor) are checked for TensorRT compatibility and written as a
    target bundle; where TensorRT and a GPU are present the engine is built too. On the target,
    `cabinlm build BUNDLE` builds the bundle's engine (docs/tensorrt.md). `cabinlm chat OUT` runs it."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.engines.tensorrt.builder import TensorRTUnavailable

    prepared = []
    if adapter:  # each adapter read and checked against the export before anything is built
        from cabinlm.contract.manifest import load_manifest as read_manifest
        from cabinlm.export.adapter_files import AdapterRequest, prepare

        requests = [AdapterRequest.parse(a) for a in adapter]
        source = read_manifest(artifact)
        prepared = [prepare(r, source) for r in requests]
    try:
        device = load_profile(profile) if profile else None
        if engine is EngineChoice.CPU:
            from cabinlm.profiles import cpu_engine

            device = cpu_engine(device or load_profile("cpu"))
        path = build_artifact(artifact, device, out, log=info, attention=attention,
                              accuracy_level=accuracy_level, minimums=minimums, attention_kernel=attention_kernel,
                              matmul_kernel=matmul_kernel, activations=activations, calib=calib,
                              a16_weights=a16_weights, adapters=prepared)  # fmt: skip
    except TensorRTUnavailable as e:
        if e.details:  # the compatibility report
            info(e.details)
        raise
    from cabinlm.engines.tensorrt.bundle import finish_instruction
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.contract.engines.tensorrt import EngineState

    built = load_manifest(path, check_files=False).runtime_spec
    trt = built.facts_as(TensorRTSettings)
    if trt is not None and trt.state is EngineState.BUNDLE:  # no TensorRT here: finish on the car
        typer.echo(f"wrote the TensorRT bundle {path}; {finish_instruction(path, trt, built.profile)}")
        return
    typer.echo(f"built {artifact} for {built.profile or profile}: {path} (run it with `cabinlm chat {path}`)")
