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


def test_a_tokenizer_that_adds_a_bos_the_template_lacks_gets_it_pinned_first(tmp_path):
    """Gemma's base GGUF: no chat template, a tokenizer that puts <bos> first. The plain template then
    carries it (ChatTemplate.bos), and Template.start pins it before any system prompt, or alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from cabinlm.runtime.template import Template
    from cabinlm.runtime.tokenizer import Tokenizer as RuntimeTokenizer

    vocab = {"<bos>": 0, "<eos>": 1, "a": 2, "b": 3, " ": 4}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>")
    chat = resolve_chat_template(fast)
    assert chat.source == "plain" and chat.bos == "<bos>"
    tk.save(str(tmp_path / "tokenizer.json"))
    template = Template(RuntimeTokenizer(tmp_path / "tokenizer.json"), chat)
    assert template.start(None) == [0]
    assert template.start("a")[0] == 0 and template.start("a")[1:] == template.system("a")
    # a tokenizer without one keeps the pieces as they were
    tk.post_processor = None
    assert resolve_chat_template(PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>")).bos == ""
