"""Mistral's tool-call convention (its v0.3 tokenizer's control tokens and chat templates):

    the tool list    [AVAILABLE_TOOLS] [{"type": "function", "function": {...}}, ...][/AVAILABLE_TOOLS]
    a reply's calls  [TOOL_CALLS] [{"name": "set_climate", "arguments": {...}, "id": "a1B2c3D4e"}, ...]
    a tool result    [TOOL_RESULTS] {"content": RESULT, "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]

The bracketed markers are control tokens. The grammar makes the model write [TOOL_CALLS] itself, as
its token id (llguidance's `<[id]>`); with tool_choice "auto" the grammar holds from that token on (a
lazy grammar triggered by the id, not by text). Each call's id is written by the model under the
grammar, nine letters or digits as Mistral's template requires, and is the call's id in the API: a
history that sends the call back renders exactly what the model wrote. Where a reply is shown as
text, the runtime's tokenizer shows [TOOL_CALLS] (runtime/tokenizer.Tokenizer.show), so the reply's
text says where the calls begin; every other control token stays hidden.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cabinlm.runtime.grammar import GrammarError, GrammarSpec
from cabinlm.runtime.tools import CallStyle, Tool, ToolChoice

CALLS, TOOLS_OPEN, TOOLS_CLOSE = "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"
RESULTS_OPEN, RESULTS_CLOSE = "[TOOL_RESULTS]", "[/TOOL_RESULTS]"
CALL_ID = re.compile(r"[A-Za-z0-9]{9}")  # what Mistral's template accepts as a call's id


@dataclass(frozen=True)
class MistralStyle(CallStyle):
    opener_id: int | None = None  # [TOOL_CALLS]'s token id in the model's vocabulary (bind())
    ids_written = True

    def bind(self, token_to_id) -> MistralStyle:
        """This style with the model's id of [TOOL_CALLS] (token_to_id: the tokenizer's lookup)."""
        return replace(self, opener_id=token_to_id(CALLS))

    def call_schema(self, tool: Tool) -> dict:
        schema = super().call_schema(tool)
        schema["properties"]["id"] = {"type": "string", "pattern": f"^{CALL_ID.pattern}$"}
        schema["required"] = ["name", self.args_key, "id"]
        return schema

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> GrammarSpec | None:
        if choice.mode == "none":
            return None
        if self.opener_id is None:
            raise GrammarError(f"the model's vocabulary has no {CALLS} token: re-export the model", "tools")
        schema = self.calls_schema(tools, choice)
        more = ' (", " call)*' if parallel else ""
        lark = (f'start: <[{self.opener_id}]> " [" call{more} "]"\n'
                f"call: %json {json.dumps(schema, ensure_ascii=False)}\n")  # fmt: skip
        return GrammarSpec(lark, self.opener_id if choice.mode == "auto" else None, "tools")

    def _read(self, text: str) -> tuple[str, list[dict], bool]:
        """(content, the whole calls' objects, the list was closed) of a reply's text."""
        at = text.find(CALLS)
        if at < 0:
            return text, [], False
        body = text[at + len(CALLS):]
        if not body.startswith(" ["):
            return text, [], False
        rest, decoder = body[2:], json.JSONDecoder()
        calls: list[dict] = []
        while True:
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return text[:at].strip(), calls, False
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)
                    and isinstance(obj.get("id"), str)):  # fmt: skip
                return text[:at].strip(), calls, False
            calls.append(obj)
            rest = rest[end:]
            if rest.startswith(", "):
                rest = rest[2:]
                continue
            return text[:at].strip(), calls, rest == "]"

    def parse(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        content, calls, _ = self._read(text)
        if not calls:
            return text, []
        return content, [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]

    def written_ids(self, text: str) -> list[str]:
        return [c["id"] for c in self._read(text)[1]]

    def render(self, content: str, calls: Sequence[tuple[str, str]], ids: Sequence[str] = ()) -> str:
        items = []
        for (name, arguments), call_id in zip(calls, ids, strict=True):
            try:
                args = json.loads(arguments)
            except (TypeError, ValueError):
                args = arguments
            items.append(json.dumps({"name": name, "arguments": args, "id": call_id}, ensure_ascii=False))
        return f"{content}{CALLS} [{', '.join(items)}]"

    def results(self, results: Sequence[str], ids: Sequence[str] = ()) -> str:
        # the content as the template writes it (its text, not quoted), the call it answers by id
        return "".join(f'{RESULTS_OPEN} {{"content": {r}, "call_id": "{i}"}}{RESULTS_CLOSE}'
                       for r, i in zip(results, ids, strict=True))  # fmt: skip

    def check_id(self, call_id: str, param: str) -> None:
        if not CALL_ID.fullmatch(call_id):
            raise GrammarError(f"{param} must be 9 letters or digits for this model (Mistral's call ids), got "
                               f"{call_id[:40]!r}", param)  # fmt: skip


MISTRAL = MistralStyle("mistral", "", "", "arguments", True, CALLS,
                       markers=(CALLS, TOOLS_OPEN, TOOLS_CLOSE, RESULTS_OPEN, RESULTS_CLOSE))  # fmt: skip
