"""`cabinlm doctor`: on a new board, check TensorRT, CUDA, the GPU and a TensorRT bundle, build its
engine, and compare the engine's logits with ONNX Runtime on the CPU (engines/tensorrt/doctor.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from cabinlm.cli.common import info


def doctor(
    bundle: Path = typer.Argument(..., help="A TensorRT bundle or build (`cabinlm build ART --profile orin-x` wrote it)."),
    build: bool = typer.Option(True, "--build/--no-build", help="Build the engine here when it is missing or was built "
                               "for another TensorRT or GPU (minutes on a Jetson / DRIVE board)."),
) -> None:
    """The first command on a new NVIDIA board: checks TensorRT, CUDA, the GPU and the bundle (every
    file's sha256), builds the engine if needed, then runs the engine and ONNX Runtime (CPU) over the
    same graph on a short text and compares the logits. One line per check; exit 1 if any fails.

      cabinlm doctor smol-build-orin-x       # on the board, after copying the bundle there
    """
    from cabinlm.engines.tensorrt.doctor import diagnose

    checks = diagnose(bundle, build=build, report=lambda c: info(c.line()))
    failed = [c.name for c in checks if c.status == "fail"]
    if failed:
        info(f"doctor: {len(failed)} check(s) failed ({', '.join(failed)}); fix the first one and run it again")
        raise typer.Exit(1)
    info("doctor: every check passed")
