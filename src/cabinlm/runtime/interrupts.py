"""Ctrl-C held while a cache or a session file is written, so a half-written state never survives."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def defer_sigint():
    """Hold Ctrl-C until the block ends; then raise KeyboardInterrupt if one came. A no-op off the
    main thread (signals are delivered to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
