"""Rounds of `cabinlm bench`: the scripted dialogue (bench/runner.run_cabinlm) run again and again,
one build or two builds taking turns (A, B, A, B, ...), each round a record (bench/records.py).

Each round runs in a process of its own (`python -m cabinlm.bench.rounds ...`), so its memory figures
are its own and not what an earlier round's build left in the allocator. Taking turns matters on a
machine whose speed drifts over minutes (frequency, other tenants): a build's round and the other's
next to it ran under nearly the same conditions, so their ratio is the figure to compare.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from cabinlm.bench.records import Record, Recorder
from cabinlm.bench.trace import Trace, summarize
from cabinlm.contract.errors import CabinlmError

TOOL = "cabinlm bench"
DRAFTING = {None: "default", True: "on", False: "off"}


@dataclass(frozen=True)
class DialogueParams:
    """What one round of the scripted dialogue is asked to do (the record's params)."""

    tokens: int
    threads: int
    max_new: int = 128
    seed: int = 0
    speculative: bool | None = None  # drafting: None as chat decides for the build
    time_limit_s: float = 1800
    adapter: str | None = None  # a build's switchable LoRA adapter, by name (None: the base model)

    def params(self) -> dict[str, Any]:
        out = {"runner": "cabinlm", "seats": 1, "tokens": self.tokens, "max_new": self.max_new, "seed": self.seed,
               "drafting": DRAFTING[self.speculative]}  # fmt: skip
        if self.adapter is not None:
            out["adapter"] = self.adapter
        return out


def figures(trace: Trace) -> dict[str, Any]:
    """A dialogue's figures as a record holds them: its summary's numbers (bench/trace.summarize),
    the load time, whether it drafted and how many drafts it kept."""
    s = summarize(trace)
    c = trace.config
    out = {k: v for k, v in s.items() if k not in ("engine", "config", "stopped")}
    out.update(load_s=trace.load_s or None, done=trace.stopped == "done", drafting=bool(c.get("speculative")))
    for k in ("drafted", "accepted"):
        if k in c:
            out[k] = c[k]
    return out


def record_trace(rec: Recorder, trace: Trace, p: DialogueParams, *, artifact: Path | None, utc_start: str,
                 loadavg_start: float | None, round: int = 0, extra: dict[str, Any] | None = None) -> Record:  # fmt: skip
    """A record of one finished dialogue: cabinlm's (ARTIFACT) or a peer's (ARTIFACT None, the trace's engine)."""
    params = {**p.params(), **(extra or {})}
    engine = None if artifact is not None else trace.engine
    if engine is not None:
        params["runner"] = engine
    return rec.add(params, figures(trace), utc_start=utc_start, loadavg_start=loadavg_start, artifact=artifact,
                   engine=engine, threads=p.threads, round=round)  # fmt: skip


def run_round(build: Path, p: DialogueParams) -> Trace:
    """One dialogue on BUILD in a fresh process: its trace."""
    cmd = [sys.executable, "-m", "cabinlm.bench.rounds", str(build), json.dumps(asdict(p))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=p.time_limit_s + 120)
    except subprocess.TimeoutExpired as e:
        raise CabinlmError(f"{build}: a round ran past --time-limit {p.time_limit_s:g} s") from e
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CabinlmError(f"{build}: a round failed (exit {done.returncode}): {last}")
    return Trace.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))


def take_turns(rec: Recorder, builds: list[Path], p: DialogueParams, rounds: int,
               log: Callable[[str], None] = lambda s: None) -> list[tuple[Record, Trace]]:  # fmt: skip
    """ROUNDS rounds, each build once a round in the order given (A, B, A, B, ...): every round's
    record (added to REC) and trace."""
    from cabinlm.bench.provenance import load_average, utc_now

    out = []
    for r in range(rounds):
        for build in builds:
            log(f"round {r + 1} of {rounds}: {build}")
            start, load = utc_now(), load_average()
            trace = run_round(build, p)
            out.append((record_trace(rec, trace, p, artifact=build, utc_start=start, loadavg_start=load, round=r), trace))
    return out


if __name__ == "__main__":  # one round in a process of its own (run_round): its trace as one JSON line
    from cabinlm.bench.runner import run_cabinlm

    folder, given = sys.argv[1], DialogueParams(**json.loads(sys.argv[2]))
    try:
        trace = run_cabinlm(folder, tokens=given.tokens, threads=given.threads, max_new=given.max_new, seed=given.seed,
                            time_limit_s=given.time_limit_s, speculative=given.speculative,
                            adapter=given.adapter)  # fmt: skip
    except CabinlmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(trace.to_dict()))
