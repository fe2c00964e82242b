"""Running a child process for the baselines (a baseline run, the GGUF preparation, the ort-genai model
builder and its KV-cache calibration), and turning its failure into an error that carries the child's
own error line.

A child's stdout and stderr are read as one stream. Two kinds of line talk to the parent; the rest is
kept (the last TAIL_LINES of it) to explain a failure:

    progress: TEXT               relayed to the caller's progress callback as it arrives
    error: KIND: MESSAGE         the child's own CabinlmError (KIND its class name), raised again here

A failure's message puts the child's real error on its first line (callers that show one line show
that), then the last lines the child wrote:

    ort-genai int4: the model builder failed (exit 1): ModuleNotFoundError: No module named 'onnx_ir'
      | Traceback (most recent call last):
      | ...
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from cabinlm.bench.catalog import BaselineError, BaselineUnavailable
from cabinlm.contract.errors import CabinlmError, ModelError

TAIL_LINES = 40  # lines of a child's output kept to explain a failure
SHOWN_LINES = 15  # of which a failure's message shows the last ones

PROGRESS = "progress: "
ERROR = "error: "

# The CabinlmError kinds a child may report that the parent raises as the same class.
KINDS: dict[str, type[CabinlmError]] = {"ModelError": ModelError, "BaselineUnavailable": BaselineUnavailable,
                                        "BaselineError": BaselineError}  # fmt: skip

_TRACEBACK = "Traceback (most recent call last):"
_ERROR_WORD = re.compile(r"\b(error|fatal|failed|exception)\b", re.IGNORECASE)
_ERROR_CLASS = re.compile(r"[A-Za-z](Error|Exception)\b")  # RuntimeError, OSError, ...


@dataclass
class ChildResult:
    """What a finished child left: its exit status and the last lines of its output (progress lines
    excluded)."""

    returncode: int
    tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_child(cmd: list[str], *, env: dict[str, str] | None = None,
              progress: Callable[[str], None] | None = None) -> ChildResult:  # fmt: skip
    """Run CMD to its end, stdout and stderr merged; relay its progress lines, keep the tail of the rest."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env=env)  # fmt: skip
    assert proc.stdout is not None  # PIPE above
    with proc:
        for raw in proc.stdout:
            line = raw.rstrip()  # text mode: a progress bar's carriage returns end lines too
            if line.startswith(PROGRESS):
                if progress:
                    progress(line[len(PROGRESS) :])
            elif line.strip():
                tail.append(line)
    return ChildResult(proc.wait(), list(tail))


def error_line(lines: list[str]) -> str:
    """The line that says why a child failed: its own `error: KIND: MESSAGE` line, else the exception
    line that ends its last Python traceback, else the last line that reads like an error, else its
    last line."""
    for line in reversed(lines):
        if line.startswith(ERROR):
            return line[len(ERROR) :]
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
    if starts:
        # Frames are indented; the exception line is the first one after them that is not.
        for line in lines[starts[-1] + 1 :]:
            if line and not line[0].isspace():
                return line.strip()
    for line in reversed(lines):
        if _ERROR_WORD.search(line) or _ERROR_CLASS.search(line):
            return line.strip()
    return lines[-1].strip() if lines else "(no output)"


def _exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def failure(what: str, result: ChildResult) -> CabinlmError:
    """The error for a child that failed: WHAT, its exit status and its own error line first, then the
    tail of its output. A child that reported its own CabinlmError (an `error: KIND: MESSAGE` line)
    gets the same class back, with its message as it was."""
    for i in range(len(result.tail) - 1, -1, -1):
        if result.tail[i].startswith(ERROR):
            kind, _, message = result.tail[i][len(ERROR) :].partition(": ")
            if kind in KINDS:  # the lines after it are the rest of its message
                return KINDS[kind]("\n".join([message, *result.tail[i + 1 :]]))
            break
    shown = "\n".join(f"  | {line}" for line in result.tail[-SHOWN_LINES:]) or "  | (no output)"
    return BaselineError(f"{what} failed ({_exit(result.returncode)}): {error_line(result.tail)}\n{shown}")


def check(cmd: list[str], what: str, *, env: dict[str, str] | None = None,
          progress: Callable[[str], None] | None = None) -> ChildResult:  # fmt: skip
    """Run CMD; raise `failure(what, ...)` unless it exits 0."""
    result = run_child(cmd, env=env, progress=progress)
    if not result.ok:
        raise failure(what, result)
    return result
