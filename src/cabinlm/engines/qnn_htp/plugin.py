"""ONNX Runtime's QNN execution provider, engaged the one way that works: as a plugin library
(`onnxruntime-qnn`), registered once per process and attached to a session by its devices.

The older `providers=["QNNExecutionProvider"]` list does not engage the plugin: ONNX Runtime then
builds a CPU-only session without a word. Every session here has CPU fallback disabled, so a graph
the HTP cannot run fails to load instead of running elsewhere, and a context model is checked to be
nothing but QNN EPContext nodes before it is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterator

from cabinlm.contract.buildspec import ExecutionProvider
from cabinlm.engines.backend import BackendError

INSTALL = "pip install 'cabinlm[qnn]' (Qualcomm's QNN SDK as ONNX Runtime's QNN plugin, onnxruntime-qnn)"
_registered = False


class QnnUnavailable(BackendError):
    """The QNN plugin is not installed or does not offer an HTP device here."""


def require() -> None:
    """Raise QnnUnavailable unless the plugin can be registered and offers its device."""
    _devices()


def _devices() -> list:
    global _registered
    if importlib.util.find_spec("onnxruntime_qnn") is None:
        raise QnnUnavailable(f"Qualcomm HTP builds and runs need the QNN plugin for ONNX Runtime: {INSTALL}")
    import onnxruntime as ort

    try:
        import onnxruntime_qnn
    except ImportError as e:
        raise QnnUnavailable(f"Qualcomm HTP builds and runs need the QNN plugin for ONNX Runtime ({e}): {INSTALL}") from e
    if not hasattr(ort, "register_execution_provider_library"):
        raise QnnUnavailable(f"onnxruntime {ort.__version__} cannot load execution provider plugins; "
                             "install onnxruntime >= 1.23 with " + INSTALL)  # fmt: skip
    if not _registered:
        try:
            ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        except Exception as e:  # registered already by someone else in this process: fine if it offers devices
            if not any(d.ep_name == "QNNExecutionProvider" for d in ort.get_ep_devices()):
                raise QnnUnavailable(f"the QNN plugin did not load ({str(e).splitlines()[0]}); reinstall: {INSTALL}") from e
        _registered = True
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devices:
        raise QnnUnavailable(f"the QNN plugin loaded but offers no device on this machine; reinstall: {INSTALL}")
    return devices


def session_options(provider: ExecutionProvider):
    """Session options with the QNN plugin attached (the provider's options: backend, HTP arch,
    SoC) and CPU fallback disabled."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_provider_for_devices(_devices(), dict(provider.options))
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def _fields(buf: bytes):
    """(field number, value) of one protobuf message: varints as int, length-delimited as bytes.
    Enough of the wire format to read an EPContext model's nodes without the onnx package (which a
    car does not carry); a malformed message raises ValueError."""
    i, n = 0, len(buf)

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            if i >= n or shift > 63:
                raise ValueError("truncated varint")
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7

    while i < n:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, varint()
        elif wire == 2:
            size = varint()
            if i + size > n:
                raise ValueError("truncated field")
            yield number, buf[i : i + size]
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def context_nodes(data: bytes) -> list[tuple[str, str, str]]:
    """(name, op_type, "source" attribute) of every node of a serialized ONNX model
    (ModelProto.graph = 7, GraphProto.node = 1; NodeProto name = 3, op_type = 4, attribute = 5;
    AttributeProto name = 1, s = 4)."""
    nodes = []
    for number, graph in _fields(data):
        if number != 7 or not isinstance(graph, bytes):
            continue
        for gnum, node in _fields(graph):
            if gnum != 1 or not isinstance(node, bytes):
                continue
            name = op = source = ""
            for nnum, value in _fields(node):
                if nnum == 3 and isinstance(value, bytes):
                    name = value.decode(errors="replace")
                elif nnum == 4 and isinstance(value, bytes):
                    op = value.decode(errors="replace")
                elif nnum == 5 and isinstance(value, bytes):
                    attr = dict((k, v) for k, v in _fields(value) if k in (1, 4))
                    if attr.get(1) == b"source" and isinstance(attr.get(4), bytes):
                        source = attr[4].decode(errors="replace")
            nodes.append((name, op, source))
    return nodes


def check_context_model(path: Path) -> None:
    """A compiled model must be QNN EPContext nodes only: then no node can run anywhere but the HTP."""
    try:
        nodes = context_nodes(path.read_bytes())
    except (OSError, ValueError) as e:
        raise BackendError(f"{path}: not a readable context model ({e}); run `cabinlm build` again") from e
    if not nodes:
        raise BackendError(f"{path}: not a readable context model (no nodes); run `cabinlm build` again")
    for name, op, source in nodes:
        if op != "EPContext" or source != "QNNExecutionProvider":
            raise BackendError(f"{path}: node {name or op} ({op}) is not compiled for the HTP; the build "
                               "is not an HTP build or was edited: run `cabinlm build` again")  # fmt: skip


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Qualcomm's libraries print a banner on stdout when the HTP (or its simulator) first starts;
    stdout belongs to the program (`chat --json` prints one JSON object per line), so native
    writes to it go to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def open_context_session(path: Path, provider: ExecutionProvider, share: bool):
    """A session over a compiled context model on the HTP (on x86: Qualcomm's HTP simulator).
    share: sessions of one process reuse a context that holds several graphs (shared weights)."""
    import onnxruntime as ort

    check_context_model(path)
    so = session_options(provider)
    if share:
        so.add_session_config_entry("ep.share_ep_contexts", "1")
    try:
        with native_stdout_to_stderr():
            return ort.InferenceSession(str(path), so)
    except Exception as e:  # onnxruntime raises its own exception types
        raise BackendError(f"{path}: the HTP cannot load this context binary ({str(e).splitlines()[0]}); "
                           "run `cabinlm build` again for this chip") from e  # fmt: skip
