"""The tool-call conventions a manifest can name (ChatTemplate.tool_call_style), and the lookups
the runtime makes by it. Hermes and Llama 3's JSON live in tools.py, Mistral's in mistral_calls.py;
this module stands above both, so neither imports the other."""

from __future__ import annotations

from cabinlm.contract.manifest import ChatTemplate
from cabinlm.runtime.mistral_calls import MISTRAL
from cabinlm.runtime.tools import HERMES, LLAMA3_JSON, CallStyle

STYLES: dict[str, CallStyle] = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL)}


def style_of(chat: ChatTemplate, token_to_id=None) -> CallStyle:
    """The model's style; token_to_id (the tokenizer's lookup): bound to its vocabulary, as a style
    whose grammar names a control token needs (Mistral's)."""
    style = STYLES[chat.tool_call_style]
    return style if token_to_id is None else style.bind(token_to_id)


def shown_markers(chat: ChatTemplate) -> set[str]:
    """The control tokens a reply's text shows: the style's call opener where it is one."""
    style = style_of(chat)
    return {style.trigger} if style.trigger in style.markers else set()
