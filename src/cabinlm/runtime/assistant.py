"""A dialogue that operates the car: a Dialogue whose replies may call tools, and the calls' results
fed back as the next turn (what `cabinlm chat --tools` runs; the server does the same per request).

    a = ToolDialogue(dialogue, tools)        the tool list joins the pinned system prompt (a reset)
    turn = a.ask("it's cold, make it 22")    turn.calls: [ToolCall], the grammar made each valid
    turn = a.answer({"set_climate": "ok"})   the results, one user turn of <tool_response> blocks;
                                             the model's reply to them (which may call again)

Every reply is constrained by the tool calls' grammar (runtime/tools.calls_grammar): with
tool_choice "auto" only from the opener on, so a reply without a call is the model's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import InputError
from cabinlm.runtime.dialogue import Dialogue, TurnResult
from cabinlm.runtime.grammar import Compiled, Grammars
from cabinlm.runtime.stops import StopStrings
from cabinlm.runtime.call_styles import style_of
from cabinlm.runtime.tools import Tool, ToolCall, new_call_id, parse_tool_choice, tools_system


@dataclass
class ToolTurn:
    result: TurnResult
    content: str  # the reply's text less its calls
    calls: list[ToolCall] = field(default_factory=list)


def grammars_for(dialogue: Dialogue) -> Grammars:
    """llguidance's view of the dialogue's model (its tokenizer file, stop ids and vocabulary)."""
    dec = dialogue.decoder
    m = dec.manifest
    return Grammars(dec.folder / m.files[FileRole.TOKENIZER].path, list(m.stop_ids), m.model.vocab_size)


class ToolDialogue:
    def __init__(self, dialogue: Dialogue, tools: Sequence[Tool], choice: Any = "auto", parallel: bool = True,
                 grammars: Grammars | None = None, system_has_tools: bool = False) -> None:  # fmt: skip
        """dialogue: its system prompt gets the tool list and the dialogue starts over (unless
        system_has_tools: it pins them already, as runtime/assembly.open_runtime's with tools).
        choice: as OpenAI's tool_choice: "auto", "required", "none" (the reply is free; calls are
        still read) or {"type": "function", "function": {"name": ...}}."""
        self.dialogue = dialogue
        self.tools = tuple(tools)
        self.parallel = parallel
        self.style = style_of(dialogue.chat, dialogue.tok.token_to_id)
        self.grammars = grammars if grammars is not None else grammars_for(dialogue)
        self._compiled: dict[str, Compiled | None] = {}  # per tool_choice, compiled once
        self.choice = choice
        self._grammar(choice)  # a choice that names no tool is refused here
        if not system_has_tools:
            dialogue.system = tools_system(dialogue.system, self.tools, dialogue.chat)
            dialogue.reset()
        self.pending: list[ToolCall] = []  # the last reply's calls that have no result yet
        self._results: list[tuple[str, str]] = []  # (name, content) received for them, in order

    def _grammar(self, choice: Any) -> Compiled | None:
        key = json.dumps(choice, sort_keys=True)
        if key not in self._compiled:
            spec = self.style.grammar(self.tools, parse_tool_choice(choice, self.tools, "tool_choice"), self.parallel)
            self._compiled[key] = None if spec is None else self.grammars.compile(spec)
        return self._compiled[key]

    def ask(self, text: str, on_text: Callable[[str], None] | None = None, choice: Any = None) -> ToolTurn:
        """A user message (choice: this turn's tool_choice; None: the dialogue's). Calls left without
        results are dropped (the driver moved on)."""
        self.pending, self._results = [], []
        return self._turn(text, on_text, choice)

    def answer(self, results: Mapping[str, str] | Sequence[tuple[str, str]],
               on_text: Callable[[str], None] | None = None, choice: Any = None) -> ToolTurn:  # fmt: skip
        """The pending calls' results, by function name, as one turn; the reply to them."""
        items = list(results.items()) if isinstance(results, Mapping) else list(results)
        for name, _ in items:
            if not any(c.name == name for c in self.pending):
                raise InputError(f"no call of {name!r} is waiting for a result "
                                 f"(waiting: {', '.join(c.name for c in self.pending) or 'none'})")  # fmt: skip
        ids, waiting = [], list(self.pending)
        for name, _ in items:  # each result answers the first call of its function not yet answered
            call = next((c for c in waiting if c.name == name), None)
            if call is None:
                raise InputError(f"more results for {name!r} than calls of it")
            waiting.remove(call)
            ids.append(call.id)
        self.pending = []
        return self._turn(self.style.results([content for _, content in items], ids), on_text, choice, tool=True)

    @property
    def missing(self) -> int:
        """Results still to come before the model answers."""
        return len(self.pending) - len(self._results)

    def result(self, name: str, content: str, on_text: Callable[[str], None] | None = None) -> ToolTurn | None:
        """One call's result; the turn once every pending call has one (None until then)."""
        if not any(c.name == name for c in self.pending[len(self._results):]):
            raise InputError(f"no call of {name!r} is waiting for a result "
                             f"(waiting: {', '.join(c.name for c in self.pending[len(self._results):]) or 'none'})")
        self._results.append((name, content))
        if len(self._results) < len(self.pending):
            return None
        results, self._results = self._results, []
        return self.answer(results, on_text)

    def _turn(self, text: str, on_text: Callable[[str], None] | None, choice: Any, tool: bool = False) -> ToolTurn:
        compiled = self._grammar(self.choice if choice is None else choice)
        constraint = None if compiled is None else self.grammars.constraint(compiled)
        content_only = StopStrings([self.style.trigger])  # from a call's opener on the text is the call: never shown

        def shown(delta: str) -> None:
            out = content_only.push(delta)
            if out and on_text is not None:
                on_text(out)

        result = self.dialogue.ask(text, on_text=shown, constraint=constraint, tool=tool)
        content, found = self.style.parse(result.reply)
        written = self.style.written_ids(result.reply) if found else []
        calls = [ToolCall(written[i] if written else new_call_id(), name, arguments)
                 for i, (name, arguments) in enumerate(found)]  # fmt: skip
        self.pending = calls
        return ToolTurn(result, content, calls)
