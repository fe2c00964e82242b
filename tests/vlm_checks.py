"""What the vision-language families' tests (test_qwen2_vl.py, test_idefics3.py) check alike: a
frame, transformers' image inputs, the NLL and greedy tokens from transformers' logits, and the
checks that run the same way on any family's exported artifact. What differs between the families
comes in as arguments: hf_logits (how transformers takes the family's image and ids), the frame's
size in pixels, the text around the frame."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cabinlm.runtime import Decoder
from cabinlm.runtime.vision import load_image

from test_cli import cabinlm

TEXT = ("The driver asked the assistant about the weather, the route and the charging stations on the way. "
        "Keep a safe distance and take a break every two hours.")  # fmt: skip

# transformers' logits (len(ids), vocab) for ids holding one image's tokens, with that image
HfLogits = Callable[..., np.ndarray]  # (loaded, ids, image) -> logits


def picture(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((h, w, 4)) * 255).astype(np.uint8), "RGBA")
    return img if mode == "RGBA" else img.convert(mode)


def hf_inputs(folder, img) -> dict:
    """The folder's own transformers image processor on img: pixel_values and the family's extras
    (Qwen2-VL: image_grid_thw; Idefics3: pixel_attention_mask)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)(images=img, return_tensors="pt")


def nll_of(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
    return lse - z[np.arange(len(targets)), targets]


def hf_greedy(hf_logits: HfLogits, loaded, prompt: list[int], img, stop_ids, max_new_tokens: int) -> list[int]:
    """transformers' greedy reply to prompt and img, up to a stop id (not included)."""
    ids, reply = list(prompt), []
    for _ in range(max_new_tokens):
        t = int(hf_logits(loaded, ids, img)[-1].argmax())
        if t in stop_ids:
            break
        ids.append(t)
        reply.append(t)
    return reply


def check_the_vision_graph_gives_transformers_image_features(loaded, folder: Path, size: tuple[int, int], layout: str,
                                                              shape: tuple[int, int]) -> None:  # fmt: skip
    """The vision graph's rows (image tokens, text hidden size) for a frame == transformers'
    get_image_features on the processor's pixel_values and `layout` (Qwen2-VL: image_grid_thw;
    Idefics3: pixel_attention_mask); another frame's differ."""
    dec = Decoder(folder)
    img = picture(*size, seed=3)
    px = hf_inputs(loaded.folder, img)
    with torch.no_grad():
        ref = loaded.model.model.get_image_features(px["pixel_values"], px[layout]).pooler_output[0].numpy()
    ours = dec.vision.encode(img)
    assert ours.shape == ref.shape == shape
    np.testing.assert_allclose(ours, ref, atol=1e-4)  # measured 7e-6 Qwen2-VL (values up to ~9), 4e-6 Idefics3 (~6)
    assert np.abs(dec.vision.encode(picture(*size, seed=4)) - ref).max() > 0.1  # another frame: other features


def check_a_turn_with_a_frame_gives_transformers_logits(loaded, folder: Path, hf_logits: HfLogits, head: str,
                                                        question: str, size: tuple[int, int]) -> None:  # fmt: skip
    """head, then the frame pinned, then question, in the artifact's chunks (16 tokens in the tests):
    every token's logits == transformers' on the same ids and frame; another frame's differ. An empty
    head puts the frame at the stream's start (its first tokens then sit in the sink)."""
    dec = Decoder(folder)
    v = dec.manifest.vision
    tok = loaded.tokenizer.backend_tokenizer
    head_ids = tok.encode(head, add_special_tokens=False).ids + list(v.image_prefix)
    tail = list(v.image_suffix) + tok.encode(question, add_special_tokens=False).ids
    image = [v.image_token_id] * v.image_tokens
    img = picture(*size, seed=5)
    ids = head_ids + image + tail
    ref = hf_logits(loaded, ids, img)
    ours = [dec.feed(head_ids, all_logits=True)]
    dec.cache.begin_frame()
    ours.append(dec.feed(image, pin="image", all_logits=True, embeds=dec.vision.encode(img)))
    ours.append(dec.feed(tail, all_logits=True))
    np.testing.assert_allclose(np.concatenate(ours), ref, atol=1e-4)  # measured 5e-6 Qwen2-VL, 3e-6 Idefics3 (up to ~5)
    other = hf_logits(loaded, ids, picture(*size, seed=6))
    assert np.abs(other[-1] - ref[-1]).max() > 1e-2  # the comparison can tell frames apart


def check_perplexity_with_a_frame(loaded, folder: Path, hf_logits: HfLogits, frame_ids: list[int],
                                  size: tuple[int, int], tmp_path: Path) -> None:  # fmt: skip
    """`cabinlm perplexity ART --image FRAME`: the text's NLL after the frame == transformers' on
    frame_ids (one image as the processor lays it out) + the text; a wrong frame is clearly apart."""
    frame, wrong = tmp_path / "cabin.png", tmp_path / "other.png"
    picture(*size, seed=8).save(frame)
    picture(*size, seed=9).save(wrong)
    (tmp_path / "t.txt").write_text(TEXT)
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT).ids[:60]  # the stream fits the cache: exactly the model
    ids = frame_ids + text
    first = len(ids) - len(text)  # the text's first token
    ref = nll_of(hf_logits(loaded, ids, load_image(frame))[first:-1], text[1:])  # text tokens 2..N
    for image, out in ((frame, tmp_path / "nll.npy"), (wrong, tmp_path / "wrong.npy")):
        p = cabinlm("perplexity", folder, "--image", image, "--text", tmp_path / "t.txt", "--nll-out", out,
                    "--max-tokens", 60, "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["tokens"] == len(text)
    ours, theirs_wrong = np.load(tmp_path / "nll.npy"), np.load(tmp_path / "wrong.npy")
    assert ours.shape == ref.shape == (len(text) - 1,)
    np.testing.assert_allclose(ours, ref, atol=1e-4)  # fp32 throughout; measured ~3e-6 (Qwen2-VL)
    assert np.abs(theirs_wrong - ref).mean() > 0.1  # another frame: Qwen2-VL's 0.45 on average (2.1 at most)


def check_perplexity_refuses_a_file_that_is_no_image(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "no.png").write_bytes(b"not a picture")
    p = cabinlm("perplexity", folder, "--image", tmp_path / "no.png", "--text", tmp_path / "t.txt")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'no.png'}: not an image Pillow can read (PNG, JPEG, BMP, ...)"]


def check_the_cpu_build_scores_a_frame_as_the_export(loaded, folder: Path, size: tuple[int, int],
                                                      tmp_path: Path) -> None:  # fmt: skip
    """`cabinlm build --profile cpu`: a frame and text score as the export does (NLL within 1e-5)."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile
    from cabinlm.runtime import stream_perplexity

    built = build_artifact(folder, load_profile("cpu"), tmp_path / "build-cpu")
    ids = loaded.tokenizer.backend_tokenizer.encode(TEXT).ids[:40]
    results = []
    for art in (folder, built):
        dec = Decoder(art)
        results.append(stream_perplexity(dec, ids, frame=dec.vision.encode(picture(*size, seed=10))).nll)
    assert Decoder(built).manifest.build is not None
    np.testing.assert_allclose(results[1], results[0], atol=1e-5)


def forty_frames_at_constant_memory(loaded, folder: Path, size: tuple[int, int]) -> tuple[Decoder, list[int], list]:
    """40 frames, each replacing the last in the image region (the first after two tokens: its first
    tokens sit in the sink), text between them evicting hundreds of tokens: the buffers never move
    and memory stays flat. Returns the decoder, the text's ids and the 4 frames' image embeddings."""
    import gc

    from cabinlm.runtime.memory import rss_mb
    from cabinlm.runtime.perplexity import feed_frame

    dec = Decoder(folder)
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT, add_special_tokens=False).ids
    frames = [dec.vision.encode(picture(*size, seed=s)) for s in range(4)]
    kv = dec.backend
    addresses = (kv.keys.ctypes.data, kv.values.ctypes.data)
    samples = []
    dec.feed(text[:2])
    for i in range(40):
        feed_frame(dec, frames[i % 4])
        dec.feed(text[(i * 7) % 50 : (i * 7) % 50 + 23])
        if i in (10, 39):
            gc.collect()
            samples.append(rss_mb())
    assert dec.cache.frames == 40 and dec.cache.evicted > 500
    assert (kv.keys.ctypes.data, kv.values.ctypes.data) == addresses
    assert samples[1] - samples[0] < 8.0, samples
    return dec, text, frames


def check_a_session_saved_with_its_frame_resumes_with_the_same_replies(folder: Path, size: tuple[int, int],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """A dialogue with a frame pinned (and the window turned over) saved to a session file; another
    dialogue loads it (where the frame starts derived again) and answers the next turns as the first
    goes on to, its cache's tokens in the same slots."""
    from cabinlm.runtime import Dialogue, open_artifact
    from cabinlm.runtime.persist import load_session, save_session

    dialogues = []
    for _ in range(2):
        dec, tok = open_artifact(folder, verify=False)
        dialogues.append(Dialogue(dec, tok, max_new_tokens=8))
    first, second = dialogues
    first.ask("the cabin camera, please", image=picture(*size, seed=13))
    for i in range(6):
        first.ask(f"turn {i}: anything new on the road ahead?")
    assert first.decoder.cache.evicted > 0
    save_session(tmp_path / "s.session", first)
    load_session(tmp_path / "s.session", second)
    assert second.decoder.cache.frame_start == first.decoder.cache.frame_start >= 0
    for text in ("and the weather?", "how far to the charging station?"):
        assert second.ask(text).reply == first.ask(text).reply
    np.testing.assert_array_equal(second.decoder.cache.slot_token, first.decoder.cache.slot_token)


def frames_against_the_reference(loaded, dec: Decoder, size: tuple[int, int], seeds: list[int],
                                 spans: list[tuple[int, int]]) -> float:
    """A 1-D-RoPE VLM's decoder beyond its cache against vlm_reference.FrameStreamingReference (positions
    are ranks): for each frame (a picture of `size` from seeds[i]) its image prefix, the frame pinned, then
    its image suffix and TEXT's tokens spans[i] as stretches of one-token steps and of 16-token chunks,
    the window evicting the text around the frame; each new frame replaces the last while text fed after
    it is still cached. Returns the worst logit difference over every fed token."""
    from vlm_reference import FrameStreamingReference

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
            n = 16 if (i // 40) % 2 else 1  # stretches of one-token steps and of chunks
            both(ids[i : i + n])
            i += n

    head = tok.encode("<|im_start|>User:", add_special_tokens=False).ids
    for k, (seed, (a, b)) in enumerate(zip(seeds, spans)):
        both((head if k == 0 else []) + list(v.image_prefix))
        both(dec.vision.encode(picture(*size, seed=seed)), frame=True)
        stream(list(v.image_suffix) + text[a:b])
        if k == 0:
            assert dec.cache.evicted > 60  # the window turned over around the first frame
    assert dec.cache.frames == len(seeds)
    assert len(ref.entries) == int((dec.cache.slot_token >= 0).sum())
    return worst
