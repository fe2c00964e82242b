"""Vision-language models: camera frames in the pinned image region of the constant-memory cache.

Both tower families (CLIP with its CLS token and center crop, SigLIP without either) are checked
against transformers' own LlavaForConditionalGeneration and its Pillow image processors."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from cabinlm.contract.errors import InputError
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


def test_drafting_with_camera_frames_gives_the_plain_replies_through_turnovers(llava, export_to):
    """Drafting with a camera frame pinned and replaced: the same greedy replies as plain decoding,
    through window turnovers. The drafts are what plain decoding fed next (the stream recorded), the
    last of every other draft made wrong, so verifications accept some and reject some. A vision
    model runs the exported graph, whose chunks see the cache as it was before them
    (Backend.verifies_after_turnover is False): its drafts stop once the window is full."""
    from cabinlm.runtime.speculative import Drafting, PlainDecoding

    class Recorder(PlainDecoding):
        def __init__(self):
            super().__init__()
            self.stream: list[int] = []

        def observe(self, ids):
            self.stream += [int(t) for t in ids]

        def push(self, token):
            self.stream.append(int(token))

    class Replay(Drafting):
        drafts = True

        def __init__(self, stream):
            super().__init__()
            self.script, self.stream, self.calls = stream, [], 0

        def observe(self, ids):
            self.stream += [int(t) for t in ids]

        def push(self, token):
            self.stream.append(int(token))

        def propose(self, dec):
            k = min(4, dec.draft_room())
            if k <= 0:
                return ()
            self.calls += 1
            drafts = self.script[len(self.stream) : len(self.stream) + k]
            return drafts[:-1] + [drafts[-1] + 1] if drafts and self.calls % 2 else drafts

    loaded, _ = llava
    folder = export_to(loaded, sink=4, pinned=12, window=96, chunk=16)
    record = Recorder()
    runs = {}
    for drafting in (record, None):
        dec, tok = open_artifact(folder, verify=False)
        assert not dec.backend.verifies_after_turnover
        if drafting is None:
            drafting = Replay(record.stream)
        d = Dialogue(dec, tok, max_new_tokens=12, drafting=drafting)
        got, late = [], 0
        for i in range(24):
            image = picture(40 + i % 5, 32, seed=i) if i % 4 == 0 else None
            full = dec.cache.window_fill == dec.layout.window
            r = d.ask("the road ahead, the road ahead?", image=image)
            got.append(r.reply)
            late += r.drafted_tokens if full else 0
        assert dec.cache.evicted > 2 * dec.layout.window and dec.cache.frames == 6
        runs[type(drafting).__name__] = (got, drafting.drafted, drafting.accepted, late)
    plain, replay = runs["Recorder"], runs["Replay"]
    assert replay[0] == plain[0]
    assert replay[1] > 0 and 0 < replay[2] < replay[1]  # drafts verified, some accepted, some rejected
    assert replay[3] == 0  # none once the window is full


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
    from cabinlm.contract.errors import ManifestError
    from cabinlm.contract.manifest import Manifest

    _, folder = llava
    d = json.loads((folder / "manifest.json").read_text())
    Manifest.from_dict(d)
    d["vision"]["preprocess"][field] = bad
    with pytest.raises(ManifestError, match="preprocess"):
        Manifest.from_dict(d)


def write_png_bomb(path, w: int, h: int):
    """A valid 1-bit PNG of w x h black pixels: each row inflates from almost nothing, so a few kB of
    file claim w * h pixels (decoded as a PIL image: w * h bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, row = zlib.compressobj(9), bytes(1 + (w + 7) // 8)  # filter byte + w bits
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    header = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)  # bit depth 1, grayscale, no interlace
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


# Pillow checks a size against MAX_IMAGE_PIXELS when it opens a file: beyond it a warning (which the
# caller sees as a stray line, and the image is then decoded), beyond twice it an exception (which was
# a traceback). Both sides of the factor two are checked; neither may leave a warning behind.
@pytest.mark.parametrize("w, h", [(9000, 9000), (20000, 20000)], ids=["beyond-the-limit", "beyond-twice-the-limit"])
def test_a_decompression_bomb_is_refused_with_the_reason_and_no_warning(tmp_path, w, h):
    import warnings

    bomb = write_png_bomb(tmp_path / "bomb.png", w, h)
    assert bomb.stat().st_size < 60_000
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(InputError, match=f"decompression bomb .*{w * h} pixels"):
            load_image(bomb)
    assert not seen, [str(w.message) for w in seen]
    write_png_bomb(tmp_path / "fine.png", 4000, 3000)  # 12 megapixels: a camera frame, not a bomb
    assert load_image(tmp_path / "fine.png").size == (4000, 3000)


def _png_with_text(path, how: str):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    if how == "one zTXt chunk of 2 MB":
        info.add_text("comment", "a" * 2_000_000, zip=True)
    elif how == "one iTXt chunk of 2 MB":
        info.add_itxt("comment", "a" * 2_000_000, zip=True)
    elif how == "70 zTXt chunks of 1 MB":  # each within the limit of one chunk, 70 MB in all
        for i in range(70):
            info.add_text(f"c{i}", "a" * 1_000_000, zip=True)
    elif how == "a zTXt chunk of 2 MB after the pixels":  # read by load(), not open()
        import zlib

        info.add(b"zTXt", b"comment\0\0" + zlib.compress(b"a" * 2_000_000), after_idat=True)
    elif how == "a small text chunk":
        info.add_text("comment", "front camera, 08:15")
    picture(16, 12).save(path, pnginfo=info)
    return path


@pytest.mark.parametrize("how", ["one zTXt chunk of 2 MB", "one iTXt chunk of 2 MB", "70 zTXt chunks of 1 MB",
                                 "a zTXt chunk of 2 MB after the pixels"])  # fmt: skip
def test_a_png_with_oversized_text_metadata_is_refused_with_the_reason(tmp_path, how):
    path = _png_with_text(tmp_path / "meta.png", how)
    assert path.stat().st_size < 100_000  # compressed text: small files, megabytes once read
    with pytest.raises(InputError, match="text metadata is too large .*(MAX_TEXT_CHUNK|MAX_TEXT_MEMORY)"):
        load_image(path)
    assert load_image(_png_with_text(tmp_path / "ok.png", "a small text chunk")).size == (16, 12)


def _llava_processor(folder):
    """The processor transformers 5 makes of a LLaVA folder: its image processor and tokenizer."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, LlavaProcessor

    cfg = AutoConfig.from_pretrained(folder)
    return LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                          tokenizer=AutoTokenizer.from_pretrained(folder), patch_size=cfg.vision_config.patch_size,
                          vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                          image_token="<image>")  # fmt: skip


def test_a_llava_folder_as_transformers_5_saves_it_exports_the_same_preprocessing(llava, tiny_llava_dir, tmp_path, load,
                                                                                  export_to):  # fmt: skip
    """transformers 5's save_pretrained of a LLaVA processor writes processor_config.json with the image
    processor nested inside and no preprocessor_config.json (that was export's "needs its
    preprocessor_config.json"). The folder in that layout exports the same image preprocessing as
    the older layout, and what transformers itself reads from it prepares images as we do."""
    from cabinlm.contract.manifest import load_manifest

    _llava_processor(tiny_llava_dir).save_pretrained(tmp_path / "saved")
    nested = json.loads((tmp_path / "saved" / "processor_config.json").read_text())
    assert "image_processor" in nested and not (tmp_path / "saved" / "preprocessor_config.json").exists()
    moved = tmp_path / "t5"
    shutil.copytree(tiny_llava_dir, moved)
    (moved / "preprocessor_config.json").unlink()
    shutil.copy(tmp_path / "saved" / "processor_config.json", moved / "processor_config.json")

    _, older = llava
    folder = export_to(load(str(moved)), sink=4, pinned=12, window=48, chunk=16)
    spec = load_manifest(folder).vision
    assert spec.preprocess == load_manifest(older).vision.preprocess
    img = picture(47, 61, seed=9)
    ref = hf_processor(moved)(images=img, return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(preprocess(load_image(img), spec), ref, atol=1e-5)


def test_the_image_processor_is_read_where_transformers_reads_it(tiny_llava_dir, tmp_path):
    """Both files present (a processor saved over an older folder): the nested settings win, as in
    transformers; a processor_config.json without them defers to preprocessor_config.json; neither is
    a ModelError naming both files. Each layout is checked against AutoImageProcessor itself."""
    from cabinlm.contract.errors import ModelError
    from cabinlm.source.processor import image_processor_config

    folder = tmp_path / "m"
    shutil.copytree(tiny_llava_dir, folder)
    own = json.loads((folder / "preprocessor_config.json").read_text())
    nested = {**own, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    layouts = {
        "nested and own file": ({"image_processor": nested, "processor_class": "LlavaProcessor"}, own, nested),
        "processor without the nested settings": ({"processor_class": "LlavaProcessor", "patch_size": 6}, own, own),
        "nested only": ({"image_processor": nested}, None, nested),
    }
    for name, (processor, preprocessor, expected) in layouts.items():
        (folder / "processor_config.json").write_text(json.dumps(processor))
        (folder / "preprocessor_config.json").unlink(missing_ok=True)
        if preprocessor is not None:
            (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
        got, _ = image_processor_config(folder)
        assert got == expected, name
        assert list(hf_processor(folder).image_mean) == expected["image_mean"], name
    (folder / "processor_config.json").unlink()
    with pytest.raises(ModelError, match="processor_config.json .*preprocessor_config.json"):
        image_processor_config(folder)


def test_a_llava_folder_without_an_image_processor_is_refused_before_its_weights_load(tiny_llava_dir, tmp_path):
    from cabinlm.contract.errors import ModelError
    from cabinlm.export.models import load_model

    folder = tmp_path / "m"
    shutil.copytree(tiny_llava_dir, folder)
    (folder / "preprocessor_config.json").unlink()
    (folder / "model.safetensors").write_bytes(b"not weights")  # reading them would fail differently
    with pytest.raises(ModelError, match="needs its image processor"):
        load_model(str(folder))
