"""The fused cpu decoder (engines/ort_fused) running Qwen2-VL's text decoder with its multimodal RoPE
(fp32 KV, GroupQueryAttention): every chunk row's cos / sin and every sink / pinned / frame key's
carry each frequency pair's own component (time, row, column) + E, and a new frame turns the window
keys whose positions it moved (engines/ort_fused/backend.py, _follow_mrope). Checked against
transformers, the rank rule's reference (test_qwen2_vl's MRopeStreamingReference) and the exported
graph, which rotates its un-rotated cache at the rule's positions every step."""

from __future__ import annotations

import numpy as np
import pytest

from cabinlm.contract.engines import BackendKind
from cabinlm.runtime import Decoder

import vlm_checks as vlm
from test_qwen2_vl import PICTURE, hf_logits, mrope_stream_against_reference
from vlm_checks import TEXT, picture


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_fused(request, load, export_to, tmp_path_factory):
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    loaded = load(str(request.getfixturevalue("tiny_qwen2_vl_dir" if request.param == "qwen2_vl" else "tiny_qwen2_5_vl_dir")))
    art = export_to(loaded, sink=4, pinned=12, window=64, chunk=16)
    built = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("fused-qwen2-vl"))
    assert Decoder(built).manifest.build.backend == BackendKind.FUSED
    return loaded, art, built


def test_perplexity_with_a_frame_on_the_fused_build_equals_transformers(qwen_fused, tmp_path):
    loaded, _, built = qwen_fused
    v = loaded.model.config
    frame_ids = [v.vision_start_token_id] + [v.image_token_id] * 12 + [v.vision_end_token_id]
    vlm.check_perplexity_with_a_frame(loaded, built, hf_logits, frame_ids, PICTURE, tmp_path)


def test_streaming_with_a_pinned_frame_on_the_fused_build_follows_the_reference(qwen_fused):
    loaded, _, built = qwen_fused
    dec = Decoder(built)
    assert dec.backend.kind == BackendKind.FUSED
    worst = mrope_stream_against_reference(loaded, dec)
    assert worst < 1e-4, worst


def test_frames_replaced_while_the_window_evicts_give_the_exported_graphs_logits(qwen_fused):
    """Frames replaced while text fed after the old one is still cached (the first one after two
    tokens: its first tokens sit in the sink), one-token steps and chunks: the fused build's logits
    are the exported graph's at every step."""
    from cabinlm.runtime.perplexity import feed_frame

    loaded, art, built = qwen_fused
    decs = [Decoder(art), Decoder(built)]
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT * 2, add_special_tokens=False).ids
    frames = [decs[0].vision.encode(picture(*PICTURE, seed=s)) for s in range(3)]
    worst = 0.0
    for d in decs:
        d.feed(text[:2])
    for i in range(8):
        for d in decs:
            feed_frame(d, frames[i % 3])
        start = (i * 13) % 100
        for chunk in [text[start + k : start + k + 1] for k in range(12)] + [text[start + 12 : start + 28]]:
            got = [d.feed(chunk, all_logits=True) for d in decs]
            worst = max(worst, float(np.abs(got[1] - got[0]).max()))
    assert decs[1].cache.frames == 8 and decs[1].cache.evicted > 100
    assert worst < 1e-4, worst


def test_a_session_saved_with_its_frame_resumes_on_the_fused_build(qwen_fused, tmp_path):
    _, _, built = qwen_fused
    vlm.check_a_session_saved_with_its_frame_resumes_with_the_same_replies(built, PICTURE, tmp_path)


def test_a_cache_resumed_before_a_new_frame_goes_on_bit_for_bit(qwen_fused):
    """The `baked` positions and the `frame` buffer travel with the cache buffers (as a session file
    carries them): a decoder given the slot state and buffers after a frame and the text after it
    turns the same window keys when the next frame comes, and gives the first's logits, bit for bit.
    (Resumed between begin_frame and the frame's first token, the slot table itself would not know
    that a frame was begun: SlotState does not hold frame_open.)"""
    loaded, _, built = qwen_fused
    dec = Decoder(built)
    v = dec.manifest.vision
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT * 2, add_special_tokens=False).ids
    frames = [dec.vision.encode(picture(*PICTURE, seed=s)) for s in (3, 4)]
    dec.feed(text[:6] + list(v.image_prefix))
    dec.cache.begin_frame()
    dec.feed([v.image_token_id] * v.image_tokens, pin="image", embeds=frames[0])
    dec.feed(list(v.image_suffix) + text[6:90])
    assert dec.cache.evicted > 0
    resumed = Decoder(built)
    resumed.cache.restore(dec.cache.state())
    for name, buf in dec.backend.buffers().items():
        resumed.backend.buffers()[name][...] = buf
    resumed.backend.restored()
    for d in (dec, resumed):
        d.feed(list(v.image_prefix))
        d.cache.begin_frame()
    got = [d.feed([v.image_token_id] * v.image_tokens, pin="image", embeds=frames[1], all_logits=True) for d in (dec, resumed)]
    np.testing.assert_array_equal(got[1], got[0])
    for chunk in (text[90:91], text[91:107], text[107:108]):
        np.testing.assert_array_equal(resumed.feed(chunk, all_logits=True), dec.feed(chunk, all_logits=True))


def test_drafting_with_frames_on_the_fused_build_gives_the_plain_replies(qwen_fused):
    """As tests/test_fused_vlm.py's: drafts verified while the window fills, none after, the plain replies."""
    from test_fused_vlm import check_drafting_gives_the_plain_replies

    check_drafting_gives_the_plain_replies(qwen_fused[2])
