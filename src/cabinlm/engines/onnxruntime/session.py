"""ONNX Runtime sessions as a build describes them: its settings, its execution provider (checked to
be the one that actually runs: ONNX Runtime otherwise falls back to the CPU without a word), and its
graph I/O checked against the manifest."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cabinlm.contract.files import FileRole
from cabinlm.contract.buildspec import THREADS_PER_CORE, BuildSpec, OptimizationLevel
from cabinlm.contract.io_spec import DecoderIO
from cabinlm.engines.backend import BackendError

_LEVELS = {
    OptimizationLevel.DISABLE: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    OptimizationLevel.BASIC: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    OptimizationLevel.EXTENDED: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    OptimizationLevel.ALL: ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_ORT_TYPES = {
    "float": "tensor(float)",
    "float16": "tensor(float16)",
    "int64": "tensor(int64)",
    "int32": "tensor(int32)",
    "bool": "tensor(bool)",
    "int8": "tensor(int8)",
    "uint8": "tensor(uint8)",
    "float8e4m3fn": "tensor(float8e4m3fn)",
}


# The session config entries a build's manifest may carry, and the values each takes: ONNX Runtime's
# switches of how kernels run. An entry that makes ONNX Runtime write or read files, load another
# model format or change providers is never one a build needs, and the manifest is read from a folder
# anybody can edit: anything else is refused before ONNX Runtime sees it.
_FLAG = re.compile(r"[01]")
MANIFEST_CONFIG_ENTRIES = {
    "session.set_denormal_as_zero": _FLAG,
    "session.intra_op.allow_spinning": _FLAG,
    "session.inter_op.allow_spinning": _FLAG,
    "session.disable_prepacking": _FLAG,
    "session.disable_cpu_ep_fallback": _FLAG,
    "session.qdq_matmulnbits_accuracy_level": re.compile(r"[0-4]"),
    "session.dynamic_block_base": re.compile(r"[1-9][0-9]{0,3}"),
    "mlas.enable_gemm_fastmath_arm64_bfloat16": _FLAG,
}


def check_session_config(entries: dict[str, str], where: str = "build.session.config") -> None:
    """BackendError unless every entry is one of MANIFEST_CONFIG_ENTRIES with a value it takes."""
    for key, value in entries.items():
        allowed = MANIFEST_CONFIG_ENTRIES.get(key)
        if allowed is None:
            raise BackendError(f"{where}: the ONNX Runtime session entry {key!r} is not one a build sets (it takes "
                               f"{', '.join(sorted(MANIFEST_CONFIG_ENTRIES))}); run `cabinlm build` again"[:600])
        if not isinstance(value, str) or not allowed.fullmatch(value):
            raise BackendError(f"{where}: {key} = {value!r} is not a value it takes ({allowed.pattern}); run "
                               "`cabinlm build` again"[:400])


def check_session_threads(threads: int | None, where: str = "build.session.intra_op_num_threads") -> None:
    """A thread count a build asks for, against this machine: 1 .. THREADS_PER_CORE x its cores (more
    only wait for each other: 1,024 threads on 2 cores took a minute to answer)."""
    cores = os.cpu_count() or 1
    if threads is not None and threads > THREADS_PER_CORE * cores:
        raise BackendError(f"{where} {threads}: this machine has {cores} core{'s' if cores != 1 else ''}, so at most "
                           f"{THREADS_PER_CORE * cores} threads; give --threads, or run `cabinlm build` for this "
                           "machine's profile")  # fmt: skip


def session_options(spec: BuildSpec, threads: int | None = None, extra: dict[str, str] | None = None) -> ort.SessionOptions:
    """The build's session settings (its thread count and config entries checked first), then the
    caller's thread count (runtime/limits.check_threads checks --threads) and extra config entries."""
    s = spec.session
    check_session_config(s.config)
    if not threads:
        check_session_threads(s.intra_op_num_threads)
    so = ort.SessionOptions()
    so.graph_optimization_level = _LEVELS[s.graph_optimization_level]
    threads = threads or s.intra_op_num_threads
    if threads:
        so.intra_op_num_threads = int(threads)
    so.enable_cpu_mem_arena = s.enable_cpu_mem_arena
    if s.denormal_as_zero:
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
    for key, value in {**s.config, **(extra or {})}.items():
        so.add_session_config_entry(key, str(value))
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


def register_custom_ops(options: ort.SessionOptions, folder: Path, spec: BuildSpec) -> None:
    """Register in `options` the custom-op libraries the build's engine lists for its graphs
    (engines.registry.custom_ops_libraries: each one verified by its engine before ONNX Runtime
    opens it, so that a missing, damaged or mismatched library is a BackendError here). Nothing is
    compiled and no cache is read."""
    from cabinlm.engines.registry import custom_ops_libraries

    for library in custom_ops_libraries(folder, spec, ort.__version__):
        try:
            options.register_custom_ops_library(str(library))
        except Exception as e:  # onnxruntime raises its own exception types; a library's own refusal is one
            raise BackendError(f"{library}: onnxruntime cannot register this custom-op library "
                               f"({str(e).strip().splitlines()[0]}); run `cabinlm build` again") from e  # fmt: skip


def open_session(graph: Path, options: ort.SessionOptions, spec: BuildSpec) -> ort.InferenceSession:
    """A session on the build's execution provider, refused if ONNX Runtime would run it elsewhere.
    A build whose engine runs custom ops (the fused cpu build's kernels) gets their libraries (in the
    graph's folder) registered in `options` first (register_custom_ops)."""
    register_custom_ops(options, graph.parent, spec)
    provider = spec.provider
    offered = ort.get_available_providers()
    if provider.name not in offered:
        raise BackendError(
            f"{graph.parent}: this build runs on {provider.name}, which this onnxruntime does not offer "
            f"({', '.join(offered)}); install the onnxruntime package with that provider, or build for another profile"
        )
    try:
        session = ort.InferenceSession(str(graph), options, providers=[(provider.name, dict(provider.options))])
    except Exception as e:  # onnxruntime raises its own exception types for unreadable graphs
        raise BackendError(f"{graph}: onnxruntime cannot load the graph ({str(e).splitlines()[0]}); export or build again") from e
    if session.get_providers()[0] != provider.name:
        raise BackendError(f"{graph}: onnxruntime placed the graph on {session.get_providers()[0]}, not {provider.name}")
    return session


def check_io(session: ort.InferenceSession, io: DecoderIO, where: Path, built: bool) -> None:
    """The graph must have exactly the I/O the manifest declares (names, element types, fixed dims)."""
    got = {i.name: i for i in session.get_inputs()}
    got.update({o.name: o for o in session.get_outputs()})
    again = "run `cabinlm build` again" if built else "export again"
    for t in (*io.inputs, *io.outputs):
        arg = got.get(t.name)
        if arg is None:
            raise BackendError(f"{where}: the graph has no {t.name!r} that the manifest declares; {again}")
        if arg.type != _ORT_TYPES[t.dtype]:
            raise BackendError(f"{where}: graph tensor {t.name!r} is {arg.type}, the manifest says {t.dtype}; {again}")
        static = [d for d in t.shape if isinstance(d, int)]
        if static != [d for d in arg.shape if isinstance(d, int)]:
            raise BackendError(
                f"{where}: graph tensor {t.name!r} has shape {arg.shape}, the manifest says {list(t.shape)}; the graph "
                f"and the manifest come from different exports or builds: {again}"
            )


def mapped_weights(folder: Path, table) -> list[tuple[str, ort.OrtValue]]:
    """The weights several graphs of a build share (table: engines/ort_static/spec.SharedWeights), as
    OrtValues over one read-only memory map of its weights file: handed to every session
    (SessionOptions.add_initializer), they are held in memory once. ValueError for a table that
    reaches past the file."""
    data = np.memmap(folder / table.file, dtype=np.uint8, mode="r")
    out = []
    for t in table.tensors:
        if t.offset + t.length > len(data):
            raise ValueError(f"shared weight {t.name} lies beyond the end of {table.file}")
        arr = data[t.offset : t.offset + t.length].view(np.dtype(t.dtype)).reshape(t.shape)
        out.append((t.name, ort.OrtValue.ortvalue_from_numpy(arr)))
    return out


def vision_session(folder: Path, manifest, threads: int | None = None) -> ort.InferenceSession:
    """The artifact's vision graph (files "vision_graph") on ONNX Runtime's CPU provider, with the
    build's session settings: how every engine without a camera encoder of its own runs it."""
    options = session_options(manifest.runtime_spec, threads)
    return ort.InferenceSession(str(folder / manifest.files[FileRole.VISION_GRAPH].path), options,
                                providers=["CPUExecutionProvider"])  # fmt: skip
