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
    ...     A             the recall archive (runtime/recall.py): JSON, A = the header's archive_bytes
                          (0 without a recall region; absent from a version 2 file)
    ...     8 * E         the seat's history (runtime/history.py, an artifact with switchable adapters):
                          (E, 2) int32, each step's kind and token count, E = the header's
                          history.entries (absent when the header's history is null, and from version 2
                          and 3 files)
    ...     4 * T         its token ids, int32, T = history.tokens
    end-32  32            sha256 of everything before it

The size is fixed for a given build, archive and history (the header says the latter two). The
history is what a switch of the seat's adapter runs again after a resume: it grows with the stream
(about 12 bytes per token), the cache does not.

Guarantees: a save writes a temporary file next to the target (a fresh random name, created
exclusively and never through a symbolic link), fsyncs it, renames it over the target (atomic on
POSIX) and fsyncs the folder, so a crash at any moment leaves either the previous or the new complete
file; a save that fails (a missing folder, a read-only or full disk) raises SessionError, removes its
temporary and leaves the previous file as it was. A process that loads or saves a session file
holds a lock on it (`.NAME.lock`, flock) until it exits: a second process on the same file is
refused with SessionError instead of overwriting the first one's dialogue. A load checks size, magic, version, checksum and identity (the model's
weights, the graph, the backend, the cache layout), then the slot table against the layout
(contract/slot_state.check_state), before it changes anything, so a refused file loses nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import stat
import struct
from pathlib import Path

import numpy as np

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import CabinlmError
from cabinlm.runtime.dialogue import Dialogue
from cabinlm.runtime.history import History, HistoryError, byte_count, check_replay
from cabinlm.runtime.interrupts import defer_sigint
from cabinlm.contract.slot_state import SlotState, StateError, check_state

MAGIC = b"CABINSES"
FORMAT = 4  # 2: the image region's state, the backend in the identity; 3: the recall archive after the buffers;
#            4: the seat's history after the archive
READS = (2, 3, 4)  # a version 2 file is a session without an archive, 2 and 3 without a history
HEADER_BYTES = 65536
_PREFIX = struct.Struct("<8sII")
_DIGEST = 32


class SessionError(CabinlmError):
    """A session file that cannot be resumed (truncated, corrupt, or from another model or build)."""


def _identity(d: Dialogue) -> dict:
    m = d.decoder.manifest
    return {
        "model": m.files[FileRole.GRAPH_DATA].sha256 if FileRole.GRAPH_DATA in m.files else m.files[FileRole.GRAPH].sha256,
        "graph": m.files[FileRole.GRAPH].sha256,
        "cache": m.cache.to_dict(),
        "backend": m.runtime_spec.backend.value,
    }


def _buffers(d: Dialogue) -> list[np.ndarray]:
    """What the file holds after the header: the slot table, then the backend's cache buffers."""
    return [d.decoder.cache.slot_token, *d.decoder.backend.buffers().values()]


def session_size(d: Dialogue) -> int:
    return _PREFIX.size + HEADER_BYTES + sum(b.nbytes for b in _buffers(d)) + _DIGEST


def _archive(d: Dialogue) -> bytes:
    return json.dumps(d.archive_state()).encode("utf-8") if d.recall else b""


def _history(d: Dialogue) -> list[np.ndarray]:
    """What the file holds after the archive: the history's arrays (none where it is unknown)."""
    h = d.decoder.known_history()
    return [] if h is None else list(h.arrays())


def _header(d: Dialogue, archive: bytes) -> bytes:
    header = {
        "format": FORMAT,
        "identity": _identity(d),
        "cache": d.decoder.cache.state().counters(),
        "dialogue": d.state(),
        "archive_bytes": len(archive),
    }
    if d.decoder.adapters is not None:  # the adapter the cache was computed with, resumed with it
        name = d.decoder.adapter
        record = None if name is None else d.decoder.manifest.lora.adapter(name)
        header["adapter"] = None if record is None else {"name": name, "sha256": record.sha256, "scale": record.scale}
        h = d.decoder.known_history()
        header["history"] = None if h is None else {"entries": h.entries, "tokens": h.tokens}
    raw = json.dumps(header).encode("utf-8")
    if len(raw) > HEADER_BYTES:
        raise SessionError(f"the session header needs {len(raw)} bytes, more than {HEADER_BYTES}; shorten the system prompt")
    return raw.ljust(HEADER_BYTES, b" ")


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _check_dialogue_state(state, vocab: int) -> None:
    """Every field Dialogue.restore takes, by type and range (raises TypeError / ValueError)."""
    if not isinstance(state, dict) or set(state) - {"recall"} != {"turns", "pending", "system", "rng"}:
        raise ValueError("the dialogue state needs exactly turns, pending, system, rng (and recall)")
    recall = state.get("recall")
    if recall is not None:
        if not isinstance(recall, dict) or set(recall) != {"region", "turns"}:
            raise ValueError("the recall state needs exactly region, turns")
        for k, top in (("region", vocab), ("turns", 2**62)):
            if not isinstance(recall[k], list) or not all(type(t) is int and 0 <= t < top for t in recall[k]):
                raise ValueError(f"the recall {k} must be a list of whole numbers below {top}")
    if type(state["turns"]) is not int or not 0 <= state["turns"] < 2**62:
        raise ValueError(f"turns = {state['turns']!r}")
    pending = state["pending"]
    if not isinstance(pending, list) or len(pending) > 4096 or not all(type(t) is int and 0 <= t < vocab for t in pending):
        raise ValueError(f"pending tokens must be at most 4096 ids below {vocab}")
    if state["system"] is not None and not isinstance(state["system"], str):
        raise TypeError("system must be text or null")
    np.random.default_rng().bit_generator.state = state["rng"]  # a scratch generator: raises if malformed


def _check_archive(archive) -> None:
    """The archive's fields by type (raises TypeError / ValueError; runtime/recall.Archive.restore)."""
    if not isinstance(archive, dict) or set(archive) != {"kept", "live", "dropped"}:
        raise ValueError("the archive needs exactly kept, live, dropped")
    for m in archive["kept"] + archive["live"]:
        if not isinstance(m, dict) or set(m) != {"role", "ids", "turn", "start", "text"}:
            raise ValueError("an archived message needs exactly role, ids, turn, start, text")
        if m["role"] not in ("user", "assistant") or not isinstance(m["text"], str):
            raise ValueError("an archived message's role is user or assistant, its text a string")
        if not all(type(t) is int and t >= 0 for t in [*m["ids"], m["turn"], m["start"]]):
            raise ValueError("an archived message's ids, turn and start are whole numbers")


def _saved_history(saved, body: bytes, at: int, d: Dialogue, state: SlotState) -> History | None:
    """The history kept at `at` (the header's history: null or its entries and tokens, the bytes
    already counted), checked as History.from_arrays checks it and against the saved cache: its
    tokens are the stream's (seen), its recall starts the table's (recalls), and its steps planned
    on a reset slot table end in the saved one (history.check_replay)."""
    if saved is None:
        return None
    entries, tokens = saved["entries"], saved["tokens"]
    runs = np.frombuffer(body, dtype="<i4", count=2 * entries, offset=at)
    ids = np.frombuffer(body, dtype="<i4", count=tokens, offset=at + 8 * entries)
    m = d.decoder.manifest
    h = History.from_arrays(runs, ids, m.model.vocab_size, d.decoder.layout.chunk)
    if h.tokens != state.seen or h.recalls != state.recalls:
        raise HistoryError(f"the history holds {h.tokens} tokens and {h.recalls} recall regions, the cache "
                           f"{state.seen} and {state.recalls}")  # fmt: skip
    check_replay(h, d.decoder.layout, state)
    return h


def _history_bytes(saved) -> int:
    """The bytes the header's history says follow the archive (raises TypeError / ValueError)."""
    if saved is None:
        return 0
    if not isinstance(saved, dict) or set(saved) != {"entries", "tokens"}:
        raise ValueError("the history needs exactly entries, tokens")
    if not all(type(v) is int and 0 <= v < 2**40 for v in saved.values()):
        raise ValueError("the history's entries and tokens must be whole numbers")
    return byte_count(saved["entries"], saved["tokens"])


def _saved_adapter(saved, d: Dialogue, where: str, fix: str) -> str | None:
    """The adapter a session was saved with, which this build must hold as it was (the same file and
    scale): the cache holds K/V that adapter computed. A SessionError where it does not."""
    lora = d.decoder.manifest.lora
    if saved is None:
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("name"), str):
        raise TypeError("adapter must be an object with a name")
    held = None if lora is None else lora.adapter(saved["name"])
    if held is None or held.sha256 != saved.get("sha256") or held.scale != saved.get("scale"):
        raise SessionError(f"{where}this session was saved with adapter {saved['name']!r}, which this build does not hold "
                           f"as it was (another file or scale); build with that adapter, or {fix}")  # fmt: skip
    return saved["name"]


_LOCKS: dict[Path, int] = {}  # session file -> the lock file descriptor this process holds


def _lock(path: Path) -> None:
    """Hold `.NAME.lock` next to the session file for the rest of this process (the kernel drops it
    when the process ends, however it ends)."""
    key = path.absolute()
    if key in _LOCKS:
        return
    lock = path.with_name(f".{path.name}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise SessionError(f"{path}: cannot create the session's lock file {lock.name} ({e.strerror})") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "another process"
        os.close(fd)
        raise SessionError(f"{path}: the session file is in use by cabinlm process {holder}; stop it, or give this one "
                           "another --session") from e  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _LOCKS[key] = fd


def release_session(path: str | Path) -> None:
    """Give up this process's lock on a session file (done for it when the process ends)."""
    fd = _LOCKS.pop(Path(path).absolute(), None)
    if fd is not None:
        os.close(fd)


def _stale_temporaries(path: Path) -> list[Path]:
    """Temporaries of earlier saves of this file that a crash left behind (harmless, but not kept)."""
    prefix = f".{path.name}."
    try:
        return [p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(".tmp")]
    except OSError:
        return []


def save_session(path: str | Path, d: Dialogue) -> None:
    """Atomically replace `path` with the dialogue's current state; on failure raise SessionError and
    change nothing on disk."""
    path = Path(path)
    if not path.parent.is_dir():
        raise SessionError(f"{path}: the folder {path.parent} does not exist; create it or choose another --session")
    _lock(path)
    archive = _archive(d)
    header = _header(d, archive)  # may refuse (a system prompt too long for the header) before any file is touched
    for old in _stale_temporaries(path):
        old.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    h = hashlib.sha256()
    with defer_sigint():
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise SessionError(f"{path}: cannot write the session ({e.strerror}); the previous one is kept") from e
        try:
            try:
                for part in (_PREFIX.pack(MAGIC, FORMAT, HEADER_BYTES), header, *_buffers(d), archive, *_history(d)):
                    part = np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part
                    h.update(part)
                    _write_all(fd, part)
                _write_all(fd, h.digest())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SessionError(f"{path}: cannot write the session ({e.strerror}); the previous one is kept") from e
        try:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise SessionError(f"{path}: saved, but the folder could not be synced to disk ({e.strerror})") from e


def load_session(path: str | Path, d: Dialogue) -> None:
    """Restore `d` (decoder cache and dialogue state) from `path`; on any problem nothing changes.
    Everything in the file is checked before use: its size, magic, version, checksum, identity, the
    slot table against the layout and every field of the dialogue state (the file is untrusted: a
    checksum can be recomputed)."""
    path = Path(path)
    fix = f"move {path} away (or delete it) to start a new session"
    expected = session_size(d)
    try:
        st = path.stat()
    except OSError as e:
        raise SessionError(f"{path}: cannot read the session file ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise SessionError(f"{path}: not a regular file; {fix}")
    try:
        with open(path, "rb") as f:
            head = f.read(_PREFIX.size)
    except OSError as e:
        raise SessionError(f"{path}: cannot read the session file ({e.strerror})") from e
    if len(head) < _PREFIX.size or head[:8] != MAGIC:
        raise SessionError(f"{path}: not a cabinlm session file; {fix}")
    _, version, header_bytes = _PREFIX.unpack_from(head)
    if version not in READS:
        raise SessionError(f"{path}: session format version {version}, this cabinlm reads {', '.join(map(str, READS))}; {fix}")
    if header_bytes != HEADER_BYTES:  # the version's own header size: the file is damaged
        raise SessionError(f"{path}: the header size field says {header_bytes} bytes, a version {FORMAT} session's "
                           f"header is {HEADER_BYTES}: the file is damaged; {fix}")
    if st.st_size < expected:
        raise SessionError(
            f"{path}: {st.st_size} bytes, a session of this build has {expected} (truncated, or from another "
            f"build); {fix}"
        )
    _lock(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SessionError(f"{path}: cannot read the session file ({e.strerror})") from e
    if len(data) != st.st_size or data[: _PREFIX.size] != head:
        raise SessionError(f"{path}: the file changed while it was read; {fix}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise SessionError(f"{path}: checksum mismatch, the file is corrupt; {fix}")
    try:
        header = json.loads(body[_PREFIX.size : _PREFIX.size + HEADER_BYTES])
        if not isinstance(header, dict):
            raise TypeError("the header is not an object")
        identity, cache_state, dialogue_state = header["identity"], header["cache"], header["dialogue"]
        archive_bytes = header.get("archive_bytes", 0) if version >= 3 else 0
        saved_history = header.get("history") if version >= 4 else None
        if not isinstance(identity, dict):
            raise TypeError("identity is not an object")
        if type(archive_bytes) is not int or archive_bytes < 0:
            raise ValueError(f"archive_bytes = {archive_bytes!r}")
        history_bytes = _history_bytes(saved_history)
        if len(data) != expected + archive_bytes + history_bytes:
            raise ValueError(f"{len(data)} bytes, a session of this build with its archive and history has "
                             f"{expected} + {archive_bytes} + {history_bytes} (truncated, or from another build)")  # fmt: skip
        _check_dialogue_state(dialogue_state, d.decoder.manifest.model.vocab_size)
        archive = None
        if archive_bytes:
            archive = json.loads(body[expected - _DIGEST : expected - _DIGEST + archive_bytes])
            _check_archive(archive)
        adapter = _saved_adapter(header.get("adapter"), d, f"{path}: ", fix)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SessionError(f"{path}: unreadable session header ({str(e)[:200]}); {fix}") from e
    mine = _identity(d)
    if identity.get("model") != mine["model"]:
        raise SessionError(f"{path}: this session was saved with another model's weights; {fix}")
    if identity != mine:
        raise SessionError(f"{path}: this session was saved with another build of this model (graph or cache layout); {fix}")
    offset = _PREFIX.size + HEADER_BYTES
    arrays = []
    for buf in _buffers(d):
        arrays.append(np.frombuffer(body, dtype=buf.dtype, count=buf.size, offset=offset).reshape(buf.shape))
        offset += buf.nbytes
    try:
        required = set(SlotState.COUNTERS) - set(SlotState.OPTIONAL)  # an older file lacks the newer ones
        if not isinstance(cache_state, dict) or not required <= set(cache_state) <= set(SlotState.COUNTERS):
            raise StateError(f"cache counters {sorted(cache_state) if isinstance(cache_state, dict) else cache_state!r}")
        if not all(type(v) is int for v in cache_state.values()):
            raise StateError("cache counters must be integers")
        state = SlotState(arrays[0].copy(), **cache_state)
        check_state(state, d.decoder.layout)
    except StateError as e:
        raise SessionError(f"{path}: the saved cache does not fit this build's layout ({e}); {fix}") from e
    try:
        history = _saved_history(saved_history, body, expected - _DIGEST + archive_bytes, d, state)
    except HistoryError as e:
        raise SessionError(f"{path}: the saved history does not fit the saved cache ({e}); {fix}") from e
    # Everything checked: restore in place (the buffers keep their addresses and bindings).
    dec = d.decoder
    with defer_sigint():
        dec.resume_adapter(adapter, history)  # its inputs bound; the cache reset, then overwritten below
        for buf, saved in zip(_buffers(d)[1:], arrays[1:]):
            np.copyto(buf, saved)
        dec.cache.restore(state)
        dec.backend.restored()
        d.restore(dialogue_state, archive)
