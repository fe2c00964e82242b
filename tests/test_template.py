"""Chat-template pieces resolved at export render exactly what the model's jinja template renders."""

from __future__ import annotations

import pytest

from cabinlm.export.template import PLAIN, resolve_chat_template


def render_with_pieces(chat, system, turns, final_user):
    text = chat.system_prefix + system + chat.system_suffix
    for user, assistant in turns:
        text += chat.user_prefix + user + chat.user_suffix + chat.assistant_prefix + assistant + chat.assistant_suffix
    return text + chat.user_prefix + final_user + chat.user_suffix + chat.assistant_prefix


def check(tok):
    chat = resolve_chat_template(tok)
    turns = [("Is the road icy?", "Yes, drive carefully."), ("How far to Munich?", "About 80 km.")]
    msgs = [{"role": "system", "content": "Be brief."}]
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": "Thanks!"})
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert render_with_pieces(chat, "Be brief.", turns, "Thanks!") == expected
    return chat


@pytest.mark.slow
def test_smollm2_template_pieces(smollm2):
    chat = check(smollm2.tokenizer)
    assert chat.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert chat.assistant_suffix == "<|im_end|>\n"


def test_chatml_template_pieces(load, tiny_qwen2_dir):
    chat = check(load(str(tiny_qwen2_dir)).tokenizer)
    assert chat.default_system is None and chat.source == "model"


def test_a_model_without_template_gets_the_plain_one(load, tiny_llama_dir):
    assert resolve_chat_template(load(str(tiny_llama_dir)).tokenizer) == PLAIN
