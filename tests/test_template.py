"""Chat-template pieces resolved at export render exactly what the model's jinja template renders."""

from __future__ import annotations

import json

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


# Qwen2.5-Instruct's template: the tools written into the system message, calls in <tool_call> tags
# (its assistant tool_calls and tool branches left out: a history's calls are rendered by the runtime).
QWEN25_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
    "<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == "
    "'assistant') %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_renders_tools_gives_its_own_wording_and_the_runtime_writes_it_exactly():
    """Qwen2.5's template lists the tools in the system message: the pieces cut at export (tools_source
    "model"), with runtime/tools.tools_system, render what the template renders with those tools."""
    from conftest import _tokenizer

    from cabinlm.runtime.tools import parse_tools, tools_system

    tok = _tokenizer(QWEN25_TOOLS_TEMPLATE)
    chat = check(tok)
    assert chat.tools_source == "model" and chat.tools_separator == "\n"
    assert chat.default_system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    tools = [{"type": "function", "function": {"name": "set_climate", "description": "Set the temperature",
              "parameters": {"type": "object", "properties": {"celsius": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "honk", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Warmer, please."}]
    expected = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    system = tools_system("Be brief.", parse_tools(tools), chat)
    assert render_with_pieces(chat, system, [], "Warmer, please.") == expected


def test_a_template_without_tools_keeps_the_default_wording(load, tiny_qwen2_dir):
    from cabinlm.contract.manifest import DEFAULT_TOOLS_PREFIX

    chat = resolve_chat_template(load(str(tiny_qwen2_dir)).tokenizer)
    assert chat.tools_source == "default" and chat.tools_prefix == DEFAULT_TOOLS_PREFIX


# Llama 3.1-Instruct's turn layout with its tool branches: JSON calls with "parameters", results in an
# "ipython" turn (minus the date lines and built-in tools a test never takes).
LLAMA31_TOOLS_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]"
    "['content'] %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}{%- if message.role in ['user', 'system'] or (message.role == 'assistant' "
    "and not message.tool_calls) %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + "
    "message.content + '<|eot_id|>' }}{%- elif message.tool_calls %}{%- set tool_call = message.tool_calls[0]"
    ".function %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{{- '{\"name\": \"' + "
    "tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{{- '<|eot_id|>' }}{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def test_a_llama_template_gets_json_calls_and_its_ipython_turn_for_results():
    """Llama 3.1's template: calls are {"name": ..., "parameters": ...} (tool_call_style
    "llama3-json") and a result has its own "ipython" turn; the runtime writes a call and its result
    as the template renders them."""
    from conftest import _tokenizer

    from cabinlm.runtime.tools import LLAMA3_JSON

    tok = _tokenizer(LLAMA31_TOOLS_TEMPLATE)
    chat = check(tok)
    assert chat.tool_call_style == "llama3-json"
    assert (chat.tool_result_prefix, chat.tool_result_suffix) == ("<|start_header_id|>ipython<|end_header_id|>\n\n",
                                                                  "<|eot_id|>")  # fmt: skip
    args = {"zone": "driver", "celsius": 22}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Warmer."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "set_climate", "arguments": args}}]},
            {"role": "tool", "content": "{\"ok\": true}"}]  # fmt: skip
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    call = LLAMA3_JSON.render("", [("set_climate", json.dumps(args))])
    ours = (render_with_pieces(chat, "Be brief.", [], "Warmer.") + call + chat.assistant_suffix
            + chat.tool_result_prefix + LLAMA3_JSON.results(["{\"ok\": true}"]) + chat.tool_result_suffix
            + chat.assistant_prefix)  # fmt: skip
    assert ours == expected
