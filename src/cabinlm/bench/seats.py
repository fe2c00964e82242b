"""`cabinlm bench --seats N`: N scripted dialogues on one loaded model at once, the way a cockpit's
seats talk to one assistant. Each round, every seat gets its next user turn (bench/script.py, a seed
per seat), its prompt is fed (prefill, seat after seat), then the seats decode their greedy replies:

    together   every seat's next token in one step (runtime.reply.advance_seats: the fused cpu build's
               batched graphs), a seat leaving the step when its reply ends (a stop id or --max-new);
               a seat that drafts (prompt lookup, as chat's default) verifies its drafts in the same
               run as the other seats' tokens and drafts
    turns      the same steps one seat after another (runtime.reply.advance), as `cabinlm serve` ran
               seats before they decoded together (ModelTurns hands the model over at every token)

and one mode without rounds, each seat's dialogue at its own pace, as independent conversations go:

    streams    after the warm-up round, a seat's next turn starts the moment its reply ends: its
               prompt is fed in pieces of the cache's chunk that ride in the same batched runs as
               the other seats' decode steps and drafts (advance_seats' prompts), so no seat waits
               for another's reply to end and no decode step waits for a prompt

Every mode gives every seat the same tokens (the steps are the seats' own steps, and drafting gives
plain decoding's greedy tokens); what differs is the time. Reported per mode: aggregate decode
tokens/s (every seat's decoded tokens over the decode phases' wall time; streams: over the whole
span from the first counted turn's start to the last reply's end, the prompts' pieces included, as
they share the runs), each seat's decode tokens/s over the same time, time to first token (from the
round's start: the prefills before a seat's own count, as they would for requests arriving at once;
streams: from the turn's start, the other seats' steps riding along), resident memory at the start
and the end, and the drafts verified and accepted; and the aggregate while every seat still talked:
streams, the span up to the first seat's last reply (after it, fewer seats are left); the round modes,
the steps in which every seat decoded (a round's steps before its first reply ends). The seats'
dialogues differ in length (seat 0's replies are the shortest), so the whole run's aggregate blends
N seats' steps with steps of fewer; the second figure is N seats' alone. A first round warms the
sessions up and is not counted. Each mode runs in a process of its own (bench/seats_child.py: one JSON line), so that its
memory is its own; the peer, llama.cpp decoding the seats' sequences in one batch, is
bench/llama_seats.py. `--scaling` adds the seat counts 1, 2, 4, ... below N, together and as streams
(seat k on script k at every count), and reports each count against one seat (scaling_report).
`--repeat K` runs the whole set K times, one repetition after the other, each run marked with its
repetition ("repeat"), and reports medians, ranges and each repetition's own ratio to one seat
(repeats_report): this machine's speed drifts by 10-20% over minutes, so a ratio is taken between
runs of one repetition, never across. Only numpy, onnxruntime and tokenizers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.runtime.memory import rss_mb

MODES = ("together", "turns", "streams")
ROUND_MODES = ("together", "turns")  # every seat's turn k starts when every seat's turn k - 1 has ended
SCALING_MODES = ("together", "streams")  # --scaling: the seat counts below N run these (one seat: no turns to take)


def scaling_counts(seats: int) -> list[int]:
    """The seat counts `--seats N --scaling` runs besides N: 1, 2, 4, ... below N."""
    return [1 << k for k in range(seats.bit_length()) if 1 << k < seats]


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
    replies: list[list[int]] = field(default_factory=list)  # every counted (round, seat)'s reply tokens
    warmup_replies: list[list[int]] = field(default_factory=list)  # the warm-up round's, seat by seat
    rss_rounds_mb: list[float] = field(default_factory=list)  # RSS after each counted round
    evicted: int = 0  # window tokens the seats' caches dropped over the counted rounds (cabinlm's modes)
    drafts: bool = False  # the seats drafted by prompt lookup (cabinlm's modes)
    drafted: int = 0  # drafts verified over the counted rounds
    accepted: int = 0  # and accepted
    # while every seat still talked: streams, the span from the first counted turn's start to the moment
    # the first seat ended its last reply; the round modes, the decode steps (runs) in which every seat
    # of the run decoded (a round's steps before its first reply ended); and the tokens decoded in it
    full_s: float = 0.0
    full_decoded: int = 0

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
            "rss_rounds_mb": [round(x, 1) for x in self.rss_rounds_mb],
            "evicted": self.evicted,
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "all_seats_decode_tok_s": round(self.full_decoded / self.full_s, 1) if self.full_s else None,
            "all_seats_decoded_tokens": self.full_decoded,
        }


def seat_adapters(text: str | None, seats: int, manifest) -> tuple[str, ...]:
    """--adapter with --seats N: one NAME for every seat, or N names comma-separated (seat i takes the
    i-th; --scaling's smaller counts the first ones), each one the build holds. OptionError otherwise."""
    from cabinlm.contract.errors import OptionError
    from cabinlm.runtime.assembly import check_adapter

    if text is None:
        return ()
    names = tuple(text.split(","))
    if len(names) not in (1, seats):
        raise OptionError(f"--adapter {text}: {len(names)} names for {seats} seats; give one name for every seat, or "
                          f"one per seat ({seats}, comma-separated)")  # fmt: skip
    for name in names:
        check_adapter(name, manifest)
    return names * seats if len(names) == 1 else names


def run_seats(artifact: Path, seats: int, rounds: int, max_new: int, threads: int | None, seed: int,
              mode: str, system: str = SYSTEM, speculative: bool | None = None,
              adapters: Sequence[str | None] = ()) -> SeatsRun:  # fmt: skip
    """`rounds` rounds of every seat's turn on a freshly opened runtime with `seats` seats, each
    with `system` pinned ("": none); speculative: the seats draft by prompt lookup (None: as chat
    does on this build, runtime.speculative.drafting_by_default); adapters: seat i's LoRA adapter
    adapters[i] (None, or past the list: the base model), loaded before the first memory sample."""
    from cabinlm.runtime import RuntimeConfig, Sampler, open_runtime
    from cabinlm.runtime.reply import advance, advance_seats

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    rt = open_runtime(RuntimeConfig(Path(artifact), seats=seats, threads=threads, system=system, speculative=speculative,
                                    max_new_tokens=max_new))  # fmt: skip
    dialogues = rt.dialogues()  # each pins the system prompt
    for d, name in zip(dialogues, adapters):  # the pinned system prompt run again with the seat's adapter
        d.set_adapter(name)
    greedy = Sampler()
    stop = set(rt.manifest.stop_ids)
    scripts = [user_turns(seed + i) for i in range(seats)]
    run = SeatsRun(mode, seats, rounds, decoded=[0] * seats, rss_start_mb=rss_mb(), drafts=rt.drafts)
    pending: list[list[int]] = [[] for _ in range(seats)]  # the closing tokens of each seat's last reply
    evicted_at_start = 0
    for r in range(rounds + 1):  # round 0 warms the sessions up (their first runs allocate) and is not counted
        if r == 1 and mode == "streams":  # the counted turns at each seat's own pace
            run.warmup_replies = run.replies
            run.decoded, run.decode_s, run.prefill_s, run.ttft_s, run.replies = [0] * seats, 0.0, 0.0, [], []
            run.full_s, run.full_decoded = 0.0, 0  # the warm-up round's steps counted none
            drafts_at_start = [(d.drafting.drafted, d.drafting.accepted) for d in dialogues]
            evicted_at_start = sum(_evicted(d.decoder) for d in dialogues)
            _streams(run, dialogues, scripts, pending, rounds, max_new, stop, greedy)
            run.rss_rounds_mb.append(rss_mb())
            break
        if r == 1:
            run.warmup_replies = run.replies
            run.decoded, run.decode_s, run.prefill_s, run.ttft_s, run.replies = [0] * seats, 0.0, 0.0, [], []
            run.full_s, run.full_decoded = 0.0, 0
            evicted_at_start = sum(_evicted(d.decoder) for d in dialogues)
            drafts_at_start = [(d.drafting.drafted, d.drafting.accepted) for d in dialogues]
        t0 = time.perf_counter()
        nxt: list[int] = []
        for i, d in enumerate(dialogues):  # the prompts, seat after seat
            ids = pending[i] + d.render_user(next(scripts[i]))
            d.drafting.observe(ids)
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
            t_step = time.perf_counter()
            args = [(dialogues[i].decoder, replies[i][-1], max_new - len(replies[i]), dialogues[i].drafting)
                    for i in live]  # fmt: skip
            if mode != "turns":  # every seat's token (and drafts) in one run (streams: its warm-up round)
                decs, tokens, budgets, draftings = zip(*args)
                got = advance_seats(decs, [greedy] * len(live), tokens, budgets, stop, draftings)
            else:
                got = [advance(dec, greedy, token, budget, stop, drafting) for dec, token, budget, drafting in args]
            if len(live) == seats:  # every seat decoded in this step (turns: in this pass over the seats)
                run.full_s += time.perf_counter() - t_step
                run.full_decoded += sum(map(len, got))
            still = []
            for i, new in zip(live, got):
                run.decoded[i] += len(new)  # a stop id that ends the reply comes last
                replies[i] += [t for t in new if t not in stop]
                if new[-1] not in stop:
                    still.append(i)
            live = still
        run.decode_s += time.perf_counter() - t1
        for i in range(seats):
            # the reply's last token (never fed) and the assistant's closing, fed with the next prompt
            last = replies[i][-1:] if len(replies[i]) == max_new else []
            pending[i] = last + dialogues[i].template.closing()
        run.replies += replies
        if r >= 1:
            run.rss_rounds_mb.append(rss_mb())
    run.rss_end_mb = rss_mb()
    run.evicted = sum(_evicted(d.decoder) for d in dialogues) - evicted_at_start
    run.drafted = sum(d.drafting.drafted - a for d, (a, _) in zip(dialogues, drafts_at_start))
    run.accepted = sum(d.drafting.accepted - b for d, (_, b) in zip(dialogues, drafts_at_start))
    return run


def _streams(run: SeatsRun, dialogues, scripts, pending: list[list[int]], rounds: int, max_new: int, stop: set[int],
             greedy) -> None:  # fmt: skip
    """`rounds` turns of every seat, each at its own pace (mode streams): a seat's next prompt starts
    when its reply ends and is fed in pieces of the cache's chunk, riding in the batched runs with the
    other seats' decode steps (runtime.reply.advance_seats' prompts). Fills run.decoded, decode_s (the
    whole span), ttft_s (from each turn's start) and replies (round after round, seat after seat, as
    the round modes order them), and full_s / full_decoded: the span while every seat still talked
    (the seats' scripts differ in length, so the last ones end alone)."""
    from cabinlm.runtime.reply import advance_seats

    n = len(dialogues)
    chunk = dialogues[0].decoder.manifest.cache.chunk
    turns = [0] * n
    feed: list[list[int]] = [[] for _ in range(n)]  # the prompt's pieces still to feed
    reply: list[list[int]] = [[] for _ in range(n)]
    started = [0.0] * n
    done: list[list[list[int]]] = [[] for _ in range(n)]  # each seat's replies, turn after turn

    def start(i: int, now: float) -> None:
        ids = pending[i] + dialogues[i].render_user(next(scripts[i]))
        dialogues[i].drafting.observe(ids)
        feed[i], reply[i], started[i] = list(ids), [], now

    t0 = time.perf_counter()
    for i in range(n):
        start(i, t0)
    active = list(range(n))
    while active:
        prompts, tokens, budgets = [], [], []
        for i in active:
            if feed[i]:
                prompts.append(np.array(feed[i][:chunk], dtype=np.int64))
                feed[i] = feed[i][chunk:]
                tokens.append(0)
                budgets.append(1)
            else:
                prompts.append(None)
                tokens.append(reply[i][-1])
                budgets.append(max_new - len(reply[i]))
        got = advance_seats([dialogues[i].decoder for i in active], [greedy] * len(active), tokens, budgets, stop,
                            [dialogues[i].drafting for i in active], prompts)  # fmt: skip
        now = time.perf_counter()
        still = []
        for i, piece, new in zip(active, prompts, got):
            if piece is not None:
                if feed[i]:  # more of the prompt to feed
                    still.append(i)
                    continue
                run.ttft_s.append(now - started[i])
                ended = new[0] in stop
                if not ended:
                    reply[i].append(new[0])
            else:
                run.decoded[i] += len(new)  # a stop id that ends the reply comes last
                reply[i] += [t for t in new if t not in stop]
                ended = new[-1] in stop
            if not ended and len(reply[i]) < max_new:
                still.append(i)
                continue
            # the reply's last token (never fed) and the assistant's closing, fed with the next prompt
            pending[i] = (reply[i][-1:] if len(reply[i]) == max_new else []) + dialogues[i].template.closing()
            done[i].append(reply[i])
            turns[i] += 1
            if turns[i] < rounds:
                start(i, now)
                still.append(i)
        if len(still) < n and not run.full_s:  # a seat has taken its last turn: every seat talked until now
            run.full_s, run.full_decoded = now - t0, sum(run.decoded)
        active = still
    run.decode_s = time.perf_counter() - t0
    run.replies = [done[i][r] for r in range(rounds) for i in range(n)]


def _evicted(decoder) -> int:
    """Window tokens this seat's cache has dropped so far."""
    return int(decoder.cache.evicted)


def report(runs: list[dict]) -> list[str]:
    """The text report of `cabinlm bench --seats N` (runs: N seats' modes first, then --scaling's)."""
    lines = []
    for d in runs:
        seats = f"{d['seats']} seat{'' if d['seats'] == 1 else 's'}"
        seats += f" (adapters {', '.join(d['adapters'])})" if d.get("adapters") else ""  # --adapter: seat i's
        lines.append(f"{d['mode']:>8}: {seats}, {d['rounds']} rounds, {d['decoded_tokens']} tokens decoded: "
                     f"{d['aggregate_decode_tok_s']} tok/s in all, per seat {d['per_seat_decode_tok_s']}; time to first "
                     f"token median {d['ttft_ms_median']} ms, max {d['ttft_ms_max']} ms; RSS {d['rss_start_mb']} -> "
                     f"{d['rss_end_mb']} MB")  # fmt: skip
        if d.get("all_seats_decode_tok_s"):
            lines.append(f"          while every seat still talked: {d['all_seats_decode_tok_s']} tok/s in all")
        if d.get("drafts"):
            lines.append(f"          drafting by prompt lookup: {d['drafted']} drafts verified, "
                         f"{d['accepted']} accepted")  # fmt: skip
        per_round = d.get("rss_rounds_mb") or []
        if len(per_round) >= 2:
            half = per_round[len(per_round) // 2 :]
            lines.append(f"          RSS after each round {min(per_round)}-{max(per_round)} MB (second half {min(half)}-"
                         f"{max(half)} MB); window tokens evicted: {d.get('evicted', 0)}")  # fmt: skip
    main = runs[0]["seats"] if runs else 0  # --scaling's smaller counts follow the N seats' modes
    ours = [d for d in runs if d["mode"] in MODES and d["seats"] == main]
    figure = {(d["mode"], d.get("repeat", 0)): d["aggregate_decode_tok_s"] for d in ours}
    reps = sorted({d.get("repeat", 0) for d in runs})
    ratios = [figure[("together", r)] / figure[("turns", r)] for r in reps if figure.get(("together", r)) and figure.get(("turns", r))]
    if ratios:  # one per repetition, each between runs of that repetition
        same = len({repr(d["replies"]) for d in ours}) == 1
        spread = f" (median of {len(ratios)} repetitions, {min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        lines.append(f"together / turns: {_median(ratios):.2f}x aggregate decode throughput{spread}; replies identical "
                     f"in {', '.join(dict.fromkeys(d['mode'] for d in ours))}: {same}")  # fmt: skip
    lines += scaling_report(runs) if len(reps) < 2 else repeats_report(runs)
    for d in runs:
        if d["mode"] == "llama.cpp" and d.get("greedy_agreement"):
            ok, n = d["greedy_agreement"]
            lines.append(f"llama.cpp decoded cabinlm's replies ({d['config'].get('n_seq_max')} sequences in one batch); "
                         f"its own argmax chose cabinlm's token at {ok} of {n} steps")  # fmt: skip
    return lines


def scaling_report(runs: list[dict]) -> list[str]:
    """Per mode of SCALING_MODES, every seat count's aggregate tok/s and its ratio to one seat's, and
    beside it the aggregate while all its seats talked and that against one seat (the runs of
    `--seats N --scaling`; nothing without a one-seat run). Seat k runs script k, so one seat is the
    first seat's dialogue alone."""
    lines = []
    for mode in SCALING_MODES:
        mine = {d["seats"]: d for d in runs if d["mode"] == mode and d["aggregate_decode_tok_s"]}
        one = mine[1]["aggregate_decode_tok_s"] if 1 in mine else None
        if not one or len(mine) < 2:
            continue
        parts = []
        for n in sorted(mine):
            whole, full = mine[n]["aggregate_decode_tok_s"], mine[n].get("all_seats_decode_tok_s")
            text = f"{n} {'seat' if n == 1 else 'seats'} {whole}"
            if n != 1:
                text += f" ({whole / one:.2f}x" + (f"; {full} while all {n} talked, {full / one:.2f}x)" if full else ")")
            parts.append(text)
        lines.append(f"scaling, {mode}: " + ", ".join(parts) + " tok/s in all (x one seat's)")
    return lines


def repeats_report(runs: list[dict]) -> list[str]:
    """`--repeat K`'s summary (runs marked "repeat" 0 .. K-1; nothing for one repetition): per mode and
    seat count the median aggregate tok/s with its lowest and highest, and, beside every count above one
    seat, the median and range of its ratio to the one-seat run of the same mode and repetition (each
    ratio between two runs minutes apart at most, not across the whole set's drift); then the same for
    the aggregate while all the count's seats talked."""
    reps = sorted({d.get("repeat", 0) for d in runs})
    if len(reps) < 2:
        return []
    lines = [f"over {len(reps)} repetitions: median [lowest-highest] tok/s in all; beside it, each repetition's "
             f"ratio to one seat's in the same mode, median [lowest-highest]"]  # fmt: skip
    for mode in MODES:
        whole = {(d["seats"], d.get("repeat", 0)): d["aggregate_decode_tok_s"] for d in runs
                 if d["mode"] == mode and d["aggregate_decode_tok_s"]}  # fmt: skip
        full = {(d["seats"], d.get("repeat", 0)): d["all_seats_decode_tok_s"] for d in runs
                if d["mode"] == mode and d.get("all_seats_decode_tok_s") and d["seats"] != 1}  # fmt: skip
        parts = []
        for n in sorted({k[0] for k in whole}):
            text = f"{n} {'seat' if n == 1 else 'seats'} {_spread(whole, n, reps, None)}"
            if n != 1 and any(k[0] == n for k in full):
                text += f"; while all {n} talked {_spread(full, n, reps, whole)}"
            parts.append(text)
        if parts:
            lines.append(f"  {mode}: " + ", ".join(parts))
    return lines


def _spread(figures: dict, n: int, reps: list[int], one: dict | None) -> str:
    """Count n's median [lowest-highest] over the repetitions, and (n > 1) its per-repetition ratio to
    the one-seat figure of `one` (None: figures' own)."""
    one = figures if one is None else one
    values = [figures[(n, r)] for r in reps if (n, r) in figures]
    text = f"{_median(values):.1f} [{min(values)}-{max(values)}]"
    ratios = [figures[(n, r)] / one[(1, r)] for r in reps if (n, r) in figures and (1, r) in one]
    if n != 1 and ratios:
        text += f" ({_median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}])"
    return text


def _median(values: list[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))
