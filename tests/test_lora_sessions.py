"""A seat's history (runtime/history.py) in session files: a seat saved with one adapter, resumed (in
this process or another, after a power cut at any point of a save) and switched to another, holds the
cache and gives the reply of a fresh seat with that adapter fed the same steps, through speculative
decoding's verified chunks and the recall region's refreshes. Older files and damaged histories."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import cabinlm
from test_lora import make_peft_adapter
from test_lora_switch import built, export_switchable, llama_switch  # noqa: F401 (fixtures)
from test_recall import FACTS, FILLER

from cabinlm.contract.errors import InputError
from cabinlm.runtime import RuntimeConfig, open_runtime
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.history import History, HistoryError, Kind
from cabinlm.runtime.persist import HEADER_BYTES, SessionError, load_session, save_session, session_size


def seat(artifact: Path, adapter: str | None = None, **kw):
    config = RuntimeConfig(artifact, adapter=adapter, max_new_tokens=kw.pop("max_new_tokens", 10), **kw)
    return open_runtime(config).dialogues()[0]


def fed(dec: Decoder, history: History) -> None:
    """The reference: a seat fed the history's steps through the decoder's public calls."""
    for kind, ids in history:
        if kind is Kind.BEGIN_RECALL:
            dec.begin_recall()
        elif kind is Kind.VERIFIED:
            dec.verify(ids, lambda logits, n=len(ids): n)
        else:
            dec.step(ids, pin=kind.pin)


def same_cache(one: Decoder, two: Decoder) -> None:
    """The same slot table, and the same K/V in every slot in use (an empty slot is masked: it may
    hold what a rejected draft left there)."""
    np.testing.assert_array_equal(one.cache.slot_token, two.cache.slot_token)
    assert one.cache.state().counters() == two.cache.state().counters()
    used = np.flatnonzero(one.cache.slot_token >= 0)
    for name, buf in one.backend.buffers().items():  # the slots' axis: the first that holds them all (padded or not)
        axis = next((i for i, n in enumerate(buf.shape) if n >= len(one.cache.slot_token)), None)
        mine, theirs = (buf, two.backend.buffers()[name]) if axis is None else \
            (np.take(buf, used, axis), np.take(two.backend.buffers()[name], used, axis))  # fmt: skip
        np.testing.assert_array_equal(theirs, mine, err_msg=name)


def same_history(one: History, two: History) -> None:
    for x, y in zip(one.arrays(), two.arrays()):
        np.testing.assert_array_equal(x, y)


# -- the history itself ----------------------------------------------------------------------------------


steps = st.lists(st.one_of(st.tuples(st.sampled_from([False, True, "recall"]), st.booleans(),
                                     st.lists(st.integers(0, 999), min_size=1, max_size=8)),
                           st.just(None)), max_size=60)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(steps=steps)
def test_a_history_keeps_every_step_in_order_and_reads_back_from_its_arrays(steps):
    h = History()
    expected = []
    for step in steps:
        if step is None:
            h.begin_recall()
            expected.append((Kind.BEGIN_RECALL, []))
        else:
            pin, verified, ids = step
            h.add(np.array(ids), pin, verified and pin is False)
            kind = Kind.VERIFIED if verified and pin is False else Kind([False, True, "recall"].index(pin))
            expected.append((kind, ids))
    assert [(k, ids.tolist()) for k, ids in h] == expected
    assert h.tokens == sum(len(ids) for _, ids in expected) and h.nbytes == 8 * len(expected) + 4 * h.tokens
    runs, ids = h.arrays()
    assert runs.dtype == ids.dtype == np.int32
    back = History.from_arrays(runs, ids, vocab=1000, chunk=8)
    assert [(k, i.tolist()) for k, i in back] == expected
    back.add(np.array([5]), False)  # a history read back grows as any
    assert back.tokens == h.tokens + 1


@pytest.mark.parametrize("runs, ids, message", [
    ([[7, 1]], [3], "kind 7"),
    ([[Kind.WINDOW, 0]], [], "outside 1..8"),
    ([[Kind.WINDOW, 9]], list(range(9)), "outside 1..8"),
    ([[Kind.BEGIN_RECALL, 1]], [3], "outside 1..8"),
    ([[Kind.WINDOW, 2]], [3], "hold 2 tokens, its ids 1"),
    ([[Kind.WINDOW, 1]], [1000], "outside 0..999"),
])  # fmt: skip
def test_arrays_that_are_not_a_history_are_refused(runs, ids, message):
    with pytest.raises(HistoryError, match=message):
        History.from_arrays(np.array(runs, dtype=np.int32), np.array(ids, dtype=np.int32), vocab=1000, chunk=8)


# -- save with a, resume, switch to b ------------------------------------------------------------------


def test_a_resumed_seat_switches_adapter_as_a_fresh_seat_fed_its_history(built, tmp_path):  # noqa: F811
    """Speculative decoding on: the history holds verified chunks, run again as they were planned."""
    d = seat(built, "a", speculative=True)
    for text in ("hello hello hello hello", "say it again, say it again"):
        d.ask(text)
    assert any(kind is Kind.VERIFIED for kind, _ in d.decoder.history)
    save_session(tmp_path / "s", d)
    assert (tmp_path / "s").stat().st_size == session_size(d) + d.decoder.history.nbytes
    saved = History.from_arrays(*d.decoder.history.arrays(), vocab=10**9, chunk=10**9)
    with_a = d.ask("and now?").reply
    resumed = seat(built, speculative=True)  # opened without an adapter: the file's is a
    load_session(tmp_path / "s", resumed)
    assert resumed.adapter == "a"
    same_history(resumed.decoder.history, saved)
    resumed.set_adapter("b")
    assert resumed.adapter == "b"
    # A fresh seat with b, fed the same steps, holds the same cache ...
    fresh = seat(built, "b", speculative=True)
    fed(fresh.decoder, saved)
    fresh.restore(resumed.state())
    same_cache(resumed.decoder, fresh.decoder)
    # ... and gives the same reply, which is not a's.
    replies = [resumed.ask("and now?").reply, fresh.ask("and now?").reply]
    assert replies[0] == replies[1] != with_a
    # And a switch back to a runs the same history again: the cache a's seat held.
    again = seat(built, speculative=True)
    load_session(tmp_path / "s", again)
    again.set_adapter("b")
    again.set_adapter("a")
    assert again.ask("and now?").reply == with_a


def child(artifact, session, kill_at, turns, adapters) -> subprocess.CompletedProcess:
    code = Path(__file__).parent / "session_child.py"
    args = [sys.executable, str(code), str(artifact), str(session), str(kill_at), json.dumps(turns),
            json.dumps(adapters)]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_power_cut_during_a_save_leaves_a_seat_that_resumes_and_switches_exactly(built, tmp_path):  # noqa: F811
    """Another process dies at every operating-system call of its second save (with adapter a); the
    next process resumes the file and switches to b: its replies are those of a seat that kept the
    same turns with a, was resumed and switched without any crash."""
    turns = ["check the route", "and the weather", "play some music", "how far is it"]
    expected = {}
    for r in (1, 2):  # the turns before the resume: the file holds the first or the second save
        first = child(built, tmp_path / f"ref{r}", 0, turns[:r], {"adapter": "a"})
        assert first.returncode == 0, first.stderr
        then = child(built, tmp_path / f"ref{r}", 0, turns, {"switch": "b"})
        assert then.returncode == 0, then.stderr
        expected[r] = json.loads(then.stdout)["replies"]
    probe = child(built, tmp_path / "probe", 10**6, turns[:1], {"adapter": "a"})
    calls = json.loads(probe.stdout)["os_calls"]
    outcomes = set()
    for k in range(calls + 1, 2 * calls + 1):
        session = tmp_path / f"s{k}"
        died = child(built, session, k, turns, {"adapter": "a"})
        assert died.returncode == 77, (k, died.stderr)
        resumed = child(built, session, 0, turns, {"switch": "b"})
        assert resumed.returncode == 0, (k, resumed.stderr)
        r = json.loads(resumed.stdout)
        assert r["replies"] == expected[r["resumed_at"]], k
        outcomes.add(r["resumed_at"])
    assert outcomes == {1, 2}


# -- the recall region's refreshes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def recall_build(tiny_llama_dir, tmp_path_factory):
    """A switchable export with a recall region, built for the cpu profile with adapters a and b."""
    root = tmp_path_factory.mktemp("lora-recall")
    folder, _ = export_switchable(tiny_llama_dir, root / "art", rank=8, sink=4, pinned=28, window=128, chunk=8,
                                  recall=128, kv="fp32")  # fmt: skip
    a = make_peft_adapter(tiny_llama_dir, root / "a", r=4, alpha=8, seed=21)
    b = make_peft_adapter(tiny_llama_dir, root / "b", r=8, alpha=16, seed=22)
    p = cabinlm("build", folder, "--profile", "cpu", "-o", root / "build", "--adapter", f"a={a}", "--adapter", f"b={b}")
    assert p.returncode == 0, p.stderr
    return root / "build"


def recalled(d) -> None:
    """Turns that push facts out of the window, then questions that recall them."""
    for text in [FACTS[0], *FILLER[:4], "where is my car parked?", FACTS[1], *FILLER[4:8], "what is the garage code?",
                 FACTS[2], *FILLER[8:], *FILLER[:3], "when is the violin lesson of my daughter?"]:
        d.ask(text)


def test_a_switch_runs_the_recall_regions_refreshes_again(recall_build, tmp_path):
    """The history holds each refresh (the region emptied, then its chunks): a switch, in memory or
    after a resume, rebuilds the region as a fresh seat with the new adapter fed the same steps."""
    d = seat(recall_build, "a", max_new_tokens=6)
    recalled(d)
    kinds = [kind for kind, _ in d.decoder.history]
    assert kinds.count(Kind.BEGIN_RECALL) >= 2 and Kind.RECALL in kinds  # refreshed more than once
    assert d.decoder.cache.recall_fill > 0
    save_session(tmp_path / "s", d)
    history = History.from_arrays(*d.decoder.history.arrays(), vocab=10**9, chunk=10**9)
    fresh = seat(recall_build, "b", max_new_tokens=6)
    fed(fresh.decoder, history)
    d.set_adapter("b")  # in memory
    same_cache(d.decoder, fresh.decoder)
    resumed = seat(recall_build, max_new_tokens=6)
    load_session(tmp_path / "s", resumed)
    resumed.set_adapter("b")  # after a resume
    same_cache(resumed.decoder, fresh.decoder)
    same_history(resumed.decoder.history, history)
    fresh.restore(resumed.state(), resumed.archive_state())
    assert resumed.ask("and the car?").reply == fresh.ask("and the car?").reply


# -- older files, damaged histories -----------------------------------------------------------------------


def rewrite(path: Path, edit_header, edit_tail=lambda tail, header: tail, version: int | None = None) -> None:
    """The session file with its header (and the bytes after the buffers) edited, checksum recomputed."""
    raw = path.read_bytes()
    header = json.loads(raw[16 : 16 + HEADER_BYTES])
    start = 16 + HEADER_BYTES
    fixed = len(raw) - 32 - header["archive_bytes"] - 8 * header["history"]["entries"] - 4 * header["history"]["tokens"]
    tail = edit_tail(raw[fixed:-32], header)
    header = edit_header(header)
    prefix = raw[:16] if version is None else raw[:8] + struct.pack("<I", version) + raw[12:16]
    body = prefix + json.dumps(header).encode().ljust(HEADER_BYTES, b" ") + raw[start:fixed] + tail
    path.write_bytes(body + hashlib.sha256(body).digest())


def without_history(header: dict) -> dict:
    return {k: v for k, v in header.items() if k != "history"}


def test_a_session_file_without_a_history_resumes_and_refuses_a_switch(built, tmp_path):  # noqa: F811
    """A version 3 file (written before the history) still resumes with its adapter; a switch is
    refused with one line, and the seat answers on."""
    d = seat(built, "a")
    d.ask("remember this")
    save_session(tmp_path / "s", d)
    expected = d.ask("and now?").reply
    rewrite(tmp_path / "s", without_history, lambda tail, h: tail[: h["archive_bytes"]], version=3)
    resumed = seat(built)
    load_session(tmp_path / "s", resumed)
    assert resumed.adapter == "a" and resumed.decoder.history is None
    with pytest.raises(InputError, match="history is unknown .* start a new dialogue"):
        resumed.set_adapter("b")
    assert resumed.adapter == "a" and resumed.ask("and now?").reply == expected


@pytest.mark.parametrize("damage, message", [
    (lambda h: {**h, "history": {**h["history"], "tokens": h["history"]["tokens"] + 1}}, "truncated"),
    (lambda h: {**h, "history": {"entries": "3", "tokens": 1}}, "whole numbers"),
    (lambda h: {**h, "history": [1, 2]}, "exactly entries, tokens"),
], ids=["count", "type", "shape"])  # fmt: skip
def test_a_damaged_history_header_is_refused_and_nothing_changes(built, tmp_path, damage, message):  # noqa: F811
    d = seat(built, "a")
    d.ask("remember this")
    save_session(tmp_path / "s", d)
    rewrite(tmp_path / "s", damage)
    fresh = seat(built)
    with pytest.raises(SessionError, match=message):
        load_session(tmp_path / "s", fresh)
    assert fresh.adapter is None and fresh.decoder.cache.length == 0


def test_a_history_that_does_not_fit_the_cache_is_refused(built, tmp_path):  # noqa: F811
    """Valid arrays whose steps are not the cache's (a token more or less than the stream, an id out of
    the vocabulary): SessionError, nothing changed."""
    d = seat(built, "a")
    d.ask("remember this")
    save_session(tmp_path / "s", d)
    original = (tmp_path / "s").read_bytes()

    def last_step_shorter(tail: bytes, h: dict) -> bytes:  # the last step loses its token
        entries, tokens = h["history"]["entries"], h["history"]["tokens"]
        runs = np.frombuffer(tail, np.int32, 2 * entries, h["archive_bytes"]).reshape(-1, 2).copy()
        ids = np.frombuffer(tail, np.int32, tokens, h["archive_bytes"] + 8 * entries)
        assert runs[-1, 1] == 1  # a decoded token
        return tail[: h["archive_bytes"]] + runs[:-1].tobytes() + ids[:-1].tobytes()

    def one_step_less(h: dict) -> dict:
        return {**h, "history": {"entries": h["history"]["entries"] - 1, "tokens": h["history"]["tokens"] - 1}}

    rewrite(tmp_path / "s", one_step_less, last_step_shorter)
    with pytest.raises(SessionError, match="the saved history does not fit the saved cache"):
        load_session(tmp_path / "s", seat(built))
    (tmp_path / "s").write_bytes(original)

    def huge_id(tail: bytes, h: dict) -> bytes:
        cut = len(tail) - 4
        return tail[:cut] + np.int32(2**31 - 1).tobytes()

    rewrite(tmp_path / "s", lambda h: h, huge_id)
    fresh = seat(built)
    with pytest.raises(SessionError, match="token id outside"):
        load_session(tmp_path / "s", fresh)
    assert fresh.decoder.cache.length == 0
    (tmp_path / "s").write_bytes(original)

    def first_step_pinned(tail: bytes, h: dict) -> bytes:  # a layout without pinned slots
        at = h["archive_bytes"]
        return tail[:at] + np.int32(Kind.PINNED).tobytes() + tail[at + 4 :]

    rewrite(tmp_path / "s", lambda h: h, first_step_pinned)
    with pytest.raises(SessionError, match=r"step 0 \(pinned, \d+ tokens\) cannot follow"):
        load_session(tmp_path / "s", fresh)
    assert fresh.decoder.cache.length == 0


def test_a_cache_put_back_behind_the_decoders_back_has_no_history(built, tmp_path):  # noqa: F811
    """A caller that restores an earlier cache state itself (as bench/recall.py scores its choices)
    leaves steps in the history the cache no longer holds: the history is then unknown, a switch is
    refused and a save keeps none, so the file still resumes."""
    d = seat(built, "a")
    d.ask("remember this")
    dec = d.decoder
    state, saved = dec.cache.state(), [b.copy() for b in dec.backend.buffers().values()]
    dec.feed(np.array([5, 6, 7]))
    for buf, keep in zip(dec.backend.buffers().values(), saved):
        np.copyto(buf, keep)
    dec.cache.restore(state)
    dec.backend.restored()
    assert dec.history is not None and dec.known_history() is None
    with pytest.raises(InputError, match="history is unknown"):
        d.set_adapter("b")
    save_session(tmp_path / "s", d)
    assert (tmp_path / "s").stat().st_size == session_size(d)
    resumed = seat(built)
    load_session(tmp_path / "s", resumed)
    assert resumed.adapter == "a" and resumed.decoder.history is None
