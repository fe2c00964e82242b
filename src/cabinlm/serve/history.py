"""What a seat holds, and what a request's history asks of it.

OpenAI clients send the whole history with every request. A seat remembers the exchanges its cache
holds (SeatRecord); plan_turn compares the two:

    seat holds   [sys] (u1,a1) (u2,a2)
    request      [sys] (u1,a1) (u2,a2) u3                 extends: feed u3 only
    request      [sys] (u1,a1) (u2,a2) (u3,a3) u4         extends: feed (u3,a3) by template, then u4
    request      [sys] (u1,a1) (u2',a2') u3               differs at exchange 2: start over, feed
                                                          (u1,a1) again exactly, then (u2',a2') by
                                                          template, then u3
    request      [sys'] ...                               another system prompt: start over

"Exactly": an exchange the seat generated is fed again with the choices its sampler made, through the
same steps (the prompt in chunks, then one token per step), so the cache is bit for bit the one the
live conversation had; the reply that follows is the one it would have given. An exchange a client
wrote (or one this seat no longer remembers) is fed as the chat template renders it (Dialogue.add_turn).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cabinlm.serve.conversation import Conversation, Message


def image_key(url: str | None) -> str | None:
    """An image as a history entry: the sha256 of its URL (a file path names the frame as it was sent)."""
    return None if url is None else hashlib.sha256(url.encode("utf-8")).hexdigest()


EXCHANGE_FIELDS = ("user", "image", "reply", "streamed", "choices", "max_new_tokens", "finish")
# and "tool" where the user side is tool results (written only then: earlier record files read as they are)
FINISHES = ("stop", "length", "interrupted", "cancelled")  # "cancelled": the client went away, or the server stopped


@dataclass
class Exchange:
    """One user message and the reply the seat's cache holds for it, and how to feed it again."""

    user: str
    image: str | None  # image_key of the user message's image
    reply: str  # the reply's text, as a non-streaming response returned it
    streamed: str | None = None  # the streamed deltas joined, where they differ from `reply`
    choices: list[int] | None = None  # the sampler's choices when the seat generated it; None: fed by template
    max_new_tokens: int = 0  # the reply limit it was generated under (its choices replay under the same)
    finish: str = "stop"  # one of FINISHES
    tool: bool = False  # the user side is tool results (fed as the template's tool turn)

    def matches(self, user: Message, assistant: Message) -> bool:
        return (
            (user.role == "tool") == self.tool
            and user.text == self.user
            and image_key(user.image) == self.image
            and assistant.text in (self.reply, self.streamed)
        )

    def to_dict(self) -> dict:
        d = {"user": self.user, "image": self.image, "reply": self.reply, "streamed": self.streamed,
             "choices": self.choices, "max_new_tokens": self.max_new_tokens, "finish": self.finish}  # fmt: skip
        if self.tool:
            d["tool"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict, vocab: int) -> Exchange:
        """From a record file; ValueError unless every field has its type and range (the file is read
        back from disk, so it is checked like any input)."""
        if not isinstance(d, dict) or set(d) - {"tool"} != set(EXCHANGE_FIELDS) or d.get("tool", True) is not True:
            raise ValueError("an exchange needs exactly its seven fields (and \"tool\": true where it carries tool results)")
        if not all(isinstance(d[k], str) for k in ("user", "reply")) or not all(
            d[k] is None or isinstance(d[k], str) for k in ("image", "streamed")
        ):
            raise ValueError("an exchange's texts must be strings")
        choices = d["choices"]
        if choices is not None and not (
            isinstance(choices, list) and all(type(t) is int and 0 <= t < vocab for t in choices)
        ):
            raise ValueError(f"an exchange's choices must be token ids below {vocab}")
        if type(d["max_new_tokens"]) is not int or d["max_new_tokens"] < 0 or d["finish"] not in FINISHES:
            raise ValueError("an exchange's max_new_tokens or finish is out of range")
        return cls(d["user"], d["image"], d["reply"], d["streamed"], choices, d["max_new_tokens"], d["finish"],
                   "tool" in d)  # fmt: skip


@dataclass
class SeatRecord:
    """The conversation a seat's cache holds: its system prompt (None: the model's default) and exchanges."""

    system: str | None
    exchanges: list[Exchange] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"system": self.system, "exchanges": [e.to_dict() for e in self.exchanges]}

    @classmethod
    def from_dict(cls, d: dict, vocab: int) -> SeatRecord:
        if not isinstance(d, dict) or not isinstance(d.get("exchanges"), list):
            raise ValueError("a record holds a system prompt and a list of exchanges")
        if d.get("system") is not None and not isinstance(d["system"], str):
            raise ValueError("a record's system prompt must be a string or null")
        return cls(d["system"], [Exchange.from_dict(e, vocab) for e in d["exchanges"]])


@dataclass(frozen=True)
class TurnPlan:
    """How to bring a seat to a request's history and answer it."""

    rebuild: bool  # False: the seat holds the first `keep` exchanges already; True: start over
    keep: int  # exchanges of the record that stay (extend) or are fed again exactly (rebuild)
    given: tuple[tuple[Message, Message], ...]  # the request's exchanges after those: fed by template
    prompt: Message  # the new user message, answered

    @property
    def kind(self) -> str:
        return "rebuilt" if self.rebuild else "extended"


def plan_turn(record: SeatRecord | None, conversation: Conversation) -> TurnPlan:
    """record None: the seat's state is not known (a new seat, a failed turn): start over."""
    c = conversation
    if record is None or record.system != c.system:
        return TurnPlan(True, 0, c.exchanges, c.prompt)
    same = 0
    for held, (user, assistant) in zip(record.exchanges, c.exchanges):
        if not held.matches(user, assistant):
            break
        same += 1
    return TurnPlan(same < len(record.exchanges), same, c.exchanges[same:], c.prompt)
