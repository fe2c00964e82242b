"""`--sessions DIR`: every seat saved after each turn, and resumed when the server starts again.

    DIR/NAME.session        the seat's dialogue: runtime/persist.save_session (cache, slot table,
                            dialogue state; atomic, checked, survives kill -9)
    DIR/NAME.history.json   the seat's SeatRecord (the exchanges its cache holds) and the sha256 that
                            ends the session file it describes
    DIR/.NAME.session.lock  persist's lock: a second server on the same folder is refused

The two files cannot be replaced in one atomic step, so the session file is written first and the
record names it: a crash between the two leaves a record that names another session, which is then
not trusted. The seat resumes its cache all the same and, not knowing which history it holds, starts
over from the next request's history (correct, only slower). A record is never trusted beyond the
session file it names.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from cabinlm.contract.errors import CabinlmError
from cabinlm.runtime.dialogue import Dialogue
from cabinlm.runtime.persist import load_session, release_session, save_session
from cabinlm.serve.history import SeatRecord
from cabinlm.serve.schema import SEAT_NAME

SESSION = ".session"
RECORD = ".history.json"
RECORD_FORMAT = 1
_DIGEST = 32  # the sha256 that ends a session file (runtime/persist.py)


def _write_atomically(path: Path, data: bytes) -> None:
    """As persist.save_session writes: a temporary under a fresh name (created exclusively, never
    through a link), fsynced, renamed over `path`, the folder fsynced; on failure the temporary goes."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _session_digest(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(-_DIGEST, os.SEEK_END)
        return f.read(_DIGEST).hex()


class SeatStore:
    """The session folder: one pair of files per seat name."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise CabinlmError(f"{self.folder}: not a folder; --sessions takes a folder (one file pair per seat)")
        self.folder.mkdir(parents=True, exist_ok=True)

    def names(self) -> list[str]:
        """The seats saved here, by name (sorted)."""
        names = sorted(p.name[: -len(SESSION)] for p in self.folder.glob(f"*{SESSION}"))
        return [n for n in names if SEAT_NAME.fullmatch(n)]

    def save(self, name: str, dialogue: Dialogue, record: SeatRecord | None) -> None:
        session = self.folder / f"{name}{SESSION}"
        save_session(session, dialogue)
        body = {"format": RECORD_FORMAT, "session_sha256": _session_digest(session),
                "record": None if record is None else record.to_dict()}  # fmt: skip
        _write_atomically(self.folder / f"{name}{RECORD}", json.dumps(body, ensure_ascii=False).encode("utf-8"))

    def load(self, name: str, dialogue: Dialogue) -> SeatRecord | None:
        """Restore the seat's dialogue (SessionError if its file cannot be resumed; nothing changes
        then) and return its record, or None when the record is missing, unreadable or names
        another session file."""
        session = self.folder / f"{name}{SESSION}"
        load_session(session, dialogue)
        vocab = dialogue.decoder.manifest.model.vocab_size
        try:
            body = json.loads((self.folder / f"{name}{RECORD}").read_text(encoding="utf-8"))
            if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
                return None
            if body.get("session_sha256") != _session_digest(session) or body.get("record") is None:
                return None
            record = SeatRecord.from_dict(body["record"], vocab)
        except (OSError, ValueError, RecursionError):  # JSON and Unicode errors are ValueErrors
            return None  # no usable record: the seat starts over from the next request's history
        return record if record.system == dialogue.system else None

    def delete(self, name: str) -> None:
        session = self.folder / f"{name}{SESSION}"
        release_session(session)  # persist's lock on the file, held since its first save or load
        for path in (session, self.folder / f"{name}{RECORD}", self.folder / f".{name}{SESSION}.lock"):
            path.unlink(missing_ok=True)
