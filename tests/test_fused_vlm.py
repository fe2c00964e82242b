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

from cabinlm.engines.registry import BackendKind
from cabinlm.runtime import Decoder

import vlm_checks as vlm
from test_idefics3 import PICTURE, frame_ids, hf_logits, make_tiny_idefics3
from vlm_checks import TEXT, picture
from vlm_reference import FrameStreamingReference


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
    v = dec.manifest.vision
    lm = loaded.model.model.text_model
    ref = FrameStreamingReference(loaded.model, lm, dec.layout.sink, dec.layout.window, lm.rotary_emb.inv_freq)
    embed = lm.embed_tokens
    tok = loaded.tokenizer.backend_tokenizer
    text = tok.encode(TEXT * 3, add_special_tokens=False).ids
    worst = 0.0

    def both(ids_or_frame, frame: bool = False) -> None:
        nonlocal worst
        if frame:
            dec.cache.begin_frame()
            ours = dec.feed([v.image_token_id] * v.image_tokens, pin="image", all_logits=True, embeds=ids_or_frame)
            theirs = ref.feed(torch.from_numpy(ids_or_frame), frame=True)
        else:
            ours = dec.feed(ids_or_frame, all_logits=True)
            theirs = ref.feed(embed(torch.tensor(ids_or_frame)))
        worst = max(worst, float(np.abs(ours - theirs.numpy()).max()))

    def stream(ids: list[int]) -> None:
        i = 0
        while i < len(ids):
            n = 16 if (i // 40) % 2 else 1
            both(ids[i : i + n])
            i += n

    both(tok.encode("<|im_start|>User:", add_special_tokens=False).ids + list(v.image_prefix))
    both(dec.vision.encode(picture(*PICTURE, seed=7)), frame=True)
    stream(list(v.image_suffix) + text[:150])
    assert dec.cache.evicted > 60
    both(list(v.image_prefix))
    both(dec.vision.encode(picture(*PICTURE, seed=8)), frame=True)  # text after frame 1 still cached
    stream(list(v.image_suffix) + text[150:190])
    both(list(v.image_prefix))
    both(dec.vision.encode(picture(*PICTURE, seed=9)), frame=True)
    stream(list(v.image_suffix) + text[190:260])
    assert dec.cache.frames == 3 and dec.cache.evicted > 150
    assert len(ref.entries) == int((dec.cache.slot_token >= 0).sum())
    assert worst < 1e-4, worst


def test_a_session_saved_with_its_frame_resumes_on_the_fused_build(fused, tmp_path):
    _, _, built = fused
    vlm.check_a_session_saved_with_its_frame_resumes_with_the_same_replies(built, PICTURE, tmp_path)
