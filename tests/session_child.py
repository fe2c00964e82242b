"""Child process for the fault-injection test: runs turns with a session file, and can die
(os._exit, like a power cut) at the k-th operating-system call made while saving.

An optional fifth argument (JSON) names switchable LoRA adapters: {"adapter": A} for a dialogue that
starts here, {"switch": B} to change the adapter of a dialogue resumed from the file."""

from __future__ import annotations

import json
import os
import sys

from cabinlm.runtime import Dialogue, open_artifact
from cabinlm.runtime import persist


class DyingOS:
    """Stands in for `os` inside cabinlm.runtime.persist; counts its calls and dies at call `at`."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if not callable(real):
            return real

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                os._exit(77)
            return real(*args, **kwargs)

        return call


def main() -> None:
    artifact, session, kill_at, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    adapters = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    dec, tok = open_artifact(artifact, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=6)
    if os.path.exists(session):
        persist.load_session(session, d)
        if "switch" in adapters:
            d.set_adapter(adapters["switch"])
    elif "adapter" in adapters:
        d.set_adapter(adapters["adapter"])
    start = d.turns
    if kill_at > 0:
        persist.os = DyingOS(kill_at)
    replies = []
    for text in turns[start:]:
        replies.append(d.ask(text).reply)
        persist.save_session(session, d)
    print(json.dumps({"resumed_at": start, "replies": replies, "os_calls": getattr(persist.os, "calls", None)}))


if __name__ == "__main__":
    main()
