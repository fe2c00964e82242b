"""Resolve a model's jinja chat template into plain prefix/suffix strings, once, at export.

The template is rendered with sentinel messages and cut at the sentinels, the way TensorRT Edge-LLM
does, so that the car runs no template engine.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from cabinlm.contract.manifest import ChatTemplate

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


def _render(tok: Any, messages: list[tuple[str, str]], gen: bool, parts: bool = False) -> str:
    """parts: each message's content as a list of typed parts ([{"type": "text", "text": ...}]), the
    form a vision-language processor's template reads (SmolVLM's renders nothing of a plain string)."""
    msgs = [{"role": r, "content": [{"type": "text", "text": c}] if parts else c} for r, c in messages]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def _reads_parts(tok: Any) -> bool:
    """The template drops plain-string contents but renders typed parts (vision-language processors'
    templates, e.g. SmolVLM's): the pieces are then cut from renders of parts."""
    try:
        if _U in _render(tok, [("user", _U)], False):
            return False
        return _U in _render(tok, [("user", _U)], False, parts=True)
    except Exception:  # noqa: BLE001 - any template error: not this kind of template
        return False


def resolve_chat_template(tok: Any) -> ChatTemplate:
    """The pieces of the model's template (PLAIN without one), with the tokenizer's BOS when the
    tokenizer adds one that the rendered turns do not hold (Gemma's base models: without it their
    first token is not what they were trained on)."""
    chat = PLAIN if not getattr(tok, "chat_template", None) else _pieces(tok)
    if chat.source == "model":
        chat = _tool_pieces(tok, chat)
    bos = getattr(tok, "bos_token", None)
    if bos and not chat.system_prefix.startswith(bos) and not chat.user_prefix.startswith(bos):
        with_special = tok("a").input_ids
        if with_special and with_special[0] == tok.bos_token_id and with_special[0] not in tok("a", add_special_tokens=False).input_ids:
            chat = dataclasses.replace(chat, bos=bos)
    return chat


def _pieces(tok: Any) -> ChatTemplate:
    parts = _reads_parts(tok)
    full = _render(tok, [("system", _S), ("user", _U), ("assistant", _A), ("user", _U2)], True, parts)
    if not parts and _U in full and _S in full and full.index(_S) > full.index(_U):
        return _folded_pieces(tok, full)
    with_gen = _render(tok, [("system", _S), ("user", _U)], True, parts)
    without_gen = _render(tok, [("system", _S), ("user", _U)], False, parts)
    if not with_gen.startswith(without_gen):
        raise ValueError("the chat template's generation prompt is not a suffix of the rendered turns")
    assistant_prefix = with_gen[len(without_gen):]

    system_prefix, rest = full.split(_S)
    sys_to_user, rest = rest.split(_U)
    user_to_asst, rest = rest.split(_A)
    asst_to_user, tail = rest.split(_U2)
    if parts and user_to_asst.rstrip(" ").endswith(assistant_prefix) and tail.endswith(assistant_prefix):
        # SmolVLM: "Assistant: " before a rendered reply, "Assistant:" as the generation prompt; the
        # model writes the space itself, so the reply as generated starts with it
        user_to_asst = user_to_asst.rstrip(" ")
    if not (tail.endswith(assistant_prefix) and user_to_asst.endswith(assistant_prefix)):
        raise ValueError("the chat template renders user turns inconsistently")
    user_suffix = tail[: len(tail) - len(assistant_prefix)]

    # Split system_suffix | user_prefix with a system-only render where the template allows one.
    try:
        only_system = _render(tok, [("system", _S)], False, parts)
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
    no_system = _render(tok, [("user", _U)], False, parts)
    head = no_system.split(_U, 1)[0]
    if head.startswith(system_prefix) and system_suffix and system_suffix in head[len(system_prefix):]:
        default_system = head[len(system_prefix):].split(system_suffix, 1)[0]
    start, image_user_prefix = "", None
    if parts:
        # What the template writes once before the first message, whichever it is (SmolVLM's
        # <|im_start|>): fed first (ChatTemplate.bos), not with every system or user turn.
        lead = head[: len(head) - len(user_prefix)] if head.endswith(user_prefix) else ""
        if lead and default_system is None and system_prefix.startswith(lead):
            start, system_prefix = lead, system_prefix[len(lead):]
        # A user turn that opens with an image (the processor's placeholder where the frame's tokens go)
        image_user_prefix = _image_user_prefix(tok, user_prefix)
    return ChatTemplate(
        system_prefix=system_prefix,
        system_suffix=system_suffix,
        user_prefix=user_prefix,
        user_suffix=user_suffix,
        assistant_prefix=assistant_prefix,
        assistant_suffix=assistant_suffix,
        default_system=default_system,
        source="model",
        bos=start,
        image_user_prefix=image_user_prefix,
    )


def _folded_pieces(tok: Any, full: str) -> ChatTemplate:
    """A template that writes the system text into the last user message rather than first
    (Mistral-7B-Instruct-v0.3: "[INST] SYSTEM\n\nUSER[/INST]" on the last turn only). That text moves
    with every turn, so no pinned prefix holds it where the template does: the pieces are cut from
    renders without a system message, and the system prompt goes first, before the first user turn,
    followed by the separator the template writes between the system text and the user's (the
    layout of Mistral's earlier templates' system message, and of its single-turn render less the
    [INST] around it). The text the template writes before the first message (its BOS) is fed once,
    first (ChatTemplate.bos)."""
    one = _render(tok, [("system", _S), ("user", _U)], True)
    between = one.split(_S, 1)[1].split(_U, 1)[0] if _S in one and _U in one.split(_S, 1)[1] else ""
    if not between or "\x02" in between:
        raise ValueError("the chat template writes the system message after the user's, in a layout not cut here")
    turns = _render(tok, [("user", _U), ("assistant", _A), ("user", _U2)], True)
    with_gen = _render(tok, [("user", _U)], True)
    without_gen = _render(tok, [("user", _U)], False)
    if not with_gen.startswith(without_gen):
        raise ValueError("the chat template's generation prompt is not a suffix of the rendered turns")
    assistant_prefix = with_gen[len(without_gen):]
    head, rest = turns.split(_U, 1)
    user_to_asst, rest = rest.split(_A, 1)
    asst_to_user, tail = rest.split(_U2, 1)
    bos = getattr(tok, "bos_token", None) or ""
    lead = bos if bos and head.startswith(bos) else ""
    user_prefix = head[len(lead):]
    if not (tail.endswith(assistant_prefix) and user_to_asst.endswith(assistant_prefix)) or not user_prefix \
            or not asst_to_user.endswith(user_prefix) or one != lead + user_prefix + _S + between + _U + tail:
        raise ValueError("the chat template renders user turns inconsistently")
    return ChatTemplate(
        system_prefix="",
        system_suffix=between,
        user_prefix=user_prefix,
        user_suffix=tail[: len(tail) - len(assistant_prefix)],
        assistant_prefix=assistant_prefix,
        assistant_suffix=asst_to_user[: len(asst_to_user) - len(user_prefix)],
        source="model",
        bos=lead,
    )


IMAGE_PLACEHOLDERS = ("<image>", "<|image_pad|>")  # what vision-language templates write for an image part


def _image_user_prefix(tok: Any, user_prefix: str) -> str | None:
    """What a user turn whose content opens with an image renders before the image, when it differs
    from user_prefix (SmolVLM: "User:" before an image, "User: " before text); None when it is the
    same, or when the template's image turn is not user_prefix less its trailing spaces."""
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _U}]}]
    try:
        before = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False).split(_U, 1)[0]
    except Exception:  # noqa: BLE001 - a template without image parts: the text prefix stands
        return None
    placeholder = next((p for p in IMAGE_PLACEHOLDERS if p in before), None)
    if placeholder is None:
        return None
    head = before.split(placeholder, 1)[0]
    stripped = user_prefix.rstrip(" ")
    if head.endswith(user_prefix) or stripped == user_prefix or not head.endswith(stripped):
        return None
    return stripped


def _tool_pieces(tok: Any, chat: ChatTemplate) -> ChatTemplate:
    """chat with the model's own tool-list wording (tools_source "model") where its template renders
    tools Hermes-style into the system message as the runtime writes them (runtime/tools.py: each
    tool's JSON, one separator between two, calls in <tool_call> tags: Qwen2.5, Qwen3) or in
    Mistral's [AVAILABLE_TOOLS] (_mistral_pieces); Llama 3.x's JSON calls (_llama3_pieces); chat as
    it is (the default wording) otherwise."""
    from cabinlm.runtime.tools import OPEN, Tool

    one = Tool("cabinlm_probe_one", "first", {"type": "object", "properties": {}})
    two = Tool("cabinlm_probe_two", "second", {"type": "object", "properties": {}})
    msgs = [{"role": "system", "content": _S}, {"role": "user", "content": _U}]
    try:
        r1 = tok.apply_chat_template(msgs, tools=[json.loads(one.listing())], tokenize=False, add_generation_prompt=True)
        r2 = tok.apply_chat_template(msgs, tools=[json.loads(t.listing()) for t in (one, two)], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - a template that takes no tools
        return chat
    l1, l2 = one.listing(), two.listing()
    if _mistral(tok, r1):
        return _mistral_pieces(tok, chat, r1, r2, l1, l2)
    if OPEN not in r1 and _llama3_json(tok):
        return _llama3_pieces(tok, chat)
    if OPEN not in r1 or _S not in r1 or l1 not in r1 or l2 not in r2:
        return chat
    after_system = r1.split(_S, 1)[1]
    prefix, rest = after_system.split(l1, 1)
    closing = chat.system_suffix + chat.user_prefix + _U
    if closing not in rest:
        return chat
    suffix = rest.split(closing, 1)[0]
    separator = r2.split(l1, 1)[1].split(l2, 1)[0]
    rebuilt = chat.system_prefix + _S + prefix + l1 + separator + l2 + suffix + closing
    if not r2.startswith(rebuilt) or "\x02" in prefix + suffix + separator:
        return chat
    return dataclasses.replace(chat, tools_prefix=prefix, tools_separator=separator, tools_suffix=suffix,
                               tools_source="model")  # fmt: skip


_R = "\x02RESULT\x03"


def _llama3_json(tok: Any) -> bool:
    """The template writes Llama 3.1's JSON calls ({"name": ..., "parameters": ...}) and gives tool
    results an "ipython" turn."""
    source = getattr(tok, "chat_template", None) or ""
    return isinstance(source, str) and '"parameters"' in source and "ipython" in source


def _llama3_pieces(tok: Any, chat: ChatTemplate) -> ChatTemplate:
    """Llama 3.x: JSON calls (tool_call_style "llama3-json"), the tools listed in the system message in
    Llama's own words (its template's wording with tools_in_user_message false), and the tool turn's
    pieces cut from the template rendered with a call and its result."""
    from cabinlm.contract.manifest import LLAMA3_TOOLS_PREFIX

    msgs = [{"role": "user", "content": _U},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "cabinlm_probe_one", "arguments": {}}}]},
            {"role": "tool", "content": _R}]  # fmt: skip
    prefix = suffix = None
    try:
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        before, after = rendered.split(_R, 1)
        end = chat.assistant_suffix
        if end and end in before and after.endswith(chat.assistant_prefix):
            prefix = before[before.rindex(end) + len(end):]
            suffix = after[: len(after) - len(chat.assistant_prefix)]
            if not prefix or prefix == chat.user_prefix:
                prefix = suffix = None
    except Exception:  # noqa: BLE001 - a template that renders no tool turn: results go in a user turn
        prefix = suffix = None
    return dataclasses.replace(chat, tool_call_style="llama3-json", tools_prefix=LLAMA3_TOOLS_PREFIX,
                               tools_separator="\n\n", tools_suffix="", tools_source="default",
                               tool_result_prefix=prefix, tool_result_suffix=suffix)  # fmt: skip



def _mistral(tok: Any, rendered: str) -> bool:
    """The template lists tools in Mistral's [AVAILABLE_TOOLS], and [TOOL_CALLS] is one control token
    of the tokenizer (Mistral's v0.3 tokenizer and later)."""
    from cabinlm.runtime.mistral_calls import CALLS, TOOLS_OPEN

    if TOOLS_OPEN not in rendered or CALLS not in (getattr(tok, "chat_template", None) or ""):
        return False
    ids = tok.encode(CALLS, add_special_tokens=False)
    return len(ids) == 1 and CALLS in tok.all_special_tokens


def _mistral_pieces(tok: Any, chat: ChatTemplate, r1: str, r2: str, l1: str, l2: str) -> ChatTemplate:
    """Mistral: the tool list's pieces cut from the template ([AVAILABLE_TOOLS] [ ... ][/AVAILABLE_TOOLS]:
    the runtime lists the tools in the pinned system prompt, where the template puts them before the
    last user message), and the tool turn's pieces around [TOOL_RESULTS] blocks, checked against the
    template rendered with a call and its result; chat as it is where the template writes either
    otherwise than runtime/mistral_calls.py does."""
    from cabinlm.runtime.mistral_calls import MISTRAL, TOOLS_CLOSE, TOOLS_OPEN

    at = r1.index(l1) if l1 in r1 else -1
    if at < 0 or l2 not in r2 or TOOLS_OPEN not in r1[:at]:
        return chat
    prefix = r1[r1.rindex(TOOLS_OPEN, 0, at): at]
    end = r1.find(TOOLS_CLOSE, at + len(l1))
    if end < 0:
        return chat
    suffix = r1[at + len(l1): end + len(TOOLS_CLOSE)]
    separator = r2.split(l1, 1)[1].split(l2, 1)[0]
    call_id = "cabinlm01"
    msgs = [{"role": "user", "content": _U},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "cabinlm_probe_one", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": call_id, "content": _R}]  # fmt: skip
    try:
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that renders no tool turn: not Mistral's convention
        return chat
    call = MISTRAL.render("", [("cabinlm_probe_one", "{}")], [call_id]) + chat.assistant_suffix
    result = MISTRAL.results([_R], [call_id])
    if call not in rendered or result not in rendered.split(call, 1)[1]:
        return chat
    between, after = rendered.split(call, 1)[1].split(result, 1)
    if not after.endswith(chat.assistant_prefix) or "\x02" in prefix + suffix + separator + between:
        return chat
    return dataclasses.replace(chat, tool_call_style="mistral", tools_prefix=prefix, tools_separator=separator,
                               tools_suffix=suffix, tools_source="model", tool_result_prefix=between,
                               tool_result_suffix=after[: len(after) - len(chat.assistant_prefix)])  # fmt: skip
