"""Tool calls, JSON replies and stop strings: grammar-constrained decoding (llguidance) in the runtime
and in `cabinlm serve`, checked with the openai client and jsonschema.

The served model is a tiny random-weight Qwen2 on the fused cpu build with batched seat graphs: it
was never trained to call anything, so every well-formed call comes from the grammar, and any slip
of the mask shows as a call that does not parse or validate. Greedy throughout, one thread.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from cabinlm.engines.build import build_artifact  # noqa: E402
from cabinlm.profiles import load_profile  # noqa: E402
from cabinlm.runtime import Dialogue, open_artifact  # noqa: E402
from cabinlm.runtime.grammar import GrammarError, Grammars  # noqa: E402
from cabinlm.runtime.speculative import PlainDecoding, PromptLookupDrafting  # noqa: E402
from cabinlm.runtime.stops import StopStrings, cut_at_stop  # noqa: E402
from cabinlm.runtime.tools import (  # noqa: E402
    calls_grammar,
    json_reply_grammar,
    parse_calls,
    parse_tool_choice,
    parse_tools,
    render_calls,
    tools_system,
)

MODEL = "tiny-qwen2"
# Vehicle functions with nested objects, enums, number ranges and arrays (no free-text strings, so a
# random model's calls end within a few dozen tokens).
TOOLS = [
    {"type": "function", "function": {
        "name": "set_climate", "description": "Set a zone's temperature and fan",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "enum": ["driver", "passenger", "rear"]},
            "celsius": {"type": "integer", "minimum": 16, "maximum": 28},
            "fan": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 5},
                                                     "auto": {"type": "boolean"}},
                    "required": ["level", "auto"], "additionalProperties": False}},
            "required": ["zone", "celsius", "fan"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "open_windows", "description": "Open windows by a percentage",
        "parameters": {"type": "object", "properties": {
            "windows": {"type": "array", "items": {"enum": ["front_left", "front_right", "rear_left", "rear_right"]},
                        "minItems": 1, "maxItems": 2},
            "percent": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["windows", "percent"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = "it is cold, warm up the driver side and open the rear windows a bit"


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- stop strings and the call format, without a model --------------------------------------------


def test_stop_strings_end_at_the_first_and_a_stream_never_shows_what_could_become_one():
    text = "Set it to 22 degrees. Then open the window."
    stops = ["degrees", "window", "."]
    cut, found = cut_at_stop(text, stops)
    assert (cut, found) == ("Set it to 22 ", True)
    for size in (1, 2, 3, 5, 7):  # the same reply in deltas of every size: a stop string split across them
        f = StopStrings(stops)
        shown = "".join(f.push(text[i : i + size]) for i in range(0, len(text), size)) + f.flush()
        assert shown == cut and f.stopped
        g = StopStrings(["degrees!"])
        seen = ""
        for i in range(0, len(text), size):
            seen += g.push(text[i : i + size])
            assert text.startswith(seen)  # what a stream shows is a prefix of the reply, always
            assert not seen.endswith("deg")  # the possible start of "degrees!" is held back
        assert seen + g.flush() == text and not g.stopped


def test_calls_read_back_and_render_as_the_grammar_writes_them():
    calls = [("set_climate", '{"zone": "driver", "celsius": 22, "fan": {"level": 2, "auto": false}}'),
             ("open_windows", '{"windows": ["rear_left"], "percent": 20}')]  # fmt: skip
    text = render_calls("", calls)
    assert text.startswith("<tool_call>\n{\"name\": \"set_climate\", \"arguments\": {")
    assert parse_calls(text) == ("", calls)
    assert parse_calls("Sure.\n" + text) == ("Sure.", calls)
    assert parse_calls("no call here") == ("no call here", [])
    assert parse_calls(text[:-5]) == ("", calls[:1])  # cut by max_tokens inside the second call: the whole one
    one = render_calls("", calls[:1])
    assert parse_calls(one[:-5]) == (one[:-5], [])  # no whole call: it stays text
    assert parse_calls(one + "\nand more text") == (one + "\nand more text", [])  # not what the grammar writes


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}], None,
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
         "tools[0].function.parameters"),
        (TOOLS, {"type": "function", "function": {"name": "sunroof"}}, "tool_choice"),
        (TOOLS, "always", "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(GrammarError) as e:
        parse_tool_choice(choice, parse_tools(tools))
    assert e.value.param == param and str(e.value)


# -- the runtime: masks, drafting, a real model ---------------------------------------------------


@pytest.fixture(scope="module")
def artifact(load, export_to, tmp_path_factory) -> Path:
    """A tiny Qwen2 (the suite's, with room for 2048 positions) on the fused cpu build (batched seat
    graphs), with pinned slots for the tool list: its byte-level vocabulary of 300 spends about a
    token per character of JSON."""
    from conftest import make_tiny_model

    source = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-long"), "qwen2", max_position_embeddings=2048)
    art = export_to(load(str(source)), sink=4, pinned=1400, window=256, chunk=16, kv="int8")
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("tools") / "build-cpu")


def grammars_of(dec) -> Grammars:
    m = dec.manifest
    return Grammars(dec.folder / m.files["tokenizer"].path, list(m.stop_ids), m.model.vocab_size)


def test_keywords_the_grammar_library_cannot_honour_are_listed_never_ignored(artifact):
    dec, _ = open_artifact(artifact, threads=1, verify=False)
    g = grammars_of(dec)
    with pytest.raises(GrammarError) as e:
        g.compile(json_reply_grammar({"type": "array", "uniqueItems": True}, "response_format"))
    assert "uniqueItems" in str(e.value) and e.value.param == "response_format"
    with pytest.raises(GrammarError) as e:
        json_reply_grammar({"type": "object", "properties": {"a": {"type": "strin"}}}, "response_format")
    assert "not a valid JSON Schema" in str(e.value)
    with pytest.raises(GrammarError) as e:
        json_reply_grammar({"type": "object", "description": "x" * 70_000}, "response_format")
    assert "limit" in str(e.value)


GRAMMARS = {
    "required": lambda tools: calls_grammar(tools, parse_tool_choice("required", tools), True),
    "named": lambda tools: calls_grammar(tools, parse_tool_choice(
        {"type": "function", "function": {"name": "open_windows"}}, tools), False),
    "single": lambda tools: calls_grammar(tools, parse_tool_choice("required", tools), False),
    "json_schema": lambda tools: json_reply_grammar(SCHEMAS["set_climate"], "response_format"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_replies_are_valid_and_the_same_with_and_without_drafting(artifact, kind):
    """Greedy, three turns on one dialogue (the drafts find the earlier calls' text): every reply
    parses and validates, and prompt-lookup drafting (cut to the grammar's valid prefix, each row
    checked against the mask) gives the same tokens as plain decoding."""
    tools = parse_tools(TOOLS)
    replies = {}
    for drafting in (PlainDecoding(), PromptLookupDrafting()):
        dec, tok = open_artifact(artifact, threads=1, verify=False)
        g = grammars_of(dec)
        d = Dialogue(dec, tok, system=tools_system("You drive the car.", tools, dec.manifest.chat), max_new_tokens=256,
                     drafting=drafting)  # fmt: skip
        got = []
        for turn in range(3):
            r = d.ask(f"{ASK} ({turn})", constraint=g.constraint(g.compile(GRAMMARS[kind](tools))))
            # the grammar ended it (only a stop id was allowed), or, with parallel calls, the length limit
            assert r.finish == "stop" or (kind == "required" and r.finish == "length"), r.reply
            got.append(r.reply)
        replies[type(drafting).__name__] = (got, drafting.accepted)
    assert replies["PlainDecoding"][0] == replies["PromptLookupDrafting"][0]
    assert replies["PromptLookupDrafting"][1] > 0  # drafts were accepted under the grammar
    for reply in replies["PlainDecoding"][0]:
        if kind == "json_schema":
            jsonschema.validate(json.loads(reply), SCHEMAS["set_climate"])
            continue
        whole = reply[: reply.rfind("</tool_call>") + len("</tool_call>")]  # the calls the length limit left whole
        content, calls = parse_calls(whole)
        assert calls and content == ""
        assert len(calls) == 1 or kind == "required"
        for name, arguments in calls:
            check_call(name, arguments)
            assert kind != "named" or name == "open_windows"


def test_a_lazy_grammar_leaves_a_reply_without_a_call_untouched(artifact):
    """tool_choice auto: the grammar holds only from "<tool_call>" on, so a reply that never writes
    it is token for token the unconstrained one."""
    tools = parse_tools(TOOLS)
    out = []
    for constrained in (False, True):
        dec, tok = open_artifact(artifact, threads=1, verify=False)
        g = grammars_of(dec)
        d = Dialogue(dec, tok, system=tools_system(None, tools, dec.manifest.chat), max_new_tokens=40)
        spec = calls_grammar(tools, parse_tool_choice("auto", tools), True)
        out.append(d.ask(ASK, constraint=g.constraint(g.compile(spec)) if constrained else None).reply)
    assert "<tool_call>" not in out[0]
    assert out[0] == out[1]


# -- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    from test_serve import Server

    with Server(artifact, tmp_path_factory.mktemp("tools-server") / "server.log", "--seats", 3,
                model=MODEL) as s:  # fmt: skip
        yield s


@pytest.fixture(autouse=True)
def free_seats(request):
    """Each server test starts with every seat free (the server holds three)."""
    yield
    if "server" in request.fixturenames:
        s = request.getfixturevalue("server")
        for seat in s.request("GET", "/v1/seats")[1]["data"]:
            s.request("DELETE", f"/v1/seats/{seat['name']}")


def stream_calls(client, **kw):
    """A streamed reply put back together as the openai client's users do: (content, calls, finish);
    each call also says in how many deltas its arguments came ("pieces")."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            slot["pieces"] += bool(tc.function and tc.function.arguments)
        finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_climate"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_served_tool_calls_validate_streamed_and_not(server, choice, parallel):
    client = server.client()
    messages = [{"role": "user", "content": ASK}]
    kw = dict(messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=200)
    r = client.chat.completions.create(model=MODEL, user="calls", **kw)
    m = r.choices[0].message
    # parallel calls go on until the length limit here (a random model): the whole ones come back
    assert r.choices[0].finish_reason in (("tool_calls", "length") if parallel else ("tool_calls",))
    assert m.tool_calls, m
    assert parallel or len(m.tool_calls) == 1
    for tc in m.tool_calls:
        check_call(tc.function.name, tc.function.arguments)
        assert isinstance(choice, str) or tc.function.name == "set_climate"
    content, calls, finish = stream_calls(client, user="calls-streamed", **kw)
    assert finish == r.choices[0].finish_reason and content == (m.content or "")
    # a call the length limit cut is streamed as far as it went (finish "length" says so); the whole
    # ones are the non-streamed reply's
    whole = calls if finish == "tool_calls" else calls[: len(m.tool_calls)]
    assert [(c["name"], c["arguments"]) for c in whole] == [(tc.function.name, tc.function.arguments)
                                                           for tc in m.tool_calls]  # fmt: skip
    assert all(c["id"] for c in calls)
    assert [c["id"] for c in calls] != [tc.id for tc in m.tool_calls]  # each request its own ids
    assert calls[0]["pieces"] > 3  # the arguments stream as the model writes them, not at the end


def test_a_tool_result_fed_back_answers_as_the_same_history_does_in_a_fresh_seat(server):
    client = server.client()
    messages = [{"role": "system", "content": "You drive the car."}, {"role": "user", "content": ASK}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, user="fed-back")  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True})}]  # fmt: skip
    kw = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12)
    r = client.chat.completions.create(user="fed-back", **kw)
    assert r.usage.model_extra["cabinlm"]["history"] == "extended"  # the seat held the call: only the result was fed
    fresh = client.chat.completions.create(user="fed-back-fresh", **kw)
    assert fresh.usage.model_extra["cabinlm"]["history"] == "rebuilt"
    assert r.choices[0].message.content == fresh.choices[0].message.content


def test_json_replies_follow_response_format(server):
    client = server.client()
    schema = SCHEMAS["open_windows"]
    for stream in (False, True):
        fmt = {"type": "json_schema", "json_schema": {"name": "windows", "schema": schema}}
        kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], response_format=fmt, max_tokens=64,
                  user="json")  # fmt: skip
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)  # fmt: skip
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=64,
                                       response_format={"type": "json_object"}, user="json")  # fmt: skip
    text = r.choices[0].message.content
    # any object: a random model's free keys may run to the length limit; a finished one parses
    assert text.startswith("{")
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)


def test_stop_strings_end_replies_where_openai_says_also_in_streams(server, artifact):
    client = server.client()
    messages = [{"role": "user", "content": "check the route"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, user="stops").choices[0]
    text = free.message.content
    assert len(text) > 12
    # a stop string from the middle of the reply, across token boundaries: its first few characters
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.find(stop)]
    for i, stream in enumerate((False, True)):
        kw = dict(model=MODEL, messages=messages, max_tokens=24, stop=[stop, "\u2603never"], user=f"stops-{i}")
        if stream:
            got = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                          if c.choices)  # fmt: skip
        else:
            r = client.chat.completions.create(**kw)
            got = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
        assert got == want
        # the seat is consistent after the stop: the next turn, sent with the cut reply, extends it
        nxt = client.chat.completions.create(model=MODEL, max_tokens=6, user=f"stops-{i}", messages=[
            *messages, {"role": "assistant", "content": got}, {"role": "user", "content": "and the weather"}])
        assert nxt.usage.model_extra["cabinlm"]["history"] == "extended"


def test_seats_with_grammars_decode_together_as_each_does_alone(server):
    """Three clients at once, each with its own grammar (its own matcher), their steps riding together
    on the batched graphs: every reply is the one the same request gets alone."""
    client = server.client()
    asks = {
        "t1": dict(tools=TOOLS, tool_choice="required"),
        "t2": dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "open_windows"}}),
        "t3": dict(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS["set_climate"]}}),
    }  # fmt: skip

    def one(seat, kw):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=200,
                                           user=seat, **kw)  # fmt: skip
        m = r.choices[0].message
        return m.content, [(t.function.name, t.function.arguments) for t in m.tool_calls or []]

    alone = {}
    for seat, kw in asks.items():
        alone[seat] = one(f"{seat}-alone", kw)
        server.request("DELETE", f"/v1/seats/{seat}-alone")
    got, errors = {}, []
    start = threading.Barrier(len(asks), timeout=60)

    def run(seat, kw):
        try:
            start.wait()
            got[seat] = one(seat, kw)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in asks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert got == alone
    assert got["t1"][1] and got["t2"][1], got  # the tool seats called, the JSON seat wrote JSON
    jsonschema.validate(json.loads(got["t3"][0]), SCHEMAS["set_climate"])


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sunroof"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "array", "uniqueItems": True}}}}}]}, "tools[0].function.parameters"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "set_climate", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "done"}]}, "messages[2].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_one_4xx_line_naming_the_param_and_the_server_keeps_serving(server, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "user": "bad", **extra}
    status, error = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and error["error"]["param"] == param, error
    assert "\n" not in error["error"]["message"]
    assert server.request("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "user": "bad",
                          "messages": [{"role": "user", "content": "hi"}]})[0] == 200  # fmt: skip


def test_the_runtime_imports_no_torch_for_grammars():
    """The grammar library is part of the runtime a car carries: no torch, no transformers."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import cabinlm.runtime.grammar, cabinlm.runtime.tools, llguidance; print('ok')")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_mask_allows_exactly_what_the_matcher_accepts(artifact):
    """The bitmask as applied to logits (bit order, width, padding) against the matcher's own
    token-by-token check, on the tiny vocabulary."""
    dec, _ = open_artifact(artifact, threads=1, verify=False)
    g = grammars_of(dec)
    c = g.constraint(g.compile(json_reply_grammar({"type": "object", "properties": {"a": {"enum": [1, 2]}},
                                                   "required": ["a"], "additionalProperties": False}, "x")))  # fmt: skip
    ok = c.allowed()
    vocab = dec.manifest.model.vocab_size
    assert ok.shape == (vocab,)
    m = g.matcher(g.compile(json_reply_grammar({"type": "object", "properties": {"a": {"enum": [1, 2]}},
                                                "required": ["a"], "additionalProperties": False}, "x")))  # fmt: skip
    accepted = np.array([m.validate_tokens([t]) == 1 for t in range(vocab)])
    assert (ok == accepted).all() and 0 < ok.sum() < vocab


# -- cabinlm chat --tools, the demo's tools, sessions --------------------------------------------


def test_chat_with_tools_prints_calls_as_json_and_answers_their_results(artifact, tmp_path):
    """`cabinlm chat --tools FILE --json`: a message, its call (valid against the schema), the
    caller's {"tool": ..., "content": ...} line, and the model's answer to it; a result for a
    function nobody called is one error line, and the chat goes on."""
    import subprocess
    import sys

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    lines = [ASK, json.dumps({"tool": "honk", "content": "ok"})]
    cmd = [sys.executable, "-m", "cabinlm", "chat", str(artifact), "--json", "--threads", "1", "--tools", str(tools),
           "--tool-choice", "set_climate", "--max-new-tokens", "200"]  # fmt: skip
    first = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert first.returncode == 1, first.stderr  # the stray result counts as a failure
    out = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(out) == 1 and out[0]["tool_calls"], out
    call = out[0]["tool_calls"][0]["function"]
    assert call["name"] == "set_climate"
    check_call(call["name"], call["arguments"])
    assert "no call of 'honk' is waiting" in first.stderr and len(first.stderr.strip().splitlines()) == 1
    answered = subprocess.run(cmd[:-4] + ["--tool-choice", "set_climate", "--max-new-tokens", "200"],
                              input="\n".join([ASK, json.dumps({"tool": "set_climate", "content": {"ok": True}})]) + "\n",
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert answered.returncode == 0, answered.stderr
    turns = [json.loads(line) for line in answered.stdout.splitlines()]
    assert len(turns) == 2 and turns[0]["tool_calls"] and turns[1]["turn"] == 2


def test_a_tools_file_that_is_not_a_tool_list_is_refused_in_one_line(artifact, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "tools.json"
    bad.write_text(json.dumps([{"type": "function", "function": {"name": "bad name"}}]))
    p = subprocess.run([sys.executable, "-m", "cabinlm", "chat", str(artifact), "--tools", str(bad)], input="",
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and "tools[0].function.name" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_the_demos_vehicle_tools_are_a_valid_tool_list_and_its_simulator_applies_them():
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "demo"))
    from vehicle import TOOLS as VEHICLE, Vehicle

    tools = parse_tools(VEHICLE)
    assert len(tools) == 12
    car = Vehicle()
    before = car.snapshot()
    assert json.loads(car.call("set_temperature", {"zone": "driver", "celsius": 22.5}))["ok"]
    assert car.changes(before) == {"temperature": {**before["temperature"], "driver": 22.5}}


def test_tool_calls_and_results_survive_a_killed_server_in_its_sessions(artifact, tmp_path):
    """serve --sessions, a call, kill -9: the restarted server holds the seat's exchange with its
    call, so the history with the tool's result extends it and answers as a fresh seat does."""
    from test_serve import Server

    messages = [{"role": "user", "content": ASK}]
    kw = dict(model=MODEL, tools=TOOLS, max_tokens=200)
    with Server(artifact, tmp_path / "server.log", "--sessions", tmp_path / "sessions") as s:
        first = s.client().chat.completions.create(messages=messages, tool_choice="required", parallel_tool_calls=False,
                                                   user="kept", **kw)  # fmt: skip
        s.kill()
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "done"}]  # fmt: skip
    with Server(artifact, tmp_path / "server.log", "--sessions", tmp_path / "sessions", "--seats", 2) as s:
        client = s.client()
        after = client.chat.completions.create(messages=messages, tool_choice="none", user="kept", **kw)
        assert after.usage.model_extra["cabinlm"]["history"] == "extended"
        fresh = client.chat.completions.create(messages=messages, tool_choice="none", user="fresh", **kw)
    assert after.choices[0].message.content == fresh.choices[0].message.content


# -- a Llama 3.x template: JSON calls, results in the template's own tool turn ---------------------


@pytest.fixture(scope="module")
def llama_artifact(load, export_to, tmp_path_factory) -> Path:
    """A tiny Llama with Llama 3.1's tool template, on the fused cpu build."""
    from conftest import make_tiny_model
    from test_template import LLAMA31_TOOLS_TEMPLATE
    from transformers import AutoTokenizer

    source = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-tools"), "llama", max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(source)
    tok.chat_template = LLAMA31_TOOLS_TEMPLATE
    tok.save_pretrained(source)
    art = export_to(load(str(source)), sink=4, pinned=1400, window=256, chunk=16, kv="int8")
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("llama-tools") / "build-cpu")


def test_a_llama_model_calls_in_its_json_and_reads_results_in_its_tool_turn(llama_artifact, tmp_path):
    """Served: the call is Llama's JSON ("parameters"), valid; the result goes back as the template's
    "ipython" turn, the seat extends, and a fresh seat given the same messages answers the same."""
    from test_serve import Server

    from cabinlm.contract.manifest import load_manifest

    chat = load_manifest(llama_artifact).chat
    assert chat.tool_call_style == "llama3-json" and chat.tool_result_prefix
    with Server(llama_artifact, tmp_path / "server.log", "--seats", 2) as s:
        client = s.client()
        messages = [{"role": "user", "content": ASK}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                               max_tokens=200, user="llama")  # fmt: skip
        call = first.choices[0].message.tool_calls[0]
        check_call(call.function.name, call.function.arguments)
        assert first.choices[0].finish_reason == "tool_calls"
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "{\"ok\": true}"}]  # fmt: skip
        kw = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12)
        after = client.chat.completions.create(user="llama", **kw)
        assert after.usage.model_extra["cabinlm"]["history"] == "extended"
        fresh = client.chat.completions.create(user="llama-fresh", **kw)
    assert after.choices[0].message.content == fresh.choices[0].message.content


def test_the_runtimes_tool_dialogue_feeds_results_in_the_tool_turn(llama_artifact):
    """ToolDialogue.answer feeds the results as the template's tool turn: the prompt it adds is
    exactly tool_result_prefix + results + tool_result_suffix + assistant_prefix after the call."""
    from cabinlm.runtime.assistant import ToolDialogue

    dec, tok = open_artifact(llama_artifact, threads=1, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=200)
    a = ToolDialogue(d, parse_tools(TOOLS), "required", parallel=False)
    turn = a.ask(ASK)
    assert len(turn.calls) == 1
    check_call(turn.calls[0].name, turn.calls[0].arguments)
    fed = []
    original = d.decoder.feed
    d.decoder.feed = lambda ids, *args, **kw: (fed.append(list(ids)), original(ids, *args, **kw))[1]
    a.answer({turn.calls[0].name: "done"}, choice="none")
    chat = dec.manifest.chat
    want = (tok.encode(chat.assistant_suffix) + tok.encode(chat.tool_result_prefix) + tok.encode_text("done")
            + tok.encode(chat.tool_result_suffix + chat.assistant_prefix))  # fmt: skip
    assert fed[0] == want  # the call's turn closed, then the tool turn, whole, in one feed
