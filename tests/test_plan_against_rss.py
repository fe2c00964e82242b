"""`cabinlm plan` of a build against the peak resident memory of a real chat on it.

SmolLM2 as `make demo` builds it (the GGUF's Q4_1 blocks, int8 KV, the fused cpu decoder) in a small
cache, once with cabinlm's block matmuls (the default: weights read in place from one map of the
weights file) and once with ONNX Runtime's MatMulNBits (`--matmul-kernel onnxruntime`: each session
packs its own copy of every matrix beside that map). Each build's plan, read off its manifest as
`cabinlm plan BUILD` reads it, must be within PLAN_TOLERANCE of the peak RSS of `cabinlm chat BUILD`
run in a child process over the demo dialogue (docs/results.md, "Plan against RSS").
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cabinlm.profiles import load_profile

pytestmark = pytest.mark.slow

PLAN_TOLERANCE = 0.20  # |plan / peak RSS - 1|
DIALOGUE = Path(__file__).parent.parent / "demo" / "dialogue.txt"
MIB = 1 << 20

# `cabinlm chat ARGS` in this child process; at exit, its peak resident memory in bytes into the file
# named by the first argument: VmHWM, the high-water mark of this program's own memory (getrusage's
# ru_maxrss would count the forking test process's memory too), getrusage where /proc is not.
CHAT_CHILD = """
import atexit, resource, sys
def peak(path=sys.argv[1]):
    try:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = kb if sys.platform == "darwin" else kb * 1024
    with open(path, "w") as f:
        f.write(str(peak))
atexit.register(peak)
sys.argv = ["cabinlm", *sys.argv[2:]]
from cabinlm.cli import main
main()
"""


@pytest.fixture(scope="module")
def smollm2_builds(smollm2, smollm2_fused, export_to, tmp_path_factory):
    """The default cpu build (smollm2_fused) and the same export built on MatMulNBits."""
    from cabinlm.engines.build import build_artifact

    art = export_to(smollm2, kv="int8", sink=4, pinned=60, window=252, chunk=32, weights="int4")  # smollm2_fused's
    nbits = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("smollm2-nbits") / "build-cpu",
                           matmul_kernel="onnxruntime")  # fmt: skip
    return {"cabinlm": smollm2_fused, "onnxruntime": nbits}


def chat_peak_rss(build: Path, tmp_path: Path) -> int:
    peak = tmp_path / "peak"
    run = subprocess.run([sys.executable, "-c", CHAT_CHILD, str(peak), "chat", str(build), "--max-new-tokens", "16"],
                         input=DIALOGUE.read_text(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]
    return int(peak.read_text())


def run_plan(*args) -> tuple[int, str, str]:
    """`cabinlm plan ARGS` in this process: (exit code, stdout, stderr)."""
    from cabinlm.cli import main

    out, errs, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["cabinlm", "plan", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
            main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return code, out.getvalue(), errs.getvalue()


def plan_of(build: Path) -> dict:
    code, out, err = run_plan(build, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("kernel", ["cabinlm", "onnxruntime"])
def test_the_plan_of_a_build_is_within_a_fifth_of_a_chats_peak_rss(smollm2_builds, kernel, tmp_path):
    from cabinlm.contract.engines.fused import FusedSettings
    from cabinlm.contract.manifest import load_manifest

    build = smollm2_builds[kernel]
    facts = load_manifest(build).runtime_spec.facts_as(FusedSettings)
    assert (facts.matmul_kernel, facts.seat_batches) == (kernel, (2, 4))
    p = plan_of(build)
    peak = chat_peak_rss(build, tmp_path)
    ratio = p["total_bytes"] / peak
    what = (f"{kernel}: plan {p['total_bytes'] / MIB:.1f} MiB (packed copies {p['packed_bytes'] / MIB:.1f}) against "
            f"a peak of {peak / MIB:.1f} MiB: {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= PLAN_TOLERANCE, what
    if kernel == "onnxruntime":
        # the session's packed copies are what keep this plan within reach: without them it is short
        assert p["packed_bytes"] > 0 and (p["total_bytes"] - p["packed_bytes"]) / peak < 1 - PLAN_TOLERANCE, what
    else:
        assert p["packed_bytes"] == 0, what


def test_cabinlm_plan_of_a_build_reads_its_manifest_and_refuses_a_layout(smollm2_builds):
    """`cabinlm plan BUILD` is the plan of the build's manifest (profiles/planner.plan_for_manifest) on the
    profile it was built for; a cache layout option is refused in one line, since the build's is fixed."""
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles.planner import plan_for_manifest

    build = smollm2_builds["onnxruntime"]
    planned = plan_for_manifest(load_manifest(build), load_profile("cpu"))
    assert plan_of(build) == json.loads(json.dumps(planned.to_dict()))
    code, out, err = run_plan(build)
    assert code == 0 and "packed copies" in out and "window 252" in out, err
    for option in (["--window", "64"], ["--kv", "fp32"], ["--pinned", "8", "--sink", "0"]):
        code, _, err = run_plan(build, *option)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert all(o in lines[0] for o in option[::2]) and "fixed when it is exported" in lines[0], lines[0]
