"""Seats decoding together: a fused cpu build's batched graphs run B seats' rows through
every weight matmul in one graph run, each seat's attention over its own cache
(engines/ort_fused/graph.py fused_model(seats=B), FusedBackend.run_seats, runtime step_seats).

Every case compares seats stepping together with the same seats stepping alone, bit for bit: the
logits of every step, hence the greedy tokens. The earlier cases fix which seats step together; the
later ones change it between steps (a seat joining or leaving, batches of 2 and 4 and a seat alone in
one step), save a seat mid-dialogue and restore it, and mix prefill chunks of different lengths and
pinned spans in one run."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.manifest import load_manifest
from cabinlm.profiles import cpu_engine, load_profile
from cabinlm.runtime import Decoder, step_seats
from cabinlm.runtime.persist import load_session, save_session

from seat_threads import turns_in_threads

LAYOUT = dict(sink=2, pinned=10, window=16, chunk=4)  # the window turns over every 16 tokens


@pytest.fixture(scope="module", params=["llama-int4", "qwen2-fp32"])
def build(request, load, tiny_llama_dir, tiny_qwen2_dir, export_to, tmp_path_factory):
    """A tiny model's fused cpu build with int8 KV (cabinlm's attention kernel, so batched graphs):
    Llama with int4 weights and an int4 head (cabinlm's BlockQ4MatMul, int8 activations; the head in
    a graph of its own, which the batched graphs share) and Qwen2 (q/k/v bias) with fp32 weights."""
    arch, weights = request.param.split("-")
    src = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    head = dict(head="int4") if weights == "int4" else {}
    art = export_to(load(str(src)), kv="int8", weights=weights, **head, **LAYOUT)
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("fused-seats") / "build")


def seats(build, n: int) -> list[Decoder]:
    first = Decoder(build)
    return [first] + [first.seat() for _ in range(n - 1)]


class Pair:
    """The same seat twice: `together` steps with other seats (step_seats), `alone` on its own
    (Decoder.step), on one loaded model. check() feeds both and asserts the same logits, bit for bit."""

    def __init__(self, together: Decoder, alone: Decoder):
        self.together, self.alone = together, alone
        self.last: np.ndarray | None = None

    def alone_step(self, chunk, pin=False) -> np.ndarray:
        return self.alone.step(np.asarray(chunk, np.int64), pin=pin, logits="last")[-1]


def step_together(pairs: list[Pair], chunks, pins=None) -> None:
    """One step of these pairs' `together` seats in one step_seats call, each `alone` seat on its own;
    every seat's logits must be its alone twin's."""
    pins = pins or [False] * len(pairs)
    got = step_seats([p.together for p in pairs], chunks, pins)
    for p, g, chunk, pin in zip(pairs, got, chunks, pins):
        want = p.alone_step(chunk, pin)
        np.testing.assert_array_equal(g, want)
        p.last = want


def test_the_build_records_its_batched_graphs_and_they_read_the_one_seat_graphs_weights(build):
    m = load_manifest(build)
    facts = m.runtime_spec.facts_as(FusedSettings)
    assert facts.attention_kernel == "cabinlm" and facts.seat_batches == (2, 4)
    assert {"graph_seats2", "graph_seats4", "graph_head"} <= set(m.files)
    assert [p.name for p in build.glob("*.data")] == ["decoder.opt.onnx.data"]  # one weights file for every graph
    table = {t.name: t for t in facts.shared_weights.tensors}
    for role in ("graph_seats2", "graph_seats4", "graph_head"):
        graph = onnx.load(str(build / m.files[role].path), load_external_data=False)
        external = [i for i in graph.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
        assert external
        for init in external:  # the same bytes of the same file the one-seat graph reads
            info = {e.key: e.value for e in init.external_data}
            t = table[init.name]
            assert (info["location"], int(info["offset"]), int(info["length"])) == (facts.shared_weights.file, t.offset, t.length)
    dec = Decoder(build)
    graphs = dec.backend.graphs
    assert len(graphs.weights) == len(facts.shared_weights.tensors)
    # a dialogue alone opens no batched session (ONNX Runtime packs the LM head again in the head
    # graph's); the loaded build's second seat opens them all
    assert dec.backend.seat_batches == (2, 4) and not graphs.batched.sessions and graphs.batched.head is None
    dec.seat()
    assert sorted(graphs.batched.sessions) == [2, 4] and graphs.batched.head is not None
    # the batched graphs' threads stop spinning when a run returns, so the head and a prefill right
    # after a batched step have the cores; the head's never spin; the one-seat session keeps spinning
    entry = lambda sess, key: sess.get_session_options().get_session_config_entry(key)  # noqa: E731
    assert all(entry(graphs.batched.sessions[b], "session.force_spinning_stop") == "1" for b in (2, 4))
    assert entry(graphs.batched.head, "session.intra_op.allow_spinning") == "0"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        entry(graphs.decoder, "session.force_spinning_stop")


def test_four_seats_decoding_together_give_each_seats_own_logits_through_pins_and_eviction(build):
    """Four seats, each with its own pinned system prompt and prompt, then 70 decode steps together
    (the window turns over four times): every step's logits are the seat's own, bit for bit, and so
    are the greedy tokens; the seats' caches stay apart (different prompts, different replies)."""
    together, alone = seats(build, 4), seats(build, 4)
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    rng = np.random.default_rng(1)
    for _ in range(2):  # system prompts, pinned: two chunks of 1..4 tokens each
        step_together(pairs, [rng.integers(3, 300, 1 + i) for i in range(4)], [True] * 4)
    step_together(pairs, [rng.integers(3, 300, 1 + i) for i in range(4)])  # prompts: chunks of 1..4
    tokens = [[int(p.last.argmax())] for p in pairs]
    for _ in range(70):
        step_together(pairs, tokens)
        tokens = [[int(p.last.argmax())] for p in pairs]
    assert all(p.together.cache.evicted > 3 * LAYOUT["window"] for p in pairs)
    assert len({p.together.cache.evicted for p in pairs}) > 1  # the seats are at different points of their streams
    for p in pairs:
        np.testing.assert_array_equal(p.together.cache.slot_token, p.alone.cache.slot_token)
        for name, buf in p.together.backend.buffers().items():
            np.testing.assert_array_equal(buf, p.alone.backend.buffers()[name], err_msg=name)


def test_seats_join_and_leave_between_steps(build):
    """Which seats step together changes every step: 1, 2, 3 (the graph for 4, its fourth place idle),
    4 and 5 (4, then 1 alone) seats in random order, a seat pinning a new span while the others decode, a seat
    reset (a new conversation) and rejoining."""
    together, alone = seats(build, 5), seats(build, 5)
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    rng = np.random.default_rng(2)
    for p in pairs:
        step_together([p], [rng.integers(3, 300, 3)], [True])
    for step in range(80):
        k = int(rng.integers(1, 6))
        chosen = [pairs[i] for i in rng.permutation(5)[:k]]
        pins = [bool(rng.random() < 0.05) for _ in chosen]
        chunks = [rng.integers(3, 300, int(rng.integers(1, 3))) if pin else [int(p.last.argmax())] for p, pin in zip(chosen, pins)]
        step_together(chosen, chunks, pins)
        if step == 40:  # seat 2 starts a new conversation and rejoins
            pairs[2].together.reset()
            pairs[2].alone.reset()
            step_together([pairs[2]], [rng.integers(3, 300, 2)], [True])
    assert all(p.together.cache.evicted > 0 for p in pairs)
    batched = together[0].backend.graphs.batched  # 3 seats ran in the graph for 4, the idle seat in the fourth place
    assert batched.idle is not None and batched.idle_table.seen == 0 and batched.idle.keys.ctypes.data not in {
        d.backend.keys.ctypes.data for d in together + alone}


def test_a_seat_saved_after_stepping_together_resumes_in_another_model_and_steps_on_together(build, tmp_path):
    """A seat's session written after batched steps (the window turned over) holds its solo twin's
    cache; restored into a seat of another loaded model, it steps on together with that model's other
    seats as its twin steps alone. Seats of two loaded models never share a step."""
    from cabinlm.runtime import Dialogue, Tokenizer

    tok = Tokenizer(build / load_manifest(build).files["tokenizer"].path)
    together, alone = seats(build, 3), seats(build, 5)
    dialogues = [Dialogue(d, tok, system="") for d in together + alone]  # each seat started as a dialogue starts it
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    rng = np.random.default_rng(3)
    step_together(pairs, [rng.integers(3, 300, 4) for _ in pairs], [True] * 3)
    for _ in range(30):
        step_together(pairs, [[int(p.last.argmax())] for p in pairs])
    assert pairs[1].together.cache.evicted > 0
    save_session(tmp_path / "seat1", dialogues[1])
    other = seats(build, 3)  # another loaded model
    load_session(tmp_path / "seat1", Dialogue(other[0], tok, system=""))
    for name, buf in other[0].backend.buffers().items():
        np.testing.assert_array_equal(buf, pairs[1].alone.backend.buffers()[name], err_msg=name)
    with pytest.raises(ValueError, match="this loaded build"):
        step_seats([pairs[0].together, other[0]], [[1], [1]])
    group = [Pair(other[0], pairs[1].alone), Pair(other[1], alone[3]), Pair(other[2], alone[4])]
    group[0].last = pairs[1].last
    for d in other[1:]:
        Dialogue(d, tok, system="")
    step_together(group[1:], [rng.integers(3, 300, 3) for _ in group[1:]], [True, True])
    for _ in range(25):
        step_together(group, [[int(p.last.argmax())] for p in group])


def test_prefill_chunks_and_pins_of_different_lengths_share_one_run(build):
    """A batched run takes each seat's own number of rows (seat_tokens): one seat's 4-token prefill
    chunk, another's pinned span, two decode steps, in one run; each seat's last row's logits are its
    own chunk's, and the caches are what their own chunks leave."""
    together, alone = seats(build, 4), seats(build, 4)
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    rng = np.random.default_rng(4)
    for _ in range(20):
        sizes = rng.integers(1, LAYOUT["chunk"] + 1, 4)
        pins = [bool(rng.random() < 0.1) for _ in pairs]
        step_together(pairs, [rng.integers(3, 300, int(n)) for n in sizes], pins)
    for p in pairs:
        for name, buf in p.together.backend.buffers().items():
            np.testing.assert_array_equal(buf, p.alone.backend.buffers()[name], err_msg=name)


def test_bad_steps_are_refused_before_anything_runs(build):
    a, b = seats(build, 2)
    with pytest.raises(ValueError, match="twice"):
        step_seats([a, a], [[1], [2]])
    with pytest.raises(ValueError, match="2 seats, 1 chunks"):
        step_seats([a, b], [[1]])
    assert a.cache.seen == b.cache.seen == 0  # nothing was planned into the tables
    assert step_seats([], []) == []


@pytest.mark.parametrize("batches", [(1,), (4, 2), (2, 2), (True,), (65,)])
def test_seat_batches_out_of_range_are_refused(build, batches):
    facts = load_manifest(build).runtime_spec.facts_as(FusedSettings)
    with pytest.raises(ValueError, match="seat_batches"):
        FusedSettings.from_dict({**facts.to_dict(), "seat_batches": list(batches)})


def test_a_build_without_cabinlms_attention_kernel_steps_its_seats_one_by_one(load, tiny_llama_dir, export_to, tmp_path):
    """fp32 KV (GroupQueryAttention): no batched graphs; step_seats still steps every seat, each alone."""
    art = export_to(load(str(tiny_llama_dir)), kv="fp32", **LAYOUT)
    out = build_artifact(art, load_profile("cpu"), tmp_path / "gqa")
    facts = load_manifest(out).runtime_spec.facts_as(FusedSettings)
    assert facts.seat_batches == () and facts.shared_weights is None
    together, alone = seats(out, 3), seats(out, 3)
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    step_together(pairs, [[5, 6], [7], [8, 9, 10]], [True, False, False])
    for _ in range(20):
        step_together(pairs, [[int(p.last.argmax())] for p in pairs])


def test_smollm2_seats_decode_together_as_they_do_alone(smollm2_fused):
    """SmolLM2 as `make demo` builds it (BlockQ4MatMul over the GGUF's Q4_1 blocks, the int8 head,
    cabinlm's attention kernel), in a small cache (window 252): four seats with different prompts
    decode together past the window's turnover, every step's logits bit for bit their own."""
    from cabinlm.runtime import Tokenizer

    tok = Tokenizer(smollm2_fused / load_manifest(smollm2_fused).files["tokenizer"].path)
    together, alone = seats(smollm2_fused, 4), seats(smollm2_fused, 4)
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    topics = ["the route to the airport", "the weather tonight", "a song for a long drive", "the tyre pressure"]
    prompts = [tok.encode(f"Tell me about {t}. " * 12) for t in topics]
    step_together(pairs, [tok.encode("You are a car assistant.")] * 4, [True] * 4)
    for start in range(0, max(map(len, prompts)), 32):  # prefill together, seats with text left only
        live = [(p, ids[start : start + 32]) for p, ids in zip(pairs, prompts) if ids[start : start + 32]]
        step_together([p for p, _ in live], [c for _, c in live])
    need = max(253 - p.together.cache.window_fill for p in pairs)
    tokens = [[int(p.last.argmax())] for p in pairs]
    for _ in range(need + 8):
        step_together(pairs, tokens)
        tokens = [[int(p.last.argmax())] for p in pairs]
    assert all(p.together.cache.evicted > 0 for p in pairs)


# -- the server's scheduler: seats that pass their turn ride along (runtime.model_turns.SeatSteps) --------


def test_seats_taking_turns_under_the_server_scheduler_ride_together_with_their_own_replies(build):
    """Three seats in three threads, each a turn as the server runs it (hold the model, prefill, then
    greedy tokens with pass_turn between them), queued in order: each turn takes the model at the
    holder's next token, the seat that passed it on then rides, and the riders' steps go with the
    holder's (its prefill chunks too) in batched runs; every seat's tokens are those it decodes alone."""

    from cabinlm.runtime.model_turns import SeatSteps

    rng = np.random.default_rng(5)
    prompts = [[rng.integers(3, 300, int(rng.integers(1, 5))) for _ in range(3)] for _ in range(3)]

    def turn(d: Decoder, chunks, n: int, model=None) -> list[int]:
        with model if model is not None else _Nothing():
            for c in chunks[:-1]:
                d.step(c, pin=True)
            logits = d.step(chunks[-1], logits="last")[-1]
            out = []
            for _ in range(n):
                out.append(int(logits.argmax()))
                if model is not None:
                    model.pass_turn()
                logits = d.step(np.array([out[-1]]))[-1]
            return out

    expected = [turn(d, p, 40) for d, p in zip(seats(build, 3), prompts)]
    model = SeatSteps(4)
    ds = seats(build, 3)
    for d in ds:
        model.join(d)
    got = turns_in_threads(model, [lambda i=i: turn(ds[i], prompts[i], 40, model) for i in range(3)])
    assert got == expected
    assert model.batched_runs > 10
    assert not model._held and not model._posted  # everything ran, the model is free


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_three_clients_at_once_on_a_fused_server_get_the_replies_chat_gives_each_alone(load, tiny_qwen2_dir, export_to,
                                                                                       tmp_path):  # fmt: skip
    """`cabinlm serve --seats 3` on a fused build with batched graphs (its seats' steps ride together,
    runtime.model_turns.SeatSteps), three openai clients sending their turns at the same moment, greedy,
    the window (40 tokens) turning over: every reply is what `cabinlm chat` gives that conversation
    alone, byte for byte."""
    pytest.importorskip("openai")
    from test_serve import DRIVER, PASSENGER, PASSENGER_SYSTEM, Server, ask, chat_replies

    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")
    fused = build_artifact(art, load_profile("cpu"), tmp_path / "fused")
    assert load_manifest(fused).runtime_spec.facts_as(FusedSettings).seat_batches == (2, 4)
    rear = ["is there a rest area", "how long until we stop", "play a story", "turn the light on"]
    talks = {"driver": (DRIVER, None), "passenger": (PASSENGER, PASSENGER_SYSTEM), "rear": (rear, None)}
    expected = {seat: chat_replies(fused, turns, 12, system) for seat, (turns, system) in talks.items()}
    got: dict[str, list[str]] = {seat: [] for seat in talks}
    errors = []
    start = threading.Barrier(3, timeout=60)

    def talk(seat: str) -> None:
        turns, system = talks[seat]
        try:
            client = server.client()
            for i in range(len(turns)):
                start.wait()  # the three requests of each turn leave together
                got[seat].append(ask(client, turns[: i + 1], got[seat], seat, system, max_tokens=12, stream=seat == "rear")[0])
        except Exception as e:  # reported by the main thread
            errors.append(e)

    with Server(fused, tmp_path / "server.log", "--seats", 3) as server:
        threads = [threading.Thread(target=talk, args=(seat,)) for seat in talks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
    assert got == expected


def test_bench_seats_reports_every_mode_with_the_same_replies(build):
    """`cabinlm bench --seats 3`: the seats' dialogues decoded together and in turns (rounds), and as
    streams (each seat's next prompt fed in pieces riding with the others' steps the moment its reply
    ends), each mode in a process of its own, the same greedy replies in all; the figures a report
    needs are there, streams' aggregate while every seat still talked too."""
    import json

    from cabinlm.bench.seats_child import run_in_child
    from test_cli import assert_clean_error, cabinlm

    runs = [run_in_child(build, 3, 2, 6, 1, 0, mode, 300, system="") for mode in ("together", "turns", "streams")]
    assert runs[0]["replies"] == runs[1]["replies"] == runs[2]["replies"] and len(runs[0]["replies"]) == 3 * 2
    for r in runs:
        assert r["seats"] == 3 and r["decoded_tokens"] == sum(map(len, r["replies"])) - sum(len(x) == 6 for x in r["replies"])
        assert len(r["per_seat_decode_tok_s"]) == 3 and r["aggregate_decode_tok_s"] > 0 and r["rss_end_mb"] > 0
        assert r["all_seats_decode_tok_s"] is not None  # every mode: while all 3 seats talked (the rounds' first steps)
        assert 0 < r["all_seats_decoded_tokens"] <= r["decoded_tokens"]
    # one seat talks all the time: its whole counted run is "while every seat talked" (the warm-up round not)
    for mode in ("together", "streams"):
        one = run_in_child(build, 1, 2, 6, 1, 0, mode, 300, system="")
        assert one["all_seats_decoded_tokens"] == one["decoded_tokens"] > 0, (mode, one)
    p = cabinlm("bench", build, "--seats", 2, "--tokens", 8, "--max-new", 4, "--threads", 1, "--json")
    assert p.returncode == 0, p.stderr
    assert [r["mode"] for r in json.loads(p.stdout)["seats"]] == ["together", "turns", "streams"]
    # --scaling: one seat too, together and as streams, and each count against one seat's
    # (and --repeat 2: the whole set twice, one repetition after the other, each run marked with its own)
    p = cabinlm("bench", build, "--seats", 2, "--scaling", "--repeat", 2, "--tokens", 8, "--max-new", 4, "--threads", 1,
                "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    runs = json.loads(p.stdout)["seats"]
    one = [("together", 2), ("turns", 2), ("streams", 2), ("together", 1), ("streams", 1)]
    assert [(r["mode"], r["seats"], r["repeat"]) for r in runs] == [m + (k,) for k in (0, 1) for m in one]
    p = cabinlm("bench", build, "--seats", 2, "--scaling", "--tokens", 8, "--max-new", 4, "--threads", 1)
    assert p.returncode == 0, p.stderr
    assert "scaling, together: 1 seat " in p.stdout and "scaling, streams: 1 seat " in p.stdout, p.stdout
    assert "together / turns: " in p.stdout and "replies identical in together, turns, streams: True" in p.stdout
    assert_clean_error(cabinlm("bench", build, "--scaling"), "--scaling goes with --seats 2 or more")
    assert_clean_error(cabinlm("bench", build, "--repeat", 3), "--repeat goes with --seats 2 or more")
    assert_clean_error(cabinlm("bench", build, "--seats", 2, "--repeat", 0), "--repeat must be >= 1")
    assert_clean_error(cabinlm("bench", build, "--seats", 2, "--baseline", "hf"), "--seats takes --baseline llama.cpp only")
    assert_clean_error(cabinlm("bench", build, "--seats", 0), "seats")


def test_bench_scaling_reports_each_seat_count_against_one_seat():
    """scaling_counts: the powers of two below N; scaling_report: per mode, each count's aggregate and its
    ratio to one seat's, checked against the division done here; nothing for a mode without one seat."""
    from cabinlm.bench.seats import report, scaling_counts, scaling_report

    assert scaling_counts(2) == [1] and scaling_counts(4) == [1, 2] and scaling_counts(6) == [1, 2, 4]
    assert scaling_counts(8) == [1, 2, 4] and scaling_counts(1) == []
    figures = {("together", 4): 701.3, ("turns", 4): 480.0, ("streams", 4): 612.7, ("together", 1): 343.9,
               ("streams", 1): 331.1, ("together", 2): 520.4, ("streams", 2): 0.0}  # fmt: skip
    runs = [{"mode": m, "seats": n, "aggregate_decode_tok_s": v} for (m, n), v in figures.items()]
    lines = scaling_report(runs)
    assert lines == [f"scaling, together: 1 seat 343.9, 2 seats 520.4 ({520.4 / 343.9:.2f}x), 4 seats 701.3 "
                     f"({701.3 / 343.9:.2f}x) tok/s in all (x one seat's)",
                     f"scaling, streams: 1 seat 331.1, 4 seats 612.7 ({612.7 / 331.1:.2f}x) tok/s in all (x one seat's)"]
    assert "(1.51x)" in lines[0] and "(2.04x)" in lines[0] and "(1.85x)" in lines[1]
    talked = [dict(r, all_seats_decode_tok_s=690.0 if (r["mode"], r["seats"]) == ("streams", 4) else None) for r in runs]
    assert scaling_report(talked)[1] == (f"scaling, streams: 1 seat 331.1, 4 seats 612.7 ({612.7 / 331.1:.2f}x; 690.0 while "
                                         f"all 4 talked, {690.0 / 331.1:.2f}x) tok/s in all (x one seat's)")  # fmt: skip
    assert scaling_report([r for r in runs if r["seats"] != 1]) == []
    full = [dict(r, rounds=2, decoded_tokens=10, per_seat_decode_tok_s=[], ttft_ms_median=1, ttft_ms_max=2,
                 rss_start_mb=1, rss_end_mb=2, replies=[[1]]) for r in runs]  # fmt: skip
    text = report(full)
    assert f"together / turns: {701.3 / 480.0:.2f}x" in " ".join(text)  # the N seats' runs, not the smaller counts'
    assert any(line.startswith("together: 1 seat, ") for line in (t.strip() for t in text))


def test_bench_repeats_report_medians_and_each_repetitions_ratio_to_one_seat():
    """repeats_report (--repeat K): per mode and count the median of the repetitions' aggregates and their
    range, and each count's ratio to one seat taken within a repetition (median and range of those),
    checked against numpy here; one repetition reports nothing, and report() then keeps scaling_report."""
    import numpy as np

    from cabinlm.bench.seats import report, repeats_report

    agg = {("together", 4): [600.0, 560.0, 610.0], ("turns", 4): [310.0, 300.0, 330.0], ("streams", 4): [590.0, 0.0, 600.0],
           ("together", 1): [300.0, 250.0, 320.0], ("streams", 1): [280.0, 290.0, 270.0]}  # the CLI's order  # fmt: skip
    runs = [{"mode": m, "seats": n, "aggregate_decode_tok_s": v[r], "repeat": r} for r in range(3) for (m, n), v in agg.items()]
    lines = repeats_report(runs)
    t = [600 / 300, 560 / 250, 610 / 320]  # within each repetition
    s = [590 / 280, 600 / 270]  # the second repetition's 4 seats reported nothing (0.0): no ratio
    assert lines[0].startswith("over 3 repetitions: ")
    assert lines[1] == (f"  together: 1 seat 300.0 [250.0-320.0], 4 seats 600.0 [560.0-610.0] ({np.median(t):.2f}x "
                        f"[{min(t):.2f}-{max(t):.2f}])")  # fmt: skip
    assert lines[2] == "  turns: 4 seats 310.0 [300.0-330.0]"  # no one-seat run in turns: no ratio
    assert lines[3] == f"  streams: 1 seat 280.0 [270.0-290.0], 4 seats 595.0 [590.0-600.0] ({np.median(s):.2f}x [{min(s):.2f}-{max(s):.2f}])"
    assert "(2.00x [1.91-2.24])" in lines[1]  # the median ratio is not the ratio of the medians here (2.00 either way)
    assert repeats_report([r for r in runs if r["repeat"] == 0]) == []
    # while all N seats talked: its own median and range, its ratio to the same repetition's one-seat aggregate
    talked = {0: 650.0, 1: 0.0, 2: 640.0}  # repetition 1 without the figure (None): no ratio from it
    with_full = [dict(r, all_seats_decode_tok_s=(talked[r["repeat"]] or None) if (r["mode"], r["seats"]) == ("streams", 4) else None)
                 for r in runs]  # fmt: skip
    f = [650 / 280, 640 / 270]
    assert repeats_report(with_full)[3] == (lines[3] + f"; while all 4 talked 645.0 [640.0-650.0] ({np.median(f):.2f}x "
                                            f"[{min(f):.2f}-{max(f):.2f}])")  # fmt: skip
    full = [dict(r, rounds=2, decoded_tokens=10, per_seat_decode_tok_s=[], ttft_ms_median=1, ttft_ms_max=2,
                 rss_start_mb=1, rss_end_mb=2, replies=[[1]]) for r in runs]  # fmt: skip
    text = report(full)
    turns = [600 / 310, 560 / 300, 610 / 330]
    assert (f"together / turns: {np.median(turns):.2f}x aggregate decode throughput (median of 3 repetitions, "
            f"{min(turns):.2f}-{max(turns):.2f}); replies identical in together, turns, streams: True") in text  # fmt: skip
    assert lines[1] in text and not any(x.startswith("scaling, ") for x in text)


def test_the_profile_says_which_batches_a_build_carries(load, tiny_llama_dir, export_to, tmp_path):
    """seat_batches in a profile: [3] builds one batched graph, for 3 seats (2 seats then run in it
    with an idle place, 4 as 3 and one alone), every step still each seat's own; [] builds none; the
    Snapdragon and TensorRT profiles say none; a bad value is one error naming the field."""
    from importlib import resources

    from cabinlm.profiles import ProfileError
    from cabinlm.profiles.schema import parse_profile

    text = (resources.files("cabinlm.profiles") / "builtin" / "cpu.toml").read_text()
    assert "seat_batches = [2, 4]" in text
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    (tmp_path / "three.toml").write_text(text.replace("seat_batches = [2, 4]", "seat_batches = [3]"))
    out = build_artifact(art, load_profile(str(tmp_path / "three.toml")), tmp_path / "three")
    m = load_manifest(out)
    assert m.runtime_spec.facts_as(FusedSettings).seat_batches == (3,)
    assert sorted(p.name for p in out.glob("decoder.seats*.onnx")) == ["decoder.seats3.onnx"]
    together, alone = seats(out, 4), seats(out, 4)
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    rng = np.random.default_rng(6)
    step_together(pairs, [rng.integers(3, 300, 3) for _ in pairs], [True] * 4)
    for k in (2, 3, 4, 2, 4, 3) * 5:
        step_together(pairs[:k], [[int(p.last.argmax())] for p in pairs[:k]])
    (tmp_path / "none.toml").write_text(text.replace("seat_batches = [2, 4]", "seat_batches = []"))
    out = build_artifact(art, load_profile(str(tmp_path / "none.toml")), tmp_path / "none")
    assert load_manifest(out).runtime_spec.facts_as(FusedSettings).seat_batches == () and not list(out.glob("decoder.seats*"))
    for name in ("sa8295p", "sa8775p", "orin-x", "thor"):
        assert load_profile(name).seat_batches == ()
    assert cpu_engine(load_profile("sa8775p")).seat_batches == (2, 4)
    for bad in ("[1]", "[4, 2]", "[2, 2]", "[65]", "[true]", "4", '"2,4"'):
        with pytest.raises(ProfileError, match="seat_batches"):
            parse_profile(text.replace("seat_batches = [2, 4]", f"seat_batches = {bad}"), "bad.toml")


def test_the_seat_limit_counts_what_seats_decoding_together_hold_once(build, load, tiny_llama_dir, export_to, tmp_path):
    """runtime.limits.seat_limit: a build with batched graphs holds, beyond its files, what its graphs'
    sessions pack of the weights on ONNX Runtime's matmuls (as the build recorded it: nothing where
    cabinlm's BlockQ4MatMul reads every int4 matrix and head in place; the fp32 matrices and head in
    every graph's) and the idle seat; an export holds neither."""
    from cabinlm.runtime import limits

    m = load_manifest(build)
    extra = limits.together_bytes(m)
    packed = m.runtime_spec.facts_as(FusedSettings).packed_bytes
    assert set(packed) == {"graph", "graph_head", "graph_seats2", "graph_seats4"}
    assert (min(packed.values()) > 0) == (m.weights == "fp32") and (max(packed.values()) > 0) == (m.weights == "fp32")
    assert extra == sum(packed.values()) + limits.seat_bytes(m)
    files = sum(f.bytes for f in m.files.values())
    per_seat = limits.seat_bytes(m)
    assert limits.seat_limit(m, files + extra + 3 * per_seat).seats == 3
    # the idle seat takes one seat's room; packed copies (fp32: more than a seat's) take more
    assert limits.seat_limit(m, files + 3 * per_seat).seats == (1 if m.weights == "fp32" else 2)
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    assert limits.together_bytes(load_manifest(art)) == 0


# The batched step's inputs bound once and its outputs reused: what the earlier cases could not catch.


def test_two_batched_runs_in_one_step_give_each_seat_its_own_logits(build):
    """7 and 8 seats in one step_seats call run the graph for 4 twice, each run's LM head writing the
    logits array bound for 4 rows (seats._head_logits): the first run's seats must keep their logits
    (fails if the second run overwrites them before step_seats reads them), through the window's
    turnover."""
    for n in (8, 7):
        pairs = [Pair(t, a) for t, a in zip(seats(build, n), seats(build, n))]
        rng = np.random.default_rng(n)
        step_together(pairs, [rng.integers(5, 90, 3) for _ in pairs])
        for _ in range(24):  # 3 + 24 tokens: past the 16-slot window
            step_together(pairs, [[int(np.argmax(p.last))] for p in pairs])


@pytest.mark.parametrize("swiglu", [False, True])
def test_block_q4_matmul_prefill_rows_are_one_row_runs_and_the_plain_paths_bits(swiglu, tmp_path):
    """Chunks of 8 rows and more (a prefill chunk's, up to 64): rows go through a tile in groups of 4
    and a rest of 1 to 3. Each row must be its one-row run bit for bit, and this CPU's path the plain
    C++ path's bits (fails if a group size changed a row's arithmetic; tests/test_kernels.py and
    tests/test_arm.py check up to 9 rows)."""
    from test_kernels import _matmul_session, _q4_case

    from cabinlm.engines.ort_fused.block_layouts import block_q4_layout
    from cabinlm.engines.ort_fused.kernels.compiler import compile_library

    libs = {}
    for name, defines in (("native", ()), ("generic", ("CABINLM_GENERIC",))):
        (tmp_path / name).mkdir()
        libs[name] = compile_library(tmp_path / name, defines=defines).path
    K, N = 576, 48
    q, d, m = _q4_case(K, N, seed=7)
    blob = block_q4_layout(q, d, m)
    fast, plain = (_matmul_session(blob, libs[name], swiglu=swiglu) for name in ("native", "generic"))
    rng = np.random.default_rng(8)
    for rows in (8, 9, 12, 15, 16, 21, 64):
        x = (rng.standard_normal((1, rows, K * (2 if swiglu else 1))) * 2).astype(np.float32)
        x[0, rows // 2, :32] = 0.0  # a block of zeros: scale 0
        chunk = fast.run(None, {"x": x})[0]
        steps = np.concatenate([fast.run(None, {"x": x[:, i : i + 1]})[0] for i in range(rows)], axis=1)
        np.testing.assert_array_equal(chunk, steps, err_msg=f"{rows} rows")
        np.testing.assert_array_equal(chunk, plain.run(None, {"x": x})[0], err_msg=f"{rows} rows")
