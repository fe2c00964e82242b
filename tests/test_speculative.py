"""Speculative decoding by prompt lookup (runtime/speculative.py; the reply loop, runtime/reply.py):
greedy output token for token the same as plain decoding, on every backend with a chunk path,
through eviction, pins, seats and session save / restore (the fused cpu build drafting after the
window has turned over too, its verified rows being one-token steps); a rejected draft leaves the cache as if it was never drafted; sampling
keeps the model's distribution (the acceptance rule, checked against the exact distribution)."""

from __future__ import annotations

import numpy as np
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, Dialogue, open_artifact
from cabinlm.runtime.persist import load_session, save_session
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.speculative import DraftLength, PromptLookup, PromptLookupDrafting

LAYOUT = dict(sink=4, pinned=28, window=48, chunk=8)
TURNS = ["check the route and the weather", "check the route and the weather again", "play some music",
         "how far is it to the charging station", "check the route", "thanks, check the route and the weather"]  # fmt: skip


@pytest.fixture(scope="module")
def artifacts(load, tiny_qwen2_dir, export_to, tmp_path_factory):
    art = export_to(load(str(tiny_qwen2_dir)), kv="int8", **LAYOUT)
    fused = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("spec") / "fused", attention="fused")
    return {"onnxruntime-graph": art, "onnxruntime-fused": fused}


def test_prompt_lookup_drafts_what_followed_the_longest_matching_suffix():
    lookup = PromptLookup(capacity=64)
    lookup.observe([5, 6, 7, 8, 9, 1, 2, 6, 7])
    assert lookup.draft(3) == [8, 9, 1]  # "6 7" was followed by 8 9 1
    lookup.observe([3])
    assert lookup.draft(3) == []  # "3" never seen before
    lookup.observe([5, 6, 7, 4, 6, 7])
    assert lookup.draft(2) == [4, 6]  # no earlier "4 6 7"; the latest earlier "6 7" was followed by 4 6
    assert PromptLookup().draft(4) == []


def test_prompt_lookup_memory_is_bounded():
    lookup = PromptLookup(capacity=100)
    lookup.observe(np.random.default_rng(0).integers(0, 50, 5000))
    assert len(lookup.tokens) <= 200 and len(lookup._ends) <= 3 * 200


def test_the_draft_length_grows_falls_and_pauses():
    d = DraftLength(longest=8, start=4, patience=2)
    d.update(4, 4)
    assert d.next() == 6
    d.update(6, 2)
    assert d.next() == 3
    d.update(3, 0)
    d.update(1, 0)  # two verifications in a row accepted nothing: drafting pauses
    assert [d.next() for _ in range(9)] == [0] * 8 + [1]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("draft", [0, 3, 5])
def test_the_acceptance_rule_keeps_the_distribution(temperature, top_p, draft):
    """Whatever the draft, the token that comes out of accept_draft is distributed as the sampler's
    own distribution (chi-square against the exact probabilities, 20,000 draws)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    s = Sampler(temperature=temperature, top_p=top_p, seed=11)
    p = s.probs(logits)
    n = 20_000
    counts = np.bincount([s.accept_draft(logits, draft)[1] for _ in range(n)], minlength=len(p))
    live = p > 0
    assert (counts[~live] == 0).all()  # never a token the sampler excludes (top-p)
    chi2 = (((counts[live] - n * p[live]) ** 2) / (n * p[live])).sum()
    assert chi2 < 25.0, (chi2, counts / n, p)  # dof <= 5: p-value ~1e-4 at 25


def dialogues(folder, spec: bool, seats: int = 1):
    dec, tok = open_artifact(folder, verify=False)
    decs = [dec] + [dec.seat() for _ in range(seats - 1)]
    return [Dialogue(d, tok, system="Answer briefly.", max_new_tokens=24, drafting=PromptLookupDrafting() if spec else None)
            for d in decs]  # fmt: skip


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_greedy_speculative_replies_are_the_plain_replies_through_eviction_seats_and_sessions(backend, artifacts, tmp_path):
    folder = artifacts[backend]
    (plain,) = dialogues(folder, spec=False)
    expected = [plain.ask(t).reply for t in TURNS * 3]
    assert plain.decoder.cache.evicted > 2 * LAYOUT["window"]  # far past the window

    a, b = dialogues(folder, spec=True, seats=2)  # two seats on one model, interleaved
    got_a, got_b = [], []
    results, turned = [], []
    for i, t in enumerate(TURNS * 3):
        turned.append(a.decoder.cache.evicted > 0)
        r = a.ask(t)
        results.append(r)
        got_a.append(r.reply)
        got_b.append(b.ask(t).reply)
        if i == 7:  # save seat a, and go on from the file in a fresh process's place
            save_session(tmp_path / "a.ses", a)
            (a,) = dialogues(folder, spec=True)
            load_session(tmp_path / "a.ses", a)
    assert got_a == expected and got_b == expected
    drafted, accepted = sum(r.drafted_tokens for r in results), sum(r.accepted_tokens for r in results)
    assert drafted > 0 and 0 < accepted <= drafted  # drafts were made, some accepted, some not
    # after the window has turned over: the fused build goes on drafting (its rows run as one-token
    # steps); the exported graph stops (its chunks see the cache as it was before them)
    late = [r for r, t in zip(results, turned) if t]
    assert len(late) > len(results) // 2
    if backend == "onnxruntime-fused":
        assert sum(r.drafted_tokens for r in late) > 0 and sum(r.accepted_tokens for r in late) > 0
    else:
        assert sum(r.drafted_tokens for r in late) == 0


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_a_rejected_draft_leaves_the_cache_as_if_it_was_never_drafted(backend, artifacts):
    """verify([t, drafts]) that keeps only t: two decoders given different rejected drafts (of the
    same length) end with the same slot table and the same bytes in every slot in use and in the
    sink / pinned keys' sources, so a rejected draft leaves no trace; and both match a decoder that
    stepped t alone: its table, and on the fused build (rows as one-token steps, after the window's
    turnover too) its logits and every slot's bytes exactly; on the exported graph its logits to
    rounding and its K/V within one int8 step (another kernel path)."""
    exact = backend == "onnxruntime-fused"
    folder = artifacts[backend]
    ref, a, b = Decoder(folder), Decoder(folder), Decoder(folder)
    rng = np.random.default_rng(3)
    system = rng.integers(3, 300, 10)
    for d in (ref, a, b):
        d.feed(system, pin=True)
    for step in range(120):
        t = int(rng.integers(3, 300))
        n = int(rng.integers(1, LAYOUT["chunk"]))
        want = ref.step(np.array([t]))[0]
        rows, kept = a.verify(np.array([t, *rng.integers(3, 300, n)]), lambda logits: 1)
        b.verify(np.array([t, *rng.integers(3, 300, n)]), lambda logits: 1)
        assert kept == 1
        if exact:
            np.testing.assert_array_equal(rows[0], want, err_msg=f"step {step}")
        else:
            np.testing.assert_allclose(rows[0], want, atol=2e-2)  # row 0: the plain step's logits
        sa, sb, sr = a.cache.state(), b.cache.state(), ref.cache.state()
        assert sa.counters() == sb.counters() == sr.counters()
        assert (sa.slot_token == sb.slot_token).all() and (sa.slot_token == sr.slot_token).all()
        used = np.flatnonzero(sa.slot_token >= 0)
        for name, buf in a.backend.buffers().items():
            other, plain = b.backend.buffers()[name], ref.backend.buffers()[name]
            if name == "key_source":
                np.testing.assert_array_equal(buf, other)
                continue
            np.testing.assert_array_equal(buf[:, :, used], other[:, :, used], err_msg=f"{name} after step {step}")
            if exact:
                np.testing.assert_array_equal(buf[:, :, used], plain[:, :, used], err_msg=f"{name} after step {step}")
            diff = np.abs(buf[:, :, used].astype(np.float32) - plain[:, :, used].astype(np.float32)).max()
            assert diff <= 1.0, (name, step, diff)
    assert a.cache.evicted > LAYOUT["window"]  # the rejected rows landed in empty slots, then in scratch rows


def test_chat_drafts_by_default_only_where_rows_are_steps(artifacts):
    from cabinlm.runtime.speculative import drafting_by_default

    assert drafting_by_default(Decoder(artifacts["onnxruntime-fused"]).backend) == (True, "")
    on, why = drafting_by_default(Decoder(artifacts["onnxruntime-graph"]).backend)
    assert not on and "rounding" in why


def test_smollm2_fused_chunk_rows_are_its_steps_bit_for_bit(smollm2_fused):
    """What lets chat and bench draft by default on the fused cpu build (Backend.rows_match_steps):
    on the real model, int8 activations and int8 KV, the rows of a verification chunk give exactly
    the logits of one-token steps over the same tokens; an unbuilt export's graph does not promise it."""
    from cabinlm.runtime.speculative import drafting_by_default

    rng = np.random.default_rng(0)
    steps, chunks = Decoder(smollm2_fused), Decoder(smollm2_fused)
    assert drafting_by_default(steps.backend) == (True, "")
    prompt = rng.integers(100, 20000, size=20)
    steps.feed(prompt)
    chunks.feed(prompt)
    for _ in range(15):  # 20 + 75 tokens: no eviction (none may happen inside a chunk)
        ids = rng.integers(100, 20000, size=5)
        one = np.stack([steps.step(ids[i : i + 1])[0].copy() for i in range(5)])
        rows, kept = chunks.verify(ids, lambda logits: 5)
        assert kept == 5 and np.array_equal(rows, one)


def test_smollm2_fused_chunk_rows_are_its_steps_after_the_window_turns_over(smollm2_fused):
    """Drafting for the whole dialogue (Backend.verifies_after_turnover): on the real model, with a
    pinned system prompt and the window turning over again and again, every row of a verification
    chunk is bit for bit the logits of the one-token step it stands for, and a chunk that keeps only
    its first k rows leaves every slot in use, and the sink / pinned keys' sources, byte for byte as
    k plain steps do (the rest then stepped one by one)."""
    rng = np.random.default_rng(1)
    steps, chunks = Decoder(smollm2_fused), Decoder(smollm2_fused)
    assert chunks.backend.verifies_after_turnover
    system, prompt = rng.integers(100, 20000, size=30), rng.integers(100, 20000, size=260)
    for d in (steps, chunks):
        d.feed(system, pin=True)
        d.feed(prompt)  # the window (252) is full: from here every token evicts
    assert chunks.draft_room() == chunks.layout.chunk - 1
    for it in range(40):
        n = int(rng.integers(2, 9))
        ids = rng.integers(100, 20000, size=n)
        one = np.stack([steps.step(ids[i : i + 1])[0].copy() for i in range(n)])
        k = n if it % 3 == 0 else int(rng.integers(1, n))
        rows, kept = chunks.verify(ids, lambda logits: k)
        assert kept == k and np.array_equal(rows, one), it
        for i in range(k, n):  # the rejected rows, stepped plainly
            chunks.step(ids[i : i + 1])
        sa, sb = steps.cache.state(), chunks.cache.state()
        assert sa.counters() == sb.counters() and (sa.slot_token == sb.slot_token).all()
        used = np.flatnonzero(sa.slot_token >= 0)
        for name, buf in steps.backend.buffers().items():
            other = chunks.backend.buffers()[name]
            if name != "key_source":
                buf, other = buf[:, :, used], other[:, :, used]
            np.testing.assert_array_equal(buf, other, err_msg=f"{name} after chunk {it}")
    assert steps.cache.evicted > 150


def test_chat_replies_are_the_same_with_and_without_speculation(artifacts):
    import json
    import subprocess
    import sys

    stdin = "\n".join(TURNS) + "\n"
    runs = {}
    for flag in ("--speculative", "--no-speculative"):
        p = subprocess.run([sys.executable, "-m", "cabinlm", "chat", str(artifacts["onnxruntime-fused"]), "--json",
                            "--max-new-tokens", "24", flag], input=stdin, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stderr
        runs[flag] = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["reply"] for r in runs["--speculative"]] == [r["reply"] for r in runs["--no-speculative"]]
    assert sum(r["drafted_tokens"] for r in runs["--speculative"]) > 0
    assert sum(r["drafted_tokens"] for r in runs["--no-speculative"]) == 0


class WrongDrafts(PromptLookupDrafting):
    """A strategy the reply loop has never seen: drafts as many tokens as it may, all made up (every
    verification rejects most of them)."""

    def propose(self, dec):
        k = min(3, dec.draft_room())
        return [int(t) for t in np.random.default_rng(len(self.lookup.tokens)).integers(3, 300, k)] if k > 0 else []


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_the_reply_loop_gives_the_plain_replies_with_any_drafting_strategy(backend, artifacts):
    """The loop is given its strategy: plain decoding (PlainDecoding, drafts nothing), prompt lookup,
    or one that drafts nonsense give the same greedy replies, the rejected drafts leaving no trace."""
    from cabinlm.runtime.speculative import PlainDecoding

    dec, tok = open_artifact(artifacts[backend], verify=False)
    replies = {}
    for name, drafting in (("plain", PlainDecoding()), ("wrong", WrongDrafts()), ("lookup", PromptLookupDrafting())):
        d = Dialogue(dec, tok, system="Answer briefly.", max_new_tokens=24, drafting=drafting)
        replies[name] = [d.ask(t).reply for t in TURNS * 2]
        assert (drafting.drafted > 0) == (name != "plain"), name
    assert replies["wrong"] == replies["plain"] == replies["lookup"]


def test_a_paused_strategy_drafts_nothing_but_still_learns_the_stream(artifacts):
    dec = Decoder(artifacts["onnxruntime-fused"])
    dec.feed(np.arange(3, 20))
    drafting = PromptLookupDrafting()
    drafting.observe([5, 6, 7, 8, 5, 6])
    assert list(drafting.propose(dec)) == [7, 8, 5, 6]
    with drafting.paused():
        assert not drafting.propose(dec)
        drafting.observe([9, 5, 6])
    assert drafting.lookup.tokens[-3:] == [9, 5, 6] and list(drafting.propose(dec))[:1] == [9]


def test_a_build_whose_chunks_are_not_its_steps_never_drafts(load, tiny_qwen2_dir, export_to):
    """Exactness is the backend's property, not its kind: the exported graph with fp8 KV attends to
    a chunk's own K/V unquantized (Backend.verifies_drafts is False), so no draft is ever verified
    there, even when drafting is asked for, and it is off by default with that reason."""
    from cabinlm.runtime.speculative import drafting_by_default

    art = export_to(load(str(tiny_qwen2_dir)), kv="fp8", **LAYOUT)
    dec, tok = open_artifact(art, verify=False)
    assert not dec.backend.verifies_drafts and dec.draft_room() == 0
    on, why = drafting_by_default(dec.backend)
    assert not on and "precision the cache does not keep" in why
    d = Dialogue(dec, tok, max_new_tokens=24, drafting=PromptLookupDrafting())
    assert sum(d.ask(t).drafted_tokens for t in TURNS) == 0
    int8 = Decoder(export_to(load(str(tiny_qwen2_dir)), kv="int8", **LAYOUT))
    assert int8.backend.verifies_drafts and int8.draft_room() == LAYOUT["chunk"] - 1


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_a_backend_reads_the_plan_never_the_slot_table(backend, artifacts):
    """Every fact of the table a step needs comes with its plan: after a stream of pins, chunks,
    verifications and hundreds of evictions, nothing of the backend (its rotated keys included)
    holds the Decoder's slot table; only the Decoder does."""
    import gc

    dec = Decoder(artifacts[backend])
    rng = np.random.default_rng(5)
    dec.feed(np.arange(3, 13), pin=True)
    for step in range(150):
        if step == 40:
            dec.feed(rng.integers(3, 300, 5), pin=True)
        ids = rng.integers(3, 300, int(rng.integers(1, LAYOUT["chunk"] + 1)))
        dec.step(ids)
        dec.verify(ids[:3], lambda logits: 1)
    assert dec.cache.evicted > 5 * LAYOUT["window"]
    holders = [r for r in gc.get_referrers(dec.cache) if r is not dec and r is not dec.__dict__]
    assert holders == [], [type(h).__name__ for h in holders]
