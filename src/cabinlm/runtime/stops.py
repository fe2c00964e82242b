"""Stop strings: the reply ends where one of them first appears, and never shows it.

OpenAI's rule: the returned text is the reply up to the first occurrence of any stop string, the
stop string excluded. A stop string may be split across tokens, so a stream holds back the text
that could still become one (the longest tail that is a stop string's beginning), and lets it out
only once it cannot:

    text so far     "Set it to 22 deg"    stop ["degrees"]    shown "Set it to 22 ", held "deg"
    next delta      "rees."                                   found: the reply ends; shown nothing more

Held-back text never leaks: what a stream shows is always a prefix of the final reply.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 4  # as OpenAI's chat completions


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(text up to the first stop string, whether one was found)."""
    at = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


class StopStrings:
    """A stream's stop-string filter: push() the reply's text deltas, get back what may be shown."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything pushed
        self.shown = 0  # characters of `text` given out
        self.stopped = False

    def push(self, delta: str) -> str:
        """What of the reply may be shown now (after a stop string: nothing, ever)."""
        if self.stopped:
            return ""
        self.text += delta
        cut, found = cut_at_stop(self.text, self.stops)
        if found:
            self.stopped = True
            return self._show(len(cut))
        return self._show(len(self.text) - self._held(self.text))

    def flush(self) -> str:
        """The reply ended without a stop string: the held-back tail is shown."""
        return "" if self.stopped else self._show(len(self.text))

    def _show(self, upto: int) -> str:
        out = self.text[self.shown : upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return out

    def _held(self, text: str) -> int:
        """The length of the longest tail of `text` that is a stop string's proper beginning."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
