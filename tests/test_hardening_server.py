"""`cabinlm serve` against hostile clients: a real server process on a loopback port, real
clients (the openai package, urllib, a raw socket), the tiny Qwen2 of test_serve.py (window 40).

What the earlier server tests could not catch: they sent one hostile request at a time and looked only
at its answer. Here another seat's request runs beside it and its latency is asserted (loosely: "within
seconds, not the length of the hostile request's work"), the seats a refused request leaves behind are
counted, and the server's log is read for tracebacks.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import MODEL, NO_PROXY, Server, history, library  # noqa: E402

SOON_S = 2.0  # "at once" for a 3-token request (0.02 s measured); the hostile work took 4-7 s before the fix


@pytest.fixture(scope="module")
def artifact(load, tiny_qwen2_dir, export_to) -> Path:
    return export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")


@pytest.fixture(scope="module")
def small_reply(artifact) -> str:
    """What a seat answers to "hi" alone (3 tokens of reply)."""
    d = library(artifact, max_new_tokens=3)
    return d.ask("hi").reply


def post(server: Server, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with NO_PROXY.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"not json": raw.decode("utf-8", "replace")}


def small_request(server: Server, seat: str) -> tuple[float, str]:
    """A 3-token reply to "hi" on `seat`: (seconds it took, the reply)."""
    t = time.monotonic()
    status, body = post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                 "user": seat})  # fmt: skip
    assert status == 200, body
    return time.monotonic() - t, body["choices"][0]["message"]["content"]


def seat_names(server: Server) -> list[str]:
    status, body = server.request("GET", "/v1/seats")
    assert status == 200
    return sorted(s["name"] for s in body["data"])


def long_history(exchanges: int) -> list[dict]:
    turns = [f"stop {i} on the route" for i in range(exchanges + 1)]
    return history(turns, [f"noted, stop {i}" for i in range(exchanges)])


# -- one request must not stall the others ---------------------------------------------------------


def test_a_huge_message_is_refused_before_it_takes_the_model_and_the_other_seat_answers_at_once(artifact, tmp_path,
                                                                                                  small_reply):  # fmt: skip
    """An 8 MB message (the tiny tokenizer needs about 10 s and 2 GB for it) is refused by its length
    alone, and a 3-token request on another seat sent just after it answers within seconds."""
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "check the route " * 500_000}], "user": "big"}
    with Server(artifact, tmp_path / "server.log", "--seats", 2) as server:
        got: dict = {}
        t0 = time.monotonic()
        sender = threading.Thread(target=lambda: got.update(answer=post(server, huge), at=time.monotonic() - t0))
        sender.start()
        time.sleep(0.5)  # the huge request is in: parsed, and (before the fix) tokenized under the model
        took, reply = small_request(server, "small")
        sender.join(timeout=120)
        assert took < SOON_S and reply == small_reply, took
        status, error = got["answer"]
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert "characters" in error["error"]["message"] and got["at"] < 10, (got["at"], error)
        assert seat_names(server) == ["small"]  # the refused request took no seat


def test_a_history_longer_than_a_request_may_feed_is_refused_before_any_inference(artifact, tmp_path, small_reply):
    """1,500 exchanges sent to a seat that holds none of them would be fed whole (minutes on a car's
    CPU) while every other seat waits: refused in one step, with the limit and the fix, no seat taken."""
    with Server(artifact, tmp_path / "server.log", "--seats", 1) as server:
        t = time.monotonic()
        status, error = post(server, {"model": MODEL, "messages": long_history(1500), "user": "far"})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert "--max-prompt-tokens" in error["error"]["message"] and time.monotonic() - t < SOON_S, error
        assert seat_names(server) == []
        # a history that fits the limit (4 windows: 160 tokens) is fed
        status, body = post(server, {"model": MODEL, "messages": long_history(2), "max_tokens": 3, "user": "far"})
        assert status == 200 and body["usage"]["cabinlm"]["fed_again"] == 2, body
        assert small_request(server, "far")[1] == small_reply  # a shorter history: the seat starts over


def test_a_client_that_leaves_while_its_history_is_fed_stops_it_and_the_seat_stays_consistent(artifact, tmp_path,
                                                                                                small_reply):  # fmt: skip
    """With the limit raised, 1,500 exchanges take the tiny model about 15 s to feed. The other seat
    is served between the exchanges; the client leaves after 1.5 s and the feeding stops after the
    exchange it was on: the seat is idle within seconds, holds the exchanges fed (fewer than sent),
    and answers its next request as a fresh seat would. (A seat's first request that is stopped so
    gives the seat back, as any unanswered first request does: "far" answers once first.)"""
    sent = 1500
    with Server(artifact, tmp_path / "server.log", "--seats", 2, "--max-prompt-tokens", 10**6) as server:
        assert small_request(server, "far")[1] == small_reply
        outcome: list = []

        def leave_after_a_while() -> None:
            try:
                outcome.append(post(server, {"model": MODEL, "messages": long_history(sent), "max_tokens": 3,
                                             "user": "far"}, timeout=1.5))  # fmt: skip
            except OSError as e:  # the client's timeout: it closes the connection
                outcome.append(e)

        gone = threading.Thread(target=leave_after_a_while)
        gone.start()
        time.sleep(0.7)  # feeding the history
        took, reply = small_request(server, "near")
        assert took < SOON_S and reply == small_reply, took
        gone.join(timeout=30)
        assert len(outcome) == 1 and isinstance(outcome[0], OSError), outcome
        left = time.monotonic()
        while (state := server.seat("far"))["busy"]:
            assert time.monotonic() - left < SOON_S, state
            time.sleep(0.05)
        assert state["answered"] == 1 and state["exchanges"] is not None and 0 < state["exchanges"] < sent, state
        assert small_request(server, "far")[1] == small_reply
        assert "Traceback" not in server.log.read_text()


# -- a refused request takes no seat ---------------------------------------------------------------


def test_refused_requests_take_no_seat(artifact, tmp_path, small_reply):
    """Before the fix the seat was claimed before the request was checked: two refused requests on a
    2-seat server left every new conversation with 503 seats_full."""
    too_long = "check the route " * 40  # more than the 40-token window
    refused = [
        ({"messages": [{"role": "user", "content": too_long}]}, "context_length_exceeded"),
        ({"messages": [{"role": "system", "content": "mirrors " * 200}, {"role": "user", "content": "hi"}]},
         "context_length_exceeded"),
        ({"messages": history(["hi", too_long], ["hello"])}, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/nowhere.png"}}]}]},
         "images_not_supported"),
    ]  # fmt: skip
    with Server(artifact, tmp_path / "server.log", "--seats", 2) as server:
        for i, (body, code) in enumerate(refused):
            status, error = post(server, {"model": MODEL, "user": f"refused-{i}", **body})
            assert status == 400 and error["error"]["code"] == code, error
        assert seat_names(server) == []
        assert small_request(server, "first")[1] == small_reply
        assert small_request(server, "second")[1] == small_reply
        assert seat_names(server) == ["first", "second"]


# -- hostile keys, names and bodies ----------------------------------------------------------------

SURROGATE_KEYS = [
    b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}',
    b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "hi", "\\udfff": 1}]}',
    b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": [{"type": "\\ud800"}]}]}',
    b'{"model": "tiny-qwen2", "messages": [{"role": "\\ud800", "content": "hi"}]}',
    b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
]


@pytest.fixture(scope="module")
def hostile(artifact, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    with Server(artifact, folder / "server.log", "--sessions", folder / "sessions") as server:
        yield server, folder / "sessions"


@pytest.mark.parametrize("body", SURROGATE_KEYS, ids=range(len(SURROGATE_KEYS)))
def test_a_lone_surrogate_in_a_key_or_value_is_a_json_400(hostile, body, small_reply):
    server, _ = hostile
    status, error = post(server, body)
    assert status in (400, 404) and set(error) == {"error"}, error  # JSON: the handler could encode its reply
    assert "\\ud" in error["error"]["message"] + (error["error"]["param"] or ""), error  # the key, escaped
    assert small_request(server, "default")[1] == small_reply


@pytest.mark.parametrize("name", ["nl\n", "a\n", "a\r", "a\x00", "a/b", "a\u2028"])
def test_a_seat_name_with_a_line_break_or_control_character_is_refused(hostile, name):
    server, sessions = hostile
    status, error = post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "user": name})  # fmt: skip
    assert status == 400 and error["error"]["param"] == "user", error
    assert all(p.name.isprintable() for p in sessions.iterdir()), list(sessions.iterdir())


def test_a_client_that_sends_half_a_body_and_leaves_is_not_an_internal_error(hostile, small_reply):
    server, _ = hostile
    before = server.log.read_text()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny-qwen2", "mess')  # fmt: skip
    deadline = time.monotonic() + 10
    while "left before its request arrived" not in server.log.read_text()[len(before):]:
        assert time.monotonic() < deadline, server.log.read_text()[len(before):]
        time.sleep(0.05)
    assert small_request(server, "default")[1] == small_reply
    logged = server.log.read_text()[len(before):]
    assert "Traceback" not in logged and "failed" not in logged and " 500 " not in logged, logged
