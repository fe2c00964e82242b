"""Grammar-constrained decoding: what a reply's tokens must follow, with llguidance.

    Grammars(tokenizer.json, stop ids, vocabulary)   one per loaded model: llguidance's view of the
                                                     vocabulary (built once), the compile limits
    Grammars.compile(GrammarSpec)                    a checked grammar, or GrammarError naming what
                                                     cannot be honoured (never silently ignored)
    Constraint(compiled)                             one per reply: an llguidance matcher
        mask(logits)        the logits with every token the grammar forbids at -inf
        consume(token)      a chosen token joins the reply
        admissible(drafts)  how many drafts the grammar lets through: the reply loop verifies only those

A Sampler that holds a Constraint masks before it chooses and consumes what it chose, draft checks
included (Sampler.accept_draft), so the matcher holds exactly the reply's chosen tokens and greedy
output with drafting is the output without, token for token: a draft the grammar forbids has -inf on
its row and is never accepted, and the reply loop does not even send it (Sampler.admissible).

A lazy grammar (`trigger`): the reply is free text until the trigger text (a tool-call opener, e.g.
"<tool_call>") appears in it; from there on the grammar holds, starting with the trigger itself, so
ordinary replies are not touched at all. A trigger may also be a token id (a control token that
opens calls, Mistral's [TOOL_CALLS]): the grammar holds from that token on, whatever text precedes it.
The grammar's end allows only the model's stop ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cabinlm.contract.errors import InputError

# A schema this large (its JSON text) is refused before it is compiled: compiling stops the seat's
# turn, and llguidance's own limits below bound what a smaller one may cost.
MAX_SCHEMA_BYTES = 64 * 1024


class GrammarError(InputError):
    """A schema or grammar that cannot be enforced: what is wrong, in one line. `param` names the
    request field it came from, where the caller said."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must follow: a Lark grammar in llguidance's dialect (which embeds JSON Schemas as
    `%json {...}`), and optionally the text from which it holds (None: from the first token)."""

    lark: str
    trigger: str | int | None = None  # text, or a control token's id
    param: str | None = None  # the request field it came from (errors name it)


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A reply that is one JSON value following `schema` (checked as JSON Schema first)."""
    check_schema(schema, param)
    return GrammarSpec(f"start: %json {json.dumps(schema, ensure_ascii=False)}", None, param)


def check_schema(schema: Any, param: str) -> None:
    """GrammarError unless `schema` is a JSON Schema (draft 2020-12 meta-schema) of bounded size."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{param} is {size} bytes of JSON Schema; the limit is {MAX_SCHEMA_BYTES} bytes (a larger "
                           "schema would hold the seat while it compiles): split it or simplify it", param)  # fmt: skip
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"{param} is not a valid JSON Schema: {e.message}" + (f" (at {where})" if where else ""),
                           param) from None  # fmt: skip


@dataclass(frozen=True)
class Compiled:
    """A grammar llguidance accepted for this model's vocabulary."""

    grammar: str  # llguidance's serialized grammar
    trigger: bytes | int | None  # text's bytes, or a token id


class Grammars:
    """llguidance's view of one model's vocabulary, and what compiles against it."""

    def __init__(self, tokenizer_json: str | Path, stop_ids: list[int], vocab_size: int):
        import llguidance

        self._llg = llguidance
        # The model's logits may be wider than the tokenizer's vocabulary (padded embeddings): the
        # matcher's masks cover every logit, the padding never allowed.
        # llguidance's end-of-sentence token is the first stop id; the others are allowed and
        # consumed as it (Constraint), so a grammar's end allows every stop id.
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=int(stop_ids[0]))
        self.stop_ids = tuple(int(t) for t in stop_ids)
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(max_grammar_size=200_000, step_lexer_fuel=200_000,
                                                initial_lexer_fuel=1_000_000, verbose_errors=False)  # fmt: skip

    def compile(self, spec: GrammarSpec) -> Compiled:
        """GrammarError, with the spec's param, when llguidance cannot honour the grammar: a schema
        keyword it does not implement (listed), an unknown format, a grammar past its limits."""
        grammar = self._llg.LLMatcher.grammar_from_lark(spec.lark)
        failed, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
        if failed or messages:
            # one line: llguidance's messages may quote the grammar over several
            detail = " ".join("; ".join(messages).split())[:300]
            raise GrammarError(f"{spec.param or 'the grammar'} cannot be enforced: {detail}", spec.param)
        trigger = spec.trigger.encode("utf-8") if isinstance(spec.trigger, str) else spec.trigger
        return Compiled(grammar, trigger)

    def constraint(self, compiled: Compiled) -> Constraint:
        return Constraint(self, compiled)

    def matcher(self, compiled: Compiled):
        m = self._llg.LLMatcher(self.tokenizer, compiled.grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {m.get_error()[:300]}")
        return m


class Constraint:
    """One reply's matcher. Invariant: the matcher (once active) has consumed exactly the reply's
    chosen tokens from the trigger on (all of them without a trigger); `text` holds the reply's bytes
    while it waits for the trigger."""

    def __init__(self, grammars: Grammars, compiled: Compiled):
        self._g = grammars
        self._compiled = compiled
        self._matcher = None if compiled.trigger is not None else grammars.matcher(compiled)
        self._text = b""  # the reply so far, while waiting for the trigger
        self._stops = np.array(grammars.stop_ids, dtype=np.int64)

    @property
    def active(self) -> bool:
        """The grammar holds (from the first token, or since the trigger appeared)."""
        return self._matcher is not None

    @property
    def complete(self) -> bool:
        """The tokens consumed so far are a whole sentence of the grammar."""
        return self._matcher is not None and self._matcher.is_accepting()

    def allowed(self) -> np.ndarray | None:
        """A bool per logit: what the grammar allows next (None: anything, while waiting for the trigger)."""
        if self._matcher is None:
            return None
        out = np.zeros(self._g.vocab_size, dtype=bool)
        if self._matcher.is_error():  # cannot happen for chosen tokens; end the reply rather than go on unchecked
            out[self._stops] = True
            return out
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        ok = np.unpackbits(words, bitorder="little")[: self._g.vocab_size].view(bool)
        if ok[self._stops[0]]:
            ok[self._stops] = True
        return ok

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with what the grammar forbids at -inf (a new array; the same one while waiting)."""
        ok = self.allowed()
        if ok is None:
            return logits
        if ok.size < logits.size:  # logits wider than the vocabulary the matcher was made for
            ok = np.concatenate([ok, np.zeros(logits.size - ok.size, dtype=bool)])
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        np.copyto(out, logits, where=ok[: logits.size])
        return out

    def consume(self, token: int) -> None:
        if self._matcher is not None:
            self._matcher.consume_token(int(self._stops[0]) if token in self._g.stop_ids else int(token))
            return
        if isinstance(self._compiled.trigger, int):  # a control token: the grammar holds from it on
            if token == self._compiled.trigger:
                self._matcher = self._g.matcher(self._compiled)
                self._matcher.consume_token(int(token))
            return
        self._text += self._g.tokenizer.decode_bytes([int(token)])
        at = self._text.find(self._compiled.trigger)
        if at >= 0:  # the grammar holds from the trigger on: it reads the trigger and what followed it
            self._matcher = self._g.matcher(self._compiled)
            self._matcher.consume_tokens(self._g.tokenizer.tokenize_bytes(self._text[at:]))
            self._text = b""

    def admissible(self, drafts) -> int:
        """How many of `drafts` (in order) the grammar lets follow the reply so far. While waiting for
        the trigger every draft passes: its rows are masked as they are checked once the trigger shows."""
        if self._matcher is None or not len(drafts):
            return len(drafts)
        return int(self._matcher.validate_tokens([int(t) for t in drafts]))
