"""Drafting per seat while seats decode together: a seat's verified draft (its last token
and the drafts after it, every row's logits) rides in the same batched run as other seats' one-token
steps, verified drafts and prefill chunks (runtime.seats_together, FusedBackend.run_seats with
all_logits), and only the rows its accept() keeps are committed.

The first cases check the run itself against an independent reference: each riding seat has a twin
fed the same tokens by plain one-token steps on its own (Decoder.step, the one-seat graph), so the
rows a verification kept must be the twin's step logits bit for bit (the fused cpu build's rows are
its steps), and the seat's next logits and cache are what feeding exactly the kept tokens leaves
(a commit of one row too few or too many, or of another seat's rows, fails there). Then a batched
verify against the same seat's solo Decoder.verify (every row, rejected ones too, and the whole
buffers). Then the reply level: greedy replies of seats drafting while they ride (prompt lookup on
repetitive prompts, drafts accepted and rejected) are each seat's plain solo greedy replies, through
the window's turnover, seats joining and leaving mid-reply, a session saved and restored into another
loaded model, and threads under serve's scheduler. Last, Ctrl-C inside a step: every seat as it was."""

from __future__ import annotations

import dataclasses
import signal

import numpy as np
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.contract.manifest import load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, seats_together
from cabinlm.runtime.reply import advance, advance_seats
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.speculative import Drafting, PlainDecoding, PromptLookupDrafting

from seat_threads import turns_in_threads

LAYOUT = dict(sink=2, pinned=10, window=16, chunk=4)  # the window turns over every 16 tokens; 3 drafts at most


@pytest.fixture(scope="module", params=["llama-int4", "qwen2-fp32"])
def build(request, load, tiny_llama_dir, tiny_qwen2_dir, export_to, tmp_path_factory):
    """The tiny models' fused cpu builds of tests/test_batched_seats.py (batched graphs for 2 and 4)."""
    arch, weights = request.param.split("-")
    src = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    art = export_to(load(str(src)), kv="int8", weights=weights, **LAYOUT)
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("fused-drafting") / "build")


def state(d: Decoder) -> dict:
    """The seat's slot table, comparable with ==."""
    st = d.cache.state()
    return {f.name: np.asarray(getattr(st, f.name)).tolist() for f in dataclasses.fields(st)}


def seats(build, n: int) -> list[Decoder]:
    first = Decoder(build)
    return [first] + [first.seat() for _ in range(n - 1)]


class Twin:
    """A seat that rides (`together`: seats_together) and its twin fed the same tokens one token at a
    time on its own (`steps`: Decoder.step), on one loaded model."""

    def __init__(self, together: Decoder, steps: Decoder):
        self.together, self.steps = together, steps
        self.last: np.ndarray | None = None  # the logits after the last token both hold

    def same_cache(self) -> None:
        a, b = self.together, self.steps
        assert state(a) == state(b)
        used = np.flatnonzero(a.cache.slot_token >= 0)  # a rejected draft's rows may stay in empty slots
        for name in ("keys", "values"):
            np.testing.assert_array_equal(a.backend.buffers()[name][:, :, used], b.backend.buffers()[name][:, :, used])
        np.testing.assert_array_equal(a.backend.key_source, b.backend.key_source)


def ride(twins: list[Twin], chunks, pins, keep) -> None:
    """One seats_together call: twin i's chunk is a plain step where keep[i] is None, else a verified
    draft whose accept() keeps keep[i] tokens. Checks every seat against its twin's plain steps."""
    rows: dict[int, np.ndarray] = {}

    def accept_for(i: int, k: int):
        def accept(logits: np.ndarray) -> int:
            rows[i] = logits.copy()
            return k

        return accept

    accepts = [None if k is None else accept_for(i, k) for i, k in enumerate(keep)]
    got = seats_together([t.together for t in twins], chunks, pins, accepts)
    for i, (t, (logits, kept), chunk, pin, k) in enumerate(zip(twins, got, chunks, pins, keep)):
        chunk = np.asarray(chunk, np.int64)
        if k is None:
            assert kept == len(chunk) and logits.shape[0] == 1
            t.last = t.steps.step(chunk, pin=pin, logits="last")[-1]
            np.testing.assert_array_equal(logits[-1], t.last)
        else:
            assert kept == k and logits.shape[0] == len(chunk)
            np.testing.assert_array_equal(logits, rows[i])  # what accept() was handed
            for j in range(k):  # the kept rows are the twin's steps, bit for bit
                t.last = t.steps.step(chunk[j : j + 1], logits="last")[-1]
                np.testing.assert_array_equal(logits[j], t.last, err_msg=f"row {j} of {len(chunk)}, {k} kept")
        assert t.together.cache.seen == t.steps.cache.seen


def draft_chunk(rng, t: Twin) -> tuple[list[int], int] | None:
    """A verification for this seat (its last greedy token and 1..room random drafts, keeping 1..all
    of them), or None where the seat may not draft now (Decoder.draft_room)."""
    room = t.together.draft_room()
    if room <= 0:
        return None
    n = int(rng.integers(1, room + 1))
    return [int(t.last.argmax()), *rng.integers(3, 300, n).tolist()], int(rng.integers(1, n + 2))


def test_verified_drafts_ride_with_steps_and_pins_and_commit_only_their_kept_rows(build):
    """Five seats, a random group of 1..5 each step (3: the graph for 4 with an idle place; 5: 4 and one
    alone), each seat a plain step, a verified draft keeping a random 1..all of its rows, or now and then
    a pinned span, for 120 steps: the windows turn over many times. Every kept row is the seat's own
    plain step's logits bit for bit and each seat's cache is what its kept tokens alone leave."""
    twins = [Twin(t, s) for t, s in zip(seats(build, 5), seats(build, 5))]
    rng = np.random.default_rng(11)
    ride(twins, [rng.integers(3, 300, 3) for _ in twins], [True] * 5, [None] * 5)  # system prompts: the sink fills
    kinds = {"step": 0, "verify": 0, "partial": 0, "pin": 0}
    for _ in range(120):
        group = [twins[i] for i in rng.permutation(5)[: int(rng.integers(1, 6))]]
        chunks, pins, keep = [], [], []
        for t in group:
            verify = draft_chunk(rng, t) if rng.random() < 0.6 else None
            if rng.random() < 0.04 and t.together.cache.pinned_free >= 2:
                chunks.append(rng.integers(3, 300, 2)), pins.append(True), keep.append(None)
                kinds["pin"] += 1
            elif verify is not None:
                chunks.append(verify[0]), pins.append(False), keep.append(min(verify[1], len(verify[0])))
                kinds["verify"] += 1
                kinds["partial"] += keep[-1] < len(verify[0])
            else:
                chunks.append([int(t.last.argmax())]), pins.append(False), keep.append(None)
                kinds["step"] += 1
        ride(group, chunks, pins, keep)
    assert kinds["verify"] > 100 and kinds["partial"] > 30 and kinds["step"] > 50 and kinds["pin"] > 0, kinds
    assert all(t.together.cache.evicted > 3 * LAYOUT["window"] for t in twins)
    for t in twins:
        t.same_cache()


def test_a_batched_verify_gives_the_seats_solo_verify_every_row_and_buffer(build):
    """Four seats, two verifying (rejected rows included) beside a step and a prefill chunk in one run,
    against the same seats' own Decoder.verify / Decoder.step: every row's logits, the kept count and
    every buffer (the rejected rows' scratch too) bit for bit, through the window's turnover."""
    together, alone = seats(build, 4), seats(build, 4)
    rng = np.random.default_rng(12)
    for d in together + alone:
        d.feed([5, 6, 7], pin=True)
    last = [d.step(np.array([9]))[-1].copy() for d in alone]
    for d in together:
        d.step(np.array([9]))
    for _ in range(40):
        chunks, accepts, ks = [], [], []
        for i in range(4):
            if i < 2 and together[i].draft_room() > 0:
                n = int(rng.integers(1, together[i].draft_room() + 1))
                ks.append(int(rng.integers(1, n + 2)))
                chunks.append(np.array([int(last[i].argmax()), *rng.integers(3, 300, n)]))
                accepts.append(lambda rows, k=ks[-1]: k)
            else:
                chunks.append(rng.integers(3, 300, 3) if i == 3 else np.array([int(last[i].argmax())]))
                ks.append(None)
                accepts.append(None)
        got = seats_together(together, chunks, None, accepts)
        for i, ((logits, kept), chunk, k) in enumerate(zip(got, chunks, ks)):
            if k is None:
                want = alone[i].step(chunk, logits="last")
                assert kept == len(chunk)
            else:
                want, kept_alone = alone[i].verify(chunk, lambda rows, k=k: k)
                assert kept == kept_alone == k
            np.testing.assert_array_equal(logits, want)
            last[i] = logits[k - 1] if k else logits[-1]
    assert all(d.cache.evicted > LAYOUT["window"] for d in together)
    for a, b in zip(together, alone):
        assert state(a) == state(b)
        for name, buf in a.backend.buffers().items():
            np.testing.assert_array_equal(buf, b.backend.buffers()[name], err_msg=name)


def test_the_logits_seats_together_returns_stay_the_callers_through_later_runs(build):
    """seats_together hands a verification's logits over without a copy where the run allocated them
    for itself (StepOutput.owned), and copies those that lie in buffers a later run rewrites (a decode
    step's, batched or alone). Every array it returns, kept without a copy through decode steps,
    verifications and single-seat runs of every kind, must still hold what it held when returned."""
    group = seats(build, 4)
    for d in group:
        d.feed([5, 6, 7], pin=True)
    rng = np.random.default_rng(3)
    kept: list[tuple[np.ndarray, np.ndarray]] = []  # (the array returned, a copy taken then)
    for step in range(24):
        which = group if step % 3 else group[: 1 + step % 4]  # four together, or fewer (one alone)
        chunks, accepts = [], []
        for i, d in enumerate(which):
            verify = (step + i) % 2 == 0 and d.draft_room() > 0
            n = int(rng.integers(1, d.draft_room() + 1)) if verify else 0
            chunks.append(rng.integers(3, 300, 1 + n))
            accepts.append((lambda rows: 1) if verify else None)
        for logits, _ in seats_together(which, chunks, None, accepts):
            kept.append((logits, logits.copy()))
    assert len(kept) > 40
    for i, (logits, then) in enumerate(kept):
        np.testing.assert_array_equal(logits, then, err_msg=f"returned array {i}")


def test_an_accept_keeping_too_few_or_too_many_is_refused_before_any_seat_commits(build):
    a, b = seats(build, 2)
    for d in (a, b):
        d.feed([5, 6, 7], pin=True)
    before = [state(d) for d in (a, b)]
    for bad in (0, 4):
        with pytest.raises(ValueError, match="keep 1..3 tokens"):
            seats_together([a, b], [[1], [1, 2, 3]], None, [None, lambda rows, k=bad: k])
    with pytest.raises(ValueError, match="not pinned"):
        seats_together([a, b], [[1], [1, 2]], [False, True], [None, lambda rows: 1])
    assert [state(d) for d in (a, b)] == before


# -- the reply level: greedy replies of seats drafting while they ride ---------------------------------

PHRASES = [[41, 42, 43, 44, 45, 46], [61, 62, 63, 64], [81, 82, 83, 84, 85], [101, 102, 103]]


def prompt(i: int, round_: int) -> list[int]:
    """A repetitive prompt, so prompt lookup drafts (and the tiny model's replies repeat themselves too)."""
    return PHRASES[i % len(PHRASES)] * 3 + [7 + round_, 8 + i]


def solo_reply(dec: Decoder, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
    """A seat's plain greedy reply alone: the prompt fed, then one-token steps (no drafting)."""
    token = int(np.argmax(dec.feed(np.array(ids))))
    out = [token]
    while len(out) < max_new and out[-1] not in stop:
        out += advance(dec, Sampler(), out[-1], max_new - len(out), stop, PlainDecoding())
    return out


class Foresight(Drafting):
    """Drafts the seat's reply as its plain solo decoding gives it (`known`), from where the stream is
    (the tokens pushed so far), with one draft changed in every third proposal so the verification
    rejects it there: drafts of 1..3 tokens accepted whole, in part and not at all, whatever the tiny
    random model replies (prompt lookup finds little to draft in its replies)."""

    drafts = True

    def __init__(self, known: list[int], seed: int):
        super().__init__()
        self.known, self.pushed, self.proposals = known, 0, 0
        self.rng = np.random.default_rng(seed)

    def push(self, token: int) -> None:
        self.pushed += 1

    def observe(self, ids) -> None:
        self.pushed += len(list(ids))

    def propose(self, dec: Decoder) -> list[int]:
        k = min(int(self.rng.integers(1, 4)), dec.draft_room())
        drafts = list(self.known[self.pushed : self.pushed + k]) if k > 0 else []
        self.proposals += 1
        if drafts and self.proposals % 3 == 0:
            drafts[int(self.rng.integers(0, len(drafts)))] = 300 + self.proposals % 7  # a token the reply never has
        return drafts


class Talker:
    """A seat replying with drafts in rounds driven by advance_seats: by prompt lookup over its stream,
    or by Foresight of a known reply (start's `known`)."""

    def __init__(self, dec: Decoder):
        self.dec, self.drafting, self.reply = dec, PromptLookupDrafting(), []
        self.drafted = self.accepted = 0

    def start(self, ids: list[int], known: list[int] | None = None) -> None:
        self.drafted += self.drafting.drafted
        self.accepted += self.drafting.accepted
        if known is not None:
            self.drafting = Foresight(known, seed=len(ids) + len(known))
        else:
            self.drafting.observe(ids)
        self.reply = [int(np.argmax(self.dec.feed(np.array(ids))))]
        if known is not None:
            self.drafting.pushed = 0  # the reply's first token is pushed next


def talk_together(talkers: list[Talker], max_new: int, stop: set[int], joining=()) -> None:
    """Every talker's reply to its fed prompt, their steps and verified drafts in shared runs
    (advance_seats) until each reply ends; joining: (step, talker, prompt) to start mid-way."""
    live = list(talkers)
    joins = list(joining)
    step = 0
    while live or joins:
        for j in [j for j in joins if j[0] == step]:
            j[1].start(*j[2:])
            live.append(j[1])
            joins.remove(j)
        live = [t for t in live if len(t.reply) < max_new and t.reply[-1] not in stop]
        if live:
            got = advance_seats([t.dec for t in live], [Sampler()] * len(live), [t.reply[-1] for t in live],
                                [max_new - len(t.reply) for t in live], stop, [t.drafting for t in live])  # fmt: skip
            for t, new in zip(live, got):
                t.reply += new
        step += 1


def test_seats_drafting_while_they_ride_give_their_plain_solo_greedy_replies(build):
    """Four seats with repetitive prompts reply over three rounds (the windows turn over), drafting by
    prompt lookup while they ride together, one seat joining mid-reply in each round and seats leaving
    as their replies end: every reply is the seat's plain greedy reply alone, token for token, with
    drafts both accepted and rejected on the way."""
    stop = set(load_manifest(build).stop_ids)
    plain = seats(build, 4)
    talkers = [Talker(d) for d in seats(build, 4)]
    for d in plain + [t.dec for t in talkers]:
        d.feed(np.array([5, 6, 7, 8]), pin=True)
    max_new = 24
    for r in range(3):
        want = [solo_reply(d, prompt(i, r), max_new, stop) for i, d in enumerate(plain)]
        for i, t in enumerate(talkers[:3]):
            t.start(prompt(i, r), want[i] if i != 1 else None)  # seat 1 drafts by prompt lookup
        talk_together(talkers[:3], max_new, stop, joining=[(3 + r, talkers[3], prompt(3, r), want[3])])
        assert [t.reply for t in talkers] == want
        for t, d in zip(talkers, plain):  # the reply's last token (when not a stop id) goes with the next prompt
            if t.reply[-1] not in stop:
                t.dec.step(np.array([t.reply[-1]]))
                d.step(np.array([t.reply[-1]]))
    drafted = sum(t.drafted + t.drafting.drafted for t in talkers)
    accepted = sum(t.accepted + t.drafting.accepted for t in talkers)
    assert drafted > accepted > 50, (drafted, accepted)
    assert all(t.dec.cache.evicted > LAYOUT["window"] for t in talkers)


def test_a_seat_saved_after_drafting_together_resumes_in_another_model_and_drafts_on_together(build, tmp_path):
    """A seat's session written after replies drafted while riding, restored into a seat of another
    loaded model, replies on (drafting, with that model's other seats) as the seat does alone."""
    from cabinlm.runtime import Dialogue, Tokenizer
    from cabinlm.runtime.persist import load_session, save_session

    m = load_manifest(build)
    stop, tok = set(m.stop_ids), Tokenizer(build / m.files["tokenizer"].path)
    plain, first = seats(build, 2), seats(build, 3)
    dialogues = [Dialogue(d, tok, system="") for d in plain + first]
    talkers = [Talker(d) for d in first]
    want = [solo_reply(plain[0], prompt(0, 0), 20, stop)]
    for i, t in enumerate(talkers):
        t.start(prompt(i, 0), want[0] if i == 0 else None)
    talk_together(talkers, 20, stop)
    assert talkers[0].reply == want[0] and talkers[0].drafting.accepted > 0
    if want[0][-1] not in stop:
        for d in (plain[0], first[0]):
            d.step(np.array([want[0][-1]]))
    save_session(tmp_path / "seat0", dialogues[2])
    other = seats(build, 2)  # another loaded model
    load_session(tmp_path / "seat0", Dialogue(other[0], tok, system=""))
    Dialogue(other[1], tok, system="")
    moved = [Talker(other[0]), Talker(other[1])]
    want = [solo_reply(d, prompt(i, 1), 20, stop) for i, d in enumerate(plain)]
    for i, t in enumerate(moved):
        t.start(prompt(i, 1), want[i])
    talk_together(moved, 20, stop)
    assert [t.reply for t in moved] == want and moved[0].drafting.accepted > 0


def test_seats_drafting_under_the_server_scheduler_ride_with_their_drafts(build):
    """Three seats in three threads under serve's scheduler, each a greedy reply drafting (Foresight)
    with pass_turn between tokens (the reply loop, runtime.reply.decode_reply, as a turn of `cabinlm
    serve` runs it): riders post their verified drafts instead of taking the model, and each reply is
    the seat's plain greedy reply alone."""
    from cabinlm.runtime.reply import decode_reply
    from cabinlm.runtime.model_turns import SeatSteps

    stop = set(load_manifest(build).stop_ids)
    want = [solo_reply(d, prompt(i, 0), 40, stop) for i, d in enumerate(seats(build, 3))]
    model = SeatSteps(4)
    ds = seats(build, 3)
    for d in ds:
        model.join(d)

    def turn(i: int) -> list[int]:
        with model:
            drafting = Foresight(want[i], seed=i)
            logits = ds[i].feed(np.array(prompt(i, 0)))
            r = decode_reply(ds[i], Sampler(), logits, 40, stop, lambda t: None, drafting,
                             should_stop=lambda: model.pass_turn() or False)  # fmt: skip
            return r.ids  # the stop id that ended a reply is not among them

    got = turns_in_threads(model, [lambda i=i: turn(i) for i in range(3)])
    assert got == [w[:-1] if w[-1] in stop else w for w in want]
    assert model.batched_runs > 5 and model.verified_riding > 0
    assert not model._held and not model._posted


# -- Ctrl-C inside a step --------------------------------------------------------------------------


@pytest.fixture
def python_handles_sigint():
    """Python's own SIGINT handler (a background shell's process inherits SIGINT ignored)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("where", ["in the batched run", "in an accept", "between two seats' commits"])
def test_ctrl_c_inside_a_step_with_a_verified_draft_leaves_every_seat_as_it_was_or_all_committed(build, where,
                                                                                              python_handles_sigint):  # fmt: skip
    """A real SIGINT in the run or in a seat's accept(): no seat commits anything; between two seats'
    commits: it is held until every seat committed, then raised. Either way the seats step on as
    their twins stepping alone, bit for bit."""
    twins = [Twin(t, s) for t, s in zip(seats(build, 3), seats(build, 3))]
    ride(twins, [[5, 6, 7], [8, 9], [10]], [True] * 3, [None] * 3)
    for _ in range(20):  # past the window's turnover
        ride(twins, [[int(t.last.argmax())] for t in twins], [False] * 3, [None] * 3)
    first, middle = twins[0].together.backend, twins[1].together.backend  # run_seats is the first seat's
    real_run, real_commit = first.run_seats, middle.commit
    if where == "in the batched run":
        first.run_seats = lambda *a: (signal.raise_signal(signal.SIGINT), real_run(*a))[1]
    elif where == "between two seats' commits":  # after the middle seat's commit, before the last one's
        middle.commit = lambda plan, out: (real_commit(plan, out), signal.raise_signal(signal.SIGINT))[0]
    before = [state(t.together) for t in twins]
    chunks = [[int(twins[0].last.argmax())], [int(twins[1].last.argmax()), 40, 41], [int(twins[2].last.argmax()), 50]]

    def accept(rows: np.ndarray) -> int:
        if where == "in an accept":
            signal.raise_signal(signal.SIGINT)
        return 2

    with pytest.raises(KeyboardInterrupt):
        seats_together([t.together for t in twins], chunks, None, [None, accept, lambda rows: 1])
    for backend, name in ((first, "run_seats"), (middle, "commit")):
        backend.__dict__.pop(name, None)  # the backends' own methods again
    if where == "between two seats' commits":  # every seat committed: the twins feed what was kept
        for t, chunk, k in zip(twins, chunks, (1, 2, 1)):
            for tok in chunk[:k]:
                t.last = t.steps.step(np.array([tok]), logits="last")[-1]
    else:
        assert [state(t.together) for t in twins] == before
    for t in twins:
        assert t.together.cache.seen == t.steps.cache.seen
    for _ in range(6):
        ride(twins, [[int(t.last.argmax())] for t in twins], [False] * 3, [None] * 3)
    for t in twins:
        t.same_cache()


def test_bench_seats_drafting_gives_the_same_replies_in_every_mode_and_without_drafting(build):
    """`cabinlm bench --seats`' three modes with every seat drafting (prompt lookup, bench.seats.run_seats in
    this process) and without: the same greedy replies all six ways (streams: drafts verified in the
    runs that carry other seats' prompt pieces), and the figures say who drafted."""
    from cabinlm.bench.seats import run_seats

    runs = {(mode, spec): run_seats(build, 3, 2, 12, 1, 0, mode, system="", speculative=spec)
            for mode in ("together", "turns", "streams") for spec in (True, False)}  # fmt: skip
    replies = {key: r.replies for key, r in runs.items()}
    assert len({repr(v) for v in replies.values()}) == 1 and len(replies["together", True]) == 3 * 2
    for (mode, spec), r in runs.items():
        d = r.to_dict()
        assert d["drafts"] is spec and (spec or d["drafted"] == 0)
        assert d["decoded_tokens"] == sum(map(len, r.replies)) - sum(len(x) == 12 for x in r.replies)
