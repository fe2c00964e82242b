"""Session files: a dialogue saved after every turn, resumed after the car restarts.

Layout (little-endian; the size is fixed for a given build, so a short file is a truncated one):

    offset  size          what
    0       8             magic b"CABINSES"
    8       4             format version (uint32)
    12      4             header size H (uint32) = HEADER_BYTES
    16      H             header: JSON, space-padded: identity, cache bookkeeping, dialogue state
    16+H    8 * slots     slot_token (int64): stream index held by each slot, -1 = empty
    ...     cache bytes   the backend's buffers (Backend.buffers(): keys, values, and value scales or
                          un-rotated sink keys, as that backend holds them), in that order
    end-32  32            sha256 of everything before it

Guarantees: a save writes a temporary file next to the target, fsyncs it, renames it over the
target (atomic on POSIX) and fsyncs the folder, so a crash at any moment leaves either the previous
or the new complete file. A load checks size, magic, version, checksum and identity (the model's
weights, the graph, the backend, the cache layout), then the slot table against the layout
(runtime/slots.check_state), before it changes anything, so a refused file loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from cabinlm.errors import CabinlmError
from cabinlm.runtime.dialogue import Dialogue
from cabinlm.runtime.interrupts import defer_sigint
from cabinlm.runtime.slots import SlotState, StateError, check_state

MAGIC = b"CABINSES"
FORMAT = 2  # 2: the image region's state, the backend in the identity
HEADER_BYTES = 65536
_PREFIX = struct.Struct("<8sII")
_DIGEST = 32


class SessionError(CabinlmError):
    """A session file that cannot be resumed (truncated, corrupt, or from another model or build)."""


def _identity(d: Dialogue) -> dict:
    m = d.decoder.manifest
    return {
        "model": m.files["graph_data"].sha256 if "graph_data" in m.files else m.files["graph"].sha256,
        "graph": m.files["graph"].sha256,
        "cache": m.cache.to_dict(),
        "backend": m.runtime_spec.backend.value,
    }


def _buffers(d: Dialogue) -> list[np.ndarray]:
    """What the file holds after the header: the slot table, then the backend's cache buffers."""
    return [d.decoder.cache.slot_token, *d.decoder.backend.buffers().values()]


def session_size(d: Dialogue) -> int:
    return _PREFIX.size + HEADER_BYTES + sum(b.nbytes for b in _buffers(d)) + _DIGEST


def _header(d: Dialogue) -> bytes:
    header = {
        "format": FORMAT,
        "identity": _identity(d),
        "cache": d.decoder.cache.state().counters(),
        "dialogue": d.state(),
    }
    raw = json.dumps(header).encode("utf-8")
    if len(raw) > HEADER_BYTES:
        raise SessionError(f"the session header needs {len(raw)} bytes, more than {HEADER_BYTES}; shorten the system prompt")
    return raw.ljust(HEADER_BYTES, b" ")


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def save_session(path: str | Path, d: Dialogue) -> None:
    """Atomically replace `path` with the dialogue's current state."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    h = hashlib.sha256()
    with defer_sigint():
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for part in (_PREFIX.pack(MAGIC, FORMAT, HEADER_BYTES), _header(d), *_buffers(d)):
                part = np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part
                h.update(part)
                _write_all(fd, part)
            _write_all(fd, h.digest())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def load_session(path: str | Path, d: Dialogue) -> None:
    """Restore `d` (decoder cache and dialogue state) from `path`; on any problem nothing changes."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SessionError(f"{path}: cannot read the session file ({e})") from e
    fix = f"move {path} away (or delete it) to start a new session"
    if len(data) < _PREFIX.size or data[:8] != MAGIC:
        raise SessionError(f"{path}: not a cabinlm session file; {fix}")
    _, version, header_bytes = _PREFIX.unpack_from(data)
    if version != FORMAT or header_bytes != HEADER_BYTES:
        raise SessionError(f"{path}: session format version {version}, this cabinlm reads {FORMAT}; {fix}")
    expected = session_size(d)
    if len(data) != expected:
        raise SessionError(
            f"{path}: {len(data)} bytes, a session of this build has {expected} (truncated, or from another "
            f"build); {fix}"
        )
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise SessionError(f"{path}: checksum mismatch, the file is corrupt; {fix}")
    try:
        header = json.loads(body[_PREFIX.size : _PREFIX.size + HEADER_BYTES])
        identity, cache_state, dialogue_state = header["identity"], header["cache"], header["dialogue"]
        if not {"turns", "pending", "system", "rng"} <= set(dialogue_state):
            raise KeyError("dialogue")
    except (ValueError, KeyError, TypeError) as e:
        raise SessionError(f"{path}: unreadable session header ({e}); {fix}") from e
    mine = _identity(d)
    if identity["model"] != mine["model"]:
        raise SessionError(f"{path}: this session was saved with another model's weights; {fix}")
    if identity != mine:
        raise SessionError(f"{path}: this session was saved with another build of this model (graph or cache layout); {fix}")
    offset = _PREFIX.size + HEADER_BYTES
    arrays = []
    for buf in _buffers(d):
        arrays.append(np.frombuffer(body, dtype=buf.dtype, count=buf.size, offset=offset).reshape(buf.shape))
        offset += buf.nbytes
    try:
        if not isinstance(cache_state, dict) or set(cache_state) != set(SlotState.COUNTERS):
            raise StateError(f"cache counters {sorted(cache_state) if isinstance(cache_state, dict) else cache_state!r}")
        if not all(type(v) is int for v in cache_state.values()):
            raise StateError("cache counters must be integers")
        state = SlotState(arrays[0].copy(), **cache_state)
        check_state(state, d.decoder.layout)
    except StateError as e:
        raise SessionError(f"{path}: the saved cache does not fit this build's layout ({e}); {fix}") from e
    # Everything checked: restore in place (the buffers keep their addresses and bindings).
    dec = d.decoder
    with defer_sigint():
        for buf, saved in zip(_buffers(d)[1:], arrays[1:]):
            np.copyto(buf, saved)
        dec.cache.restore(state)
        dec.backend.restored()
        d.restore(dialogue_state)
