"""Qualcomm's compiler, driven through ONNX Runtime's QNN plugin: one ONNX graph into an EPContext
model and its context binary for a profile's HTP, CPU fallback disabled. The decoder's builder
(builder.py) and the camera encoder's (vision_build.py) both compile through here.

    graph.onnx ─ compile_graph ─ name.ctx.onnx (one EPContext node) + name_qnn.bin
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import onnx

from cabinlm.contract.files import FileRole, context_binary
from cabinlm.contract.buildspec import ExecutionProvider
from cabinlm.contract.engines.qnn import QNN_PROVIDER, SIMULATOR
from cabinlm.contract.errors import BuildError
from cabinlm.engines.qnn_htp import plugin as qnn_plugin

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

# The unshared twin of a weight-sharing build's (prefill, decode) context models, for the x86 simulator.
SIM_PAIR = ("decoder.prefill.sim.ctx.onnx", "decoder.decode.sim.ctx.onnx")


class HTPRejected(BuildError):
    """A node of the graph cannot run on the HTP (CPU fallback is off)."""


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """The process's stderr (where ONNX Runtime's C++ logger writes) into a file, for the duration."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


_UNSUPPORTED = re.compile(r"\{ name: ([^,]+), type: ([^ }]+) \}")


def compile_graph(src: Path, ctx: Path, profile: DeviceProfile, share: bool, last: bool) -> None:
    """Compile one graph for the profile's HTP into ctx (+ its binary), CPU fallback disabled."""
    import onnxruntime as ort

    so = qnn_plugin.session_options(profile_provider(profile))
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(ctx))
    so.add_session_config_entry("ep.context_embed_mode", "0")
    if share:
        so.add_session_config_entry("ep.share_ep_contexts", "1")
        if last:
            so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
    so.log_severity_level = 2
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "qnn.log"
        try:
            with _stderr_to(log), qnn_plugin.native_stdout_to_stderr():
                ort.InferenceSession(str(src), so)
        except Exception as e:  # onnxruntime raises its own exception types
            text = log.read_text(errors="replace")
            nodes = _UNSUPPORTED.findall(text)
            if nodes:
                names = ", ".join(f"{n} ({t})" for n, t in dict(nodes).items())
                raise HTPRejected(f"the HTP ({profile.name}: v{profile.htp_arch}) cannot run {len(dict(nodes))} node(s) of "
                                  f"{src.name}: {names}. CPU fallback is off for HTP builds; re-export without these "
                                  "ops or report this") from e  # fmt: skip
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            errors = [ln for ln in text.splitlines() if ":E:" in ln or "[E:" in ln or "ERROR" in ln]
            raise BuildError(f"QNN could not compile {src.name} for {profile.name}: {detail}"
                             + (f" ({errors[-1].strip()[:300]})" if errors else "")) from e  # fmt: skip


def profile_provider(profile: DeviceProfile) -> ExecutionProvider:
    """The QNN provider options of a profile: the HTP backend, its architecture and SoC."""
    return ExecutionProvider(QNN_PROVIDER, {"backend_type": "htp", "htp_arch": str(profile.htp_arch),
                                            "soc_model": str(profile.soc_model)})  # fmt: skip


def compile_pair(sources: list[tuple[Path, int]], out: Path, names: tuple[str, str], profile: DeviceProfile, share: bool,
                  log: Callable[[str], None], simulator: bool = False) -> dict[str, str]:
    """Compile the prefill and decode graphs into out/names (+ their binaries). Returns manifest
    roles -> files: graph, graph_decode, context_binary[_N] (each with SIMULATOR appended for the
    simulator's twin)."""
    suffix = SIMULATOR if simulator else ""
    files: dict[str, str] = {}
    binaries: list[str] = []
    for i, ((src, tokens), name) in enumerate(zip(sources, names)):
        t = time.perf_counter()
        log(f"compiling {name} (tokens = {tokens}) for HTP v{profile.htp_arch}, SoC {profile.soc_model}"
            f"{', weights shared' if share else ''} ...")  # fmt: skip
        compile_graph(src, out / name, profile, share=share, last=i == len(sources) - 1)
        log(f"  compiled in {time.perf_counter() - t:.1f} s")
        files[(FileRole.GRAPH, FileRole.GRAPH_DECODE)[i] + suffix] = name
    for name in names:
        binary = binary_of(out / name)[0]
        if binary not in binaries:
            binaries.append(binary)
    for i, b in enumerate(binaries):
        files[context_binary(i) + suffix] = b
    return files


def binary_of(ctx: Path) -> tuple[str, str]:
    """The binary file an EPContext model points at, and the QNN SDK version it records."""
    m = onnx.load(str(ctx), load_external_data=False)
    nodes = list(m.graph.node)
    if not nodes or any(n.op_type != "EPContext" for n in nodes):
        raise BuildError(f"{ctx.name}: the compiled model is not one EPContext node; the HTP did not take the whole graph")
    attrs = {a.name: a for a in nodes[0].attribute}
    return attrs["ep_cache_context"].s.decode(), attrs["ep_sdk_version"].s.decode() if "ep_sdk_version" in attrs else ""
