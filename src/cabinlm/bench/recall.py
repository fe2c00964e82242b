"""`cabinlm recall`: does the dialogue remember a fact once it has left the window? Through the real
dialogue path (runtime/dialogue.py), with and without the artifact's recall region.

One trial per fact and distance D:

    turn 1         the fact's statement (the user's), a short assistant reply
    turns 2..k     filler: user messages cut from the filler text, short assistant replies, until the
                   statement's first token is D tokens back
    last turn      the fact's question; each of its choices scored as the assistant's reply by the
                   model's log-likelihood (teacher-forced, from the same cache); right = the answer
                   scores highest

Every turn goes through Dialogue.add_turn / ask, so the recall region is refilled before each user
turn as in `cabinlm chat`; its prefill time per turn is reported. Every input is checked before
anything runs (check_inputs): one line per problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cabinlm.contract.errors import InputError

DATA = Path(__file__).parent / "data"
DEFAULT_FACTS = DATA / "recall_facts.jsonl"
# The default filler: the calibration prose shipped with cabinlm (about 6,000 tokens), cycled through
# (filler turns wrap around to its start) so that every distance is reachable; a --filler text is not
# cycled and must hold the largest distance itself.
DEFAULT_FILLER = Path(__file__).parents[1] / "contract" / "data" / "calibration_prose.txt"
DEFAULT_DISTANCES = "2000,8000,32000"
REPLY = "All right."  # the assistant's reply to every statement and filler turn
FILLER_MESSAGE = 160  # tokens of filler text per user message
KEYS = ("statement", "question", "choices", "answer")


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str
    choices: tuple[str, ...]
    answer: str


@dataclass
class Result:
    distance: int
    recall: bool
    accuracy: float
    trials: int
    recall_ms_per_turn: float
    held: float = 0.0  # the share of questions whose region held the statement's turn
    lead: int = 0  # filler turns before the statement
    retrieval_ms_per_turn: float = 0.0  # BM25 over the archive's pieces, on the host

    def to_dict(self) -> dict:
        return {"distance": self.distance, "recall": self.recall, "lead": self.lead,
                "accuracy": round(self.accuracy, 4), "held": round(self.held, 4), "trials": self.trials,
                "recall_ms_per_turn": round(self.recall_ms_per_turn, 2),
                "retrieval_ms_per_turn": round(self.retrieval_ms_per_turn, 2)}  # fmt: skip


def read_facts(path: Path) -> list[Fact]:
    """The facts file: one JSON object a line with statement, question, choices (2 or more distinct
    strings) and answer (one of them). Every problem is one InputError line naming the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--facts {path}: cannot read it ({e}); give a UTF-8 JSON-lines file") from e
    facts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--facts {path} line {n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not JSON ({e.msg}); each line is an object with {', '.join(KEYS)}") from e
        if not isinstance(d, dict) or set(d) != set(KEYS):
            raise InputError(f"{where}: needs exactly the keys {', '.join(KEYS)}")
        if not all(isinstance(d[k], str) and d[k].strip() for k in ("statement", "question", "answer")):
            raise InputError(f"{where}: statement, question and answer must be non-empty text")
        choices = d["choices"]
        if (not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c.strip() for c in choices)
                or len(set(choices)) != len(choices)):  # fmt: skip
            raise InputError(f"{where}: choices must be a list of at least 2 distinct non-empty strings")
        if d["answer"] not in choices:
            raise InputError(f"{where}: the answer {d['answer']!r} is not among its choices")
        facts.append(Fact(d["statement"], d["question"], tuple(choices), d["answer"]))
    if not facts:
        raise InputError(f"--facts {path}: no facts in it; give one JSON object a line")
    return facts


def parse_distances(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError as e:
        raise InputError(f"--distances {text!r}: give whole numbers of tokens separated by commas, e.g. 2000,8000") from e
    if not out or any(d < 1 or d > 10**7 for d in out):
        raise InputError(f"--distances {text!r}: each distance is 1..10000000 tokens")
    return out


def filler_messages(tokenizer, path: Path, distances: list[int], window: int, cycle: bool = False) -> list[str]:
    """The filler text cut into user messages of FILLER_MESSAGE tokens (a quarter of the window at most,
    so that a message and its reply fit it). Unless `cycle` (the default filler: trials wrap around to
    its start), it must hold the largest distance."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--filler {path}: cannot read it ({e}); give a UTF-8 text file") from e
    ids = tokenizer.encode_text(" ".join(text.split()))
    if not ids:
        raise InputError(f"--filler {path}: no text in it; give a UTF-8 text file of prose")
    if not cycle and len(ids) < max(distances):
        raise InputError(f"--filler {path}: {len(ids)} tokens, but --distances goes to {max(distances)}: give a longer "
                         f"filler or smaller distances")  # fmt: skip
    size = max(1, min(FILLER_MESSAGE, window // 4))
    return [tokenizer.decode(ids[a : a + size]) for a in range(0, len(ids), size)]


def score_choices(d, question: str, choices: tuple[str, ...], retrieval: list[float] | None = None,
                  ) -> tuple[np.ndarray, float]:  # fmt: skip
    """((choices,) log-likelihood of each choice as the assistant's reply to `question`, the question
    turn's recall prefill ms). Each choice is scored from the cache as the question left it (the slot
    table and the buffers saved, then put back), teacher-forced."""
    dec = d.decoder
    r = d.ask(question, should_stop=lambda: True)  # the question's turn fed (the region refilled first); no reply
    if retrieval is not None:
        retrieval.append((r.recall or {}).get("retrieval_ms", 0.0))
    first = d.prompt_logits
    state = dec.cache.state()
    saved = [b.copy() for b in dec.backend.buffers().values()]
    out = []
    for choice in choices:
        ids = d.template.text(choice)
        logp = _log_softmax(first)[ids[0]]
        if len(ids) > 1:
            logits = dec.feed(ids[:-1], all_logits=True)
            logp += sum(_log_softmax(logits[i])[ids[i + 1]] for i in range(len(ids) - 1))
        out.append(float(logp))
        for buf, keep in zip(dec.backend.buffers().values(), saved):
            np.copyto(buf, keep)
        dec.cache.restore(state)
        dec.backend.restored()
    return np.array(out), (r.recall or {}).get("prefill_ms", 0.0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def trial(d, fact: Fact, filler: list[str], offset: int, distance: int, lead: int = 0,
          retrieval: list[float] | None = None) -> tuple[bool, float, int, bool]:  # fmt: skip
    """One fact at one distance: (right, recall prefill ms over its user turns, user turns, the region
    held the statement's turn when the question came); each user turn's retrieval ms appended to
    `retrieval` when given. `lead` filler turns come before the statement,
    so that with lead > 0 it is not the opening request (which the region always keeps) and only
    retrieval brings it back."""
    took = retrieval if retrieval is not None else []

    def turn(text: str) -> float:  # one filler or statement turn: its region prefill ms
        r = (d.add_turn(text, REPLY).recall or {})
        took.append(r.get("retrieval_ms", 0.0))
        return r.get("prefill_ms", 0.0)

    d.reset()
    ms, turns, i = 0.0, 0, offset
    for _ in range(lead):
        ms, turns, i = ms + turn(filler[i % len(filler)]), turns + 1, i + 1
    start = d.decoder.cache.seen  # the statement's turn's first token
    ms, turns = ms + turn(fact.statement), turns + 1
    statement_turn = d.turns
    while d.decoder.cache.seen - start < distance:
        ms, turns, i = ms + turn(filler[i % len(filler)]), turns + 1, i + 1
    scores, last = score_choices(d, fact.question, fact.choices, took)
    held = d.recall and statement_turn in d.region.turns
    return fact.choices[int(np.argmax(scores))] == fact.answer, ms + last, turns + 1, held


def run(d, facts: list[Fact], filler: list[str], distances: list[int], modes: list[bool], lead: int = 0,
        done=None) -> list[Result]:  # fmt: skip
    """Every (distance, recall on / off) over every fact; the dialogue's recall switched per mode.
    `done(result)`, when given, is called as each result is complete."""
    results = []
    has_region = d.recaller is not None
    for recall in modes:
        d.recall = recall and has_region
        for distance in distances:
            right, ms, turns, held, took = 0, 0.0, 0, 0, []
            for k, fact in enumerate(facts):
                ok, t, n, h = trial(d, fact, filler, offset=k * 7, distance=distance, lead=lead, retrieval=took)
                right, ms, turns, held = right + ok, ms + t, turns + n, held + h
            results.append(Result(distance, recall, right / len(facts), len(facts), ms / max(turns, 1),
                                  held / len(facts), lead, sum(took) / max(len(took), 1)))  # fmt: skip
            if done is not None:
                done(results[-1])
    return results
