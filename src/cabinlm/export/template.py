"""Resolve a model's jinja chat template into plain prefix/suffix strings, once, at export.

The template is rendered with sentinel messages and cut at the sentinels, the way TensorRT Edge-LLM
does, so that the car runs no template engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cabinlm.manifest import ChatTemplate

_S, _U, _A, _U2 = "\x02SYSTEM\x03", "\x02USER\x03", "\x02ASSISTANT\x03", "\x02USER2\x03"

# For models without a chat template (base models, tiny test models).
PLAIN = ChatTemplate(
    system_prefix="",
    system_suffix="\n\n",
    user_prefix="User: ",
    user_suffix="\n",
    assistant_prefix="Assistant:",
    assistant_suffix="\n",
    default_system=None,
    source="plain",
)


def _render(tok: Any, messages: list[tuple[str, str]], gen: bool) -> str:
    msgs = [{"role": r, "content": c} for r, c in messages]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def resolve_chat_template(tok: Any) -> ChatTemplate:
    """The pieces of the model's template (PLAIN without one), with the tokenizer's BOS when the
    tokenizer adds one that the rendered turns do not hold (Gemma's base models: without it their
    first token is not what they were trained on)."""
    chat = PLAIN if not getattr(tok, "chat_template", None) else _pieces(tok)
    bos = getattr(tok, "bos_token", None)
    if bos and not chat.system_prefix.startswith(bos) and not chat.user_prefix.startswith(bos):
        with_special = tok("a").input_ids
        if with_special and with_special[0] == tok.bos_token_id and with_special[0] not in tok("a", add_special_tokens=False).input_ids:
            chat = dataclasses.replace(chat, bos=bos)
    return chat


def _pieces(tok: Any) -> ChatTemplate:
    full = _render(tok, [("system", _S), ("user", _U), ("assistant", _A), ("user", _U2)], True)
    with_gen = _render(tok, [("system", _S), ("user", _U)], True)
    without_gen = _render(tok, [("system", _S), ("user", _U)], False)
    if not with_gen.startswith(without_gen):
        raise ValueError("the chat template's generation prompt is not a suffix of the rendered turns")
    assistant_prefix = with_gen[len(without_gen):]

    system_prefix, rest = full.split(_S)
    sys_to_user, rest = rest.split(_U)
    user_to_asst, rest = rest.split(_A)
    asst_to_user, tail = rest.split(_U2)
    if not (tail.endswith(assistant_prefix) and user_to_asst.endswith(assistant_prefix)):
        raise ValueError("the chat template renders user turns inconsistently")
    user_suffix = tail[: len(tail) - len(assistant_prefix)]

    # Split system_suffix | user_prefix with a system-only render where the template allows one.
    try:
        only_system = _render(tok, [("system", _S)], False)
        system_suffix = only_system.split(_S, 1)[1]
        if not sys_to_user.startswith(system_suffix):
            raise ValueError
    except Exception:  # noqa: BLE001 - any template error: fall back to an empty suffix (same text)
        system_suffix = ""
    user_prefix = sys_to_user[len(system_suffix):]
    if not asst_to_user.endswith(user_prefix):
        raise ValueError("the chat template renders user prefixes inconsistently")
    assistant_suffix = asst_to_user[: len(asst_to_user) - len(user_prefix)]

    # A default system prompt the template injects when none is given (SmolLM2, Qwen2.5 do).
    default_system = None
    no_system = _render(tok, [("user", _U)], False)
    head = no_system.split(_U, 1)[0]
    if head.startswith(system_prefix) and system_suffix and system_suffix in head[len(system_prefix):]:
        default_system = head[len(system_prefix):].split(system_suffix, 1)[0]
    return ChatTemplate(
        system_prefix=system_prefix,
        system_suffix=system_suffix,
        user_prefix=user_prefix,
        user_suffix=user_suffix,
        assistant_prefix=assistant_prefix,
        assistant_suffix=assistant_suffix,
        default_system=default_system,
        source="model",
    )
