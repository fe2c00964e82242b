"""Mistral's tool-call convention end to end: resolved at export from a v0.3-style chat template,
[TOOL_CALLS] written by the grammar as its control token, calls with the ids the model writes,
results in [TOOL_RESULTS] blocks, every marker a single control-token id in the prompt.

The model is a tiny random-weight Mistral whose tokenizer holds Mistral's control tokens; it never
learnt to call anything, so calls are forced (tool_choice required or named) and every well-formed
call comes from the grammar. Greedy throughout, one thread.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from test_tool_calls import ASK, TOOLS, check_call, stream_calls  # noqa: E402
from test_tool_calls import MODEL as TOOLS_MODEL  # noqa: E402

from cabinlm.engines.build import build_artifact  # noqa: E402
from cabinlm.contract.manifest import load_manifest  # noqa: E402
from cabinlm.profiles import load_profile  # noqa: E402
from cabinlm.runtime import Dialogue, open_artifact  # noqa: E402
from cabinlm.runtime.grammar import Grammars  # noqa: E402
from cabinlm.runtime.mistral_calls import MISTRAL  # noqa: E402
from cabinlm.runtime.speculative import PlainDecoding, PromptLookupDrafting  # noqa: E402
from cabinlm.runtime.template import Template  # noqa: E402
from cabinlm.runtime.call_styles import style_of  # noqa: E402
from cabinlm.runtime.tools import parse_tool_choice, parse_tools, tools_system  # noqa: E402

MODEL = TOOLS_MODEL  # the name stream_calls asks for
CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]"]  # fmt: skip
# Mistral's v0.3 tool template (the tools before the last user message, calls as a JSON list with
# 9-character ids, results in [TOOL_RESULTS]), its system message kept first as the suite's Mistral
# layout has it, less the role checks a test never trips.
MISTRAL_TOOLS_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set loop_messages = messages[1:] %}"
    "{{- messages[0]['content'] + '\n\n' }}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools is defined and tools is not none and message == user_messages[-1] %}"
    "{{- '[AVAILABLE_TOOLS] [' }}{%- for tool in tools %}{%- set tool = tool.function %}"
    "{{- '{\"type\": \"function\", \"function\": {' }}"
    "{%- for key, val in tool.items() if key != 'return' %}"
    "{%- if val is string %}{{- '\"' + key + '\": \"' + val + '\"' }}{%- else %}{{- '\"' + key + '\": ' + val|tojson }}"
    "{%- endif %}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '}}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' }}{%- endif %}{%- endfor %}{{- '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if tool_call.id is not defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}"
    "{%- endif %}{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] {\"content\": ' + message.content|string + "
    "', \"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)
# The chat template Mistral publishes with Mistral-7B-Instruct-v0.3 (its tokenizer_config.json),
# verbatim: the system text folded into the last user message, the tools before it.
V03_TEMPLATE = (Path(__file__).parent / "data" / "mistral-7b-instruct-v0.3.jinja").read_text()
ID = re.compile(r"[A-Za-z0-9]{9}")


def tiny_mistral(folder: Path, template: str):
    from conftest import make_tiny_model
    from transformers import AutoTokenizer

    source = make_tiny_model(folder, "mistral", max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(source)
    tok.add_special_tokens({"additional_special_tokens": CONTROL})
    tok.chat_template = template
    tok.save_pretrained(source)
    return source, tok


def export_mistral(load, export_to, tmp_path_factory, template: str, name: str) -> Path:
    source, _ = tiny_mistral(tmp_path_factory.mktemp(f"tiny-{name}"), template)
    art = export_to(load(str(source)), sink=4, pinned=1400, window=256, chunk=16, kv="int8")
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp(name) / "build-cpu")


@pytest.fixture(scope="module")
def artifact(load, export_to, tmp_path_factory) -> Path:
    return export_mistral(load, export_to, tmp_path_factory, MISTRAL_TOOLS_TEMPLATE, "mistral-tools")


@pytest.fixture(scope="module")
def v03_artifact(load, export_to, tmp_path_factory) -> Path:
    return export_mistral(load, export_to, tmp_path_factory, V03_TEMPLATE, "mistral-v03")


def test_the_published_v03_template_resolves_with_the_system_prompt_first(tmp_path):
    """Mistral's v0.3 template writes the system text into the last user message, where no pinned
    prefix can hold it: the pieces are its turns without a system message, exactly, and the system
    prompt goes first with the template's own separator before the first [INST]; the tool pieces are
    the suite's Mistral layout's."""
    from cabinlm.export.template import resolve_chat_template

    _, tok = tiny_mistral(tmp_path, V03_TEMPLATE)
    chat = resolve_chat_template(tok)
    assert chat.tool_call_style == "mistral" and chat.tools_source == "model"
    assert (chat.system_prefix, chat.system_suffix, chat.user_prefix, chat.user_suffix) == \
        ("", "\n\n", "[INST] ", "[/INST]")  # fmt: skip
    msgs = [{"role": "user", "content": "Is the road icy?"}, {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Thanks!"}]  # fmt: skip
    turn = chat.user_prefix + "{}" + chat.user_suffix + chat.assistant_prefix
    pieces = chat.bos + turn.format("Is the road icy?") + " Yes." + chat.assistant_suffix + turn.format("Thanks!")
    assert pieces == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ours = resolve_chat_template(tiny_mistral(tmp_path / "suite", MISTRAL_TOOLS_TEMPLATE)[1])
    assert chat == ours


def test_the_v03_template_exports_with_mistrals_calls(v03_artifact):
    """Exported with the published template: Mistral's convention, markers as single control ids,
    a forced call that opens with the control token, parses and validates."""
    test_the_markers_are_single_control_tokens_where_the_runtime_writes_them(v03_artifact)
    tools = parse_tools(TOOLS)
    dec, tok = open_artifact(v03_artifact, threads=1, verify=False)
    assert dec.manifest.chat.tool_call_style == "mistral"
    style = style_of(dec.manifest.chat, tok.token_to_id)
    g = grammars_of(dec)
    spec = style.grammar(tools, parse_tool_choice("required", tools), False)
    system = tools_system("You drive the car.", tools, dec.manifest.chat)
    d = Dialogue(dec, tok, system=system, max_new_tokens=200)
    fed = []
    r = d.ask(ASK, constraint=g.constraint(g.compile(spec)), on_token=fed.append)
    assert fed[0] == style.opener_id == tok.token_to_id("[TOOL_CALLS]")
    content, calls = style.parse(r.reply)
    assert content == "" and len(calls) == 1, r.reply
    assert all(ID.fullmatch(i) for i in style.written_ids(r.reply))
    check_call(*calls[0])


def test_the_export_resolves_mistrals_convention_from_the_template(artifact):
    chat = load_manifest(artifact).chat
    assert chat.tool_call_style == "mistral" and chat.tools_source == "model"
    assert (chat.tools_prefix, chat.tools_separator, chat.tools_suffix) == \
        ("[AVAILABLE_TOOLS] [", ", ", "][/AVAILABLE_TOOLS]")  # fmt: skip
    assert (chat.tool_result_prefix, chat.tool_result_suffix) == ("", "")


def test_the_markers_are_single_control_tokens_where_the_runtime_writes_them(artifact):
    """The tool list, a call sent back and a tool result hold each marker as its one control id; a
    user's message that types a marker holds it as plain text."""
    dec, tok = open_artifact(artifact, threads=1, verify=False)
    chat = dec.manifest.chat
    template = Template(tok, chat)
    ids = {m: tok.token_to_id(m) for m in CONTROL}
    assert all(i is not None for i in ids.values())
    system = template.system(tools_system("You drive the car.", parse_tools(TOOLS), chat))
    assert system.count(ids["[AVAILABLE_TOOLS]"]) == 1 and system.count(ids["[/AVAILABLE_TOOLS]"]) == 1
    call = MISTRAL.render("", [("set_climate", '{"zone": "driver"}')], ["a1B2c3D4e"])
    fed = template.text(call)
    assert fed[0] == ids["[TOOL_CALLS]"] and tok.decode(fed[1:]) == call[len("[TOOL_CALLS]"):]
    result = template.user(MISTRAL.results(['{"ok": true}'], ["a1B2c3D4e"]), tool=True)
    assert result[0] == ids["[TOOL_RESULTS]"] and ids["[/TOOL_RESULTS]"] in result
    typed = template.user("please write [TOOL_CALLS] and [TOOL_RESULTS]")
    assert not set(typed) & {ids["[TOOL_CALLS]"], ids["[TOOL_RESULTS]"]}


def grammars_of(dec) -> Grammars:
    m = dec.manifest
    return Grammars(dec.folder / m.files["tokenizer"].path, list(m.stop_ids), m.model.vocab_size)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "open_windows"}}])
def test_forced_calls_open_with_the_control_token_and_drafting_changes_nothing(artifact, choice):
    """The grammar writes [TOOL_CALLS] as its token id, then calls that validate with 9-character ids;
    three greedy turns give the same tokens with prompt-lookup drafting as without."""
    tools = parse_tools(TOOLS)
    got = {}
    for drafting in (PlainDecoding(), PromptLookupDrafting()):
        dec, tok = open_artifact(artifact, threads=1, verify=False)
        style = style_of(dec.manifest.chat, tok.token_to_id)
        g = grammars_of(dec)
        spec = style.grammar(tools, parse_tool_choice(choice, tools), True)
        d = Dialogue(dec, tok, system=tools_system("You drive the car.", tools, dec.manifest.chat), max_new_tokens=200,
                     drafting=drafting)  # fmt: skip
        replies, firsts = [], []
        for turn in range(3):
            fed = []
            r = d.ask(f"{ASK} ({turn})", constraint=g.constraint(g.compile(spec)), on_token=fed.append)
            replies.append(r.reply)
            firsts.append(fed[0])
        got[type(drafting).__name__] = (replies, firsts, drafting.accepted)
    assert got["PlainDecoding"][:2] == got["PromptLookupDrafting"][:2]
    assert got["PromptLookupDrafting"][2] > 0
    opener = style.opener_id
    for reply, first in zip(*got["PlainDecoding"][:2]):
        assert first == opener  # the control token itself, not its text spelt in pieces
        content, calls = style.parse(reply)
        assert content == "" and calls, reply
        assert all(ID.fullmatch(i) for i in style.written_ids(reply))
        for name, arguments in calls:
            check_call(name, arguments)
            assert isinstance(choice, str) or name == "open_windows"


def test_auto_leaves_a_reply_without_the_control_token_untouched(artifact):
    tools = parse_tools(TOOLS)
    out = []
    for constrained in (False, True):
        dec, tok = open_artifact(artifact, threads=1, verify=False)
        style = style_of(dec.manifest.chat, tok.token_to_id)
        g = grammars_of(dec)
        d = Dialogue(dec, tok, system=tools_system(None, tools, dec.manifest.chat), max_new_tokens=40)
        spec = style.grammar(tools, parse_tool_choice("auto", tools), True)
        assert spec.trigger == style.opener_id
        out.append(d.ask(ASK, constraint=g.constraint(g.compile(spec)) if constrained else None).reply)
    assert "[TOOL_CALLS]" not in out[0] and out[0] == out[1]


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    from test_serve import Server

    with Server(artifact, tmp_path_factory.mktemp("mistral-server") / "server.log", "--seats", 4, model=MODEL) as s:
        yield s


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_climate"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_served_mistral_calls_validate_streamed_and_not(server, choice, parallel):
    client = server.client()
    kw = dict(messages=[{"role": "user", "content": ASK}], tools=TOOLS, tool_choice=choice,
              parallel_tool_calls=parallel, max_tokens=200)  # fmt: skip
    try:
        r = client.chat.completions.create(model=MODEL, user="m-calls", **kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason in (("tool_calls", "length") if parallel else ("tool_calls",))
        assert m.tool_calls and (parallel or len(m.tool_calls) == 1), m
        assert m.content is None  # the opener and the calls are no content
        for tc in m.tool_calls:
            check_call(tc.function.name, tc.function.arguments)
            assert ID.fullmatch(tc.id)  # the id the model wrote, as Mistral's template needs it
            assert isinstance(choice, str) or tc.function.name == "set_climate"
        content, calls, finish = stream_calls(client, user="m-calls-streamed", **kw)
        assert finish == r.choices[0].finish_reason and content == ""
        whole = calls if finish == "tool_calls" else calls[: len(m.tool_calls)]
        assert [(c["id"], c["name"], c["arguments"]) for c in whole] == \
            [(tc.id, tc.function.name, tc.function.arguments) for tc in m.tool_calls]  # fmt: skip
    finally:
        for seat in ("m-calls", "m-calls-streamed"):
            server.request("DELETE", f"/v1/seats/{seat}")


def test_a_result_fed_back_answers_as_a_fresh_seat_given_the_same_history(server):
    client = server.client()
    messages = [{"role": "system", "content": "You drive the car."}, {"role": "user", "content": ASK}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, user="m-fed")  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True})}]  # fmt: skip
    kw = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12)
    r = client.chat.completions.create(user="m-fed", **kw)
    assert r.usage.model_extra["cabinlm"]["history"] == "extended"
    fresh = client.chat.completions.create(user="m-fed-fresh", **kw)
    assert fresh.usage.model_extra["cabinlm"]["history"] == "rebuilt"
    assert r.choices[0].message.content == fresh.choices[0].message.content
    # a history whose call id Mistral's template cannot hold is refused, naming it
    bad = [*messages[:2], {**messages[2], "tool_calls": [{**messages[2]["tool_calls"][0], "id": "call_1"}]},
           {**messages[3], "tool_call_id": "call_1"}]  # fmt: skip
    status, error = server.request("POST", "/v1/chat/completions", {**kw, "messages": bad, "user": "m-bad"})
    assert status == 400 and error["error"]["param"] == "messages[2].tool_calls[0].id", error
    for seat in ("m-fed", "m-fed-fresh"):
        server.request("DELETE", f"/v1/seats/{seat}")

