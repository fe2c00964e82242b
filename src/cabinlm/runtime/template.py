"""The chat template's pieces (manifest.chat, resolved at export) rendered as token ids: the one
renderer of a dialogue's turns, used by the Dialogue, by the checks made before a model loads
(runtime/limits.py, runtime/assembly.py) and by `cabinlm bench`'s script.

    start      bos + system_prefix + TEXT + system_suffix                    pinned (sink + pinned slots)
    user       user_prefix + TEXT + user_suffix + assistant_prefix           the window
    closing    assistant_suffix                                              fed with the next prompt

The pieces are encoded as control tokens (they hold strings like "<|im_start|>"); the text between
them always as plain text, so a message cannot forge a turn. The tool-call style's markers (Mistral's
[AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]: CallStyle.markers) are control tokens where the
runtime writes them: in a system prompt (the tool list), a reply sent back (its calls) and a tool turn
(the results); a user's message never holds one.
"""

from __future__ import annotations

import re

from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.manifest import ChatTemplate
from cabinlm.runtime.tokenizer import Tokenizer
from cabinlm.runtime.call_styles import style_of


class Template:
    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate):
        self.tok = tokenizer
        self.chat = chat
        self.markers = style_of(chat).markers

    def marked(self, text: str) -> list[int]:
        """Text whose call-style markers are control tokens, the rest plain text."""
        if not self.markers or not any(m in text for m in self.markers):
            return self.tok.encode_text(text)
        ids: list[int] = []
        for i, piece in enumerate(re.split("(" + "|".join(map(re.escape, self.markers)) + ")", text)):
            if piece:
                ids += self.tok.encode(piece) if i % 2 else self.tok.encode_text(piece)
        return ids

    def system(self, text: str) -> list[int]:
        c = self.chat
        return self.tok.encode(c.system_prefix) + self.marked(text) + self.tok.encode(c.system_suffix)

    def start(self, system: str | None) -> list[int]:
        """What a dialogue pins before its first turn: the BOS the template does not render (if the
        model needs one), then the system prompt (if any)."""
        head = self.tok.encode(self.chat.bos) if self.chat.bos else []
        return head + (self.system(system) if system else [])

    def user(self, text: str, tool: bool = False) -> list[int]:
        """A user turn up to the reply: user_head() + user_tail(text). tool: the turn carries tool
        results (runtime/tools.py), in the template's own tool turn where it has one."""
        c = self.chat
        if tool and c.tool_result_prefix is not None:
            return (self.tok.encode(c.tool_result_prefix) + self.marked(text)
                    + self.tok.encode(c.tool_result_suffix + c.assistant_prefix))  # fmt: skip
        return self.user_head() + self.user_tail(text)

    def user_head(self, image: bool = False) -> list[int]:
        """What precedes a user turn's text (a camera frame's tokens go between the two); image: the
        turn opens with a frame (ChatTemplate.image_user_prefix, where the template has one)."""
        c = self.chat
        return self.tok.encode(c.image_user_prefix if image and c.image_user_prefix is not None else c.user_prefix)

    def user_tail(self, text: str) -> list[int]:
        c = self.chat
        return self.tok.encode_text(text) + self.tok.encode(c.user_suffix + c.assistant_prefix)

    def closing(self) -> list[int]:
        """What closes an assistant turn."""
        return self.tok.encode(self.chat.assistant_suffix)

    def text(self, text: str) -> list[int]:
        """A reply a client sends: plain text, but for the call style's markers (its calls)."""
        return self.marked(text)


def system_overflow(tokens: int, layout: CacheLayout, shorter: str | None) -> str | None:
    """None when a system prompt of `tokens` rendered tokens fits where a Dialogue pins it (the sink
    and pinned slots); otherwise what is wrong and the fix, to follow "<the prompt> is":
    "N tokens but the artifact pins at most R (sink S + pinned P); <shorter>, or re-export with
    --pinned X or more" (shorter: how to shorten it, e.g. "give a shorter --system"; None: only the
    re-export)."""
    room = layout.sink + layout.pinned
    if tokens <= room:
        return None
    fix = f"re-export with --pinned {tokens - layout.sink} or more"
    return (f"{tokens} tokens but the artifact pins at most {room} (sink {layout.sink} + pinned {layout.pinned}); "
            f"{fix if shorter is None else f'{shorter}, or {fix}'}")  # fmt: skip
