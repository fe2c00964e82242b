"""The dialogue every benchmark engine runs, and how it is measured: the token script, the engine
interface (feed a prompt, step one token, both greedy), and the two drivers (`dialogue`, the scripted
multi-turn chat; `fixed_context`, fill then decode). cabinlm (bench/runner.py) and every peer
(bench/peers.py) run through these same functions. No heavy imports."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.bench.trace import Trace
from cabinlm.runtime.memory import rss_mb

RSS_EVERY = 64  # tokens between memory samples
FILL_REPLY = "Sure. I have taken care of that for you, and I will tell you if anything changes on the way."


class ContextFull(Exception):
    """The engine cannot go on (its context is full, or it refuses more): the message is the honest
    one-line reason, recorded in trace.stopped."""



@dataclass
class Script:
    """The dialogue as token ids, rendered with the model's tokenizer (tokenizers only: no transformers)."""

    system: list[int]
    assistant_suffix: list[int]
    stop_ids: set[int]
    max_positions: int
    _tok: object
    _chat: dict

    @classmethod
    def load(cls, folder: Path) -> Script:
        from cabinlm.runtime.tokenizer import Tokenizer

        meta = json.loads((folder / "cabinlm_baseline.json").read_text())
        tok = Tokenizer(folder / "tokenizer.json")
        chat = meta["chat"]
        bos = tok.encode(chat["bos"]) if chat.get("bos") else []  # the BOS a model needs first (Template.start)
        system = bos + tok.encode(chat["system_prefix"]) + tok.encode_text(SYSTEM) + tok.encode(chat["system_suffix"])
        return cls(system=system, assistant_suffix=tok.encode(chat["assistant_suffix"]),
                   stop_ids=set(meta["stop_ids"]), max_positions=int(meta["max_positions"]), _tok=tok, _chat=chat)  # fmt: skip

    def user(self, text: str) -> list[int]:
        c, tok = self._chat, self._tok
        return tok.encode(c["user_prefix"]) + tok.encode_text(text) + tok.encode(c["user_suffix"] + c["assistant_prefix"])  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)  # type: ignore[attr-defined]

    def fill(self, n: int, seed: int = 0) -> list[int]:
        """n tokens of dialogue: the system prompt, then user turns each answered by a fixed reply."""
        ids = list(self.system)
        reply = self._tok.encode_text(FILL_REPLY) + self.assistant_suffix  # type: ignore[attr-defined]
        turns = user_turns(seed)
        while len(ids) < n:
            ids += self.user(next(turns)) + reply
        return ids[:n]


class Engine:
    """feed(ids) -> greedy next token; step(token) -> greedy next token; context: tokens in the engine."""

    name = ""
    context = 0
    config: dict

    def feed(self, ids: list[int]) -> int:
        raise NotImplementedError

    def step(self, token: int) -> int:
        return self.feed([token])

    def advance(self, token: int, budget: int) -> list[int]:
        """Feed `token`; the tokens chosen after it (1..budget): an engine that verifies drafts
        returns the accepted ones (fed) and the next (not fed), a plain one the next token only."""
        return [self.step(token)]

    def close(self) -> None:
        pass


class _Recorder:
    """Counts processed tokens and samples RSS each time the count crosses a multiple of RSS_EVERY. The
    first sample follows the first prefill (every engine has touched all its weights by then: hf and
    llama.cpp map their weight files lazily, so a sample right after loading would understate them)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.next_rss = 0

    def add(self, n: int) -> None:
        t = self.trace
        t.tokens += n
        if t.tokens >= self.next_rss:
            t.rss.append((t.tokens, round(rss_mb(), 2)))
            self.next_rss = (t.tokens // RSS_EVERY + 1) * RSS_EVERY


def dialogue(engine: Engine, script: Script, *, tokens: int, max_new: int = 128, seed: int = 0,
             time_limit_s: float = 900, log: Callable[[str], None] = lambda s: None,
             on_reply: Callable[[int, str], None] | None = None) -> Trace:  # fmt: skip
    """The scripted multi-turn dialogue on one engine (in this process)."""
    trace = Trace(engine=engine.name, config=dict(engine.config))
    trace.config.update(max_new=max_new, seed=seed, time_limit_s=time_limit_s)
    rec = _Recorder(trace)
    turns = user_turns(seed)
    pending = list(script.system)
    t0 = time.perf_counter()
    perf = time.perf_counter

    def over_time() -> bool:
        if perf() - t0 > time_limit_s:
            trace.stopped = f"time limit {time_limit_s:g} s"
            return True
        return False

    while trace.tokens < tokens and not over_time():
        prompt = pending + script.user(next(turns))
        t = perf()
        try:
            token = engine.feed(prompt)
        except ContextFull as e:
            trace.stopped = str(e)
            break
        trace.prefill.append((len(prompt), perf() - t))
        rec.add(len(prompt))
        trace.turns += 1
        reply: list[int] = []
        unfed: list[int] = []
        stop = False
        ahead: list[int] = []  # tokens an engine chose in one call beyond the next (accepted drafts, fed)
        while True:
            if token in script.stop_ids:
                break
            reply.append(token)
            if ahead:
                token = ahead.pop(0)
                continue
            if len(reply) == max_new:
                unfed = [token]  # fed with the next prompt
                break
            if trace.tokens >= tokens or over_time():
                stop = True
                break
            t = perf()
            try:
                chosen = engine.advance(token, max_new - len(reply))
            except ContextFull as e:
                trace.stopped = str(e)
                stop = True
                break
            # One call that chose n tokens fed n (`token` and the n - 1 accepted drafts): each of
            # the n counts as a decoded token at 1/n of the call's time.
            n = len(chosen)
            trace.decode_ms += [(perf() - t) * 1000.0 / n] * n
            trace.decode_context += [engine.context] * n
            rec.add(n)
            token, ahead = chosen[0], chosen[1:]
        if on_reply:
            on_reply(trace.turns, script.decode(reply))
        log(f"turn {trace.turns}: {trace.tokens} tokens, context {engine.context}, reply {len(reply)} tokens")
        if stop:
            break
        pending = unfed + script.assistant_suffix
    if trace.tokens and (not trace.rss or trace.rss[-1][0] != trace.tokens):
        trace.rss.append((trace.tokens, round(rss_mb(), 2)))
    return trace


def fixed_context(engine: Engine, script: Script, *, context: int, decode: int = 128,
                  time_limit_s: float = 900) -> Trace:  # fmt: skip
    """Fill `context` tokens in one timed prefill, then `decode` timed greedy steps (stop tokens ignored)."""
    trace = Trace(engine=engine.name, config=dict(engine.config))
    trace.config.update(mode="fixed_context", context=context, decode=decode)
    rec = _Recorder(trace)
    ids = script.fill(context)
    t0 = time.perf_counter()
    try:
        token = engine.feed(ids)
    except ContextFull as e:
        trace.stopped = str(e)
        return trace
    trace.prefill.append((len(ids), time.perf_counter() - t0))
    rec.add(len(ids))
    trace.turns = 1
    for _ in range(decode):
        if time.perf_counter() - t0 > time_limit_s:
            trace.stopped = f"time limit {time_limit_s:g} s"
            break
        t = time.perf_counter()
        try:
            token = engine.step(token)
        except ContextFull as e:
            trace.stopped = str(e)
            break
        trace.decode_ms.append((time.perf_counter() - t) * 1000.0)
        trace.decode_context.append(engine.context)
        rec.add(1)
    if trace.tokens and (not trace.rss or trace.rss[-1][0] != trace.tokens):
        trace.rss.append((trace.tokens, round(rss_mb(), 2)))
    return trace
