"""Seats' turns in threads of their own under serve's scheduler (runtime.model_turns.SeatSteps), as
`cabinlm serve` runs them: the tests' shared harness (test_batched_seats, test_batched_frames)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def turns_in_threads(model, turns: list[Callable[[], object]]) -> list:
    """Run each of `turns` in a thread of its own, all queued (in order) on `model` while the test holds
    it, then released together so that their steps ride in batched runs. Returns each turn's result;
    raises the first error a turn raised."""
    got: list = [None] * len(turns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = turns[i]()
        except Exception as e:  # raised below, in the test's thread
            errors.append(e)

    model.acquire()
    threads = []
    for i in range(len(turns)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while model.waiting < i + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert model.waiting == len(turns)
    model.release()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return got
