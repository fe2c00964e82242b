"""Vision-language models: camera frames in the pinned image region of the constant-memory cache.

Both tower families (CLIP with its CLS token and center crop, SigLIP without either) are checked
against transformers' own LlavaForConditionalGeneration and its Pillow image processors."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from cabinlm.errors import InputError
from cabinlm.runtime import Decoder, Dialogue, open_artifact
from cabinlm.runtime.memory import rss_mb
from cabinlm.runtime.vision import load_image, preprocess


def picture(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = (rng.random((h, w, 4)) * 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGBA")
    return img if mode == "RGBA" else img.convert(mode)


@pytest.fixture(scope="module")
def llava(load, tiny_llava_dir, export_to):
    loaded = load(str(tiny_llava_dir))
    return loaded, export_to(loaded, sink=4, pinned=12, window=48, chunk=16)


def hf_processor(folder):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)


@pytest.mark.parametrize("size", [(47, 61), (61, 47), (30, 30), (12, 90), (640, 480)])
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_preprocessing_equals_the_transformers_processor(llava, tiny_llava_dir, size, mode):
    _, folder = llava
    dec = Decoder(folder)
    img = picture(*size, mode=mode)
    ours = preprocess(load_image(img), dec.manifest.vision)
    ref = hf_processor(tiny_llava_dir)(images=img, return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_the_first_turn_with_an_image_equals_transformers(llava):
    loaded, folder = llava
    dec = Decoder(folder)
    vision = dec.manifest.vision
    tok = loaded.tokenizer.backend_tokenizer
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False).ids
    tail = tok.encode(" what is on the road ahead?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    img = picture(64, 48, seed=3)
    ids = head + [vision.image_token_id] * vision.image_tokens + tail
    pixels = hf_processor(loaded.folder)(images=img, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = loaded.model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0].numpy()
    ours = [dec.feed(head, all_logits=True)]
    dec.cache.begin_frame()
    ours.append(dec.feed([vision.image_token_id] * vision.image_tokens, pin="image", all_logits=True,
                         embeds=dec.vision.encode(img)))  # fmt: skip
    ours.append(dec.feed(tail, all_logits=True))
    np.testing.assert_allclose(np.concatenate(ours), ref, atol=1e-3)
    # the comparison can tell: another image changes the logits after the image
    with torch.no_grad():
        other = loaded.model(input_ids=torch.tensor([ids]), pixel_values=hf_processor(loaded.folder)(
            images=picture(64, 48, seed=4), return_tensors="pt")["pixel_values"]).logits[0].numpy()  # fmt: skip
    assert np.abs(other[-1] - ref[-1]).max() > 1e-2


def test_many_frames_and_turns_keep_one_frame_pinned_at_constant_memory(llava):
    _, folder = llava
    dec, tok = open_artifact(folder, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=5)
    lay = dec.layout
    c, kv = dec.cache, dec.backend
    addresses = (kv.keys.ctypes.data, kv.values.ctypes.data, kv.keys.shape)
    samples = []
    for i in range(120):
        image = picture(40 + i % 7, 30 + i % 5, seed=i) if i % 3 == 0 else None
        d.ask(f"turn {i}: anything new?", image=image)
        region = c.slot_token[lay.image_start : lay.window_start]
        # exactly one frame's tokens: consecutive stream indices, all present
        assert (region >= 0).all() and (np.diff(region) == 1).all()
        window = np.sort(c.slot_token[lay.window_start :][c.slot_token[lay.window_start :] >= 0])
        # the window holds the most recent unpinned tokens: nothing newer is missing from it
        newer_than_window = np.arange(window[0], c.seen)
        missing = np.setdiff1d(newer_than_window, np.concatenate([window, region]))
        assert missing.size == 0
        if i in (30, 119):
            gc.collect()
            samples.append(rss_mb())
    assert c.frames == 40 and c.evicted > 5 * lay.window
    assert (kv.keys.ctypes.data, kv.values.ctypes.data, kv.keys.shape) == addresses
    assert c.slot_token[: lay.sink].tolist() == list(range(lay.sink))
    assert samples[1] - samples[0] < 8.0, samples


def test_bad_images_are_refused_and_the_dialogue_goes_on(llava, tmp_path):
    _, folder = llava
    dec, tok = open_artifact(folder, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=3)
    d.ask("hello", image=picture(50, 40))
    (tmp_path / "notes.txt").write_text("not an image")
    picture(50, 40).save(tmp_path / "good.png")
    data = (tmp_path / "good.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    Image.new("L", (9000, 8000)).save(tmp_path / "huge.png")
    cases = [(tmp_path / "notes.txt", "not an image"), (tmp_path / "cut.png", "corrupt or truncated"),
             (tmp_path / "huge.png", "megapixels"), (tmp_path / "missing.jpg", "no such image")]  # fmt: skip
    for path, message in cases:
        before = (dec.cache.slot_token.copy(), dec.cache.seen, d.turns)
        with pytest.raises(InputError, match=message):
            d.ask("look", image=path)
        assert (dec.cache.slot_token == before[0]).all() and dec.cache.seen == before[1] and d.turns == before[2]
    picture(50, 40, mode="LA").save(tmp_path / "gray_alpha.png")
    assert d.ask("and this one?", image=tmp_path / "gray_alpha.png").turn == d.turns


def test_a_text_model_refuses_images(load, tiny_qwen2_dir, export_to):
    dec, tok = open_artifact(export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=64, chunk=16), verify=False)
    with pytest.raises(InputError, match="no vision input"):
        Dialogue(dec, tok).ask("what do you see?", image=picture(10, 10))


def test_chat_cli_takes_images_by_flag_and_json_lines(llava, tmp_path):
    _, folder = llava
    picture(50, 40, seed=1).save(tmp_path / "a.png")
    picture(50, 40, seed=2).save(tmp_path / "b.jpg")
    lines = "hello\n" + json.dumps({"text": "and now?", "image": str(tmp_path / "b.jpg")}) + "\n" + \
        json.dumps({"text": "broken", "image": str(tmp_path / "nope.png")}) + "\nstill there?\n"  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "cabinlm", "chat", str(folder), "--json", "--max-new-tokens", "3",
                        "--image", str(tmp_path / "a.png")], input=lines, capture_output=True, text=True, timeout=120)  # fmt: skip
    turns = [json.loads(line) for line in p.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert "no such image" in p.stderr and "Traceback" not in p.stderr and p.returncode == 1


def _chat(folder, session, *args):
    """A chat process reading JSON lines from a pipe, one turn per line, one JSON result per turn."""
    return subprocess.Popen([sys.executable, "-m", "cabinlm", "chat", str(folder), "--json", "--max-new-tokens", "5",
                             "--session", str(session), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _turn(p: subprocess.Popen, line: dict) -> dict:
    p.stdin.write(json.dumps(line) + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_a_vision_session_killed_and_resumed_reports_and_computes_what_the_uninterrupted_one_does(llava, tmp_path):
    """kill -9 after a turn with a camera frame (the session file saved), a new process resumes it:
    every later turn (a text turn that still sees the frame, a new frame, more text) reports the
    same reply, cache tokens and evictions as one process that was never interrupted. The frame's
    region state (its fill and the frames counter) is part of the saved state: without it, the
    resumed cache would count the frame's tokens as missing and mask them."""
    _, folder = llava
    frames = []
    for seed in (5, 6):
        frames.append(tmp_path / f"frame{seed}.png")
        picture(48, 40, seed=seed).save(frames[-1])
    turns = [{"text": "what is in front of the car?", "image": str(frames[0])}, {"text": "and on the left?"},
             {"text": "and now?", "image": str(frames[1])}] + [{"text": f"anything else {i}?"} for i in range(4)]  # fmt: skip
    whole = _chat(folder, tmp_path / "whole.ses")
    expected = [_turn(whole, t) for t in turns]
    whole.stdin.close()
    assert whole.wait(timeout=120) == 0
    assert expected[-1]["evicted_tokens"] > 0  # the window turned over after the frames

    keys = ("turn", "reply", "prompt_tokens", "new_tokens", "cache_tokens", "cache_bytes", "evicted_tokens", "finish")
    killed = _chat(folder, tmp_path / "s.ses")
    first = _turn(killed, turns[0])
    killed.kill()  # SIGKILL: no clean-up runs; the session file was saved after the turn
    killed.wait(timeout=30)
    assert {k: first[k] for k in keys} == {k: expected[0][k] for k in keys}
    resumed = _chat(folder, tmp_path / "s.ses")
    got = [first] + [_turn(resumed, t) for t in turns[1:]]
    resumed.stdin.close()
    assert resumed.wait(timeout=120) == 0, resumed.stderr.read()
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in expected]


@pytest.mark.parametrize("field,bad", [("resize", {"shortest_edge": -3}), ("resize", {"width": 30}), ("resample", 9),
                                       ("crop", "30x30"), ("mean", [0.5, 0.5]), ("std", None)])  # fmt: skip
def test_image_preprocessing_in_the_manifest_is_typed_and_checked(llava, field, bad):
    """The runtime reads the image processor as typed data: a wrong field is a manifest error."""
    from cabinlm.errors import ManifestError
    from cabinlm.manifest import Manifest

    _, folder = llava
    d = json.loads((folder / "manifest.json").read_text())
    Manifest.from_dict(d)
    d["vision"]["preprocess"][field] = bad
    with pytest.raises(ManifestError, match="preprocess"):
        Manifest.from_dict(d)
