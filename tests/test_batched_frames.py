"""Seats with camera frames decoding together: a vision-language model exported with fp32
KV and built for the cpu with cabinlm's attention kernel (FloatKVAttention, the int8 kernel's
arithmetic over a float32 cache) carries batched graphs, each seat's image rows its own
(graph.fused_model(seats=B)); the image region's keys are re-written at positions + E by the runtime
before a step (frames.FrameKeys.refresh_image), for a seat alone and in a batched run alike. A
frame's own chunks ride too (runtime.seats_together with the seat's embeddings, as serve's scheduler
runs them); the seats' text steps ride together whatever frame each holds.

Two models: a LLaVA-style one (SigLIP tower, Llama text model, ranks of one component) and Qwen2-VL
(multimodal RoPE: three components per key). The first cases check the build and that its one-seat
steps are right (the exported graph's logits, with frames replaced while the window evicts: the
bit-for-bit cases after them could not catch a wrong rotation that seats alone and together share).
The others compare seats stepping together with their twins stepping alone, bit for bit, with
different frames and fills, a frame replaced in one seat while the others ride, pins, seats joining
and leaving, a seat's session saved and restored into another loaded model, and serve's scheduler's
threads (greedy replies). Last, fp32 text models on the same kernel, which the frames build on."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.engines.ort_fused import kernels
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.manifest import load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, step_seats
from cabinlm.runtime.perplexity import feed_frame

from seat_threads import turns_in_threads
from vlm_checks import TEXT, picture

LAYOUTS = {"llava": dict(sink=4, pinned=12, window=32, chunk=16), "qwen2_vl": dict(sink=4, pinned=12, window=32, chunk=16)}
PICTURES = {"llava": (64, 48), "qwen2_vl": (32, 24)}


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def vlm(request, load, export_to, tmp_path_factory):
    """(name, loaded, exported folder, fp32-KV cpu build on cabinlm's attention kernel)."""
    if request.param == "llava":
        from conftest import make_tiny_llava

        loaded = load(str(make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-seats"), "siglip")))
    else:
        loaded = load(str(request.getfixturevalue("tiny_qwen2_vl_dir")))
    art = export_to(loaded, kv="fp32", **LAYOUTS[request.param])
    built = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("frames-seats") / "build", attention_kernel="cabinlm")
    return request.param, loaded, art, built


def text_ids(loaded) -> list[int]:
    return loaded.tokenizer.backend_tokenizer.encode(TEXT * 3, add_special_tokens=False).ids


def frames_of(vlm, dec: Decoder, seeds) -> list[np.ndarray]:
    return [dec.vision.encode(picture(*PICTURES[vlm[0]], seed=s)) for s in seeds]


def test_the_build_takes_the_float_kernel_and_its_batched_graphs_take_each_seats_image_rows(vlm):
    _, _, _, built = vlm
    m = load_manifest(built)
    facts = m.runtime_spec.facts_as(FusedSettings)
    assert facts.attention_kernel == "cabinlm" and facts.step_rows and facts.seat_batches == (2, 4)
    assert m.cache.kv_dtype.value == "fp32" and m.vision is not None
    solo = onnx.load(str(built / m.files["graph"].path), load_external_data=False)
    assert {n.op_type for n in solo.graph.node} >= {kernels.FLOAT_ATTENTION_OP}
    assert "GroupQueryAttention" not in {n.op_type for n in solo.graph.node} and "rotate_graph" not in m.files
    four = onnx.load(str(built / m.files["graph_seats4"].path), load_external_data=False)
    ops = [n.op_type for n in four.graph.node]
    assert ops.count(kernels.FLOAT_SEATS_ATTENTION_OP) == m.cache.layers
    names = {i.name for i in four.graph.input}
    assert {f"image_embeds.seat{s}" for s in range(4)} | {f"image_mask.seat{s}" for s in range(4)} <= names
    dec = Decoder(built)
    assert dec.backend.seat_batches == (2, 4) and not dec.backend.verifies_after_turnover


def test_one_seat_with_frames_replaced_while_the_window_evicts_gives_the_exported_graphs_logits(vlm):
    """The float kernel build alone against the exported graph (which rotates its un-rotated cache at
    the rule's positions every step): frames replaced while text fed after the old one is still cached,
    one-token steps and chunks, the window turning over. A wrong turn of the image rows or the window
    keys moves the logits by far more than the tolerance (test_fused_vlm: > 1e-2)."""
    _, loaded, art, built = vlm
    decs = [Decoder(art), Decoder(built)]
    text = text_ids(loaded)
    frames = frames_of(vlm, decs[0], range(3))
    worst = 0.0
    for d in decs:
        d.feed(text[:2])
    window = LAYOUTS[vlm[0]]["window"]
    for i in range(5):
        for d in decs:
            feed_frame(d, frames[i % 3])
        start = (i * 13) % 60
        # the last frame stays while more than a window of text follows it: the window tokens evicted
        # are then newer than the frame, and its keys' positions + E move on at every step
        chunks = [text[start + k : start + k + 1] for k in range(10)] + [text[start + 10 : start + 26]] * (1 if i < 4 else 5)
        for chunk in chunks:
            got = [d.feed(chunk, all_logits=True) for d in decs]
            worst = max(worst, float(np.abs(got[1] - got[0]).max()))
    assert decs[1].cache.frames == 5 and decs[1].cache.evicted > 3 * window
    assert worst < 1e-4, worst


class Pair:
    """The same seat twice on one loaded model: `together` steps with other seats (step_seats),
    `alone` on its own (Decoder.step); frames are fed to both alone (Decoder.feed)."""

    def __init__(self, together: Decoder, alone: Decoder):
        self.together, self.alone = together, alone
        self.last: np.ndarray | None = None

    def frame(self, rows: np.ndarray) -> None:
        for d in (self.together, self.alone):
            feed_frame(d, rows)
        self.last = self.alone.step(np.asarray(text_after_frame, np.int64), logits="last")[-1]
        np.testing.assert_array_equal(self.together.step(np.asarray(text_after_frame, np.int64), logits="last")[-1], self.last)


text_after_frame = [11, 12]  # a short text chunk after each frame, fed alone by both twins


def step_together(pairs: list[Pair], chunks, pins=None) -> None:
    """One step of these pairs' `together` seats in one step_seats call, each `alone` twin on its own:
    every seat's logits must be its twin's, bit for bit."""
    pins = pins or [False] * len(pairs)
    got = step_seats([p.together for p in pairs], chunks, pins)
    for p, g, chunk, pin in zip(pairs, got, chunks, pins, strict=True):
        want = p.alone.step(np.asarray(chunk, np.int64), pin=pin, logits="last")[-1]
        np.testing.assert_array_equal(g, want)
        p.last = want


def greedy(pairs: list[Pair]) -> list[list[int]]:
    return [[int(p.last.argmax())] for p in pairs]


def seats(built, n: int) -> list[Decoder]:
    first = Decoder(built)
    return [first] + [first.seat() for _ in range(n - 1)]


def test_four_seats_with_different_frames_decode_together_as_each_alone(vlm):
    """Four seats: two holding different frames, one the first's frame at another fill (more text
    before it), one text only; pinned system prompts and prompts of different lengths, then greedy
    decoding together while the window turns over, one seat's frame replaced (fed alone) while the
    other three ride, and decoding on. Every step's logits are the seat's own, bit for bit, hence the
    greedy replies; the caches end as their twins'."""
    _, loaded, _, built = vlm
    pairs = [Pair(t, a) for t, a in zip(seats(built, 4), seats(built, 4))]
    frames = frames_of(vlm, pairs[0].alone, (21, 22, 23))
    rng = np.random.default_rng(5)
    step_together(pairs, [rng.integers(3, 200, 2 + i) for i in range(4)], [True] * 4)  # system prompts, pinned
    step_together(pairs[3:], [rng.integers(3, 200, 9)])  # seat 3: more text before its frame
    for p, rows in zip(pairs[:3], (frames[0], frames[1], frames[0])):
        p.frame(rows)
    step_together(pairs, [rng.integers(3, 200, 1 + 3 * i) for i in range(4)])
    replies = [[] for _ in pairs]
    for step in range(70):
        tokens = greedy(pairs)
        for r, t in zip(replies, tokens):
            r += t
        if step == 30:  # seat 1's frame replaced, fed alone, while the others ride
            pairs[1].frame(frames[2])
            step_together([pairs[0], pairs[2], pairs[3]], [tokens[0], tokens[2], tokens[3]])
            continue
        step_together(pairs, tokens)
    window = LAYOUTS[vlm[0]]["window"]
    assert all(p.together.cache.evicted > window for p in pairs)
    assert pairs[1].together.cache.frames == 2 and pairs[0].together.cache.frames == 1 and pairs[2].together.cache.frames == 1
    assert len({tuple(r) for r in replies}) > 1  # the seats are not one dialogue four times
    for p in pairs:
        np.testing.assert_array_equal(p.together.cache.slot_token, p.alone.cache.slot_token)
        for name, buf in p.together.backend.buffers().items():
            np.testing.assert_array_equal(buf, p.alone.backend.buffers()[name], err_msg=name)


def test_the_image_rows_reach_the_seats_attention_in_a_batched_run(vlm):
    """The same text after two different frames gives different logits in one batched step (the
    frame's keys are read, each seat's own), and a seat's logits do not depend on its neighbour's frame."""
    _, _, _, built = vlm
    a, b, c = seats(built, 3)
    frames = frames_of(vlm, a, (31, 32))
    for d, rows in zip((a, b, c), (frames[0], frames[1], frames[0])):
        feed_frame(d, rows)
    got = step_seats([a, b, c], [[40, 41, 42]] * 3)
    assert np.abs(got[0] - got[1]).max() > 1e-3
    np.testing.assert_array_equal(got[0], got[2])


def test_seats_with_frames_join_and_leave_between_steps(vlm):
    """Which seats step together changes every step (1 to 5 of them: the graphs for 2 and 4, a place
    left to the idle seat, a seat alone), seats pinning a span or taking a new frame (alone) while the
    others decode, a seat reset and starting over with a frame."""
    _, _, _, built = vlm
    pairs = [Pair(t, a) for t, a in zip(seats(built, 5), seats(built, 5))]
    frames = frames_of(vlm, pairs[0].alone, (41, 42, 43))
    rng = np.random.default_rng(6)
    for i, p in enumerate(pairs):
        step_together([p], [rng.integers(3, 200, 3)], [True])
        if i != 4:  # seat 4: text only
            p.frame(frames[i % 3])
    for step in range(60):
        k = int(rng.integers(1, 6))
        chosen = [pairs[i] for i in rng.permutation(5)[:k]]
        pins = [bool(rng.random() < 0.05) for _ in chosen]
        chunks = [rng.integers(3, 200, int(rng.integers(1, 3))) if pin else greedy([p])[0] for p, pin in zip(chosen, pins)]
        step_together(chosen, chunks, pins)
        if step % 20 == 10:  # a new frame in one seat
            pairs[step % 5].frame(frames[step % 3])
        if step == 35:  # seat 2 starts a new conversation, with a frame
            for d in (pairs[2].together, pairs[2].alone):
                d.reset()
            step_together([pairs[2]], [rng.integers(3, 200, 2)], [True])
            pairs[2].frame(frames[1])
    assert sum(p.together.cache.evicted > 0 for p in pairs) >= 3


def test_a_seat_saved_with_its_frame_after_batched_steps_resumes_in_another_model_and_rides_on(vlm, tmp_path):
    """A seat with a frame, after batched steps through a window turnover, saved to a session file;
    restored into a seat of another loaded model, its buffers are its twin's, and it steps on together
    with that model's other seats (one of them with another frame) as its twin steps alone."""
    from cabinlm.runtime import Dialogue, Tokenizer
    from cabinlm.runtime.persist import load_session, save_session

    _, _, _, built = vlm
    tok = Tokenizer(built / load_manifest(built).files["tokenizer"].path)
    together, alone = seats(built, 2), seats(built, 4)
    dialogues = [Dialogue(d, tok, system="") for d in together + alone]
    pairs = [Pair(t, a) for t, a in zip(together, alone)]
    frames = frames_of(vlm, alone[0], (51, 52))
    for p, rows in zip(pairs, frames):
        p.frame(rows)
    for _ in range(45):
        step_together(pairs, greedy(pairs))
    assert pairs[0].together.cache.evicted > 0
    save_session(tmp_path / "seat0", dialogues[0])
    other = seats(built, 2)
    load_session(tmp_path / "seat0", Dialogue(other[0], tok, system=""))
    for name, buf in other[0].backend.buffers().items():
        np.testing.assert_array_equal(buf, pairs[0].alone.backend.buffers()[name], err_msg=name)
    group = [Pair(other[0], pairs[0].alone), Pair(other[1], alone[2])]
    group[0].last = pairs[0].last
    Dialogue(other[1], tok, system="")
    for d in (other[1], alone[2]):
        feed_frame(d, frames[1])
    group[1].last = group[1].alone.step(np.asarray([7, 8], np.int64), logits="last")[-1]
    other[1].step(np.asarray([7, 8], np.int64), logits="last")
    for _ in range(30):
        step_together(group, greedy(group))


def test_a_frames_chunks_ride_with_other_seats_steps_and_a_verified_draft(vlm):
    """runtime.seats_together takes a camera frame's chunks (embeds, pin "image") beside another seat's
    decode steps and a third seat's verified drafts (keeping 1..all of their rows) in one batched run
    per chunk: every seat's logits (every row of a verification) are its solo step's / verify's, bit
    for bit, and every buffer ends as its solo twin's (the frame's image rows, key_source included)."""
    from cabinlm.runtime import seats_together

    _, loaded, _, built = vlm
    together, alone = seats(built, 3), seats(built, 3)
    v = together[0].manifest.vision
    C = together[0].layout.chunk
    rows = frames_of(vlm, together[0], (73,))[0]
    text = text_ids(loaded)
    for d in together + alone:
        d.feed(text[:5], pin=True)
        d.feed(text[5:9])
    for d in (together[0], alone[0]):
        if v.image_prefix:
            d.feed(v.image_prefix)
        d.cache.begin_frame()
    last = [alone[i].step(np.array([text[9 + i]]))[-1].copy() for i in (1, 2)]
    for i in (1, 2):
        together[i].step(np.array([text[9 + i]]))
    rng = np.random.default_rng(8)
    verified = 0
    for start in range(0, len(rows), C):
        frame = rows[start : start + C]
        ids0 = np.full(len(frame), v.image_token_id, np.int64)
        room = together[2].draft_room()
        n = int(rng.integers(1, room + 1)) if room > 0 else 0
        k = int(rng.integers(1, n + 2))
        chunk2 = np.array([int(last[1].argmax()), *rng.integers(3, 200, n)], np.int64)
        accept = (lambda r, k=k: k) if n else None
        got = seats_together(together, [ids0, [int(last[0].argmax())], chunk2], ["image", False, False],
                             [None, None, accept], [frame, None, None])  # fmt: skip
        np.testing.assert_array_equal(got[0][0], alone[0].step(ids0, pin="image", embeds=frame, logits="last"))
        want1 = alone[1].step(np.array([int(last[0].argmax())]), logits="last")
        np.testing.assert_array_equal(got[1][0], want1)
        if accept is None:
            want2, kept = alone[2].step(chunk2, logits="last"), len(chunk2)
        else:
            want2, kept = alone[2].verify(chunk2, accept)
            verified += 1
        np.testing.assert_array_equal(got[2][0], want2)
        assert got[2][1] == kept
        last = [want1[-1].copy(), want2[kept - 1 if accept else -1].copy()]
    assert verified > 0 and together[0].cache.image_fill == len(rows)
    for d, twin in zip(together, alone, strict=True):
        for name, buf in d.backend.buffers().items():
            np.testing.assert_array_equal(buf, twin.backend.buffers()[name], err_msg=name)


def test_seats_with_frames_under_the_server_scheduler_give_their_own_greedy_replies(vlm):
    """Three seats in three threads, each a turn as the server runs it (hold the model, a frame, a
    prompt, then greedy tokens with pass_turn between them; runtime.model_turns.SeatSteps): a frame's chunks
    ride like text steps (the holder's frame carries the riders' steps), the riders' text steps go with
    the holder's in batched runs, and every seat's greedy reply is the one it gives alone."""
    from cabinlm.runtime.model_turns import SeatSteps

    _, _, _, built = vlm
    rng = np.random.default_rng(7)
    prompts = [[rng.integers(3, 200, int(rng.integers(2, 6))) for _ in range(2)] for _ in range(3)]
    rows = frames_of(vlm, Decoder(built), (61, 62, 63))

    def turn(d: Decoder, frame: np.ndarray, chunks, n: int, model=None) -> list[int]:
        with model if model is not None else _Nothing():
            d.step(chunks[0], pin=True)
            feed_frame(d, frame)
            logits = d.step(chunks[1], logits="last")[-1]
            out = []
            for _ in range(n):
                out.append(int(logits.argmax()))
                if model is not None:
                    model.pass_turn()
                logits = d.step(np.array([out[-1]]))[-1]
            return out

    n = LAYOUTS[vlm[0]]["window"] + 10  # the window turns over during the reply
    expected = [turn(d, f, p, n) for d, f, p in zip(seats(built, 3), rows, prompts)]
    model = SeatSteps(4)
    ds = seats(built, 3)
    for d in ds:
        model.join(d)
    got = turns_in_threads(model, [lambda i=i: turn(ds[i], rows[i], prompts[i], n, model) for i in range(3)])
    assert got == expected
    assert len({tuple(g) for g in got}) > 1
    assert model.batched_runs > 10
    assert all(d.cache.evicted > 0 and d.cache.frames == 1 for d in ds)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# -- a text model with fp32 KV on the float kernel: what the frames above build on -----------------


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def text_fp32(request, load, export_to, tmp_path_factory):
    """Llama, and Gemma 3 (local layers' rings of 20 slots beside a global layer, its softmax scale
    folded into the queries), exported with fp32 KV and built on the float kernel."""
    from conftest import make_tiny_model

    if request.param == "llama":
        loaded = load(str(request.getfixturevalue("tiny_llama_dir")))
    else:
        loaded = load(str(make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3-fp32"), "gemma3")))
    art = export_to(loaded, kv="fp32", sink=2, pinned=10, window=16, chunk=4)
    return art, build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("fp32-seats") / "build", attention_kernel="cabinlm")


def test_an_fp32_text_build_on_the_float_kernel_steps_as_the_export_drafts_after_turnover_and_batches(text_fp32):
    """A text model's fp32-KV build on FloatKVAttention: its logits are the exported graph's through
    pins and eviction; a verified chunk's rows are its one-token steps bit for bit after the window
    has turned over (rows as steps, which GroupQueryAttention's fp32 builds cannot take); and three
    seats decode together as each alone."""
    art, built = text_fp32
    rng = np.random.default_rng(8)
    ref, dec = Decoder(art), Decoder(built)
    assert dec.backend.verifies_after_turnover and dec.backend.seat_batches == (2, 4)
    system = rng.integers(3, 300, 8)
    worst = 0.0
    for d in (ref, dec):
        d.feed(system, pin=True)
    for _ in range(20):
        ids = rng.integers(3, 300, int(rng.integers(1, 5)))
        got = [d.feed(ids, all_logits=True) for d in (ref, dec)]
        worst = max(worst, float(np.abs(got[1] - got[0]).max()))
    assert dec.cache.evicted > 16 and worst < 1e-4, worst
    steps = Decoder(built)
    steps.feed(system, pin=True)
    steps.feed(rng.integers(3, 300, 20))  # the window (16) turned over: a verified chunk's plan is rows as steps
    chunks = Decoder(built)
    chunks.cache.restore(steps.cache.state())
    for name, buf in steps.backend.buffers().items():
        chunks.backend.buffers()[name][...] = buf
    chunks.backend.restored()
    for it in range(12):
        n = int(rng.integers(2, 5))
        ids = rng.integers(3, 300, n)
        one = np.stack([steps.step(ids[i : i + 1])[0].copy() for i in range(n)])
        rows, kept = chunks.verify(ids, lambda logits: n)
        assert kept == n and np.array_equal(rows, one), it
    pairs = [Pair(t, a) for t, a in zip(seats(built, 3), seats(built, 3))]
    step_together(pairs, [rng.integers(3, 300, 2 + i) for i in range(3)], [True] * 3)
    for _ in range(40):
        step_together(pairs, greedy(pairs))
    assert all(p.together.cache.evicted > 16 for p in pairs)


def test_drafting_with_frames_on_the_float_kernel_gives_the_plain_replies(vlm, export_to, tmp_path):
    """Chat drafts by default on the float kernel's VLM build too (its chunk rows are its steps while
    the window fills) and stops at the turnover (the image rows are re-written per step, not per row):
    with frames pinned and replaced through window turnovers, drafting gives the plain greedy replies
    (test_fused_vlm's check, on a build whose window holds a chat turn: 64 tokens)."""
    from test_fused_vlm import check_drafting_gives_the_plain_replies

    art = export_to(vlm[1], kv="fp32", sink=4, pinned=24, window=64, chunk=16)
    check_drafting_gives_the_plain_replies(build_artifact(art, load_profile("cpu"), tmp_path / "b", attention_kernel="cabinlm"))


def test_a_frames_chunk_beside_a_text_chunk_in_one_run_of_the_batched_graph_is_each_seats_own(vlm):
    """The batched graph takes a frame's chunk beside another seat's, each seat's image
    rows its own (image_embeds.seat{s}, image_mask.seat{s}, stacked as the rows are): one run of
    decoder.seats2.onnx with seat 0's first frame chunk and seat 1's text chunk gives each seat's solo
    logits of every row and leaves each cache as its solo step does, bit for bit. (Driven here as
    SeatBatches.run_batch drives the graph, with seat 0's image rows put in.)"""
    from cabinlm.contract import io_spec as io
    from cabinlm.engines.backend import StepOutput

    _, loaded, _, built = vlm
    together, alone = seats(built, 2), seats(built, 2)
    v = together[0].manifest.vision
    chunk = together[0].layout.chunk
    rows = frames_of(vlm, together[0], (71,))[0][:chunk]  # the frame's first chunk
    text = text_ids(loaded)
    for d in together + alone:
        d.feed(text[:5], pin=True)
        d.feed(text[5:9])
        if v.image_prefix:
            d.feed(v.image_prefix)
        d.cache.begin_frame()
    ids = [np.full(len(rows), v.image_token_id, np.int64), np.asarray(text[20:23], np.int64)]
    plans = [together[0].cache.plan(len(rows), "image"), together[1].cache.plan(3)]
    backends = [d.backend for d in together]
    graphs = backends[0].graphs
    counts = np.array([p.tokens for p in plans], np.int64)
    ends = np.cumsum(counts)
    feeds = {io.INPUT_IDS: np.concatenate(ids), io.SEAT_TOKENS: counts, io.LOGIT_ROWS: np.arange(int(ends[-1]), dtype=np.int64)}
    for s, (b, plan, c) in enumerate(zip(backends, plans, ids)):
        b.rotated.chunk_tables(plan)
        own = b.chunk_inputs(plan, c, all_logits=True)
        if s == 0:
            own[io.IMAGE_EMBEDS], own[io.IMAGE_MASK] = np.ascontiguousarray(rows, np.float32), np.ones((len(rows), 1), bool)
        for name in io.SHARED_BY_SEATS:
            own.pop(name)
        feeds.update({io.seat_name(name, s): np.ascontiguousarray(value) for name, value in own.items()})
    group = graphs.batched.group(backends)
    for name, value in feeds.items():
        group.binding.bind_cpu_input(name, value)
    hidden, *qkv = graphs.batched._run(group, int(ends[-1]))
    logits = graphs.batched.head.run([io.LOGITS], {io.HIDDEN: hidden})[0]
    want = [alone[0].step(ids[0], pin="image", embeds=rows), alone[1].step(ids[1])]
    for s, (b, d, plan) in enumerate(zip(backends, together, plans)):
        a, e = int(ends[s] - counts[s]), int(ends[s])
        np.testing.assert_array_equal(logits[a:e], want[s])
        b.commit(plan, StepOutput(logits[a:e], (plan.extent, [q[:, a:e] for q in qkv])))
        d.cache.advance(plan)
    for d, twin in zip(together, alone, strict=True):
        for name, buf in d.backend.buffers().items():
            np.testing.assert_array_equal(buf, twin.backend.buffers()[name], err_msg=name)
