"""What the serve benchmarks share: a real `cabinlm serve` started on a free port, waited for until
/health answers, and stopped with SIGTERM when the measurement ends, its output in a log file for a
failure; and the server's resident memory."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@contextlib.contextmanager
def serving(build: str | Path, options: Sequence[str], log_name: str) -> Iterator[tuple[int, int]]:
    """`cabinlm serve BUILD OPTIONS` on 127.0.0.1 at a free port, ready: yields (port, the server's pid)."""
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"{log_name}_{port}.log", "wb")  # the server's output, for a failure
    cmd = [sys.executable, "-m", "cabinlm", "serve", str(build), "--host", "127.0.0.1", "--port", str(port), *options]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start; see {log.name}")
                time.sleep(0.2)
        yield port, server.pid
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
