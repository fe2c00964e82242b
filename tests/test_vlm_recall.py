"""A camera frame together with a recall region (docs/design.md, "The recall region"), on tiny Qwen2-VL and Idefics3.

In a layout with a region the cache ranks as the layout lies: sink | pinned | frame | recalled text | window. The
frame's chunks and the region's see the sink, the pinned spans, the frame and their own earlier tokens, never the
window; a new frame empties the region (its tokens saw the old frame), and the Dialogue refills it after the frame,
then feeds the user's text; multimodal RoPE applies its rule over those ranks (text after the frame continues from
the frame's largest position + 1). Checked against RecallFrameReference (below: test_qwen2_vl's plain PyTorch
reference of the M-RoPE rank rule, with the region's rules written out) on the exported graph, the static pair and
the fused cpu build (GroupQueryAttention, keys rotated once at positions + O, O = E - r - I + (I - max(rows, cols))), the same
with ranks on Idefics3's exported graph and fused build on cabinlm's kernel (O = E - r - I; the frame's keys among
the rows it rotates from key_source), the slot table's positions against the rule over the rank order, and a
Dialogue turn with a new frame and recalled text.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cabinlm.contract.engines import BackendKind
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.slots import SlotTable, StepPlan
from cabinlm.runtime import Decoder

from test_qwen2_vl import PICTURE, MRopeStreamingReference, rule_positions
from vlm_checks import TEXT, picture
from vlm_reference import FrameStreamingReference

LAYOUT = dict(sink=4, pinned=32, recall=64, window=64, chunk=8)  # the tiny tokenizer: about a token a letter


class RecallReference:
    """The cache semantics with a frame and a recall region, from docs/design.md alone, over vlm_reference.py's
    reference of frames (its positions and rotation: ranks, or test_qwen2_vl's M-RoPE rule): every cached token
    keeps the K/V it was given when fed; the cached tokens rank pinned first (sink, pinned spans, frame, recalled
    text, in stream order), then the window's, in stream order; a frame's or the region's chunk sees the pinned
    ones only, a window chunk every cached token; positions are the rule over the tokens seen then the chunk, in
    rank order; a new frame drops the old frame's tokens and the recalled ones, begin_recall the recalled ones."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recalled: set[int] = set()

    def begin_frame(self) -> None:
        self.entries = [e for e in self.entries if (e[0] < self.sink or not e[2]) and e[0] not in self.recalled]
        self.recalled = set()

    def begin_recall(self) -> None:
        self.entries = [e for e in self.entries if e[0] not in self.recalled]
        self.recalled = set()

    @torch.no_grad()
    def feed(self, x: torch.Tensor, frame: bool = False, pin: bool = False, recall: bool = False) -> torch.Tensor:
        pinned = [e for e in self.entries if e[1]]
        self.entries = pinned + [e for e in self.entries if not e[1]]  # ranks: the window after every other token
        seen = pinned if frame or recall else self.entries
        logits, new_kv = self.attend(x, seen, frame)
        n = len(x)
        for t in range(n):
            idx = self.seen + t
            self.entries.append((idx, frame or pin or recall or idx < self.sink, frame, new_kv[t]))
            if recall:
                self.recalled.add(idx)
        self.seen += n
        unpinned = [i for i, e in enumerate(self.entries) if not e[1]]
        drop = set(unpinned[: max(0, len(unpinned) - self.window)])
        self.entries = [e for i, e in enumerate(self.entries) if i not in drop]
        return logits


class RecallFrameReference(RecallReference, MRopeStreamingReference):
    """Qwen2-VL: multimodal RoPE's rule over the ranks."""


class RecallRankReference(RecallReference, FrameStreamingReference):
    """Idefics3 (a Llama decoder): positions are ranks."""


@pytest.fixture(scope="module")
def qwen_recall(load, tiny_qwen2_vl_dir, export_to, tmp_path_factory):
    """(loaded model, the export with a frame and a region, its fused cpu build)."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    loaded = load(str(tiny_qwen2_vl_dir))
    art = export_to(loaded, **LAYOUT)
    built = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("vlm-recall") / "fused")
    return loaded, art, built


@pytest.fixture(scope="module")
def qwen_static(qwen_recall, tmp_path_factory):
    """The static prefill / decode pair of the same export (a short chunk padded to the graph's size)."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile
    from test_backends import static_profile

    tmp = tmp_path_factory.mktemp("vlm-recall-static")
    return build_artifact(qwen_recall[1], load_profile(static_profile(tmp)), tmp / "static")


# (what, tokens or picture seed): "pin" the system prompt, "text" window text (in stretches of one-token steps and
# chunks), "frame" a new frame (begin_frame), "recall" a new region (begin_recall), its text fed in chunks
STREAM = [("pin", 10), ("text", 20), ("frame", 1), ("recall", 10), ("text", 45), ("frame", 2), ("recall", 16),
          ("text", 30), ("recall", 5), ("text", 20), ("frame", 3), ("text", 12)]  # fmt: skip


def recall_stream_against_reference(loaded, dec: Decoder, size: tuple[int, int] = PICTURE) -> float:
    """STREAM through `dec` and the reference (Qwen2-VL's, or with ranks for a Llama decoder), the worst logit
    difference over every fed token. size: the test frames' (width, height)."""
    v = dec.manifest.vision
    lay = dec.layout
    if v.mrope:
        ref = RecallFrameReference(loaded.model, lay.sink, lay.window, v.grid)
        embed = loaded.model.model.language_model.embed_tokens
    else:
        lm = loaded.model.model.text_model
        ref = RecallRankReference(loaded.model, lm, lay.sink, lay.window, lm.rotary_emb.inv_freq)
        embed = lm.embed_tokens
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT * 3, add_special_tokens=False).ids
    worst, at = 0.0, 0

    def both(ours: np.ndarray, theirs: torch.Tensor) -> None:
        nonlocal worst
        worst = max(worst, float(np.abs(ours - theirs.numpy()).max()))

    for what, n in STREAM:
        if what == "frame":
            frame = dec.vision.encode(picture(*size, seed=n))
            dec.cache.begin_frame()
            ref.begin_frame()
            both(dec.feed([v.image_token_id] * v.image_tokens, pin="image", all_logits=True, embeds=frame),
                 ref.feed(torch.from_numpy(frame), frame=True))  # fmt: skip
            continue
        ids, at = text[at : at + n], at + n
        if what == "recall":
            dec.cache.begin_recall()
            ref.begin_recall()
        if what == "text":  # one-token steps, then chunks
            parts = [ids[i : i + 1] for i in range(min(6, n))]
            parts += [ids[i : i + lay.chunk] for i in range(6, n, lay.chunk)]
        else:
            parts = [ids[i : i + lay.chunk] for i in range(0, n, lay.chunk)]
        for part in parts:
            pin = {"pin": True, "recall": "recall"}.get(what, False)
            both(dec.feed(part, pin=pin, all_logits=True),
                 ref.feed(embed(torch.tensor(part)), pin=what == "pin", recall=what == "recall"))  # fmt: skip
    c = dec.cache
    assert c.frames == 3 and c.recalls == 3 and c.evicted > 40 and c.recall_fill == 0  # the last frame emptied it
    assert sorted(e[0] for e in ref.entries) == c.cached_stream_indices().tolist()  # the same tokens cached
    return worst


@pytest.mark.parametrize("engine", ["graph", "static", "fused"])
def test_a_frame_and_a_region_follow_the_reference(qwen_recall, engine, request):
    loaded, art, built = qwen_recall
    dec = Decoder({"graph": art, "fused": built}.get(engine) or request.getfixturevalue("qwen_static"))
    assert dec.layout.recall == LAYOUT["recall"] and dec.layout.image == 12
    assert (dec.backend.kind == BackendKind.FUSED) == (engine == "fused")
    assert engine == "fused" or dec.backend.graphs.static == (engine == "static")
    worst = recall_stream_against_reference(loaded, dec)
    assert worst < 1e-4, (engine, worst)  # measured 4.6e-6 and 4.4e-6 (logits up to ~5)


@pytest.fixture(scope="module")
def idefics3_recall(load, export_to, tmp_path_factory):
    """A tiny Idefics3 (ranks of one component) with a frame and a region, and its fused cpu build on cabinlm's
    attention kernel (FloatKVAttention: the sink / pinned / frame / recall keys rotated per row from key_source)."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.engines.ort_fused.kernels import compiler
    from cabinlm.profiles import load_profile
    from test_idefics3 import make_tiny_idefics3

    if compiler.unavailable() is not None:
        pytest.skip(f"cabinlm's attention kernel cannot be compiled here: {compiler.unavailable()}")
    loaded = load(str(make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3-recall"), "idefics3", seed=1)))
    art = export_to(loaded, **LAYOUT)
    built = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("idefics3-recall") / "fused",
                           attention_kernel="cabinlm")  # fmt: skip
    return loaded, art, built


@pytest.mark.parametrize("engine", ["graph", "fused"])
def test_a_frame_and_a_region_with_ranks_follow_the_reference(idefics3_recall, engine):
    """The same on a decoder whose positions are ranks, its fused build on cabinlm's kernel (O = E - r - I): measured
    8e-6 on both; with the frame left out of O (O = E - r) the fused build is 5.3 away."""
    from test_idefics3 import PICTURE as IDEFICS3_PICTURE

    loaded, art, built = idefics3_recall
    dec = Decoder(art if engine == "graph" else built)
    assert (dec.backend.kind == BackendKind.FUSED) == (engine == "fused")
    worst = recall_stream_against_reference(loaded, dec, IDEFICS3_PICTURE)
    assert worst < 1e-4, (engine, worst)


def test_the_reference_tells_a_frame_that_sees_the_window(qwen_recall, monkeypatch):
    """The comparison above is sharp: the exported graph with a frame's chunk let see the window (the window masked
    for the region's chunks only) is far from the reference."""
    loaded, art, _ = qwen_recall
    monkeypatch.setattr(StepPlan, "sees_window", property(lambda self: self.pin != "recall"))
    worst = recall_stream_against_reference(loaded, Decoder(art))
    assert worst > 1e-2, worst


def test_the_fused_builds_window_keys_need_the_frame_in_their_offset(qwen_recall, monkeypatch):
    """The fused build rotates a window key once, at its positions + O: O must take the frame (before the window in
    this layout) as it takes the region, I ranks and back the I - max(rows, cols) multimodal RoPE gives back; with
    either left out the window keys sit at wrong distances (measured 2.5 and 2.8 against 4e-6)."""
    from cabinlm.engines.onnxruntime.rotated import RotatedKeys

    loaded, _, built = qwen_recall
    with monkeypatch.context() as m:
        m.setattr(StepPlan, "before_window", property(lambda self: self.recall_fill))
        assert recall_stream_against_reference(loaded, Decoder(built)) > 0.5
    with monkeypatch.context() as m:
        m.setattr(RotatedKeys, "offset", lambda self, plan: plan.offset)
        assert recall_stream_against_reference(loaded, Decoder(built)) > 0.5


def test_positions_are_the_rule_over_the_ranks_sink_pinned_frame_region_window():
    """The slot table's M-RoPE positions for every kind of chunk, against the rule written over the cached tokens
    in the layout's rank order (the window last) then the chunk; a frame's or region's chunk before the window it
    does not see. Frames replaced, regions refilled, the window turning over."""
    grid, I = (3, 4), 12
    lay = CacheLayout(sink=4, pinned=4, image=I, recall=16, window=10, chunk=8, layers=1, kv_heads=1, head_dim=2)
    table = SlotTable(lay)
    rng = np.random.default_rng(1)
    frame = None

    def check(n: int, pin) -> None:
        plan = table.plan(n, pin)
        chunk, cache = plan.mrope_positions(I, grid)
        held = np.flatnonzero(table.slot_token >= 0)
        pinned = held[held < lay.window_start]
        seen = pinned if pin in ("image", "recall") else held
        order = list(pinned[np.argsort(table.slot_token[pinned])])
        if len(seen) > len(pinned):
            window = held[held >= lay.window_start]
            order += list(window[np.argsort(table.slot_token[window])])
        stream = [int(table.slot_token[s]) for s in order] + list(plan.seen + np.arange(n))
        image = [frame is not None and frame <= t < frame + I for t in stream]
        ref = rule_positions(image, grid)
        np.testing.assert_array_equal(chunk, ref[:, len(order) :])
        for i, slot in enumerate(order):
            np.testing.assert_array_equal(cache[:, slot], ref[:, i])
        if pin in ("image", "recall"):  # the window is masked, its tokens ranked after the chunk's
            assert (plan.attention_mask[:, lay.window_start : lay.slots] < 0).all()
        table.advance(plan)

    check(4, True)
    check(3, True)
    for turn in range(5):
        for _ in range(int(rng.integers(1, 4))):
            check(int(rng.integers(1, 7)), False)
        table.begin_frame()
        assert table.recall_fill == 0 and (table.slot_token[lay.image_start : lay.window_start] < 0).all()
        frame = table.seen
        check(8, "image")
        check(4, "image")
        table.begin_recall()
        for _ in range(int(rng.integers(0, 3))):
            check(int(rng.integers(1, 9)), "recall")
        for _ in range(int(rng.integers(2, 6))):
            check(int(rng.integers(1, 7)), False)
    assert table.evicted > 20 and table.frames == 5


def test_a_dialogue_turn_feeds_the_frame_then_the_region_then_the_text(qwen_recall):
    """Dialogue.ask with a new frame in a layout with a region: the frame, then the region refilled for the
    message (the opening request, archived once it left the window), then the user head and text: their stream
    indices in that order. Every step of the dialogue, replies included, replayed through RecallFrameReference
    gives the same logits."""
    from cabinlm.runtime import Dialogue, open_artifact

    loaded, art, _ = qwen_recall
    dec, tok = open_artifact(art, verify=False)
    log: list = []
    step = dec._step

    def logged_step(ids, pin, embeds, logits):
        out = step(ids, pin, embeds, logits)
        log.append(("step", np.array(ids), pin, None if embeds is None else np.array(embeds), out.copy(), logits))
        return out

    dec._step = logged_step  # from the system prompt on
    d = Dialogue(dec, tok, system="Be brief.", max_new_tokens=3)
    begin_frame, begin_recall = dec.cache.begin_frame, dec.cache.begin_recall
    dec.cache.begin_frame = lambda: (log.append(("frame",)), begin_frame())[1]
    dec.cache.begin_recall = lambda: (log.append(("recall",)), begin_recall())[1]
    d.ask("where is my blue car?")
    d.ask("tell me about the weather")
    d.ask("what is the traffic like", image=picture(*PICTURE, seed=4))
    turn = len(log)
    result = d.ask("is my blue car there?", image=picture(*PICTURE, seed=5))
    c, lay = dec.cache, dec.layout
    assert result.recall is not None and result.recall["refreshed"] and result.recall["tokens"] == c.recall_fill > 0
    kinds = [e[0] if e[0] != "step" else e[2] for e in log[turn:]]
    assert kinds[:2] == ["frame", "image"] and "recall" in kinds and kinds.index("recall") < kinds.index(False)
    image = c.slot_token[lay.image_start : lay.recall_start]
    region = c.slot_token[lay.recall_start : lay.window_start]
    region = region[region >= 0]
    window = c.slot_token[lay.window_start :]
    assert image.max() < region.min() and region.max() < window.max()
    assert c.frames == 2 and c.evicted > 0

    ref = RecallFrameReference(loaded.model, lay.sink, lay.window, dec.manifest.vision.grid)
    embed = loaded.model.model.language_model.embed_tokens
    worst = 0.0
    for e in log:
        if e[0] != "step":
            getattr(ref, f"begin_{e[0]}")()
            continue
        _, ids, pin, embeds, out, rows = e
        x = torch.from_numpy(embeds) if pin == "image" else embed(torch.tensor(ids))
        want = ref.feed(x, frame=pin == "image", pin=pin is True, recall=pin == "recall").numpy()
        worst = max(worst, float(np.abs(out - (want if rows == "all" else want[-1:])).max()))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("engine", ["graph", "fused"])
def test_a_session_with_a_frame_and_a_region_resumes_with_the_same_replies(qwen_recall, engine, tmp_path):
    """A dialogue with a frame and recalled text cached (the window turned over) saved to a session file; another
    dialogue loads it (the region's choice, the archive, where the frame starts; the fused build's rotated keys
    and their copies) and answers the next turns, which refill the region, as the first goes on to."""
    from cabinlm.runtime import Dialogue, open_artifact
    from cabinlm.runtime.persist import load_session, save_session

    _, art, built = qwen_recall
    folder = art if engine == "graph" else built
    first, second = (Dialogue(*open_artifact(folder, verify=False), max_new_tokens=6) for _ in range(2))
    first.ask("where is my blue car?")
    for i in range(3):
        first.ask(f"turn {i}: anything new ahead?")
    first.ask("and the camera?", image=picture(*PICTURE, seed=13))
    c = first.decoder.cache
    assert c.evicted > 0 and c.recall_fill > 0 and c.frame_start >= 0
    save_session(tmp_path / "s.session", first)
    load_session(tmp_path / "s.session", second)
    for text in ("is my blue car there?", "and the weather?"):
        assert second.ask(text).reply == first.ask(text).reply
    np.testing.assert_array_equal(second.decoder.cache.slot_token, first.decoder.cache.slot_token)
    assert second.region == first.region and first.decoder.cache.recalls >= 2  # refilled after the frame too
