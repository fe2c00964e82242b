"""The fused cpu decoder (engines/ort_fused) running a vision-language model's text decoder: a tiny
random Idefics3 (its Llama decoder, ranks of one component) exported with fp32 KV and built with
`cabinlm build --profile cpu`. The frame's rows go into the pinned image region through the graph's
image_embeds; its keys follow the ranks as the pinned ones do, and a new frame turns back the keys of
the window tokens fed after the old one (engines/ort_fused/backend.py, "Camera frames"). Checked
against transformers, the exported graph and vlm_reference.py's reference of the semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cabinlm.contract.engines import BackendKind
from cabinlm.runtime import Decoder

import vlm_checks as vlm
from test_idefics3 import PICTURE, frame_ids, hf_logits, make_tiny_idefics3
from vlm_checks import TEXT, picture


@pytest.fixture(scope="module")
def fused(tmp_path_factory, load, export_to):
    """(loaded, exported folder, fused build folder)."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    loaded = load(str(make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3-fused"), "idefics3", seed=1)))
    art = export_to(loaded, sink=4, pinned=24, window=64, chunk=16)
    built = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("fused-vlm"))
    return loaded, art, built


def test_the_cpu_build_of_a_vlm_with_fp32_kv_is_the_fused_decoder_with_its_camera_encoder(fused):
    _, _, built = fused
    m = Decoder(built).manifest
    assert m.build.backend == BackendKind.FUSED and m.vision is not None
    assert "vision_graph" in m.files and (built / m.files["vision_graph"].path).is_file()
    assert {"image_embeds", "image_mask"} <= {t.name for t in m.io.inputs}


def test_perplexity_with_a_frame_on_the_fused_build_equals_transformers_and_the_export(fused, tmp_path):
    from cabinlm.runtime import stream_perplexity

    loaded, art, built = fused
    vlm.check_perplexity_with_a_frame(loaded, built, hf_logits, frame_ids(Decoder(built).manifest.vision), PICTURE, tmp_path)
    ids = loaded.tokenizer.backend_tokenizer.encode(TEXT).ids[:40]
    nll = []
    for folder in (art, built):
        dec = Decoder(folder)
        nll.append(stream_perplexity(dec, ids, frame=dec.vision.encode(picture(*PICTURE, seed=10))).nll)
    np.testing.assert_allclose(nll[1], nll[0], atol=1e-5)


def test_frames_replaced_while_the_window_evicts_follow_the_reference_of_the_semantics(fused):
    """One-token steps and 16-token chunks with a frame pinned while the window evicts the text around
    it, a second frame replacing the first while text fed after the first is still cached (its keys
    turned back by the frame's tokens), then a third: against FrameStreamingReference (ranks)."""
    loaded, _, built = fused
    dec = Decoder(built)
    assert dec.backend.kind == BackendKind.FUSED
    worst = vlm.frames_against_the_reference(loaded, dec, PICTURE, [7, 8, 9], [(0, 150), (150, 190), (190, 260)])
    assert dec.cache.evicted > 150
    assert worst < 1e-4, worst


def test_a_session_saved_with_its_frame_resumes_on_the_fused_build(fused, tmp_path):
    _, _, built = fused
    vlm.check_a_session_saved_with_its_frame_resumes_with_the_same_replies(built, PICTURE, tmp_path)


def test_a_cache_saved_between_frames_resumes_with_the_old_frame_known(fused):
    """The fused backend's `frame` buffer (frames.FrameKeys: what the last commit left in the image region) travels with
    the cache buffers, as a session file carries them: a second decoder given the first's slot state
    and buffers right after begin_frame (the old frame already out of the slot table) turns the same
    window keys back and gives the same logits from there on, bit for bit."""
    loaded, _, built = fused
    dec = Decoder(built)
    v = dec.manifest.vision
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT * 2, add_special_tokens=False).ids
    frames = [dec.vision.encode(picture(*PICTURE, seed=s)) for s in (3, 4)]

    def frame(d: Decoder, rows: np.ndarray) -> np.ndarray:
        return d.feed([v.image_token_id] * v.image_tokens, pin="image", all_logits=True, embeds=rows)

    dec.feed(text[:6])
    dec.cache.begin_frame()
    frame(dec, frames[0])
    dec.feed(text[6:100])
    assert dec.cache.evicted > 0
    dec.cache.begin_frame()
    resumed, lost = Decoder(built), Decoder(built)
    for d in (resumed, lost):
        d.cache.restore(dec.cache.state())
        for name, buf in dec.backend.buffers().items():
            d.backend.buffers()[name][...] = buf
        d.backend.restored()
    lost.backend.frames.frame[:] = (-1, -1, 0)  # a cache restored without it: the old frame unknown
    got = [frame(d, frames[1]) for d in (dec, resumed, lost)]
    np.testing.assert_array_equal(got[1], got[0])
    for chunk in (text[100:101], text[101:117], text[117:118]):
        got = [d.feed(chunk, all_logits=True) for d in (dec, resumed, lost)]
        np.testing.assert_array_equal(got[1], got[0])
    assert np.abs(got[2] - got[0]).max() > 1e-2  # the test can tell: keys not turned back move the logits


def test_seats_with_a_frame_in_one_seat_step_together_as_each_alone(fused):
    """runtime.step_seats on the fused VLM build (fp32 KV: GroupQueryAttention, no batched graphs, so
    seats run one after another through the one-seat graph): one seat holds a frame (fed with
    Decoder.feed: step_seats takes token ids only), the other text; each seat's logits are what the
    same seat gives alone, bit for bit, while the window turns over and the frame is replaced."""
    from cabinlm.runtime import step_seats

    loaded, _, built = fused
    base = Decoder(built)
    v = base.manifest.vision
    together, alone = [base.seat(), base.seat()], [base.seat(), base.seat()]
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT * 2, add_special_tokens=False).ids
    for s, rows in enumerate([base.vision.encode(picture(*PICTURE, seed=5)), base.vision.encode(picture(*PICTURE, seed=6))]):
        for d in (together[0], alone[0]):
            d.cache.begin_frame()
            d.feed([v.image_token_id] * v.image_tokens, pin="image", embeds=rows)
        for i in range(80):
            chunks = [np.array(text[(i + s * 80) % len(text) : (i + s * 80) % len(text) + 1]),
                      np.array(text[(i * 3 + 7) % len(text) : (i * 3 + 7) % len(text) + 1])]  # fmt: skip
            got = step_seats(together, chunks)
            for g, d, c in zip(got, alone, chunks, strict=True):
                np.testing.assert_array_equal(g, d.step(c)[-1])
    assert together[0].cache.frames == 2 and together[0].cache.evicted > 0


def test_a_llava_first_turn_on_the_fused_build_equals_transformers(tmp_path_factory, load, export_to):
    """LLaVA-style (a SigLIP tower, a projector, a Qwen2 text model): the first turn with an image on
    the fused build gives transformers' logits, and another image clearly others."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    from conftest import make_tiny_llava
    from test_vision import hf_processor

    loaded = load(str(make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-fused"), "siglip")))
    built = build_artifact(export_to(loaded, sink=4, pinned=12, window=48, chunk=16), load_profile("cpu"),
                           tmp_path_factory.mktemp("fused-llava"))  # fmt: skip
    dec = Decoder(built)
    assert dec.backend.kind == BackendKind.FUSED
    vision = dec.manifest.vision
    tok = loaded.tokenizer.backend_tokenizer
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False).ids
    tail = tok.encode(" what is on the road ahead?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    ids = head + [vision.image_token_id] * vision.image_tokens + tail

    def hf(seed: int) -> np.ndarray:
        pixels = hf_processor(loaded.folder)(images=picture(64, 48, seed=seed), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            return loaded.model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0].numpy()

    ours = [dec.feed(head, all_logits=True)]
    dec.cache.begin_frame()
    ours.append(dec.feed([vision.image_token_id] * vision.image_tokens, pin="image", all_logits=True,
                         embeds=dec.vision.encode(picture(64, 48, seed=3))))  # fmt: skip
    ours.append(dec.feed(tail, all_logits=True))
    ref = hf(3)
    np.testing.assert_allclose(np.concatenate(ours), ref, atol=1e-3)
    assert np.abs(hf(4)[-1] - ref[-1]).max() > 1e-2


def test_a_vlm_with_int8_kv_keeps_the_exported_graph_and_says_why(fused, export_to, tmp_path):
    from cabinlm.engines.build import build_artifact
    from cabinlm.engines.ort_fused.graph import ineligible
    from cabinlm.profiles import load_profile

    loaded, _, _ = fused
    art = export_to(loaded, sink=4, pinned=24, window=64, chunk=16, kv="int8")
    why = ineligible(Decoder(art).manifest)
    assert why is not None and "quantize once" in why and "\n" not in why
    assert Decoder(build_artifact(art, load_profile("cpu"), tmp_path / "b")).manifest.build.backend == BackendKind.EXPORTED_GRAPH


def test_drafting_with_frames_on_the_fused_build_gives_the_plain_replies(fused):
    """The fused VLM build drafts by default (its chunk rows are its steps while the window fills):
    with frames pinned and replaced through window turnovers, drafting (the stream plain decoding fed,
    every other draft's last token made wrong) gives the plain greedy replies, and no drafts once the
    window is full (GroupQueryAttention's chunks cannot take a slot per row)."""
    check_drafting_gives_the_plain_replies(fused[2])


def check_drafting_gives_the_plain_replies(built) -> None:
    from cabinlm.runtime import Dialogue, open_artifact
    from cabinlm.runtime.speculative import Drafting, PlainDecoding, drafting_by_default

    class Recorder(PlainDecoding):
        def __init__(self):
            super().__init__()
            self.stream: list[int] = []

        def observe(self, ids):
            self.stream += [int(t) for t in ids]

        def push(self, token):
            self.stream.append(int(token))

    class Replay(Recorder, Drafting):
        drafts = True

        def __init__(self, script):
            super().__init__()
            self.script, self.calls = script, 0

        def propose(self, dec):
            k = min(4, dec.draft_room())
            if k <= 0:
                return ()
            self.calls += 1
            drafts = self.script[len(self.stream) : len(self.stream) + k]
            return drafts[:-1] + [drafts[-1] + 1] if drafts and self.calls % 2 else drafts

    record = Recorder()
    runs = []
    for drafting in (record, None):
        dec, tok = open_artifact(built, verify=False)
        assert drafting_by_default(dec.backend)[0] and not dec.backend.verifies_after_turnover
        drafting = drafting or Replay(record.stream)
        d = Dialogue(dec, tok, max_new_tokens=10, drafting=drafting)
        got, late = [], 0
        for i in range(16):
            full = dec.cache.window_fill == dec.layout.window
            r = d.ask("the road ahead, the road ahead?", image=picture(40 + i % 5, 32, seed=i) if i % 4 == 0 else None)
            got.append(r.reply)
            late += r.drafted_tokens if full else 0
        assert dec.cache.evicted > dec.layout.window and dec.cache.frames == 4
        runs.append((got, drafting.drafted, drafting.accepted, late))
    (plain, *_), replay = runs
    assert replay[0] == plain
    assert replay[1] > 0 and 0 < replay[2] < replay[1] and replay[3] == 0
