"""A refused request: the OpenAI error object the HTTP layer answers with, and the checks every part
of a request's parsing shares (schema.py, conversation.py)."""

from __future__ import annotations

from typing import Any

from cabinlm.contract.errors import CabinlmError


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


def fail(param: str, message: str) -> RequestError:
    return RequestError(message, param=param, code="invalid_value")


def absent(v: Any) -> bool:
    return v is None or v == [] or v == {}


def checked_text(value: str, param: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"): not text a tokenizer or a session file can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise fail(param, f"{param} is not valid Unicode ({e.reason} at character {e.start})") from e
    return value
