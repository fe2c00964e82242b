"""One line of chat input -> UserInput(seat, text, image): what a car's front end or a script sends.

    plain text                                seat 1
    @2 text                                   seat 2
    {"text": ..., "image": PATH, "seat": 2}   a JSON object; image and seat are optional
    {"tool": NAME, "content": ..., "seat": 2} a tool's result, answering the seat's call of NAME

A message is delivered to the seat its sender named, or not at all: a line that cannot be read as
meant raises InputError (one line: what is wrong), and the caller goes on with the next line. That
covers a seat that does not exist, a JSON message with an unknown key or a value of the wrong type,
one that is not valid JSON, nested too deep (RecursionError) or holding a number too long to read,
and text or a path with a lone surrogate ("\\ud800" from a JSON escape: it has no UTF-8 form, so
neither the tokenizer nor a terminal can take it). A line that starts with "{" but not with '{"'
and is not JSON is plain text ("{curly} braces" in speech); one that opens a JSON object with a key
is a JSON message, so a truncated {"seat": 2, ... is refused rather than given to seat 1 as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from cabinlm.contract.errors import InputError

_SEAT_PREFIX = re.compile(r"^@(\d+)(?:\s+(.*))?$", re.DOTALL)
_JSON_OBJECT = re.compile(r'^\{\s*"')  # a JSON object's first key: no sentence starts this way
_KEYS = ("text", "seat", "image")
_TOOL_KEYS = ("tool", "content", "seat")


@dataclass(frozen=True)
class UserInput:
    seat: int  # 1..seats
    text: str  # stripped; valid Unicode (no lone surrogates); a tool result's content as it was sent
    image: Path | None = None
    tool: str | None = None  # the function whose result `text` is (a {"tool": ...} line)


def parse_input_line(line: str, seats: int = 1) -> UserInput:
    """The message in one input line for a chat of `seats` seats; InputError when it cannot be
    delivered as its sender meant (the message names the reason)."""
    text = line.strip()
    if text.startswith("{"):
        obj = _json_object(text)
        if obj is not None:
            return _from_json(obj, seats)
    m = _SEAT_PREFIX.match(text)
    if m:
        return UserInput(_seat_from_digits(m.group(1), seats), _valid(m.group(2) or "").strip())
    return UserInput(1, _valid(text))


def _json_object(text: str) -> dict | None:
    """The JSON object a line holds; None when the line is plain text that happens to start with "{"."""
    try:
        return json.loads(text)  # a line starting with "{" that parses is an object
    except RecursionError as e:  # the C scanner recurses once per level
        raise InputError("the JSON message is nested too deep to read; send a flat object") from e
    except json.JSONDecodeError as e:
        if _JSON_OBJECT.match(text):
            raise InputError(f"the JSON message is not valid JSON ({e.msg} at character {e.pos})") from e
        return None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise InputError("the JSON message holds a number too long to read (thousands of digits)") from e


def _from_json(obj: dict, seats: int) -> UserInput:
    if "tool" in obj:
        return _tool_result(obj, seats)
    unknown = [k for k in obj if k not in _KEYS]
    if unknown:
        raise InputError(f"unknown key {_show(unknown[0])} in a JSON message (it may hold text, seat, image)")
    if not isinstance(obj.get("text"), str):
        raise InputError(f'a JSON message needs "text" as a string, got {_show(obj.get("text"))}')
    seat = obj.get("seat", 1)
    if isinstance(seat, bool) or not isinstance(seat, int):
        raise InputError(
            f'"seat" must be a whole number (1..{seats}), got {_show(seat)}; the message was not delivered'
        )
    if not 1 <= seat <= seats:
        raise _no_seat(_show(seat), seats)
    image = obj.get("image")
    if image is not None:
        if not isinstance(image, str) or not image.strip() or "\x00" in image:
            raise InputError(
                f'"image" must be a file path (a non-empty string without NUL) or null, got {_show(image)}'
            )
        image = Path(_valid(image, "the image path"))
    return UserInput(seat, _valid(obj["text"]).strip(), image)


def _tool_result(obj: dict, seats: int) -> UserInput:
    unknown = [k for k in obj if k not in _TOOL_KEYS]
    if unknown:
        raise InputError(f"unknown key {_show(unknown[0])} in a tool result (it may hold tool, content, seat)")
    if not isinstance(obj["tool"], str) or not obj["tool"]:
        raise InputError(f'a tool result needs "tool" as the function\'s name, got {_show(obj["tool"])}')
    content = obj.get("content")
    if not isinstance(content, str):  # a structured result is sent as the JSON text the model reads
        content = json.dumps(content, ensure_ascii=False)
    seat = obj.get("seat", 1)
    if isinstance(seat, bool) or not isinstance(seat, int) or not 1 <= seat <= seats:
        raise _no_seat(_show(seat), seats)
    return UserInput(seat, _valid(content), None, _valid(obj["tool"], "the tool's name"))


def _seat_from_digits(digits: str, seats: int) -> int:
    """@N's seat. A number longer than any seat count is refused before int() (which refuses more
    than 4300 digits with a ValueError) is asked to read it."""
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(seats)) or not 1 <= int(significant) <= seats:
        raise _no_seat(_short(digits), seats)
    return int(significant)


def _no_seat(shown: str, seats: int) -> InputError:
    return InputError(f"seat {shown} does not exist (--seats {seats}: seats 1..{seats}); the message was not delivered")


def _valid(text: str, what: str = "the message") -> str:
    """text, if it is valid Unicode; a lone surrogate (no UTF-8 form) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"{what} holds a lone surrogate ({ascii(text[e.start])[1:-1]} at character {e.start}), which is not a "
            "character; a JSON escape must pair a high surrogate with a low one"
        ) from e
    return text


def _show(value) -> str:
    """A JSON value for an error line: ASCII (no surrogate or control character reaches the terminal), short."""
    try:
        shown = json.dumps(value, ensure_ascii=True)
    except (ValueError, RecursionError):  # an int too long for str(), a structure too deep
        shown = f"a {type(value).__name__}"
    return _short(shown)


def _short(s: str, most: int = 40) -> str:
    return s if len(s) <= most else f"{s[: most - 10]}... ({len(s)} characters)"
