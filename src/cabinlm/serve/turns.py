"""One request's work on its seat, in a worker thread: bring the seat to the request's history (a
TurnPlan), answer the new message, and keep the seat's record true to its cache at every point.

    plan.rebuild   reset (the request's system prompt pinned), the kept exchanges fed again exactly
                   (ScriptedSampler: the same choices through the same steps), then
    plan.given     the client's own exchanges, fed by template (Dialogue.add_turn), then
    plan.prompt    answered (RecordingSampler keeps the choices, so the exchange can be fed again)

The record is None (unknown: the next request starts over) while the cache is being changed, and set
again as soon as the cache holds a known history: after every exchange of the history fed; a failure
part-way therefore costs a rebuild later, never a wrong answer. The model is held (ModelTurns) for the
whole turn and passed to the other seats between tokens and between the history's exchanges; those
are also where a client that went away ends the turn: the reply at its next token, a history after
the exchange it is on (HistoryStopped: the seat holds the exchanges fed so far, and nothing answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from cabinlm.runtime.dialogue import Dialogue, TurnResult
from cabinlm.runtime.grammar import Constraint
from cabinlm.runtime.sampler import Sampler, TokenScore
from cabinlm.runtime.stops import StopStrings
from cabinlm.runtime.tokenizer import StreamDecoder
from cabinlm.runtime.tools import HERMES, CallStream, CallStyle, ToolCall, new_call_id
from cabinlm.serve.history import Exchange, SeatRecord, TurnPlan, image_key
from cabinlm.serve.images import open_image
from cabinlm.runtime.model_turns import ModelTurns
from cabinlm.serve.conversation import Conversation


class HistoryStopped(Exception):
    """The turn was stopped while its history was fed: the seat's record holds what was fed, no reply."""


class RecordingSampler(Sampler):
    """The request's sampler, keeping its every choice: the reply's tokens and the stop id that ended it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.choices: list[int] = []

    def __call__(self, logits: np.ndarray) -> int:
        token = super().__call__(logits)
        self.choices.append(token)
        return token

    def accept_draft(self, logits: np.ndarray, draft: int) -> tuple[bool, int]:
        ok, token = super().accept_draft(logits, draft)  # speculative decoding's choice, kept the same way
        self.choices.append(token)
        return ok, token


class ScriptedSampler(Sampler):
    """Gives back recorded choices in order: a generated exchange fed again exactly as it was generated."""

    def __init__(self, choices: list[int]):
        super().__init__()
        self._choices = choices
        self._next = 0

    def __call__(self, logits: np.ndarray) -> int:
        token = self._choices[self._next]
        self._next += 1
        return token

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._choices)


@dataclass
class Frames:
    """The images a plan feeds (PIL images or None), loaded before the model is taken."""

    kept: list[Any]  # of the record's kept exchanges (rebuild only; empty otherwise)
    given: list[Any]  # of plan.given
    prompt: Any

    @classmethod
    def load(cls, conversation: Conversation, plan: TurnPlan) -> Frames:
        first_given = len(conversation.exchanges) - len(plan.given)

        def frame(i: int | None):
            m = conversation.prompt if i is None else conversation.exchanges[i][0]
            where = f"the image of {'the last message' if i is None else f'exchange {i + 1}'}"
            return None if m.image is None else open_image(m.image, where)

        kept = [frame(i) for i in range(plan.keep)] if plan.rebuild else []
        given = [frame(i) for i in range(first_given, len(conversation.exchanges))]
        return cls(kept, given, frame(None))


@dataclass
class TurnOutcome:
    result: TurnResult
    plan: TurnPlan
    prompt_tokens: int  # tokens fed before the reply: the new messages, or all of the history when rebuilt
    streamed: str  # the deltas on_text received, joined
    cancelled: bool  # the reply was ended because the client went away
    content: str  # the reply's text, less its tool calls
    calls: list[ToolCall]  # the tool calls read from the reply (requests with tools)
    logprobs: list[TokenScore] | None = None  # the returned reply's tokens' (requests with logprobs)
    saved: bool = False  # written to --sessions (set by the service once the seat is saved)


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...] = ()  # stop strings
    constraint: Constraint | None = None  # what the reply must follow (tool calls, a JSON format)
    calls_tools: bool = False  # the reply may hold tool calls: they are read back, never streamed as text
    style: CallStyle = HERMES  # how the model writes them
    logprobs: int | None = None  # each token's log probability and this many alternatives'; None: none


def _replay(d: Dialogue, ex: Exchange, image, model: ModelTurns) -> None:
    if ex.choices is None:
        d.add_turn(ex.user, ex.reply, image=image, tool=ex.tool)
        return
    script = ScriptedSampler(ex.choices)
    d.sampler, d.max_new_tokens = script, ex.max_new_tokens

    def between_tokens() -> bool:
        model.pass_turn()
        return script.exhausted  # a cancelled exchange ended before its next choice

    # One token per step: the recorded choices end where a cancelled reply ended, which a verified
    # draft could run past. (Where drafting is on, a chunk's rows are its steps bit for bit, so the
    # cache is the one the exchange left either way.) The drafting still learns the exchange's text.
    with d.drafting.paused():
        d.ask(ex.user, image=image, should_stop=between_tokens, tool=ex.tool)


def answer(seat, conversation: Conversation, plan: TurnPlan, frames: Frames, sampling: Sampling, model: ModelTurns,
           *, on_text: Callable[[str], None], stopped: Callable[[], bool],
           on_prefilled: Callable[[], None],
           on_call: Callable[[str, int, str], None] | None = None,
           on_scores: Callable[[list[TokenScore]], None] | None = None) -> TurnOutcome:  # fmt: skip
    """Run plan on seat (its .dialogue and .record) while holding model. conversation.system is the
    effective system prompt (the model's default already filled in). on_call: the reply's tool calls
    as they stream (runtime/tools.CallStream): ("call", index, "ID NAME") once a call's name is whole
    (the id is the outcome's call's), then ("args", index, text) pieces. on_scores (sampling.logprobs):
    the scores of the tokens chosen since the last call, before each on_text or on_call they led to
    (tokens whose text is held back, a stop string's or a call opener's, come with a later one)."""
    d: Dialogue = seat.dialogue
    record: SeatRecord | None = seat.record
    with model:
        seat.record = None  # from here the cache changes; unknown until it holds a known history again
        held: list[Exchange] = []

        def fed(ex: Exchange) -> None:
            """One exchange of the history is in the cache: the seat's record says so; then the other
            seats run once, and a client that went away stops the turn here."""
            held.append(ex)
            seat.record = SeatRecord(conversation.system, list(held))
            model.pass_turn()
            if stopped():
                raise HistoryStopped

        if plan.rebuild:
            start = 0  # everything fed from the reset on counts, the system prompt included
            d.system = conversation.system
            d.reset()
            seat.record = SeatRecord(conversation.system, [])
            for ex, image in zip(record.exchanges[: plan.keep] if record else [], frames.kept):
                seat.record = None
                _replay(d, ex, image, model)
                fed(ex)
        else:
            start = d.decoder.cache.seen
            held.extend(record.exchanges[: plan.keep])
        for (user, assistant), image in zip(plan.given, frames.given):
            seat.record = None
            tool = user.role == "tool"
            d.add_turn(user.text, assistant.text, image=image, tool=tool)
            fed(Exchange(user.text, image_key(user.image), assistant.text, tool=tool))
        seat.record = SeatRecord(conversation.system, list(held))

        sampler = RecordingSampler(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                                   logprobs=sampling.logprobs)  # fmt: skip
        d.sampler, d.max_new_tokens = sampler, sampling.max_new_tokens
        prefilled: list[int] = []
        deltas: list[str] = []
        cancelled = False

        def between_tokens() -> bool:
            nonlocal cancelled
            if not prefilled:
                prefilled.append(d.decoder.cache.seen)
                on_prefilled()
            model.pass_turn()
            cancelled = stopped()
            return cancelled

        # Text from a tool call's opener on is the call, not content: held back like a stop string,
        # and read as it arrives for the calls' names and arguments.
        trigger = sampling.style.trigger
        content_only = StopStrings([trigger] if sampling.calls_tools else [])
        calls_so_far = CallStream(sampling.style.ids_written)
        raw: list[str] = []
        ids: list[str] = []
        fed_to_calls = 0  # characters of the call text given to calls_so_far
        emitted = scored = 0  # reply tokens so far; and how many of their scores went to on_scores

        def token(_: int) -> None:
            nonlocal emitted
            emitted += 1

        def text(delta: str) -> None:
            nonlocal fed_to_calls, scored
            if on_scores is not None and emitted > scored:  # a draft check scores ahead: only the emitted
                on_scores(sampler.scores[scored:emitted])
                scored = emitted
            shown = content_only.push(delta)
            if shown:
                deltas.append(shown)
                on_text(shown)
            raw.append(delta)
            if not content_only.stopped or on_call is None:
                return
            whole = "".join(raw)
            region = whole[whole.find(trigger):]
            for kind, index, value in calls_so_far.push(region[fed_to_calls:]):
                if kind == "call":
                    ids.append(calls_so_far.ids[index] if sampling.style.ids_written else new_call_id())
                    on_call("call", index, f"{ids[index]} {value}")  # the id and the name
                else:
                    on_call("args", index, value)
            fed_to_calls = len(region)

        turns = d.turns
        try:
            result = d.ask(conversation.prompt.text, on_text=text, image=frames.prompt, should_stop=between_tokens,
                           stop=sampling.stop, constraint=sampling.constraint,
                           tool=conversation.prompt.role == "tool", on_token=token)  # fmt: skip
        except BaseException:
            if d.turns != turns:  # something of the prompt was fed: the cache no longer matches `held`
                seat.record = None
            raise
    content, found = sampling.style.parse(result.reply) if sampling.calls_tools else (result.reply, [])
    written = sampling.style.written_ids(result.reply) if found else []
    calls = [ToolCall(written[i] if written else ids[i] if i < len(ids) else new_call_id(), name, arguments)
             for i, (name, arguments) in enumerate(found)]  # fmt: skip
    # A reply with calls is kept as the text a history sends back for it (its assistant message with
    # tool_calls, rendered): the seat then extends with the tool results.
    reply = sampling.style.render(content, found, [c.id for c in calls]) if calls else result.reply
    streamed = "".join(deltas)
    finish = "cancelled" if cancelled else result.finish
    prompt = conversation.prompt
    exchange = Exchange(prompt.text, image_key(prompt.image), reply, None if streamed == reply else streamed,
                        sampler.choices, sampling.max_new_tokens, finish, prompt.role == "tool")  # fmt: skip
    seat.record = SeatRecord(conversation.system, held + [exchange])
    scores = None
    if sampling.logprobs is not None:
        n = result.new_tokens  # the stop id that ended the reply is not returned
        scores = sampler.scores[: _tokens_shown(d, sampler.choices[:n], len(result.reply)) if sampling.stop else n]
    return TurnOutcome(result, plan, prefilled[0] - start, streamed, cancelled, content, calls, scores)


def _tokens_shown(d: Dialogue, ids: list[int], chars: int) -> int:
    """How many of a reply's tokens begin within its first `chars` characters (a reply a stop string
    cut: the tokens of the stop string are not returned, nor their scores)."""
    stream, length = StreamDecoder(d.tok), 0
    for i, t in enumerate(ids):
        if length >= chars:
            return i
        length += len(stream.push(t))
    return len(ids)
