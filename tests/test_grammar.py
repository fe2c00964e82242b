"""The grammar layer alone (runtime/grammar.py, runtime/tools.py): masks, drafts and the lazy trigger
against llguidance's own checks, on a small byte-level BPE tokenizer and random logits. Needs no
model and no torch, so it also runs on aarch64 under emulation (`make test-arm`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from cabinlm.runtime.grammar import Grammars  # noqa: E402
from cabinlm.runtime.sampler import Sampler  # noqa: E402
from cabinlm.runtime.tools import (  # noqa: E402
    HERMES,
    LLAMA3_JSON,
    calls_grammar,
    json_reply_grammar,
    parse_calls,
    parse_tool_choice,
    parse_tools,
)

TEXT = ('{"zone": "driver", "celsius": 22} <tool_call> </tool_call> the driver asked for warm air and the '
        "passenger for the rear window, open it a bit, 0123456789 true false null [ ] { } , : ") * 30  # fmt: skip
SCHEMA = {"type": "object", "properties": {
    "zone": {"enum": ["driver", "passenger"]}, "celsius": {"type": "integer", "minimum": 16, "maximum": 28},
    "windows": {"type": "array", "items": {"enum": ["rear_left", "rear_right"]}, "maxItems": 2}},
    "required": ["zone", "celsius", "windows"], "additionalProperties": False}  # fmt: skip
TOOLS = parse_tools([{"type": "function", "function": {"name": "set_climate", "parameters": SCHEMA}},
                     {"type": "function", "function": {"name": "honk", "parameters": {
                         "type": "object", "properties": {}, "additionalProperties": False}}}])  # fmt: skip
STOP = 0  # "<|im_end|>", the first special token
VOCAB = 400  # the model's logits: wider than the tokenizer's 300 tokens (padded embeddings)


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> Grammars:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tk.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tk.save(str(path))
    return Grammars(path, [STOP, 1], VOCAB)


def generate(g: Grammars, spec, seed: int, max_new: int = 200) -> list[int]:
    """Greedy on random logits through a constrained Sampler, as the reply loop runs it."""
    rng = np.random.default_rng(seed)
    s = Sampler(constraint=g.constraint(g.compile(spec)))
    out: list[int] = []
    while len(out) < max_new:
        t = s(rng.standard_normal(VOCAB).astype(np.float32))
        out.append(t)
        if t in (STOP, 1):
            break
    return out


def text_of(g: Grammars, ids: list[int]) -> str:
    return g.tokenizer.decode_str([t for t in ids if t not in (STOP, 1)])


@pytest.mark.parametrize("style", [HERMES, LLAMA3_JSON], ids=lambda s: s.name)
@pytest.mark.parametrize("seed", range(6))
def test_random_logits_under_a_call_grammar_always_give_valid_calls(grammars, seed, style):
    spec = calls_grammar(TOOLS, parse_tool_choice("required", TOOLS), True, style)
    ids = generate(grammars, spec, seed, max_new=600)
    assert ids[-1] in (STOP, 1)  # ended by the grammar: after the calls only stop ids are allowed
    text = text_of(grammars, ids)
    content, calls = parse_calls(text, style)
    assert content == "" and calls
    assert style.parallel or len(calls) == 1  # Llama's template takes one call a reply
    assert style.render("", calls) == text  # a call's text is a function of its name and arguments
    for name, arguments in calls:
        if name == "set_climate":
            jsonschema.validate(json.loads(arguments), SCHEMA)
        else:
            assert name == "honk" and json.loads(arguments) == {}


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_under_a_schema_give_json_that_validates(grammars, seed):
    ids = generate(grammars, json_reply_grammar(SCHEMA, "response_format"), seed)
    jsonschema.validate(json.loads(text_of(grammars, ids)), SCHEMA)


def test_the_mask_covers_the_padded_logits_and_allows_every_stop_id_at_the_end(grammars):
    c = grammars.constraint(grammars.compile(json_reply_grammar({"enum": [7]}, "x")))
    ok = c.allowed()
    assert ok.shape == (VOCAB,) and not ok[300:].any() and not ok[STOP]
    for t in grammars.tokenizer.tokenize_str("7"):
        c.consume(t)
    assert c.complete
    assert set(np.flatnonzero(c.allowed())) == {STOP, 1}  # only the stop ids, the second included
    masked = c.mask(np.zeros(VOCAB, np.float32))
    assert np.isneginf(masked).sum() == VOCAB - 2


def test_drafts_are_cut_to_the_grammar_valid_prefix(grammars):
    spec = json_reply_grammar({"type": "object", "properties": {"zone": {"enum": ["driver"]}}, "required": ["zone"],
                               "additionalProperties": False}, "x")  # fmt: skip
    c = grammars.constraint(grammars.compile(spec))
    good = grammars.tokenizer.tokenize_str('{"zone": "driver"}')
    bad = grammars.tokenizer.tokenize_str('{"zone": "passenger"}')
    assert c.admissible(good) == len(good)
    cut = c.admissible(bad)
    assert 0 < cut < len(bad) and good[:cut] == bad[:cut]
    s = Sampler(constraint=c)
    assert s.admissible(bad) == bad[:cut]


def test_a_lazy_grammar_holds_from_its_trigger_on(grammars):
    """tool_choice auto: free text (no mask) until "<tool_call>" shows in the reply, also when the
    token that completes it carries more text; from there the call's grammar holds."""
    spec = calls_grammar(TOOLS, parse_tool_choice("auto", TOOLS), False)
    c = grammars.constraint(grammars.compile(spec))
    free = grammars.tokenizer.tokenize_str("the driver asked ")
    for t in free:
        assert c.allowed() is None
        c.consume(t)
    for t in grammars.tokenizer.tokenize_str('<tool_call>\n{"name": "ho'):
        c.consume(t)
    assert c.active and not c.complete
    ok = c.allowed()
    allowed_text = {grammars.tokenizer.decode_str([int(t)]) for t in np.flatnonzero(ok)}
    assert allowed_text and all("nk".startswith(x) or x.startswith("nk") for x in allowed_text), allowed_text
