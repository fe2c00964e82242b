"""The chat-completions request, checked once: JSON in, a typed ChatRequest out, or a RequestError
that names the field, the value and the fix (the HTTP layer turns it into an OpenAI-style 4xx).

What a request may carry (https://platform.openai.com/docs/api-reference/chat/create):

    model, messages                      required; model must be the one this server loads
    max_tokens | max_completion_tokens   1..MAX_TOKENS_LIMIT (default: the server's --max-new-tokens)
    temperature, top_p, seed             sampling (default: greedy, as `cabinlm chat`)
    stream, stream_options               server-sent events; include_usage adds a usage chunk
    user                                 names the seat (default "default")
    n, stop, tools, logprobs, ...        accepted only at the value that changes nothing (n = 1, no stop
                                         strings, no tools, ...); anything else is refused, not ignored
    metadata, store, service_tier, ...   accepted and ignored (they do not change the reply)
    any other field                      refused: a misspelt field must not be silently dropped

A conversation is [system] (user, assistant)* user: the system message (first only; "developer" is
its newer name) is the pinned system prompt, the last message is the one the reply answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from cabinlm.errors import CabinlmError

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

    role: str  # "system", "user" or "assistant"
    text: str
    image: str | None = None  # a data: URL, a file:// URL or an absolute path (user messages only)


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
    "stop": (lambda v: _absent(v) or v == "",
             "stop strings are not supported; the reply ends at the model's own stop token"),
    "frequency_penalty": (lambda v: v is None or (_is_number(v) and v == 0), "penalties are not supported: use 0"),
    "presence_penalty": (lambda v: v is None or (_is_number(v) and v == 0), "penalties are not supported: use 0"),
    "logprobs": (lambda v: v is None or v is False, "log probabilities are not returned"),
    "top_logprobs": (lambda v: v is None or (_is_int(v) and v == 0), "log probabilities are not returned"),
    "logit_bias": (_absent, "logit_bias is not supported"),
    "tools": (_absent, "tools (function calling) are not supported"),
    "functions": (_absent, "functions (function calling) are not supported"),
    "tool_choice": (lambda v: v is None or v == "none", "tools (function calling) are not supported"),
    "function_call": (lambda v: v is None or v == "none", "functions (function calling) are not supported"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        'only text replies: response_format must be {"type": "text"}'),
    "modalities": (lambda v: v is None or v == ["text"], "only text replies: modalities must be [\"text\"]"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
}
# Fields that do not change the reply here: accepted and ignored.
_IGNORED = {"metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier", "prompt_cache_key",
            "prompt_cache_retention", "moderation"}  # fmt: skip
_KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
          "stream_options", "user"} | set(_ONLY_NEUTRAL) | _IGNORED  # fmt: skip
# Keys of a message object: content and role, plus what the openai client writes back with a reply.
_MESSAGE_KEYS = {"role", "content", "name"}
_MESSAGE_NULL_KEYS = {"tool_calls", "function_call", "refusal", "audio", "annotations", "reasoning_content"}


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


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _fail(where, f"{where} must be an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise _fail(f"{where}.role", f"{where}.role must be 'system', 'developer', 'user' or 'assistant', got {role!r}"
                    + ("; tool messages are not supported" if role in ("tool", "function") else ""))  # fmt: skip
    for key, value in m.items():
        if key in _MESSAGE_NULL_KEYS and not _absent(value):
            raise _fail(f"{where}.{key}", f"{where}.{key} is not supported (no tool calls, audio or refusals)")
        if key not in _MESSAGE_KEYS | _MESSAGE_NULL_KEYS:
            raise _fail(f"{where}.{key}", f"{where}: unknown field {key!r}")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise _fail(f"{where}.name", f"{where}.name must be a string")
    text, image = _content(m, where, role)
    return Message(role, text, image)


def _conversation(messages: Any) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "messages must be a non-empty list of {role, content} objects")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    system = None
    if parsed[0].role == "system":
        system, parsed = parsed[0].text, parsed[1:]
    offset = len(messages) - len(parsed)
    for i, m in enumerate(parsed):
        want = "user" if i % 2 == 0 else "assistant"
        if m.role != want:
            at = f"messages[{i + offset}]"
            if m.role == "system":
                why = "a system message is accepted only first (it is the pinned system prompt)"
            else:
                why = f"expected a {want} message: after the system message, user and assistant messages alternate"
            raise _fail(f"{at}.role", f"{at} is a {m.role} message; {why}")
    if not parsed or len(parsed) % 2 == 0:
        raise _fail("messages", "the last message must be the user's: the reply answers it")
    exchanges = tuple((parsed[i], parsed[i + 1]) for i in range(0, len(parsed) - 1, 2))
    return Conversation(system, exchanges, parsed[-1])


def parse_chat_request(body: Any, model_id: str) -> ChatRequest:
    """A decoded JSON body -> ChatRequest, or RequestError (status 400, or 404 for another model)."""
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
    if model != model_id:
        raise RequestError(f"the model {model!r} is not served here; this server serves {model_id!r} (GET /v1/models)",
                           status=404, param="model", code="model_not_found")  # fmt: skip
    conversation = _conversation(body.get("messages"))
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
    return ChatRequest(conversation, seat, max_completion if max_tokens is None else max_tokens, temperature, top_p,
                       seed, bool(stream), include_usage)  # fmt: skip
