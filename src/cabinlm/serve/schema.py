"""The chat-completions request, checked once: JSON in, a typed ChatRequest out, or a RequestError
that names the field, the value and the fix (the HTTP layer turns it into an OpenAI-style 4xx).

What a request may carry (https://platform.openai.com/docs/api-reference/chat/create):

    model, messages                      required; model must be the one this server loads
    max_tokens | max_completion_tokens   1..MAX_TOKENS_LIMIT (default: the server's --max-new-tokens)
    temperature, top_p, seed             sampling (default: greedy, as `cabinlm chat`)
    stream, stream_options               server-sent events; include_usage adds a usage chunk
    user                                 names the seat (default "default")
    tools, tool_choice,                  function calling (runtime/tools.py): the tools join the system
    parallel_tool_calls                  prompt, the grammar makes every call valid against its schema
    response_format                      {"type": "json_object"} or {"type": "json_schema", ...}: the
                                         reply is JSON following it (grammar-constrained)
    stop                                 a string or up to 4: the reply ends at the first, not shown
    logprobs, top_logprobs               each returned token's log probability under the model (its raw
                                         logits, before any grammar mask or temperature), and 0..20
                                         likeliest alternatives'
    n, frequency_penalty, ...            accepted only at the value that changes nothing (n = 1, ...);
                                         anything else is refused, not ignored
    metadata, store, service_tier, ...   accepted and ignored (they do not change the reply)
    any other field                      refused: a misspelt field must not be silently dropped

A conversation is [system] (user, assistant)* user: the system message (first only; "developer" is
its newer name) is the pinned system prompt, the last message is the one the reply answers. Tool
results count as a user message: the tool messages that follow an assistant message with tool_calls
(each naming one of its calls' ids) are one user turn of <tool_response> blocks, and the assistant
message with tool_calls is the text the model wrote for them (runtime/tools.render_calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from cabinlm.contract.errors import CabinlmError
from cabinlm.runtime.grammar import GrammarError, GrammarSpec
from cabinlm.runtime.stops import MAX_STOP_STRINGS
from cabinlm.runtime.tools import (
    HERMES,
    CallStyle,
    Tool,
    ToolChoice,
    json_reply_grammar,
    parse_tool_choice,
    parse_tools,
)

DEFAULT_SEAT = "default"
MAX_TOKENS_LIMIT = 32768  # the longest reply one request may ask for (memory stays constant regardless)
# Also a file name in --sessions DIR: matched whole (fullmatch; `$` would let a trailing newline through).
SEAT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RequestError(CabinlmError):
    """A request the server refuses: HTTP status, the OpenAI error type and code, the offending parameter."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        """The OpenAI error object: {"error": {"message", "type", "param", "code"}}. The message and the
        parameter may echo what a client sent (a key with a lone surrogate): written as encodable text."""
        param = None if self.param is None else encodable(self.param)
        return {"error": {"message": encodable(str(self)), "type": self.type, "param": param, "code": self.code}}


def encodable(text: str) -> str:
    """text as UTF-8 can carry it: a lone surrogate (JSON allows "\\ud800") becomes its escape, \\ud800."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Message:
    """One message of the history: its text parts joined, and a user message's image (its URL)."""

    role: str  # "system", "user", "assistant" or "tool" (tool results: a user turn)
    text: str
    image: str | None = None  # a data: URL, a file:// URL or an absolute path (user messages only)
    call_ids: tuple[str, ...] = ()  # an assistant message's tool calls' ids; a tool turn's tool_call_ids


@dataclass(frozen=True)
class Conversation:
    system: str | None  # None: the model's own default system prompt (as `cabinlm chat` without --system)
    exchanges: tuple[tuple[Message, Message], ...]  # earlier (user, assistant) pairs, oldest first
    prompt: Message  # the user message the reply answers


@dataclass(frozen=True)
class ChatRequest:
    conversation: Conversation
    seat: str
    max_tokens: int | None  # None: the server's default
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    grammar: GrammarSpec | None = None  # what the reply must follow (tool calls or response_format)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top_logprobs when logprobs is true (0: the chosen token's alone); None: false
    adapter: str | None = None  # the switchable LoRA adapter `model` names (BASE:NAME); None: the base model

    @property
    def calls_tools(self) -> bool:
        """The reply may hold tool calls (read back from its text)."""
        return self.tool_choice.mode != "none"


# -- field checks ---------------------------------------------------------------------------------


def _fail(param: str, message: str) -> RequestError:
    return RequestError(message, param=param, code="invalid_value")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v  # not NaN


def _absent(v: Any) -> bool:
    return v is None or v == [] or v == {}


# Fields OpenAI defines that this server can honour only at one value: (accepted?, what to say).
_ONLY_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v is None or (_is_int(v) and v == 1), "one choice per request: n must be 1"),
    "frequency_penalty": (lambda v: v is None or (_is_number(v) and v == 0), "penalties are not supported: use 0"),
    "presence_penalty": (lambda v: v is None or (_is_number(v) and v == 0), "penalties are not supported: use 0"),
    "logit_bias": (_absent, "logit_bias is not supported"),
    "functions": (_absent, "the legacy functions field is not supported: send tools"),
    "function_call": (lambda v: v is None or v == "none", "the legacy function_call field is not supported: send "
                      "tool_choice"),
    "modalities": (lambda v: v is None or v == ["text"], "only text replies: modalities must be [\"text\"]"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
}
# Fields that do not change the reply here: accepted and ignored.
_IGNORED = {"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "moderation"}  # fmt: skip
_KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
          "stream_options", "user", "tools", "tool_choice", "parallel_tool_calls", "response_format",
          "stop", "logprobs", "top_logprobs"} | set(_ONLY_NEUTRAL) | _IGNORED  # fmt: skip
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
# Keys of a message object: content and role, plus what the openai client writes back with a reply.
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
_MESSAGE_NULL_KEYS = {"function_call", "refusal", "audio", "annotations", "reasoning_content"}


def _int_field(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _fail(name, f"{name} must be an integer, got {v!r}")
    if not low <= v <= high:
        raise _fail(name, f"{name} must be between {low} and {high}, got {v}")
    return v


def _number_field(body: dict, name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise _fail(name, f"{name} must be a number, got {v!r}")
    if not ok(v):
        raise _fail(name, f"{name} must be {allowed}, got {v}")
    return float(v)


def _text(value: str, param: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"): not text a tokenizer or a session file can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _fail(param, f"{param} is not valid Unicode ({e.reason} at character {e.start})") from e
    return value


def _content(message: dict, where: str, role: str) -> tuple[str, str | None]:
    """A message's content -> (text, image URL or None). Text parts are joined with newlines."""
    content = message.get("content")
    if isinstance(content, str):
        return _text(content, f"{where}.content"), None
    if not isinstance(content, list) or not content:
        raise _fail(f"{where}.content",
                    f"{where}.content must be a string or a non-empty list of parts, got {content!r}")  # fmt: skip
    texts, image = [], None
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _fail(f"{at}.text", f"{at}.text must be a string")
            texts.append(_text(part["text"], f"{at}.text"))
        elif kind == "image_url":
            if role != "user":
                raise _fail(at, f"{at}: only user messages carry images, not {role} messages")
            if image is not None:
                raise _fail(at, f"{at}: one image per message (the cache holds one camera frame at a time)")
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise _fail(f"{at}.image_url", f"{at}.image_url must be {{\"url\": \"data:image/...\" or a file path}}")
            if url.startswith(("http://", "https://")):
                raise _fail(
                    f"{at}.image_url",
                    f"{at}: this server fetches nothing from the network; send the image as a data URL "
                    "(data:image/png;base64,...) or as a local file path",
                )
            if not (url.startswith(("data:", "file://", "/"))):
                raise _fail(f"{at}.image_url",
                            f"{at}: an image is a data: URL, a file:// URL or an absolute path, got {url[:80]!r}")
            image = url
        else:
            raise _fail(f"{at}.type", f"{at}: a part's type is 'text' or 'image_url', got {kind!r}")
    return "\n".join(texts), image


def _message(m: Any, i: int, style: CallStyle) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _fail(where, f"{where} must be an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise _fail(f"{where}.role",
                    f"{where}.role must be 'system', 'developer', 'user', 'assistant' or 'tool', got {role!r}")
    for key, value in m.items():
        if key in _MESSAGE_NULL_KEYS and not _absent(value):
            raise _fail(f"{where}.{key}", f"{where}.{key} is not supported (no audio, refusals or legacy function calls)")
        if key not in _MESSAGE_KEYS | _MESSAGE_NULL_KEYS:
            raise _fail(f"{where}.{key}", f"{where}: unknown field {key!r}")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise _fail(f"{where}.name", f"{where}.name must be a string")
    if not _absent(m.get("tool_calls")) and role != "assistant":
        raise _fail(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages carry tool calls")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _fail(f"{where}.tool_call_id", f"{where}.tool_call_id must name the call this message answers")
        text, _ = _content(m, where, role)
        return Message("tool", text, None, (call_id,))
    if m.get("tool_call_id") is not None:
        raise _fail(f"{where}.tool_call_id", f"{where}.tool_call_id: only tool messages answer a call")
    if role == "assistant" and not _absent(m.get("tool_calls")):
        calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        for j, (call_id, _, _) in enumerate(calls):
            try:
                style.check_id(call_id, f"{where}.tool_calls[{j}].id")
            except GrammarError as e:
                raise _fail(e.param or where, str(e)) from None
        content = m.get("content")
        text = "" if content is None or content == "" else _content(m, where, role)[0]
        ids = tuple(c for c, _, _ in calls)
        return Message("assistant", style.render(text, [(n, a) for _, n, a in calls], ids), None, ids)
    text, image = _content(m, where, role)
    return Message(role, text, image)


def _tool_calls(value: Any, where: str) -> list[tuple[str, str, str]]:
    """An assistant message's tool_calls -> [(id, name, arguments JSON)]."""
    if not isinstance(value, list):
        raise _fail(where, f"{where} must be a list of tool calls")
    calls = []
    for j, c in enumerate(value):
        at = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("type", "function") == "function"
                and isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise _fail(at, f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                            f'"arguments": "<JSON text>"}}}}')  # fmt: skip
        try:
            json.loads(f["arguments"])
        except ValueError:
            raise _fail(f"{at}.function.arguments", f"{at}.function.arguments is not JSON text") from None
        calls.append((c["id"], f["name"], f["arguments"]))
    return calls


def _conversation(messages: Any, style: CallStyle) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "messages must be a non-empty list of {role, content} objects")
    parsed = [_message(m, i, style) for i, m in enumerate(messages)]
    system = None
    offset = 0
    if parsed[0].role == "system":
        system, parsed, offset = parsed[0].text, parsed[1:], 1
    # Consecutive tool messages are one user turn; each answers a call of the assistant message before.
    turns: list[Message] = []
    index: list[int] = []  # each turn's first message, as the request numbers it
    for i, m in enumerate(parsed):
        at = f"messages[{i + offset}]"
        if m.role != "tool":
            turns.append(m)
            index.append(i + offset)
            continue
        if turns and turns[-1].role == "tool":
            calls = turns[-2].call_ids
            group = turns.pop()
        else:
            index.append(i + offset)
            calls = turns[-1].call_ids if turns and turns[-1].role == "assistant" else ()
            if not calls:
                raise _fail(f"{at}.role", f"{at} is a tool message, but the message before it is not an assistant "
                                          "message with tool_calls")  # fmt: skip
            group = Message("tool", "", None, ())
        if m.call_ids[0] not in calls:
            raise _fail(f"{at}.tool_call_id", f"{at}.tool_call_id {m.call_ids[0]!r} matches no call of the assistant "
                                              f"message before it ({', '.join(calls)})")  # fmt: skip
        results = [*group.call_ids, m.call_ids[0]]
        texts = ([group.text] if group.text else []) + [style.results([m.text], m.call_ids)]
        turns.append(Message("tool", "\n".join(texts), None, tuple(results)))
    for i, m in enumerate(turns):
        want = ("user", "tool") if i % 2 == 0 else ("assistant",)
        if m.role not in want:
            at = f"messages[{index[i]}]"
            if m.role == "system":
                why = "a system message is accepted only first (it is the pinned system prompt)"
            else:
                why = (f"expected a {want[0]} message: after the system message, user (or tool results) and "
                       "assistant messages alternate")  # fmt: skip
            raise _fail(f"{at}.role", f"{at} is a {m.role} message; {why}")
    if not turns or len(turns) % 2 == 0:
        raise _fail("messages", "the last message must be the user's (or tool results): the reply answers it")
    exchanges = tuple((turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2))
    return Conversation(system, exchanges, turns[-1])


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise _fail("stop", f"stop must be a string or a list of up to {MAX_STOP_STRINGS} strings, got {value!r}"[:200])
    if len(stops) > MAX_STOP_STRINGS:
        raise _fail("stop", f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    return tuple(_text(x, "stop") for x in stops if x)


def _logprobs(body: dict) -> int | None:
    """logprobs / top_logprobs -> how many alternatives each token reports (None: no log probabilities)."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise _fail("logprobs", f"logprobs must be true or false, got {asked!r}")
    top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not asked:
        raise _fail("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if asked else None


def _grammar(body: dict, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool,
             style: CallStyle) -> GrammarSpec | None:  # fmt: skip
    """What the reply must follow: the tool calls' grammar, or response_format's JSON (not both)."""
    fmt = body.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return style.grammar(tools, choice, parallel)
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        spec = json_reply_grammar({"type": "object"}, "response_format")
    elif kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _fail("response_format.json_schema",
                        'response_format.json_schema must be {"name": ..., "schema": {...}}')  # fmt: skip
        spec = json_reply_grammar(js["schema"], "response_format.json_schema.schema")
    else:
        raise _fail("response_format", 'response_format.type must be "text", "json_object" or "json_schema", got '
                                       f"{kind!r}")  # fmt: skip
    if choice.mode != "none":
        raise _fail("response_format", "a JSON response_format and tool calls cannot both shape one reply: send "
                                       'tool_choice "none", or no response_format')  # fmt: skip
    return spec


def served_models(model_id: str, adapters: tuple[str, ...] = ()) -> dict[str, str | None]:
    """The model ids a server answers to -> the adapter each selects: BASE (none), BASE:NAME per adapter."""
    return {model_id: None, **{f"{model_id}:{name}": name for name in adapters}}


def parse_chat_request(body: Any, model_id: str, style: CallStyle = HERMES, adapters: tuple[str, ...] = ()) -> ChatRequest:
    """A decoded JSON body -> ChatRequest, or RequestError (status 400, or 404 for another model).
    style: how the served model writes tool calls (its manifest's chat.tool_call_style). adapters: the
    build's switchable LoRA adapters, which `model` selects as BASE:NAME (served_models)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    for key in body:
        if key not in _KNOWN:
            raise RequestError(f"unknown field {key!r} (not a chat-completions parameter this server knows)",
                               param=key, code="unknown_parameter")  # fmt: skip
    for key, (ok, why) in _ONLY_NEUTRAL.items():
        if key in body and not ok(body[key]):
            raise RequestError(f"{key}={body[key]!r}: {why}", param=key, code="unsupported_value")
    model = body.get("model")
    if not isinstance(model, str):
        raise _fail("model", f"model must be a string naming the served model ({model_id!r}), got {model!r}")
    served = served_models(model_id, adapters)
    if model not in served:
        names = ", ".join(repr(m) for m in served)
        raise RequestError(f"the model {model!r} is not served here; this server serves {names} (GET /v1/models)",
                           status=404, param="model", code="model_not_found")  # fmt: skip
    conversation = _conversation(body.get("messages"), style)
    max_tokens = _int_field(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    max_completion = _int_field(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _fail("max_tokens",
                    f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) differ; send one")
    temperature = _number_field(body, "temperature", 0.0, lambda v: 0 <= v <= 2, "between 0 and 2")
    top_p = _number_field(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _fail("seed", f"seed must be an integer, got {seed!r}")
    if seed is not None and seed < 0:
        raise _fail("seed", f"seed must be >= 0, got {seed}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream", f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}:
            raise _fail("stream_options", f"stream_options must be {{\"include_usage\": true|false}}, got {options!r}")
        include_usage = options.get("include_usage") is True
        if not stream:
            raise _fail("stream_options", "stream_options needs stream: true")
    seat = body.get("user")
    if seat is None:
        seat = DEFAULT_SEAT
    if not isinstance(seat, str) or not SEAT_NAME.fullmatch(seat):
        raise _fail("user", f"user names the seat: 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                            f"digit; got {seat!r}")  # fmt: skip
    try:
        tools = parse_tools(body["tools"]) if not _absent(body.get("tools")) else ()
        choice = parse_tool_choice(body.get("tool_choice"), tools)
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise _fail("parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel!r}")
        grammar = _grammar(body, tools, choice, parallel is not False, style)
    except GrammarError as e:
        raise RequestError(str(e), param=e.param, code="invalid_value") from None
    return ChatRequest(conversation, seat, max_completion if max_tokens is None else max_tokens, temperature, top_p,
                       seed, bool(stream), include_usage, tools, choice, parallel is not False, grammar,
                       _stop(body.get("stop")), _logprobs(body), served[model])  # fmt: skip
