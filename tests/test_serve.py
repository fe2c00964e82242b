"""`cabinlm serve` as a client meets it: the real `openai` package against a real server process on a
127.0.0.1 port (every wait bounded), on a tiny random-weight Qwen2 whose window (40 tokens) turns
over within a few turns. Replies are compared byte for byte with `cabinlm chat` or with the library's
Dialogue doing what the server claims to do, greedy, with one ONNX Runtime thread on both sides.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from cabinlm.runtime import Dialogue, open_artifact  # noqa: E402
from cabinlm.runtime.persist import save_session  # noqa: E402
from cabinlm.serve.history import Exchange, SeatRecord, plan_turn  # noqa: E402
from cabinlm.runtime.model_turns import ModelTurns  # noqa: E402
from cabinlm.serve.store import SeatStore  # noqa: E402
from cabinlm.serve.conversation import Conversation, Message  # noqa: E402

MODEL = "tiny-qwen2"  # --model-name of every tiny server
DRIVER = ["check the route", "and the weather", "how far is it", "play some music"]
PASSENGER = ["take a break", "keep a safe distance", "thanks", "one more thing"]
PASSENGER_SYSTEM = "Check the mirrors."
REPLY = 10  # max_tokens of the tiny conversations
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, whatever the environment


@pytest.fixture(scope="module")
def artifact(load, tiny_qwen2_dir, export_to) -> Path:
    return export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`cabinlm serve` in a subprocess on a free loopback port; stopped (or killed) on exit."""

    def __init__(self, artifact: Path, log: Path, *args, model: str = MODEL, threads: int = 1, start_s: float = 90):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "cabinlm", "serve", str(artifact), "--host", "127.0.0.1", "--port", str(self.port),
               "--threads", str(threads), "--model-name", model, *map(str, args)]  # fmt: skip
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{log.read_text()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise AssertionError(f"the server did not answer /health within {start_s} s:\n{log.read_text()}")

    def client(self, retries: int = 0):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=retries, timeout=60)

    def request(self, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with NO_PROXY.open(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def seat(self, name: str) -> dict:
        status, body = self.request("GET", f"/v1/seats/{name}")
        assert status == 200, body
        return body

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def chat_replies(artifact: Path, turns: list[str], max_new_tokens: int, system: str | None = None,
                 *args: str) -> list[str]:  # fmt: skip
    """What `cabinlm chat` answers to these messages, one conversation, alone."""
    cmd = [sys.executable, "-m", "cabinlm", "chat", str(artifact), "--json", "--threads", "1",
           "--max-new-tokens", str(max_new_tokens), *args] + (["--system", system] if system else [])  # fmt: skip
    p = subprocess.run(cmd, input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [json.loads(line)["reply"] for line in p.stdout.splitlines()]


def library(artifact: Path, max_new_tokens: int = REPLY) -> Dialogue:
    dec, tok = open_artifact(artifact, threads=1, verify=False)
    return Dialogue(dec, tok, max_new_tokens=max_new_tokens)


def history(turns: list[str], replies: list[str], system: str | None = None) -> list[dict]:
    """[system] (user, assistant)* user: what an OpenAI client sends for the next reply."""
    messages = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def cabin(usage) -> dict:
    """The usage block's cabinlm field (the openai client keeps fields it does not know)."""
    return usage.model_extra["cabinlm"]


def ask(client, turns, replies, seat, system=None, max_tokens=REPLY, stream=False, model=MODEL):
    """One request; returns (reply text, usage). Streamed replies are the deltas joined."""
    kw = dict(model=model, messages=history(turns, replies, system), max_tokens=max_tokens, user=seat)
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content, r.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage


def new_tokens(d: Dialogue, text: str, previous_ended_at_length: bool) -> int:
    """Tokens a seat that holds the conversation feeds for one more user message: the previous reply's
    closing (its last token too, when it ended at the length limit) and the rendered message."""
    return int(previous_ended_at_length) + len(d.tok.encode(d.chat.assistant_suffix)) + len(d.render_user(text))


# -- the seat's state machinery, without a server -------------------------------------------------
# These pin down what the server tests below rely on: the lock hands the model over in arrival
# order, and a history is matched against what the seat holds exchange by exchange.


def test_the_model_is_handed_over_between_tokens_in_arrival_order():
    turns, order = ModelTurns(), []
    turns.acquire()  # seat A decodes
    started = []

    def seat(name: str) -> None:
        started.append(name)
        with turns:
            order.append(name)
            turns.pass_turn()
            order.append(name)

    threads = []
    for name in "BC":
        threads.append(threading.Thread(target=seat, args=(name,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while turns.waiting < len(threads) and time.monotonic() < deadline:
            time.sleep(0.001)
    order.append("A")
    turns.pass_turn()  # A's next token waits for B and C to run once
    order.append("A")
    turns.release()
    for t in threads:
        t.join(timeout=10)
    assert order == ["A", "B", "C", "A", "B", "C"]


def test_a_history_is_matched_exchange_by_exchange():
    def conv(*texts, system=None):
        msgs = [Message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)]
        return Conversation(system, tuple(zip(msgs[:-1:2], msgs[1:-1:2])), msgs[-1])

    held = SeatRecord(None, [Exchange("u1", None, "a1", choices=[1]), Exchange("u2", None, "a2", streamed="a2!")])
    extend = plan_turn(held, conv("u1", "a1", "u2", "a2!", "u3"))  # the streamed text matches as well
    assert (extend.rebuild, extend.keep, extend.given) == (False, 2, ())
    more = plan_turn(held, conv("u1", "a1", "u2", "a2", "u3", "a3", "u4"))
    assert (more.rebuild, more.keep, [(u.text, a.text) for u, a in more.given]) == (False, 2, [("u3", "a3")])
    edited = plan_turn(held, conv("u1", "a1", "u2", "other", "u3"))
    assert (edited.rebuild, edited.keep, len(edited.given)) == (True, 1, 1)
    retried = plan_turn(held, conv("u1", "a1", "u2"))  # a shorter history (a retry) cannot be extended
    assert (retried.rebuild, retried.keep, retried.prompt.text) == (True, 1, "u2")
    assert plan_turn(held, conv("u1", "a1", "u2", "a2", "u3", system="new")).keep == 0
    assert plan_turn(None, conv("u1")).rebuild  # an unknown seat state always starts over


def test_the_server_is_runtime_side_it_imports_without_torch_or_transformers():
    block = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
    code = block + "import cabinlm.serve.app, cabinlm.cli.serve; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_a_seat_record_is_trusted_only_beside_the_session_file_it_names(artifact, tmp_path):
    """The record (which exchanges the cache holds) and the session file cannot be replaced in one
    step: a record that names another session file, or that does not read back as a record, is
    dropped (the seat then starts over from the next history) while the session itself resumes."""
    d = library(artifact)
    d.ask(DRIVER[0])
    held = SeatRecord(d.system, [Exchange(DRIVER[0], None, "a1", choices=[5, 6], max_new_tokens=REPLY)])
    store = SeatStore(tmp_path / "sessions")
    store.save("d", d, held)
    assert store.names() == ["d"]
    assert store.load("d", library(artifact)) == held
    record = tmp_path / "sessions" / "d.history.json"
    good = record.read_text()
    for damage in (lambda b: b.replace("[5, 6]", "[5, 100000]"), lambda b: b.replace('"reply"', '"answer"'),
                   lambda b: b[: len(b) // 2], lambda b: "[]"):  # fmt: skip
        record.write_text(damage(good))
        resumed = library(artifact)
        assert store.load("d", resumed) is None and resumed.turns == 1
    record.write_text(good)
    d.ask(DRIVER[1])
    save_session(tmp_path / "sessions" / "d.session", d)  # a crash before the record followed it
    assert store.load("d", library(artifact)) is None
    store.delete("d")
    assert store.names() == [] and not any((tmp_path / "sessions").iterdir())


# -- the server -----------------------------------------------------------------------------------


def test_two_conversations_at_once_give_the_replies_chat_gives_each_alone(artifact, tmp_path):
    expected = {
        "driver": chat_replies(artifact, DRIVER, REPLY),
        "passenger": chat_replies(artifact, PASSENGER, REPLY, system=PASSENGER_SYSTEM),
    }
    replies: dict[str, list[str]] = {"driver": [], "passenger": []}
    usages: dict[str, list[dict]] = {"driver": [], "passenger": []}
    errors = []
    start = threading.Barrier(2, timeout=30)

    def talk(seat: str, turns: list[str], system: str | None, stream: bool) -> None:
        try:
            client = server.client()
            start.wait()
            for i in range(len(turns)):
                text, usage = ask(client, turns[: i + 1], replies[seat], seat, system, stream=stream)
                replies[seat].append(text)
                usages[seat].append(cabin(usage))
        except Exception as e:  # reported by the main thread
            errors.append(e)

    with Server(artifact, tmp_path / "server.log", "--seats", 2) as server:
        threads = [threading.Thread(target=talk, args=("driver", DRIVER, None, False)),
                   threading.Thread(target=talk, args=("passenger", PASSENGER, PASSENGER_SYSTEM, True))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        seats = {s["name"]: s for s in server.request("GET", "/v1/seats")[1]["data"]}
    assert replies == expected
    for seat, first in (("driver", "extended"), ("passenger", "rebuilt")):  # a new seat pins a system prompt by starting over
        assert [(u["seat"], u["backend"]) for u in usages[seat]] == [(seat, "onnxruntime-cpu")] * 4
        assert [u["history"] for u in usages[seat]] == [first] + ["extended"] * 3
        assert seats[seat]["turns"] == 4 and seats[seat]["evicted_tokens"] > 0  # the window turned over


def test_two_conversations_at_once_stream_the_exact_replies(artifact, tmp_path):
    """The same two conversations, both streamed at the same moment, replies compared as they arrive."""
    expected = {
        "driver": chat_replies(artifact, DRIVER, 24),
        "passenger": chat_replies(artifact, PASSENGER, 24, system=PASSENGER_SYSTEM),
    }
    got: dict[str, list[str]] = {"driver": [], "passenger": []}
    errors = []
    start = threading.Barrier(2, timeout=30)

    def talk(seat: str, turns: list[str], system: str | None) -> None:
        try:
            client = server.client()
            for i in range(len(turns)):
                start.wait()  # both requests of each turn leave together
                got[seat].append(ask(client, turns[: i + 1], got[seat], seat, system, max_tokens=24, stream=True)[0])
        except Exception as e:
            errors.append(e)

    with Server(artifact, tmp_path / "server.log", "--seats", 2) as server:
        threads = [threading.Thread(target=talk, args=("driver", DRIVER, None)),
                   threading.Thread(target=talk, args=("passenger", PASSENGER, PASSENGER_SYSTEM))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert got == expected


def test_the_fused_build_drafts_and_serves_the_plain_replies(artifact, tmp_path):
    """On the fused cpu build the server drafts by prompt lookup (as chat does) and its greedy replies
    are the plain ones byte for byte, through a window that turns over (40 tokens), and after a
    history that makes the seat start over."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    fused = build_artifact(artifact, load_profile("cpu"), tmp_path / "fused", attention="fused")
    turns = DRIVER + ["check the route", "and the weather again"]
    expected = chat_replies(fused, turns, 16, None, "--no-speculative")
    with Server(fused, tmp_path / "serve.log", "--seats", "2") as srv:
        c = srv.client()
        got, drafted = [], 0
        for i in range(len(turns)):
            text, usage = ask(c, turns[: i + 1], got, "driver", max_tokens=16)
            got.append(text)
            drafted += cabin(usage)["drafted_tokens"]
        assert got == expected and drafted > 0
        # A shorter history on the same seat: it starts over, its two exchanges fed again one token
        # per step with the recorded choices (drafting paused), then the new message drafts again.
        edited = turns[:2] + ["play some jazz"]
        text, usage = ask(c, edited, got[:2], "driver", max_tokens=16)
        assert (cabin(usage)["history"], cabin(usage)["fed_again"]) == ("rebuilt", 2)
        assert text == chat_replies(fused, edited, 16, None, "--no-speculative")[-1]


def test_a_history_that_extends_the_seat_feeds_only_the_new_message(artifact, tmp_path):
    d = library(artifact)
    with Server(artifact, tmp_path / "server.log") as server:
        client = server.client()
        replies, finishes = [], []
        for i, text in enumerate(DRIVER[:3]):
            r = client.chat.completions.create(model=MODEL, messages=history(DRIVER[: i + 1], replies), max_tokens=REPLY)
            u = cabin(r.usage)
            expected = len(d.render_user(text)) if i == 0 else new_tokens(d, text, finishes[-1] == "length")
            assert (u["history"], u["fed_again"], r.usage.prompt_tokens) == ("extended", 0, expected)
            assert r.usage.completion_tokens > 0
            replies.append(r.choices[0].message.content)
            finishes.append(r.choices[0].finish_reason)
        assert replies == [d.ask(t).reply for t in DRIVER[:3]]

        # An edited exchange: the seat starts over. The exchanges before the edit are fed again exactly as
        # generated (so the reply is the live conversation's), the client's own exchange by template.
        r = client.chat.completions.create(
            model=MODEL, max_tokens=REPLY,
            messages=history([DRIVER[0], "take a break", "how far is it"], [replies[0], "Sure."]),
        )  # fmt: skip
        u = cabin(r.usage)
        assert (u["history"], u["fed_again"]) == ("rebuilt", 2)
        live = library(artifact)
        live.ask(DRIVER[0])
        live.add_turn("take a break", "Sure.")
        assert r.choices[0].message.content == live.ask("how far is it").reply
        assert r.usage.prompt_tokens > new_tokens(d, "how far is it", True)  # the whole history this time

        # Another system prompt: everything is fed again, by template (nothing is the seat's own any more).
        r = client.chat.completions.create(model=MODEL, max_tokens=REPLY,
                                           messages=history(DRIVER[:2], replies[:1], system=PASSENGER_SYSTEM))  # fmt: skip
        fresh = Dialogue(*open_artifact(artifact, threads=1, verify=False), system=PASSENGER_SYSTEM, max_new_tokens=REPLY)
        fresh.add_turn(DRIVER[0], replies[0])
        assert (cabin(r.usage)["history"], r.choices[0].message.content) == ("rebuilt", fresh.ask(DRIVER[1]).reply)


def test_a_killed_server_resumes_every_seat_from_its_session_files(artifact, tmp_path):
    sessions = tmp_path / "sessions"
    expected = {
        "driver": chat_replies(artifact, DRIVER[:3], REPLY),
        "passenger": chat_replies(artifact, PASSENGER[:3], REPLY, system=PASSENGER_SYSTEM),
    }
    conversations = {"driver": (DRIVER, None, False), "passenger": (PASSENGER, PASSENGER_SYSTEM, True)}
    replies: dict[str, list[str]] = {seat: [] for seat in conversations}
    server = Server(artifact, tmp_path / "first.log", "--seats", 2, "--sessions", sessions)
    try:
        client = server.client()
        for _ in range(2):
            for seat, (turns, system, stream) in conversations.items():
                n = len(replies[seat])
                text, usage = ask(client, turns[: n + 1], replies[seat], seat, system, stream=stream)
                assert cabin(usage)["saved"] is True  # on disk before the reply came back
                replies[seat].append(text)
    finally:
        server.kill()  # kill -9: no shutdown handler runs
    assert server.proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in sessions.iterdir() if not p.name.startswith(".")) == [
        "driver.history.json", "driver.session", "passenger.history.json", "passenger.session"]  # fmt: skip

    d = library(artifact)
    with Server(artifact, tmp_path / "second.log", "--seats", 2, "--sessions", sessions) as server:
        for seat in conversations:
            assert (server.seat(seat)["turns"], server.seat(seat)["exchanges"]) == (2, 2)
        client = server.client()
        for seat, (turns, system, stream) in conversations.items():
            text, usage = ask(client, turns[:3], replies[seat], seat, system, stream=stream)
            replies[seat].append(text)
            # resumed, not rebuilt: only the new message was fed
            assert (cabin(usage)["history"], usage.prompt_tokens) == ("extended", new_tokens(d, turns[2], True))
    assert replies == expected


LONG = 600  # max_tokens of a reply that is cut short


@pytest.fixture(scope="module")
def long_turn(artifact) -> tuple[str, str, str, str]:
    """(second message, the first reply, the second reply at REPLY tokens, the third reply): a
    conversation DRIVER[0], second, "thanks" whose second greedy reply runs past 200 tokens when
    allowed LONG (random weights: found, not assumed)."""
    for second in ["and the weather", "take a break", "play some music", "keep a safe distance"]:
        d = library(artifact)
        d.ask(DRIVER[0])
        d.max_new_tokens = LONG
        if d.ask(second).new_tokens > 200:
            live = library(artifact)
            return second, live.ask(DRIVER[0]).reply, live.ask(second).reply, live.ask("thanks").reply
    raise AssertionError("no candidate message gets a long reply from the tiny model")


def wait_for_answer(server: Server, seat: str, answered: int) -> dict:
    """The seat's state once it has answered `answered` requests and is idle."""
    deadline = time.monotonic() + 30
    while (state := server.seat(seat))["busy"] or state["answered"] != answered:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


def read_first_delta(stream) -> None:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return


def test_a_client_that_disconnects_mid_reply_leaves_the_seat_consistent(artifact, tmp_path, long_turn):
    second, first, expected, expected_next = long_turn
    with Server(artifact, tmp_path / "server.log") as server:
        client = server.client()
        assert ask(client, DRIVER[:1], [], "d")[0] == first
        stream = client.chat.completions.create(model=MODEL, messages=history([DRIVER[0], second], [first]),
                                                max_tokens=LONG, user="d", stream=True)  # fmt: skip
        read_first_delta(stream)
        stream.close()  # the client goes away mid-reply
        seat = wait_for_answer(server, "d", 2)
        assert seat["last"]["finish"] == "cancelled" and 0 < seat["last"]["completion_tokens"] < LONG, seat

        # The client asks again: the seat starts over from the history, its first exchange fed again
        # exactly, and answers as if the cancelled reply had never been started.
        text, usage = ask(client, [DRIVER[0], second], [first], "d")
        assert (text, cabin(usage)["history"], cabin(usage)["fed_again"]) == (expected, "rebuilt", 1)
        text, usage = ask(client, [DRIVER[0], second, "thanks"], [first, text], "d")
        assert (text, cabin(usage)["history"]) == (expected_next, "extended")

        # A client that gives up on a reply it did not ask to stream is noticed as well.
        impatient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=history([DRIVER[0], second], [first]),
                                              max_tokens=LONG * 20, user="d")  # fmt: skip
        seat = wait_for_answer(server, "d", 5)
        assert seat["last"]["finish"] == "cancelled" and seat["last"]["completion_tokens"] < LONG * 20, seat
        text, usage = ask(client, [DRIVER[0], second], [first], "d")
        assert text == expected
        status, health = server.request("GET", "/health")
        assert status == 200 and health["seats"]["busy"] == 0


def test_a_server_asked_to_stop_ends_the_replies_in_flight_and_keeps_their_seats(artifact, tmp_path, long_turn):
    second, first, expected, _ = long_turn
    sessions = tmp_path / "sessions"
    server = Server(artifact, tmp_path / "first.log", "--sessions", sessions)
    try:
        client = server.client()
        assert ask(client, DRIVER[:1], [], "d")[0] == first
        stream = client.chat.completions.create(model=MODEL, messages=history([DRIVER[0], second], [first]),
                                                max_tokens=LONG * 20, user="d", stream=True)  # about 5 s  # fmt: skip
        read_first_delta(stream)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:
            for _ in stream:  # the reply stops at its next token: an error event, not [DONE], ends it
                pass
            raise AssertionError("the stream ended without an error")
        assert e.value.code == "server_stopping"
        assert server.proc.wait(timeout=20) in (0, -signal.SIGTERM)  # uvicorn ends by re-raising the signal
    finally:
        server.stop()
    with Server(artifact, tmp_path / "second.log", "--sessions", sessions) as server:
        assert server.seat("d")["turns"] == 2  # the cut turn was closed and saved
        text, usage = ask(server.client(), [DRIVER[0], second], [first], "d")
        assert (text, cabin(usage)["history"]) == (expected, "rebuilt")


def test_bad_options_and_a_second_server_on_the_same_sessions_are_one_error_line(artifact, tmp_path):
    def serve(*args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cabinlm", "serve", *map(str, args), "--port", str(free_port())],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    def one_error_line(p: subprocess.CompletedProcess, needle: str) -> None:
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and needle in errors[0], p.stderr

    one_error_line(serve(tmp_path / "nothing"), "nothing")
    one_error_line(serve(artifact, "--seats", 0), "--seats")
    one_error_line(serve(artifact, "--max-new-tokens", 0), "--max-new-tokens")
    (tmp_path / "file").write_text("")
    one_error_line(serve(artifact, "--sessions", tmp_path / "file"), "not a folder")
    sessions = tmp_path / "sessions"
    with Server(artifact, tmp_path / "server.log", "--sessions", sessions) as server:
        ask(server.client(), DRIVER[:1], [], "d")
        one_error_line(serve(artifact, "--sessions", sessions), "in use")


def test_a_new_conversation_when_every_seat_is_taken_is_refused_not_queued(artifact, tmp_path):
    with Server(artifact, tmp_path / "server.log", "--seats", 1) as server:
        client = server.client(retries=2)  # the 503 says not to retry: it comes back at once anyway
        ask(client, DRIVER[:1], [], "a")
        t = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            ask(client, DRIVER[:1], [], "b")
        assert time.monotonic() - t < 5
        assert e.value.status_code == 503 and e.value.code == "seats_full" and "DELETE /v1/seats" in e.value.message
        # two requests at once on the same seat: the second waits for the first, then starts over
        with_same = [None, None]

        def same(i: int) -> None:
            with_same[i] = ask(server.client(), DRIVER[:1], [], "a")

        threads = [threading.Thread(target=same, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert with_same[0][0] == with_same[1][0]
        assert sorted(cabin(u)["history"] for _, u in with_same) == ["rebuilt", "rebuilt"]
        assert server.request("DELETE", "/v1/seats/b")[0] == 404
        assert server.request("DELETE", "/v1/seats/a") == (200, {"name": "a", "deleted": True})
        text, usage = ask(client, DRIVER[:1], [], "b")
        assert cabin(usage)["seat"] == "b" and text == library(artifact).ask(DRIVER[0]).reply


LONG_MESSAGE = "check the route " * 40  # more than the 40-token window


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{bad json", 400, None),
        (b"[1, 2]", 400, None),
        (b"", 400, None),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": "hello"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "messages[0].content[0].type"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400, "messages[1].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, 400, "messages[1].role"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "a"}]}, 400, "messages[0].tool_call_id"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "a", "tool_call_id": "c"}]}, 400, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, 400, "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_token": 8}, 400, "max_token"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": "../etc/passwd"}, 400, "user"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400, "messages[0].content[0].image_url"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "/tmp/frame.png"}}]}]}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": LONG_MESSAGE}]}, 400, "messages"),
        (b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages[0].content"),
    ],
    ids=lambda v: None if isinstance(v, (dict, bytes)) else str(v),
)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(served, body, status, param):
    server, first_reply = served
    got, error = server.request("POST", "/v1/chat/completions", body)
    assert got == status, error
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    assert error["error"]["param"] == param and error["error"]["message"], error
    assert server.proc.poll() is None
    # and the seat the bad request named still answers, exactly
    assert ask(server.client(), DRIVER[:1], [], "default")[0] == first_reply


@pytest.fixture(scope="module")
def served(artifact, tmp_path_factory):
    """One server for the error cases, and what its first seat answers to DRIVER[0]."""
    first_reply = library(artifact).ask(DRIVER[0]).reply
    with Server(artifact, tmp_path_factory.mktemp("served") / "server.log") as server:
        yield server, first_reply


def test_wrong_paths_methods_and_the_openai_clients_errors(served):
    server, _ = served
    assert server.request("GET", "/v1/nothing")[0] == 404
    status, body = server.request("PUT", "/health")
    assert status == 405 and body["error"]["message"] == "PUT is not allowed on /health"
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"top_k": 5})
    assert e.value.code == "unknown_parameter"
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = server.request("GET", "/health")[1]
    assert (health["status"], health["backend"], health["seats"]["total"]) == ("ok", "onnxruntime-cpu", 1)


def test_images_reach_a_vision_language_artifact_as_data_urls_and_file_paths(load, export_to, tmp_path_factory, tmp_path):
    from PIL import Image

    from conftest import make_tiny_llava

    loaded = load(str(make_tiny_llava(tmp_path_factory.mktemp("serve-llava"), "clip")))
    art = export_to(loaded, sink=4, pinned=12, window=48, chunk=16)
    frames = []
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        frames.append(tmp_path / f"frame{seed}.png")
        Image.fromarray((rng.random((40, 52, 3)) * 255).astype("uint8")).save(frames[-1])
    data_url = "data:image/png;base64," + base64.b64encode(frames[0].read_bytes()).decode()

    def user(text: str, image: str | None) -> dict:
        parts = [{"type": "text", "text": text}]
        return {"role": "user", "content": parts + ([{"type": "image_url", "image_url": {"url": image}}] if image else [])}

    d = library(art)
    expected = [d.ask("what is ahead", image=frames[0]).reply, d.ask("and now", image=None).reply,
                d.ask("and this one", image=frames[1]).reply]  # fmt: skip
    with Server(art, tmp_path / "server.log", model="llava") as server:
        client = server.client()
        sent = [user("what is ahead", data_url), user("and now", None), user("and this one", f"file://{frames[1]}")]
        replies, kinds = [], []
        for i in range(3):
            messages = []
            for j in range(i):
                messages += [sent[j], {"role": "assistant", "content": replies[j]}]
            r = client.chat.completions.create(model="llava", messages=messages + [sent[i]], max_tokens=REPLY)
            replies.append(r.choices[0].message.content)
            kinds.append(cabin(r.usage)["history"])
        assert replies == expected and kinds == ["extended"] * 3
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(openai.BadRequestError, match="not an image"):
            client.chat.completions.create(model="llava", messages=bad)


# A data URL is decoded in the server's memory: a few kB of PNG that claim hundreds of megapixels, or
# compressed text chunks that inflate to megabytes, must be refused from the header (Pillow's checks,
# made strict by runtime.vision) as a 400 that says why, never a 500 or a stalled worker. Both sides
# of Pillow's factor two are sent: beyond MAX_IMAGE_PIXELS it only warns, beyond twice it raises.
@pytest.mark.parametrize(
    "how, reason",
    [
        ("a bomb of 9000x9000", "decompression bomb"),
        ("a bomb of 20000x20000", "decompression bomb"),
        ("one zTXt chunk of 2 MB", "text metadata is too large"),
        ("70 zTXt chunks of 1 MB", "text metadata is too large"),
        ("a zTXt chunk of 2 MB after the pixels", "text metadata is too large"),
    ],
)
def test_a_hostile_png_in_a_data_url_is_a_400_with_the_reason_and_the_server_goes_on(vlm_served, how, reason,
                                                                                      tmp_path):  # fmt: skip
    from test_vision import _png_with_text, write_png_bomb

    server, frame, expected = vlm_served
    if how.startswith("a bomb"):
        w, h = map(int, how.split()[-1].split("x"))
        png = write_png_bomb(tmp_path / "hostile.png", w, h)
    else:
        png = _png_with_text(tmp_path / "hostile.png", how)
    assert png.stat().st_size < 100_000  # small on the wire, huge once decoded
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"model": "llava", "max_tokens": REPLY,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is ahead"}, part]}]}  # fmt: skip
    status, error = server.request("POST", "/v1/chat/completions", body)
    assert status == 400, error
    assert error["error"]["code"] == "invalid_image" and error["error"]["param"] == "the image of the last message"
    assert reason in error["error"]["message"] and "\n" not in error["error"]["message"], error
    # the same file by path: the same refusal
    part["image_url"]["url"] = f"file://{png}"
    status, error = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and reason in error["error"]["message"], error
    # and the server goes on: a good frame on a new seat gets the reply the library gives
    assert server.proc.poll() is None
    good = {"role": "user", "content": [{"type": "text", "text": "what is ahead"},
                                        {"type": "image_url", "image_url": {"url": f"file://{frame}"}}]}  # fmt: skip
    r = server.client().chat.completions.create(model="llava", messages=[good], max_tokens=REPLY)
    assert r.choices[0].message.content == expected


@pytest.fixture(scope="module")
def vlm_served(load, export_to, tmp_path_factory):
    """A tiny LLaVA served, a good frame, and the reply the library gives to it."""
    from PIL import Image

    from conftest import make_tiny_llava

    folder = tmp_path_factory.mktemp("vlm-served")
    art = export_to(load(str(make_tiny_llava(folder / "model", "clip"))), sink=4, pinned=12, window=48, chunk=16)
    frame = folder / "frame.png"
    Image.fromarray((np.random.default_rng(1).random((40, 52, 3)) * 255).astype("uint8")).save(frame)
    expected = library(art).ask("what is ahead", image=frame).reply
    with Server(art, folder / "server.log", model="llava") as server:
        yield server, frame, expected


@pytest.mark.slow
def test_smollm2_served_gives_the_replies_chat_gives(smollm2, export_to, tmp_path):
    art = export_to(smollm2, sink=4, pinned=60, window=124, chunk=32)
    turns = ["What is the capital of France?", "And of Italy?"]
    expected = chat_replies(art, turns, 24)
    with Server(art, tmp_path / "server.log", model="smollm2-135m", start_s=180) as server:
        client = server.client()
        replies = []
        for i in range(len(turns)):
            text, usage = ask(client, turns[: i + 1], replies, "driver", max_tokens=24, stream=i == 1,
                              model="smollm2-135m")  # fmt: skip
            replies.append(text)
            assert cabin(usage)["history"] == "extended"
    assert replies == expected
    assert "Paris" in replies[0]



def test_metrics_parse_as_prometheus_text_and_equal_the_seats_and_the_process(artifact, tmp_path):
    with Server(artifact, tmp_path / "server.log", "--seats", 2) as server:
        check_metrics(server)


def check_metrics(server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client = server.client()
    ask(client, DRIVER[:1], [], "metrics-a")
    text, _ = ask(client, DRIVER[:1], [], "default")
    ask(client, DRIVER[:2], [text], "default")  # turns, cache and evictions that differ between seats
    with NO_PROXY.open(urllib.request.Request(server.url + "/metrics"), timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        exposition = r.read().decode()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{server.proc.pid}/status").read_text()).group(1)) * 1024
    families = {f.name: f for f in text_string_to_metric_families(exposition)}

    def value(name: str, **labels) -> float:
        found = [s.value for s in families[name].samples if s.labels == labels and s.name in (name, name + "_total")]
        assert len(found) == 1, (name, labels, families[name].samples)
        return found[0]

    status, seats = server.request("GET", "/v1/seats")
    _, health = server.request("GET", "/health")
    assert status == 200 and {s["name"] for s in seats["data"]} == {"default", "metrics-a"}
    for seat in seats["data"]:
        name = seat["name"]
        assert value("cabinlm_seat_cache_tokens", seat=name) == seat["cache_tokens"]
        assert value("cabinlm_seat_evicted_tokens", seat=name) == seat["evicted_tokens"]
        assert value("cabinlm_seat_turns", seat=name) == seat["turns"]
        assert value("cabinlm_seat_busy", seat=name) == 0
        assert value("cabinlm_seat_decode_tokens_per_second", seat=name) == seat["last"]["decode_tok_s"] > 0
    assert value("cabinlm_seats") == health["seats"]["total"] == seats["total"]
    assert value("cabinlm_seats_taken") == health["seats"]["taken"] == len(seats["data"])
    assert value("cabinlm_seats_busy") == health["seats"]["busy"] == 0
    assert value("cabinlm_info", model=MODEL, backend="onnxruntime-cpu") == 1
    _, snapshot = server.request("GET", "/v1/metrics.json")
    assert value("cabinlm_requests_answered") == snapshot["requests_answered"] >= 3
    assert snapshot["data"] == seats["data"]
    # the process's resident memory, as the kernel counts it: read a moment apart, within 4 MiB
    for name in ("process_resident_memory_bytes", "cabinlm_process_resident_memory_bytes"):
        assert abs(value(name) - rss) < 4 << 20, (name, value(name), rss)


def test_the_page_is_served_at_the_root_and_no_ui_turns_it_off(served, artifact, tmp_path):
    server, _ = served
    with NO_PROXY.open(urllib.request.Request(server.url + "/"), timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html") and b"/static/app.js" in r.read()
    with Server(artifact, tmp_path / "server.log", "--no-ui") as bare:
        status, error = bare.request("GET", "/")
        assert status == 404 and error["error"]["message"] == "no such endpoint: GET /"
        assert bare.request("GET", "/static/app.js")[0] == 404
        assert bare.request("GET", "/v1/metrics.json")[0] == 200  # the API and the figures stay
    help_text = subprocess.run([sys.executable, "-m", "cabinlm", "serve", "--help"], capture_output=True, text=True,
                               timeout=120).stdout  # fmt: skip
    assert "--no-ui" in help_text


def test_two_seats_keep_their_own_archives_and_report_the_recall(load, tiny_qwen2_dir, export_to, tmp_path):
    """A recall region over the OpenAI API: two seats, their conversations interleaved, each with its own
    archive; every reply and every usage.cabinlm.recall (the turns and tokens the region held) is what a
    library Dialogue alone with that conversation gives, so neither seat recalls the other's past."""
    region = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8", recall=64)
    talks = {"driver": [f"{t} {i}" for i in range(3) for t in DRIVER], "passenger": [f"{t} {i}" for i in range(3) for t in PASSENGER]}
    alone = {seat: library(region) for seat in talks}
    with Server(region, tmp_path / "server.log", "--seats", 2) as server:
        client = server.client()
        replies: dict[str, list[str]] = {seat: [] for seat in talks}
        for i in range(len(DRIVER) * 3):
            for seat, turns in talks.items():
                text, usage = ask(client, turns[: i + 1], replies[seat], seat)
                want = alone[seat].ask(turns[i])
                got = cabin(usage)["recall"]
                assert text == want.reply, (seat, i)
                if want.recall is None:
                    assert got is None
                else:  # the region's content, not its timing
                    assert (got["turns"], got["tokens"], got["refreshed"]) == (want.recall["turns"], want.recall["tokens"],
                                                                             want.recall["refreshed"]), (seat, i)  # fmt: skip
                replies[seat].append(text)
        late = [cabin(ask(client, talks[s] + ["what did I say first"], replies[s], s)[1])["recall"] for s in talks]
    assert all(r is not None and 1 in r["turns"] and r["tokens"] > 0 for r in late)  # the opening request, recalled
    assert all(d.archive.kept for d in alone.values())
    assert [m.text for m in alone["driver"].archive.kept] != [m.text for m in alone["passenger"].archive.kept]
