"""`cabinlm bench --seats N`: N scripted dialogues on one loaded model at once, the way a cockpit's
seats talk to one assistant. Each round, every seat gets its next user turn (bench/script.py, a seed
per seat), its prompt is fed (prefill, seat after seat), then the seats decode their greedy replies:

    together   every seat's next token in one step (runtime.step_seats: the fused cpu build's batched
               graphs), a seat leaving the step when its reply ends (a stop id or --max-new)
    turns      the same steps one seat after another, as `cabinlm serve` ran seats before they
               decoded together (ModelTurns hands the model over at every token)

Both modes give every seat the same tokens (the steps are the seats' own steps); what differs is the
time. Reported per mode: aggregate decode tokens/s (every seat's decoded tokens over the decode
phases' wall time), each seat's decode tokens/s over the same time, time to first token (from the
round's start: the prefills before a seat's own count, as they would for requests arriving at
once), and resident memory at the start and the end. A first round warms the sessions up and is not
counted. Each mode runs in a process of its own (`python -m cabinlm.bench.seats`: one JSON line),
so that its memory is its own. Only numpy, onnxruntime and tokenizers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.runtime.memory import rss_mb

MODES = ("together", "turns")


@dataclass
class SeatsRun:
    """One mode's figures."""

    mode: str
    seats: int
    rounds: int
    decoded: list[int] = field(default_factory=list)  # tokens decoded per seat
    decode_s: float = 0.0  # wall time of the decode phases
    prefill_s: float = 0.0  # wall time of the prefills
    ttft_s: list[float] = field(default_factory=list)  # every (round, seat)'s time to first token
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    replies: list[list[int]] = field(default_factory=list)  # every (round, seat)'s reply tokens

    def to_dict(self) -> dict:
        total = sum(self.decoded)
        ttft = np.asarray(self.ttft_s) if self.ttft_s else np.zeros(1)
        return {
            "mode": self.mode,
            "seats": self.seats,
            "rounds": self.rounds,
            "decoded_tokens": total,
            "aggregate_decode_tok_s": round(total / self.decode_s, 1) if self.decode_s else None,
            "per_seat_decode_tok_s": [round(n / self.decode_s, 1) for n in self.decoded] if self.decode_s else [],
            "ttft_ms_median": round(float(np.median(ttft)) * 1e3, 1),
            "ttft_ms_max": round(float(ttft.max()) * 1e3, 1),
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_end_mb": round(self.rss_end_mb, 1),
        }


def run_seats(artifact: Path, seats: int, rounds: int, max_new: int, threads: int | None, seed: int,
              mode: str, system: str = SYSTEM) -> SeatsRun:  # fmt: skip
    """`rounds` rounds of every seat's turn on a freshly opened runtime with `seats` seats, each
    with `system` pinned ("": none)."""
    from cabinlm.runtime import RuntimeConfig, open_runtime, step_seats

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    rt = open_runtime(RuntimeConfig(Path(artifact), seats=seats, threads=threads, system=system, speculative=False,
                                    max_new_tokens=max_new))  # fmt: skip
    dialogues = rt.dialogues()  # each pins the system prompt
    stop = set(rt.manifest.stop_ids)
    scripts = [user_turns(seed + i) for i in range(seats)]
    run = SeatsRun(mode, seats, rounds, decoded=[0] * seats, rss_start_mb=rss_mb())
    pending: list[list[int]] = [[] for _ in range(seats)]  # the closing tokens of each seat's last reply
    for r in range(rounds + 1):  # round 0 warms the sessions up (their first runs allocate) and is not counted
        if r == 1:
            run.decoded, run.decode_s, run.prefill_s, run.ttft_s, run.replies = [0] * seats, 0.0, 0.0, [], []
        t0 = time.perf_counter()
        nxt: list[int] = []
        for i, d in enumerate(dialogues):  # the prompts, seat after seat
            ids = pending[i] + d.render_user(next(scripts[i]))
            logits = d.decoder.feed(ids)
            nxt.append(int(np.argmax(logits)))
            run.ttft_s.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        run.prefill_s += t1 - t0
        replies: list[list[int]] = [[] for _ in range(seats)]
        live = [i for i in range(seats) if nxt[i] not in stop]
        for i in range(seats):
            if nxt[i] not in stop:
                replies[i].append(nxt[i])
        while live:
            live = [i for i in live if len(replies[i]) < max_new]
            if not live:
                break
            chunks = [np.array([replies[i][-1]], dtype=np.int64) for i in live]
            if mode == "together":
                got = step_seats([dialogues[i].decoder for i in live], chunks)
            else:
                got = [dialogues[i].decoder.step(c, logits="last")[-1] for i, c in zip(live, chunks)]
            still = []
            for i, logits in zip(live, got):
                run.decoded[i] += 1
                token = int(np.argmax(logits))
                if token not in stop:
                    replies[i].append(token)
                    still.append(i)
            live = still
        run.decode_s += time.perf_counter() - t1
        for i in range(seats):
            # the reply's last token (never fed) and the assistant's closing, fed with the next prompt
            last = replies[i][-1:] if len(replies[i]) == max_new else []
            pending[i] = last + dialogues[i].template.closing()
        run.replies += replies
    run.rss_end_mb = rss_mb()
    return run


def run_in_child(artifact: Path, seats: int, rounds: int, max_new: int, threads: int | None, seed: int,
                 mode: str, timeout_s: float, system: str = SYSTEM) -> dict:  # fmt: skip
    """run_seats in a fresh process: its figures (SeatsRun.to_dict, with "replies")."""
    import json
    import subprocess
    import sys

    from cabinlm.errors import CabinlmError

    cmd = [sys.executable, "-m", "cabinlm.bench.seats", str(artifact), str(seats), str(rounds), str(max_new),
           str(threads or 0), str(seed), mode, system]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise CabinlmError(f"--seats {seats} ({mode}) ran past --time-limit {timeout_s:g} s") from e
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise CabinlmError(f"--seats {seats} ({mode}) failed: {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def report(runs: list[dict]) -> list[str]:
    lines = []
    for d in runs:
        lines.append(f"{d['mode']:>8}: {d['seats']} seats, {d['rounds']} rounds, {d['decoded_tokens']} tokens decoded: "
                     f"{d['aggregate_decode_tok_s']} tok/s in all, per seat {d['per_seat_decode_tok_s']}; time to first "
                     f"token median {d['ttft_ms_median']} ms, max {d['ttft_ms_max']} ms; RSS {d['rss_start_mb']} -> "
                     f"{d['rss_end_mb']} MB")  # fmt: skip
    if len(runs) == 2 and all(d["aggregate_decode_tok_s"] for d in runs):
        a, b = (d["aggregate_decode_tok_s"] for d in runs)
        lines.append(f"together / turns: {a / b:.2f}x aggregate decode throughput; replies identical: "
                     f"{runs[0]['replies'] == runs[1]['replies']}")  # fmt: skip
    return lines


if __name__ == "__main__":  # one mode in a process of its own (run_in_child)
    import json
    import sys

    art, n, rounds, max_new, threads, seed, mode, system = sys.argv[1:9]
    done = run_seats(Path(art), int(n), int(rounds), int(max_new), int(threads) or None, int(seed), mode, system)
    print(json.dumps({**done.to_dict(), "replies": done.replies}))
