"""Memory beyond the window (docs/design.md, "The recall region"; runtime/recall.py): the archive of
what left the window, BM25 retrieval, the region refilled before a user turn through the real
dialogue path, --no-recall bit for bit StreamingLLM, sessions that keep the archive (a kill -9 after
a save loses nothing), seats with their own archives, and memory that stays flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.contract.errors import OptionError
from cabinlm.profiles import load_profile
from cabinlm.runtime import Dialogue, open_artifact
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.recall import PIECE_TOKENS, Archive, Message, Recaller, bm25_scores, check_archive_mb, words
from reference import StreamingReference

LAYOUT = dict(sink=4, pinned=28, window=128, chunk=8, kv="fp32")  # the tiny tokenizer: about a token a letter
FACTS = ["my car is parked on level three near the blue pillar", "the garage code is four seven one nine",
         "my daughter Emma has a violin lesson on Friday"]  # fmt: skip
FILLER = ["tell me about the weather today", "what is the traffic like on the highway", "play some quiet music",
          "how long until we arrive home", "is there a charging station nearby", "read me the news headlines",
          "turn the temperature down a little", "what song is this", "call the office later please",
          "remind me to buy some bread"]  # fmt: skip


@pytest.fixture(scope="module")
def artifacts(load, tiny_llama_dir, export_to, tmp_path_factory):
    loaded = load(str(tiny_llama_dir))
    with_region = export_to(loaded, recall=192, **LAYOUT)
    without = export_to(loaded, **LAYOUT)
    fused = build_artifact(with_region, load_profile("cpu"), tmp_path_factory.mktemp("recall") / "fused",
                           attention="fused", accuracy_level=0)  # fmt: skip
    return {"region": with_region, "none": without, "fused": fused}


def dialogue(folder, **kw) -> Dialogue:
    dec, tok = open_artifact(folder, verify=False)
    return Dialogue(dec, tok, max_new_tokens=kw.pop("max_new_tokens", 6), **kw)


def talk(d: Dialogue, turns: list[str]):
    return [d.ask(t) for t in turns]


def recording(d: Dialogue) -> list[np.ndarray]:
    """Every logits array the dialogue's decoder returns from here on."""
    seen: list[np.ndarray] = []
    step = d.decoder._step

    def keep(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out.copy())
        return out

    d.decoder._step = keep
    return seen


SCRIPT = [FACTS[0]] + FILLER + ["where is my car parked?"]


def test_bm25_ranks_the_statement_a_question_asks_about():
    docs = [words(t) for t in FACTS + FILLER]
    scores = bm25_scores(docs, words("where did I park the car?"))
    assert int(np.argmax(scores)) == 0 and scores[0] > 0 and (scores[3:] == 0).all()
    assert (bm25_scores(docs[: len(FACTS)], words("hello")) == 0).all()
    assert (bm25_scores([words("the a")], words("the")) == 0).all()  # stopwords only: no terms


def test_a_pieces_terms_are_made_once_and_let_go_when_it_leaves_the_archive(artifacts):
    """The Recaller decodes each archived piece once: a second turn decodes no archived piece again,
    and a piece dropped from the archive is no longer held."""
    d = dialogue(artifacts["region"])
    rec, tok = d.recaller, d.tok
    archive = Archive(limit_bytes=1 << 20)
    for turn, text in enumerate(FACTS + FILLER, start=1):
        archive.add(Message("user", tok.encode_text(text), turn, turn))
    archive.left_window(10**6, tok)
    decoded = []
    real = tok.decode
    tok.decode = lambda ids: decoded.append(tuple(ids)) or real(ids)
    try:
        first = rec.choose(archive, "where is my car parked?")
        made = len(decoded)
        assert made == sum(-(-len(m.ids) // PIECE_TOKENS) for m in archive.kept if m.turn > 1)
        assert rec.choose(archive, "where is my car parked?") == first and len(decoded) == made
        archive.kept = [m for m in archive.kept if m.turn != 2]
        rec.choose(archive, "where is my car parked?")
        assert len(decoded) == made and not any(key[0] == 2 for key in rec._terms)
    finally:
        tok.decode = real


def test_the_archive_is_bounded_and_keeps_the_opening_exchange(artifacts):
    _, tok = open_artifact(artifacts["region"], verify=False)
    a = Archive(limit_bytes=1400)
    for turn in range(1, 9):
        a.add(Message("user", tok.encode_text(f"message number {turn} " * 3), turn, start=turn * 10))
    a.left_window(oldest=10**6, tokenizer=tok)
    assert a.nbytes <= 1400 and a.dropped > 0 and len(a.kept) > 2
    assert a.kept[0].turn == 1 and [m.turn for m in a.kept] == sorted(m.turn for m in a.kept)
    assert a.kept[-1].turn == 8  # the oldest dropped first
    assert Archive(600).state() == {"kept": [], "live": [], "dropped": 0}
    b = Archive(600)
    b.restore(json.loads(json.dumps(a.state())))
    assert b.state() == a.state()
    for bad in (0, -1, "8", True, float("nan")):
        with pytest.raises(OptionError, match="--recall-archive-mb"):
            check_archive_mb(bad)


def test_the_region_holds_the_opening_request_and_the_relevant_piece(artifacts):
    d = dialogue(artifacts["region"])
    results = talk(d, SCRIPT)
    last = results[-1].recall
    assert last is not None and last["refreshed"] and 0 < last["tokens"] <= 192
    assert 1 in last["turns"]  # the opening request (which is also the fact here)
    region = d.tok.decode(list(d.region.ids))
    assert "Earlier in this conversation" in region and "parked on level three" in region
    assert d.decoder.cache.recall_fill == len(d.region.ids) and d.decoder.cache.evicted > 0
    assert all(m.turn >= 1 for m in d.archive.kept) and d.archive.kept[0].turn == 1
    # a turn whose region would not change costs no prefill
    again = d.ask("where is my car parked?").recall
    assert again["refreshed"] is False and again["prefill_ms"] == 0.0 and again["tokens"] == last["tokens"]
    assert last["retrieval_ms"] > 0 and again["retrieval_ms"] > 0  # the ranking runs every turn, refreshed or not


def test_nothing_relevant_recalls_the_opening_request_only(artifacts):
    d = dialogue(artifacts["region"])
    talk(d, SCRIPT[:-1])
    r = d.ask("zebra xylophone quantum").recall
    assert r["turns"] == [1]
    opening = d.recaller.render("user", d.tok.encode_text(FACTS[0]))
    assert list(d.region.ids) == list(d.recaller.header) + opening


def test_the_regions_kv_are_the_reference_streams(artifacts, load, tiny_llama_dir):
    """The region's K/V in the exported graph's cache are those of a plain reference that feeds the
    sink and pinned tokens, then the recalled text, as one stream (dense while it fits)."""
    d = dialogue(artifacts["region"], system="Be brief.")
    talk(d, SCRIPT)
    c, lay, kv = d.decoder.cache, d.decoder.layout, d.decoder.backend.buffers()
    ref = StreamingReference(load(str(tiny_llama_dir)).model, sink=lay.sink, window=lay.window)
    pinned = d.template.start(d.system)
    assert lay.sink < len(pinned) == c.sink_fill + c.pinned_fill
    ref.feed(pinned, pin=True)
    ref.begin_recall()
    ids = list(d.region.ids)
    for a in range(0, len(ids), lay.chunk):
        ref.feed(ids[a : a + lay.chunk], recall=True)
    region = [e for e in ref.entries if e[0] in ref.recalled]
    slots = np.arange(lay.recall_start, lay.recall_start + c.recall_fill)
    for layer in range(lay.layers):
        want_k = np.stack([e[2][layer][0].numpy() for e in region], axis=1)  # (kv_heads, r, head_dim)
        want_v = np.stack([e[2][layer][1].numpy() for e in region], axis=1)
        assert np.abs(kv["keys"][layer][:, slots] - want_k).max() < 1e-4
        assert np.abs(kv["values"][layer][:, slots] - want_v).max() < 1e-4


@pytest.mark.parametrize("engine", ["region", "fused"])
def test_no_recall_is_streamingllm_bit_for_bit(artifacts, engine, tmp_path_factory):
    """--no-recall on an artifact with a region: every logit of a dialogue through hundreds of
    evictions equals the artifact without a region's, bit for bit (the region's 192 slots shift the
    window by whole 16-lane blocks), on the exported graph and the fused cpu build."""
    if engine == "fused":
        plain = build_artifact(artifacts["none"], load_profile("cpu"), tmp_path_factory.mktemp("plain") / "fused",
                               attention="fused", accuracy_level=0)  # fmt: skip
    else:
        plain = artifacts["none"]
    off, base = dialogue(artifacts[engine], recall=False), dialogue(plain)
    got, want = recording(off), recording(base)
    a, b = talk(off, SCRIPT * 3), talk(base, SCRIPT * 3)
    assert off.decoder.cache.evicted > 4 * LAYOUT["window"]
    assert [r.reply for r in a] == [r.reply for r in b] and all(r.recall is None for r in a)
    assert len(got) == len(want) and all(np.array_equal(x, y) for x, y in zip(got, want))
    assert off.decoder.cache.recall_fill == 0 and not off.archive.kept


def test_the_fused_build_recalls_as_the_exported_graph_does(artifacts):
    graph, fused = dialogue(artifacts["region"]), dialogue(artifacts["fused"])
    got, want = recording(fused), recording(graph)
    a, b = talk(fused, SCRIPT), talk(graph, SCRIPT)
    assert [r.recall["turns"] for r in a if r.recall] == [r.recall["turns"] for r in b if r.recall]
    assert max(float(np.abs(x - y).max()) for x, y in zip(got, want)) < 2e-3


def test_seats_keep_their_own_archives(artifacts):
    dec, tok = open_artifact(artifacts["region"], verify=False)
    one = Dialogue(dec, tok, max_new_tokens=6)
    two = Dialogue(dec.seat(), tok, max_new_tokens=6)
    talk(one, [FACTS[0]] + FILLER)
    talk(two, [FACTS[1]] + FILLER)
    assert one.archive.kept[0].text.startswith("my car") and two.archive.kept[0].text.startswith("the garage")
    r1, r2 = one.ask("where is my car?"), two.ask("what is the garage code?")
    assert "level three" in tok.decode(list(one.region.ids)) and "garage" not in tok.decode(list(one.region.ids))
    assert "four seven" in tok.decode(list(two.region.ids)) and "level three" not in tok.decode(list(two.region.ids))
    assert r1.recall["turns"][0] == 1 and r2.recall["turns"][0] == 1


def child(artifact, session, turns) -> dict:
    code = Path(__file__).parent / "session_child.py"
    out = subprocess.run([sys.executable, str(code), str(artifact), str(session), "0", json.dumps(turns)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_session_keeps_the_archive_across_a_kill(artifacts, tmp_path):
    """A session file carries the archive and the region: a process killed (SIGKILL) after a turn's save
    resumes with every archived message, and the next replies are the uninterrupted dialogue's."""
    from cabinlm.runtime.persist import load_session, save_session

    whole = child(artifacts["region"], tmp_path / "whole", SCRIPT)["replies"]
    session = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "session_child.py"), str(artifacts["region"]),
                             str(session), "0", json.dumps(SCRIPT[:-2])], stdout=subprocess.PIPE, text=True)  # fmt: skip
    proc.communicate(timeout=120)  # every turn saved; now the process is gone as a kill would leave it
    assert proc.returncode == 0
    resumed = child(artifacts["region"], session, SCRIPT)
    assert resumed["resumed_at"] == len(SCRIPT) - 2 and resumed["replies"] == whole[-2:]
    d = dialogue(artifacts["region"])
    load_session(session, d)
    assert d.archive.kept and d.archive.kept[0].turn == 1 and d.region.ids
    kept = d.archive.state()
    save_session(tmp_path / "again", d)
    e = dialogue(artifacts["region"])
    load_session(tmp_path / "again", e)
    assert e.archive.state() == kept and e.region == d.region


def test_a_session_killed_mid_turn_keeps_what_was_saved(artifacts, tmp_path):
    """SIGKILL while a turn runs: the file is the last turn's, archive included."""
    import os
    import signal
    import time

    session = tmp_path / "s"
    child(artifacts["region"], session, SCRIPT[:8])
    size = session.stat().st_size
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "session_child.py"), str(artifacts["region"]),
                             str(session), "0", json.dumps(SCRIPT * 50)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(4)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    d = dialogue(artifacts["region"])
    from cabinlm.runtime.persist import load_session

    load_session(session, d)
    assert d.turns >= 8 and d.archive.kept[0].turn == 1 and session.stat().st_size >= size


@pytest.mark.slow
def test_memory_stays_flat_with_recall_refreshing(artifacts):
    """Hundreds of turns with the region refreshed: the process's resident memory stops growing (the
    archive is bounded, the region's slots fixed)."""
    from cabinlm.runtime.memory import rss_mb

    d = dialogue(artifacts["fused"], archive_mb=0.05)
    rss = []
    for i in range(300):
        r = d.ask(SCRIPT[i % len(SCRIPT)] + f" {i}")
        rss.append(r.rss_mb)
    assert d.archive.dropped > 0 and d.archive.nbytes <= 0.05 * 2**20
    assert max(rss[150:]) - max(rss[50:150]) < 3.0, (rss[50], rss[150], rss[-1])
    assert rss_mb() > 0


def test_bad_options_are_refused_in_one_line(artifacts):
    from cabinlm.runtime.assembly import RuntimeConfig

    with pytest.raises(OptionError, match="--recall-archive-mb"):
        RuntimeConfig(artifacts["region"], recall_archive_mb=0)
    with pytest.raises(OptionError, match="recall must be true or false"):
        RuntimeConfig(artifacts["region"], recall="yes")


def test_the_recall_command_refuses_bad_input_in_one_line(artifacts, tmp_path):
    from test_cli import assert_clean_error, cabinlm

    good = '{"statement": "s", "question": "q?", "choices": ["a", "b"], "answer": "a"}'
    cases = {
        "not JSON": "{broken",
        "not among its choices": good.replace('"answer": "a"', '"answer": "c"'),
        "exactly the keys": '{"statement": "s"}',
        "2 distinct": good.replace('["a", "b"]', '["a", "a"]'),
    }
    for word, text in cases.items():
        facts = tmp_path / "facts.jsonl"
        facts.write_text(good + "\n" + text + "\n")
        assert_clean_error(cabinlm("recall", artifacts["region"], "--facts", facts), word, "line 2")
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    assert_clean_error(cabinlm("recall", artifacts["region"], "--filler", short, "--distances", "500"), "longer filler")
    assert_clean_error(cabinlm("recall", artifacts["region"], "--distances", "2000,x"), "--distances")
    assert_clean_error(cabinlm("recall", artifacts["region"], "--records", tmp_path / "no" / "r.jsonl"), "--records")
    assert_clean_error(cabinlm("recall", artifacts["region"], "--lead", "-1"), "--lead")


def test_the_default_filler_reaches_every_distance(artifacts, tmp_path):
    """The shipped prose is cycled through, so the default distances (up to 32000 tokens) are reached;
    a given --filler is not cycled and must hold the largest distance itself."""
    from cabinlm.bench.recall import DEFAULT_DISTANCES, DEFAULT_FILLER, filler_messages, parse_distances
    from cabinlm.contract.errors import InputError

    _, tok = open_artifact(artifacts["region"], verify=False)
    far = parse_distances(DEFAULT_DISTANCES)
    assert DEFAULT_FILLER.is_file() and max(far) == 32000
    pieces = filler_messages(tok, DEFAULT_FILLER, far, 128, cycle=True)
    assert len(pieces) > 10
    with pytest.raises(InputError, match="longer filler"):
        filler_messages(tok, DEFAULT_FILLER, [10**6], 128)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(InputError, match="no text"):
        filler_messages(tok, empty, [10], 128, cycle=True)


def test_the_recall_command_runs_both_ways(artifacts, tmp_path):
    from test_cli import cabinlm

    facts = tmp_path / "facts.jsonl"
    facts.write_text(json.dumps({"statement": FACTS[0], "question": "where is my car parked?",
                                 "choices": ["level three", "level one"], "answer": "level three"}) + "\n")  # fmt: skip
    filler = tmp_path / "filler.txt"
    filler.write_text(" ".join(FILLER) * 20)
    records = tmp_path / "recall.jsonl"
    out = cabinlm("recall", artifacts["region"], "--facts", facts, "--filler", filler, "--distances", "300", "--lead",
                  "1", "--records", records, "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert [(r["distance"], r["recall"], r["trials"], r["lead"]) for r in results] == [(300, True, 1, 1), (300, False, 1, 1)]
    assert results[0]["recall_ms_per_turn"] > 0 and results[1]["recall_ms_per_turn"] == 0
    assert results[1]["held"] == 0  # without recall the region holds nothing
    assert results[0]["retrieval_ms_per_turn"] > 0 and results[1]["retrieval_ms_per_turn"] == 0
    from cabinlm.bench.records import read

    kept = read(records)
    assert [(r.tool, r.params["distance"], r.params["recall"]) for r in kept] == [("cabinlm recall", 300, True),
                                                                                ("cabinlm recall", 300, False)]  # fmt: skip
    assert kept[0].figures["accuracy"] == results[0]["accuracy"]


def test_perplexity_refills_the_region_from_the_evicted_text(artifacts, tmp_path):
    """A text stream (no turns): without a TextRecall the region stays empty and every NLL is the
    artifact without a region's, bit for bit; with one, the region is refilled every N tokens with
    whole pieces of the evicted text (stream order), and every NLL before the first refill is the
    same. `cabinlm perplexity --no-recall` and the default both run; a bad --recall-every is one line."""
    from cabinlm.runtime import stream_perplexity
    from cabinlm.runtime.recall import PIECE_TOKENS, TextRecall
    from test_cli import assert_clean_error, cabinlm

    text = " ".join(SCRIPT * 8)
    dec, tok = open_artifact(artifacts["region"], verify=False)
    plain, _ = open_artifact(artifacts["none"], verify=False)
    ids = tok.encode(text, add_special_tokens=True)[:900]
    off = stream_perplexity(dec, ids)
    assert np.array_equal(off.nll, stream_perplexity(plain, ids).nll) and off.refreshes == 0
    chosen = []
    recall = TextRecall(tok, dec.layout.recall, every=64)
    keep = recall.choose
    recall.choose = lambda evicted, recent: chosen.append((len(evicted), keep(evicted, recent))) or chosen[-1][1]
    on = stream_perplexity(dec, ids, recall=recall)
    assert on.refreshes > 3 and dec.cache.recall_fill > 0
    first = 64 * next(k for k, (n, c) in enumerate(chosen, 1) if c)  # the step before which the first refill came
    assert np.array_equal(on.nll[:first], off.nll[:first]) and not np.array_equal(on.nll, off.nll)
    ids_arr = np.asarray(ids)
    for n, region in chosen:
        assert len(region) % PIECE_TOKENS == 0 and len(region) <= dec.layout.recall
        for a in range(0, len(region), PIECE_TOKENS):  # each piece is a whole piece of the evicted text
            piece = np.asarray(region[a : a + PIECE_TOKENS])
            starts = [s for s in range(LAYOUT["sink"], LAYOUT["sink"] + n, PIECE_TOKENS)
                      if np.array_equal(ids_arr[s : s + PIECE_TOKENS], piece)]  # fmt: skip
            assert starts, (n, a)
    body = tmp_path / "text.txt"
    body.write_text(text)
    for extra in ((), ("--no-recall",)):
        out = cabinlm("perplexity", artifacts["region"], "--text", body, "--max-tokens", "600", "--json", *extra)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert (got["recall_refreshes"] > 0) == (not extra)
    with pytest.raises(OptionError, match="--recall-every"):
        TextRecall(tok, 192, every=0)
    assert_clean_error(cabinlm("perplexity", artifacts["region"], "--text", body, "--recall-every", "0"), "recall-every")
