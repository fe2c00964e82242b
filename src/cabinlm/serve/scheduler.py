"""One inference at a time on the shared model, handed from seat to seat between tokens, in arrival order.

The seats share one loaded model (ONNX Runtime sessions and weights). Each request runs in its own
worker thread and holds ModelTurns while it feeds or decodes; between two reply tokens it calls
pass_turn(), which hands the model to the longest-waiting request (if any) and queues behind it:

    time ->   seat A: [prefill A][tok][tok]       [tok]       [tok][tok] ...
              seat B:                   [prefill B]    [tok]
                                     ^ B arrives: A passes the model on at its next token

So a reply's time to first token is bounded by one prefill (plus one token per waiting seat), not by
another seat's whole reply, and N streaming seats decode round-robin at 1/N of the solo speed each.
A prefill (a prompt, or a seat starting over from a long history) is not split.

A plain threading.Lock is not used: its release-then-acquire lets the releasing thread take it again
at once (no hand-over), which would starve every other seat.
"""

from __future__ import annotations

import collections
import threading


class ModelTurns:
    """A first-come-first-served lock with direct hand-over."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiting: collections.deque[threading.Event] = collections.deque()

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()  # set by release(): the model is ours, never free in between

    def release(self) -> None:
        with self._mutex:
            if self._waiting:
                self._waiting.popleft().set()  # hand over; _held stays True
            else:
                self._held = False

    def pass_turn(self) -> None:
        """Let every request that was waiting run once before this one goes on (no-op when none waits)."""
        with self._mutex:
            if not self._waiting:
                return
        self.release()
        self.acquire()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def __enter__(self) -> ModelTurns:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
