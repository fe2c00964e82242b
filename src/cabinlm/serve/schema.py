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

The messages are checked in conversation.py (a Conversation); a refused request is a RequestError
(request_error.py), which the HTTP layer answers with OpenAI's error object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

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
from cabinlm.serve.conversation import Conversation, parse_conversation
from cabinlm.serve.request_error import RequestError, absent, checked_text, fail

DEFAULT_SEAT = "default"
MAX_TOKENS_LIMIT = 32768  # the longest reply one request may ask for (memory stays constant regardless)
# Also a file name in --sessions DIR: matched whole (fullmatch; `$` would let a trailing newline through).
SEAT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v  # not NaN


# Fields OpenAI defines that this server can honour only at one value: (accepted?, what to say).
_ONLY_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v is None or (_is_int(v) and v == 1), "one choice per request: n must be 1"),
    "frequency_penalty": (lambda v: v is None or (_is_number(v) and v == 0), "penalties are not supported: use 0"),
    "presence_penalty": (lambda v: v is None or (_is_number(v) and v == 0), "penalties are not supported: use 0"),
    "logit_bias": (absent, "logit_bias is not supported"),
    "functions": (absent, "the legacy functions field is not supported: send tools"),
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
def _int_field(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise fail(name, f"{name} must be an integer, got {v!r}")
    if not low <= v <= high:
        raise fail(name, f"{name} must be between {low} and {high}, got {v}")
    return v


def _number_field(body: dict, name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise fail(name, f"{name} must be a number, got {v!r}")
    if not ok(v):
        raise fail(name, f"{name} must be {allowed}, got {v}")
    return float(v)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise fail("stop", f"stop must be a string or a list of up to {MAX_STOP_STRINGS} strings, got {value!r}"[:200])
    if len(stops) > MAX_STOP_STRINGS:
        raise fail("stop", f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    return tuple(checked_text(x, "stop") for x in stops if x)


def _logprobs(body: dict) -> int | None:
    """logprobs / top_logprobs -> how many alternatives each token reports (None: no log probabilities)."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise fail("logprobs", f"logprobs must be true or false, got {asked!r}")
    top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not asked:
        raise fail("top_logprobs", "top_logprobs needs logprobs: true")
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
            raise fail("response_format.json_schema",
                        'response_format.json_schema must be {"name": ..., "schema": {...}}')  # fmt: skip
        spec = json_reply_grammar(js["schema"], "response_format.json_schema.schema")
    else:
        raise fail("response_format", 'response_format.type must be "text", "json_object" or "json_schema", got '
                                       f"{kind!r}")  # fmt: skip
    if choice.mode != "none":
        raise fail("response_format", "a JSON response_format and tool calls cannot both shape one reply: send "
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
        raise fail("model", f"model must be a string naming the served model ({model_id!r}), got {model!r}")
    served = served_models(model_id, adapters)
    if model not in served:
        names = ", ".join(repr(m) for m in served)
        raise RequestError(f"the model {model!r} is not served here; this server serves {names} (GET /v1/models)",
                           status=404, param="model", code="model_not_found")  # fmt: skip
    conversation = parse_conversation(body.get("messages"), style)
    max_tokens = _int_field(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    max_completion = _int_field(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise fail("max_tokens",
                    f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) differ; send one")
    temperature = _number_field(body, "temperature", 0.0, lambda v: 0 <= v <= 2, "between 0 and 2")
    top_p = _number_field(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise fail("seed", f"seed must be an integer, got {seed!r}")
    if seed is not None and seed < 0:
        raise fail("seed", f"seed must be >= 0, got {seed}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise fail("stream", f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}:
            raise fail("stream_options", f"stream_options must be {{\"include_usage\": true|false}}, got {options!r}")
        include_usage = options.get("include_usage") is True
        if not stream:
            raise fail("stream_options", "stream_options needs stream: true")
    seat = body.get("user")
    if seat is None:
        seat = DEFAULT_SEAT
    if not isinstance(seat, str) or not SEAT_NAME.fullmatch(seat):
        raise fail("user", f"user names the seat: 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                            f"digit; got {seat!r}")  # fmt: skip
    try:
        tools = parse_tools(body["tools"]) if not absent(body.get("tools")) else ()
        choice = parse_tool_choice(body.get("tool_choice"), tools)
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise fail("parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel!r}")
        grammar = _grammar(body, tools, choice, parallel is not False, style)
    except GrammarError as e:
        raise RequestError(str(e), param=e.param, code="invalid_value") from None
    return ChatRequest(conversation, seat, max_completion if max_tokens is None else max_tokens, temperature, top_p,
                       seed, bool(stream), include_usage, tools, choice, parallel is not False, grammar,
                       _stop(body.get("stop")), _logprobs(body), served[model])  # fmt: skip
