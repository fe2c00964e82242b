"""A real Ctrl-C (SIGINT through the process's own handler) at each point of the fused build's key
refresh: before the rotation graph runs, after it returned its keys but before they are written, and
after they are written but before the refresh is recorded.

tests/test_fused.py raises KeyboardInterrupt in place of the rotation graph's run, the first of these
points only; a signal reaches Python code wherever the interpreter next checks for one, so each point
gets a real one here. At every point the step is abandoned before its commit, and the next step
redoes the refresh: the logits equal an uninterrupted decoder's, token for token.

The build uses ONNX Runtime's GroupQueryAttention, which reads the sink / pinned keys from the cache,
so the runtime refreshes them; cabinlm's own attention kernel rotates them itself from their float
copy on every row and has no refresh to interrupt.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from test_fused import LAYOUT, fused_build

from cabinlm.runtime import Decoder


@pytest.fixture(autouse=True)
def python_handles_sigint():
    """Python's own SIGINT handler for each test: a process started in the background by a
    non-interactive shell inherits SIGINT ignored, and Python then installs no handler (no
    KeyboardInterrupt would ever land)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="module")
def fused(load, tiny_llama_dir, export_to, tmp_path_factory):
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    return fused_build(art, tmp_path_factory.mktemp("fused-int8") / "b", attention_kernel="onnxruntime")


WHERE = ["before the rotation runs", "after it returns the keys", "after the keys are written"]


@pytest.mark.parametrize("where", WHERE)
def test_a_real_sigint_inside_the_key_refresh_leaves_no_stale_key(fused, where):
    a, b = Decoder(fused), Decoder(fused)
    rng = np.random.default_rng(7)
    system = rng.integers(3, 300, 7)
    a.feed(system, pin=True)
    b.feed(system, pin=True)
    for _ in range(LAYOUT["window"] // 2):  # the window fills: from here each 2-token chunk evicts (a refresh)
        ids = rng.integers(3, 300, 2)
        a.step(ids), b.step(ids)
    rot = b.backend.rotated
    assert rot.session is not None  # the build's rotation graph runs the refresh
    real_session, real_write, armed = rot.session, rot._write, {"left": 1}

    def sigint() -> None:
        if armed["left"]:
            armed["left"] -= 1
            signal.raise_signal(signal.SIGINT)  # through Python's handler: KeyboardInterrupt where it lands

    class Session:
        def run(self, *args, **kwargs):
            if where == "before the rotation runs":
                sigint()
            out = real_session.run(*args, **kwargs)
            if where == "after it returns the keys":
                sigint()
            return out

    def write(rotated):
        real_write(rotated)
        if where == "after the keys are written":
            sigint()

    rot.session, rot._write = Session(), write
    interrupted = 0
    for t in range(12):
        ids = rng.integers(3, 300, 2)
        want = a.step(ids)
        try:
            got = b.step(ids)
        except KeyboardInterrupt:
            interrupted += 1
            got = b.step(ids)  # the same chunk again: nothing was committed
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"chunk {t}, interrupted {where}")
    assert interrupted == 1 and armed["left"] == 0
    assert (b.cache.seen, b.cache.evicted) == (a.cache.seen, a.cache.evicted)
