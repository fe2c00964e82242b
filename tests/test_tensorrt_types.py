"""Every TensorRT call of the builder and the backend names a real method with the right arguments:
mypy against NVIDIA's tensorrt-stubs 10.13 (the only TensorRT this project can have; nothing here
runs TensorRT). Three steps make the stubs count: copy `tensorrt/` and
`tensorrt_bindings/` onto MYPYPATH (no py.typed in site-packages), fix the two generated lines that
are not Python, and count only the errors in our files. Canaries prove the stubs are in effect: a
method TensorRT does not have, and a call of ours broken on purpose, must both be reported."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
CHECKED = [  # the modules that call TensorRT or CUDA, and the host-side ones they use
    "cabinlm/engines/tensorrt/engine.py", "cabinlm/engines/tensorrt/api.py", "cabinlm/engines/tensorrt/builder.py",
    "cabinlm/engines/tensorrt/bundle.py", "cabinlm/engines/tensorrt/graph.py", "cabinlm/engines/tensorrt/doctor.py",
    "cabinlm/engines/tensorrt/backend.py", "cabinlm/engines/tensorrt/cuda_mem.py",
    "cabinlm/engines/tensorrt/device_plan.py", "cabinlm/contract/engines/tensorrt.py",
]  # fmt: skip


def _stub_dir() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_stubs")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory):
    site = _stub_dir()
    if site is None or not (site / "tensorrt_bindings" / "tensorrt.pyi").exists():
        assert not os.environ.get("CI"), "CI runs `make test`, which installs tensorrt-stubs: the type check must run"
        pytest.skip("tensorrt-stubs==10.13.0.35.1 is not installed (`make setup` installs it with --no-deps)")
    if importlib.util.find_spec("mypy") is None:
        assert not os.environ.get("CI"), "CI installs mypy (the dev extra): the type check must run"
        pytest.skip("mypy is not installed (the dev extra)")
    tmp = tmp_path_factory.mktemp("mypy")
    stubs = tmp / "stubs"
    for package in ("tensorrt", "tensorrt_bindings"):
        shutil.copytree(site / package, stubs / package)
    bindings = stubs / "tensorrt_bindings" / "tensorrt.pyi"
    text = bindings.read_text()
    fixed = re.sub(r"(?<=[(,] )in(?=: )", "in_", text)  # parameters named `in`
    fixed = fixed.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
    assert fixed != text, "the stub lines this test fixes were not found: another tensorrt-stubs version?"
    bindings.write_text(fixed)
    canary = tmp / "canary.py"
    canary.write_text("import tensorrt as trt\n\ntrt.Builder(trt.Logger()).no_such_method()\n")
    # a call of ours broken on purpose: the backend's execute_async_v3 without its stream
    backend = (SRC / "cabinlm/engines/tensorrt/backend.py").read_text()
    assert "context.execute_async_v3(self.cuda.stream)" in backend
    broken = tmp / "broken_backend.py"
    broken.write_text(backend.replace("context.execute_async_v3(self.cuda.stream)", "context.execute_async_v3()"))
    files = [str(SRC / f) for f in CHECKED] + [str(canary), str(broken)]
    cmd = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports", "--check-untyped-defs",
           "--show-error-codes", "--no-error-summary", "--cache-dir", str(tmp / "cache"), *files]  # fmt: skip
    env = {"MYPYPATH": f"{stubs}:{SRC}", "PATH": "/usr/bin:/bin"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    return p, canary, broken


def _errors(output: str, path: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(path) and ": error:" in line]


def test_the_stubs_are_in_effect(mypy_run):
    p, canary, broken = mypy_run
    # mypy runs in the temporary folder: it names the files there relative to it
    assert any('"Builder" has no attribute "no_such_method"' in e for e in _errors(p.stdout, canary.name)), p.stdout[-3000:]
    assert any('Missing positional argument "stream_handle" in call to "execute_async_v3"' in e
               for e in _errors(p.stdout, broken.name)), p.stdout[-3000:]  # fmt: skip


def test_tensorrt_modules_type_check_against_nvidias_api(mypy_run):
    p, _, _ = mypy_run
    ours = [e for f in CHECKED for e in _errors(p.stdout, str(SRC / f))]
    assert ours == [], "\n".join(ours)
