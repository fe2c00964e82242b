"""Function calling: the tool list in the prompt, the grammar a call follows, the calls read back.

The model sees the tools in its system prompt (ChatTemplate.tools_prefix / separator / suffix,
resolved at export: the model's own wording where its template renders tools, a default wording
otherwise) and writes each call in its family's convention (CallStyle, ChatTemplate.tool_call_style):

    hermes (Qwen2.5, Qwen3; the default)   <tool_call>
                                           {"name": "set_temperature", "arguments": {"zone": "driver", "celsius": 22}}
                                           </tool_call>
    llama3-json (Llama 3.1 / 3.2)          {"name": "set_temperature", "parameters": {"zone": "driver", "celsius": 22}}
                                           (one call a reply, as Llama's template allows)
    mistral (Mistral's v0.3 templates)     [TOOL_CALLS] [{"name": "set_temperature", "arguments": {...}, "id": "a1B2c3D4e"}]
                                           (control-token markers, ids the model writes: runtime/mistral_calls.py)

The grammar (runtime/grammar.py) makes every call well-formed: the name one of the tools', the
arguments valid against that tool's JSON Schema, the JSON written with fixed separators (", " and
": ", no other whitespace), so a call's text is a function of its name and arguments alone. With
tool_choice "auto" it holds from the opener "<tool_call>" on (a reply without a call is untouched);
with "required" or a named function, from the first token. After the last call only the model's
stop ids are allowed.

A reply's calls go back into a history as the same text (CallStyle.render), and tool results as the
turn that carries them (CallStyle.results: a user turn of <tool_response> blocks for Hermes, as
Qwen2.5's template renders them; the content alone in Llama's own "ipython" turn, whose pieces the
export resolves into ChatTemplate.tool_result_prefix / suffix).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cabinlm.contract.manifest import ChatTemplate
from cabinlm.runtime.grammar import GrammarError, GrammarSpec, check_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# Calls and JSON replies are written compactly with these separators and no other whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON Schema of an object

    def listing(self) -> str:
        """The tool as the prompt lists it (OpenAI's tool object, as the templates serialize it)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto" or "required"
    name: str | None = None  # a named function (mode "required")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments, as the model wrote it

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(value: Any, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's `tools` list -> Tools, or GrammarError naming the element and the fix. Each tool's
    parameters are checked as JSON Schema (an object schema)."""
    if not isinstance(value, list) or not value:
        raise GrammarError(f"{param} must be a non-empty list of {{\"type\": \"function\", \"function\": {{...}}}}", param)
    tools: list[Tool] = []
    for i, t in enumerate(value):
        at = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise GrammarError(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": "
                               f"{{...}}}}}} (only function tools)", at)  # fmt: skip
        f = t["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise GrammarError(f"{at}.function: unknown field {sorted(unknown)[0]!r}", f"{at}.function")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise GrammarError(f"{at}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                               f"{at}.function.name")  # fmt: skip
        if any(x.name == name for x in tools):
            raise GrammarError(f"{at}.function.name {name!r} names two tools", f"{at}.function.name")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise GrammarError(f"{at}.function.description must be a string", f"{at}.function.description")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        where = f"{at}.function.parameters"
        check_schema(parameters, where)
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise GrammarError(f"{where} must be a JSON Schema of \"type\": \"object\" (a call's arguments are an object)",
                               where)  # fmt: skip
        tools.append(Tool(name, description, parameters))
    return tuple(tools)


def parse_tool_choice(value: Any, tools: Sequence[Tool], param: str = "tool_choice") -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise GrammarError(f"{param}={value!r} needs tools", param)
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not any(t.name == name for t in tools):
            raise GrammarError(f"{param} names the function {name!r}, which is not among tools "
                               f"({', '.join(t.name for t in tools) or 'none given'})", param)  # fmt: skip
        return ToolChoice("required", name)
    raise GrammarError(f"{param} must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                       f"{{\"name\": ...}}}}, got {value!r}"[:300], param)  # fmt: skip


def tools_system(system: str | None, tools: Sequence[Tool], chat: ChatTemplate) -> str | None:
    """The system prompt with the tool list (`system` itself without tools)."""
    if not tools:
        return system
    listing = chat.tools_separator.join(t.listing() for t in tools)
    return (system or "") + chat.tools_prefix + listing + chat.tools_suffix


@dataclass(frozen=True)
class CallStyle:
    """How a model family writes its calls and reads their results."""

    name: str
    open: str  # text before each call's JSON ("" where the JSON stands alone)
    close: str  # text after it
    args_key: str  # the JSON key of the arguments: "arguments" (Hermes), "parameters" (Llama)
    parallel: bool  # several calls a reply (joined by "\n")
    trigger: str  # the text a call starts with: a lazy grammar holds from it on, the parser looks for it
    result_open: str = ""  # around each tool result
    result_close: str = ""
    # control tokens' texts the style's pieces hold (the tool list's, a call's, a result's): where
    # they stand in a system prompt, a reply sent back or a tool turn they are fed as control tokens
    # (runtime/template.py); never in a user's message
    markers: tuple[str, ...] = ()
    ids_written = False  # the model writes each call's id (written_ids); else the runtime names calls

    def bind(self, token_to_id) -> CallStyle:
        """The style for one model's vocabulary (token_to_id: the tokenizer's lookup)."""
        return self

    def written_ids(self, text: str) -> list[str]:
        """The ids the model wrote for a reply's calls ([]: the runtime names them, new_call_id)."""
        return []

    def check_id(self, call_id: str, param: str) -> None:
        """GrammarError unless a history's call id is one this style can render."""

    def call_schema(self, tool: Tool) -> dict:
        return {"type": "object", "properties": {"name": {"const": tool.name}, self.args_key: tool.parameters},
                "required": ["name", self.args_key], "additionalProperties": False}  # fmt: skip

    def calls_schema(self, tools: Sequence[Tool], choice: ToolChoice) -> dict[str, Any]:
        """One call's JSON Schema under `choice`: the named tool's, or any of the tools', written
        compactly (JSON_STYLE)."""
        allowed = [t for t in tools if choice.name is None or t.name == choice.name]
        schema: dict[str, Any] = {"x-guidance": JSON_STYLE}
        if len(allowed) == 1:
            schema.update(self.call_schema(allowed[0]))
        else:
            schema["anyOf"] = [self.call_schema(t) for t in allowed]
        return schema

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> GrammarSpec | None:
        """The grammar of a reply under `choice` (None for "none": the reply is free)."""
        if choice.mode == "none":
            return None
        schema = self.calls_schema(tools, choice)
        more = ' ("\\n" call)*' if parallel and self.parallel else ""
        parts = [json.dumps(self.open)] if self.open else []
        parts.append("body")
        if self.close:
            parts.append(json.dumps(self.close))
        lark = (f"start: call{more}\n"
                f"call: {' '.join(parts)}\n"
                f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")  # fmt: skip
        return GrammarSpec(lark, self.trigger if choice.mode == "auto" else None, "tools")

    def parse(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """A reply's text -> (the content before its first call, stripped; [(name, arguments JSON)]).
        A reply without a well-formed call is all content; one that the length limit cut inside a
        call after whole ones gives the whole ones. Reads what grammar() lets the model write."""
        at = text.find(self.trigger)
        if at < 0:
            return text, []
        content, rest, calls = text[:at].strip(), text[at:], []
        decoder = json.JSONDecoder()
        head, tail = self.open.strip(), self.close.strip()
        while rest.startswith(head) and (self.parallel or not calls):
            body = rest[len(head):].lstrip("\n")
            try:
                obj, end = decoder.raw_decode(body)
            except json.JSONDecodeError:
                break
            args = obj.get(self.args_key) if isinstance(obj, dict) else None
            if not (isinstance(obj.get("name"), str) and isinstance(args, dict)):
                break
            after = body[end:].lstrip("\n")
            if not after.startswith(tail):
                break
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
            rest = after[len(tail):].lstrip("\n")
            if not head:
                break
        if not calls or (rest.strip() and not (head and head.startswith(rest.strip()[: len(head)]))):
            return text, []
        return content, calls

    def render(self, content: str, calls: Sequence[tuple[str, str]], ids: Sequence[str] = ()) -> str:
        """An assistant message with tool calls as the model writes it (grammar()'s form); ids: the
        calls' ids, for styles whose calls hold them."""
        parts = [content] if content else []
        for name, arguments in calls:
            try:
                args = json.loads(arguments)
            except (TypeError, ValueError):
                args = arguments
            call = json.dumps({"name": name, self.args_key: args}, ensure_ascii=False)
            parts.append(f"{self.open}{call}{self.close}")
        return "\n".join(parts)

    def results(self, results: Sequence[str], ids: Sequence[str] = ()) -> str:
        """Tool results as the text of the turn that carries them (ids: the calls each answers)."""
        return "\n".join(f"{self.result_open}{r}{self.result_close}" for r in results)


HERMES = CallStyle("hermes", OPEN + "\n", "\n" + CLOSE, "arguments", True, OPEN, RESULT_OPEN, RESULT_CLOSE)
LLAMA3_JSON = CallStyle("llama3-json", "", "", "parameters", False, '{"name": ')
def calls_grammar(tools: Sequence[Tool], choice: ToolChoice, parallel: bool, style: CallStyle = HERMES) -> GrammarSpec | None:
    """The grammar of a reply under `choice` in `style` (None for "none")."""
    return style.grammar(tools, choice, parallel)


def json_reply_grammar(schema: Any, param: str) -> GrammarSpec:
    """A reply that is one JSON value following `schema`, written compactly (JSON_STYLE)."""
    check_schema(schema, param)
    body = {"x-guidance": JSON_STYLE, **schema} if isinstance(schema, dict) else schema
    return GrammarSpec(f"start: %json {json.dumps(body, ensure_ascii=False)}", None, param)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str, style: CallStyle = HERMES) -> tuple[str, list[tuple[str, str]]]:
    return style.parse(text)


def render_calls(content: str, calls: Sequence[tuple[str, str]], style: CallStyle = HERMES,
                 ids: Sequence[str] = ()) -> str:  # fmt: skip
    return style.render(content, calls, ids)


def render_results(results: Sequence[str], style: CallStyle = HERMES, ids: Sequence[str] = ()) -> str:
    return style.results(results, ids)


_CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "(?:arguments|parameters)": ')


class CallStream:
    """A reply's calls as its text streams in (the text from the call trigger on, as the grammar
    writes it): each call's name once it is whole, then its arguments' text as it arrives. The
    arguments streamed for a call, joined, are the arguments its parse gives (the grammar writes the
    JSON as json.dumps does), so a client that joins the deltas holds the final call."""

    def __init__(self, ids_written: bool = False) -> None:
        """ids_written: each call's id follows its arguments in its text (Mistral's): a call is
        announced once its id is whole (ids), its arguments then in one piece."""
        self.text = ""
        self.names: list[str] = []  # announced calls
        self.sent: list[int] = []  # characters of each call's arguments streamed
        self.ids_written = ids_written
        self.ids: list[str] = []  # the announced calls' ids (ids_written)

    def push(self, delta: str) -> list[tuple[str, int, str]]:
        """New events: ("call", index, name) and ("args", index, text)."""
        self.text += delta
        if self.ids_written:
            return self._whole_calls()
        events: list[tuple[str, int, str]] = []
        decoder = json.JSONDecoder()
        for i, m in enumerate(_CALL_HEAD.finditer(self.text)):
            if i == len(self.names):
                self.names.append(m.group(1))
                self.sent.append(0)
                events.append(("call", i, m.group(1)))
            args = self.text[m.end():]
            try:
                _, end = decoder.raw_decode(args)
                args = args[:end]
            except json.JSONDecodeError:
                # unfinished: all of it is the arguments so far, but a call's end ("}", a closing
                # tag) only follows a whole object, so nothing after the arguments is in `args`
                nxt = _CALL_HEAD.search(args)
                args = args if nxt is None else args[: nxt.start()]
            if len(args) > self.sent[i]:
                events.append(("args", i, args[self.sent[i]:]))
                self.sent[i] = len(args)
        return events

    def _whole_calls(self) -> list[tuple[str, int, str]]:
        events: list[tuple[str, int, str]] = []
        decoder = json.JSONDecoder()
        for i, m in enumerate(_CALL_HEAD.finditer(self.text)):
            if i < len(self.names):
                continue
            try:
                _, end = decoder.raw_decode(self.text, m.end())
            except json.JSONDecodeError:
                break
            found = _WRITTEN_ID.match(self.text, end)
            if found is None:
                break
            self.names.append(m.group(1))
            self.ids.append(found.group(1))
            self.sent.append(end - m.end())
            events += [("call", i, m.group(1)), ("args", i, self.text[m.end():end])]
        return events


_WRITTEN_ID = re.compile(r', "id": "([A-Za-z0-9]{1,64})"')
