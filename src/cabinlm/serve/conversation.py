"""A request's messages, checked once: the OpenAI messages list -> a Conversation (the system prompt,
the earlier exchanges, the message the reply answers), or a RequestError that names the message and
field.

A conversation is [system] (user, assistant)* user: the system message (first only; "developer" is
its newer name) is the pinned system prompt, the last message is the one the reply answers. Tool
results count as a user message: the tool messages that follow an assistant message with tool_calls
(each naming one of its calls' ids) are one user turn of the model's tool-result blocks, and the
assistant message with tool_calls is the text the model wrote for them (the call style's render).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cabinlm.runtime.grammar import GrammarError
from cabinlm.runtime.tools import CallStyle
from cabinlm.serve.request_error import absent, checked_text, fail


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


# Keys of a message object: content and role, plus what the openai client writes back with a reply.
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
MESSAGE_NULL_KEYS = {"function_call", "refusal", "audio", "annotations", "reasoning_content"}


def _content(message: dict, where: str, role: str) -> tuple[str, str | None]:
    """A message's content -> (text, image URL or None). Text parts are joined with newlines."""
    content = message.get("content")
    if isinstance(content, str):
        return checked_text(content, f"{where}.content"), None
    if not isinstance(content, list) or not content:
        raise fail(f"{where}.content",
                    f"{where}.content must be a string or a non-empty list of parts, got {content!r}")  # fmt: skip
    texts, image = [], None
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise fail(f"{at}.text", f"{at}.text must be a string")
            texts.append(checked_text(part["text"], f"{at}.text"))
        elif kind == "image_url":
            if role != "user":
                raise fail(at, f"{at}: only user messages carry images, not {role} messages")
            if image is not None:
                raise fail(at, f"{at}: one image per message (the cache holds one camera frame at a time)")
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise fail(f"{at}.image_url", f"{at}.image_url must be {{\"url\": \"data:image/...\" or a file path}}")
            if url.startswith(("http://", "https://")):
                raise fail(
                    f"{at}.image_url",
                    f"{at}: this server fetches nothing from the network; send the image as a data URL "
                    "(data:image/png;base64,...) or as a local file path",
                )
            if not (url.startswith(("data:", "file://", "/"))):
                raise fail(f"{at}.image_url",
                            f"{at}: an image is a data: URL, a file:// URL or an absolute path, got {url[:80]!r}")
            image = url
        else:
            raise fail(f"{at}.type", f"{at}: a part's type is 'text' or 'image_url', got {kind!r}")
    return "\n".join(texts), image


def _message(m: Any, i: int, style: CallStyle) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise fail(where, f"{where} must be an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise fail(f"{where}.role",
                    f"{where}.role must be 'system', 'developer', 'user', 'assistant' or 'tool', got {role!r}")
    for key, value in m.items():
        if key in MESSAGE_NULL_KEYS and not absent(value):
            raise fail(f"{where}.{key}", f"{where}.{key} is not supported (no audio, refusals or legacy function calls)")
        if key not in MESSAGE_KEYS | MESSAGE_NULL_KEYS:
            raise fail(f"{where}.{key}", f"{where}: unknown field {key!r}")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise fail(f"{where}.name", f"{where}.name must be a string")
    if not absent(m.get("tool_calls")) and role != "assistant":
        raise fail(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages carry tool calls")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise fail(f"{where}.tool_call_id", f"{where}.tool_call_id must name the call this message answers")
        text, _ = _content(m, where, role)
        return Message("tool", text, None, (call_id,))
    if m.get("tool_call_id") is not None:
        raise fail(f"{where}.tool_call_id", f"{where}.tool_call_id: only tool messages answer a call")
    if role == "assistant" and not absent(m.get("tool_calls")):
        calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        for j, (call_id, _, _) in enumerate(calls):
            try:
                style.check_id(call_id, f"{where}.tool_calls[{j}].id")
            except GrammarError as e:
                raise fail(e.param or where, str(e)) from None
        content = m.get("content")
        text = "" if content is None or content == "" else _content(m, where, role)[0]
        ids = tuple(c for c, _, _ in calls)
        return Message("assistant", style.render(text, [(n, a) for _, n, a in calls], ids), None, ids)
    text, image = _content(m, where, role)
    return Message(role, text, image)


def _tool_calls(value: Any, where: str) -> list[tuple[str, str, str]]:
    """An assistant message's tool_calls -> [(id, name, arguments JSON)]."""
    if not isinstance(value, list):
        raise fail(where, f"{where} must be a list of tool calls")
    calls = []
    for j, c in enumerate(value):
        at = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("type", "function") == "function"
                and isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise fail(at, f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                            f'"arguments": "<JSON text>"}}}}')  # fmt: skip
        try:
            json.loads(f["arguments"])
        except ValueError:
            raise fail(f"{at}.function.arguments", f"{at}.function.arguments is not JSON text") from None
        calls.append((c["id"], f["name"], f["arguments"]))
    return calls


def parse_conversation(messages: Any, style: CallStyle) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise fail("messages", "messages must be a non-empty list of {role, content} objects")
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
                raise fail(f"{at}.role", f"{at} is a tool message, but the message before it is not an assistant "
                                          "message with tool_calls")  # fmt: skip
            group = Message("tool", "", None, ())
        if m.call_ids[0] not in calls:
            raise fail(f"{at}.tool_call_id", f"{at}.tool_call_id {m.call_ids[0]!r} matches no call of the assistant "
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
            raise fail(f"{at}.role", f"{at} is a {m.role} message; {why}")
    if not turns or len(turns) % 2 == 0:
        raise fail("messages", "the last message must be the user's (or tool results): the reply answers it")
    exchanges = tuple((turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2))
    return Conversation(system, exchanges, turns[-1])
