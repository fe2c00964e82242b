"""Idefics3 and SmolVLM on the exported graph: the image processor without image splitting (the
longest-edge resize, then the max_image_size square), the SigLIP-style tower with the pixel shuffle
and connector, and the Llama decoder with the frame in the pinned image region, each checked against
transformers' own Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration on a tiny random
model whose processor configs are written by the family's own classes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cabinlm.contract.errors import ModelError
from cabinlm.runtime import Decoder
from cabinlm.runtime.vision import load_image, preprocess

import vlm_checks as vlm
from test_cli import cabinlm
from vlm_checks import TEXT, hf_greedy, hf_inputs, picture

# SmolVLM's chat template (its Hub folders' chat_template.json; transformers' smolvlm DEFAULT_CHAT_TEMPLATE)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == 'image' %}"
    "{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SIDE, LONGEST, TOKENS = 32, 64, 16  # max_image_size, size's longest_edge, image tokens: (32 / 4)^2 / 2^2
PICTURE = (64, 48)  # most test frames' (width, height): resized twice, to 64x48 and to the 32x32 square


def make_tiny_idefics3(folder: Path, family: str = "idefics3", seed: int = 0, image_seq_len: int = TOKENS,
                       **image_processor) -> Path:
    """A random-weight Idefics3 ("idefics3") or SmolVLM ("smolvlm") folder: a SigLIP-style tower (image
    32, patch 4: 8 x 8 patches), the pixel shuffle (scale 2) and connector, a tiny Llama text model, a BPE
    tokenizer with <fake_token_around_image> <image> <end_of_utterance> <global-img> and SmolVLM's chat
    template, and the processor's configs as the family's classes save them: Idefics3Processor's
    processor_config.json (the image processor nested, image_seq_len) for Idefics3; SmolVLM's image
    processor alone (its processor needs a video processor, hence torchvision) for SmolVLM."""
    import transformers as tf

    from conftest import _tokenizer

    tok = _tokenizer(SMOLVLM_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                                                         "<global-img>"]})  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=SIDE,
                  patch_size=4, initializer_range=0.2)  # fmt: skip
    text = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                initializer_range=0.15, rope_theta=10000.0, eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"))  # fmt: skip
    config_class, model_class, processor_class = {
        "idefics3": (tf.Idefics3Config, tf.Idefics3ForConditionalGeneration, tf.Idefics3ImageProcessorPil),
        "smolvlm": (tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration, tf.SmolVLMImageProcessorPil),
    }[family]
    torch.manual_seed(seed)
    cfg = config_class(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                       scale_factor=2)  # fmt: skip
    model = model_class(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    images = processor_class(**{"size": {"longest_edge": LONGEST}, "max_image_size": {"longest_edge": SIDE},
                                "do_image_splitting": False, **image_processor})  # fmt: skip
    if family == "idefics3":
        tf.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=image_seq_len,
                             chat_template=SMOLVLM_TEMPLATE).save_pretrained(folder)  # fmt: skip
    else:
        images.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["idefics3", "smolvlm"])
def tiny_idefics3_dir(request, tmp_path_factory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, seed=1)


@pytest.fixture(scope="module")
def idefics3(tiny_idefics3_dir, load, export_to):
    loaded = load(str(tiny_idefics3_dir))
    return loaded, export_to(loaded, sink=4, pinned=24, window=64, chunk=16)


def hf_logits(loaded, ids: list[int], img) -> np.ndarray:
    px = hf_inputs(loaded.folder, img)
    with torch.no_grad():
        out = loaded.model(input_ids=torch.tensor([ids]), pixel_values=px["pixel_values"],
                           pixel_attention_mask=px["pixel_attention_mask"])  # fmt: skip
    return out.logits[0].numpy()


def frame_ids(v) -> list[int]:
    """One image as the processor expands it: <fake_token_around_image><global-img>, the image tokens,
    <fake_token_around_image>."""
    return list(v.image_prefix) + [v.image_token_id] * v.image_tokens + list(v.image_suffix)


# -- the image processor, the tokens around an image, the vision tower ------------------------------


@pytest.mark.parametrize("size", [(64, 48), (48, 64), (32, 32), (33, 17), (640, 480), (7, 200)])
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_a_frame_of_any_size_is_prepared_as_the_transformers_processor_does(idefics3, size, mode):
    """Two Lanczos resizes (the longest edge to size["longest_edge"], the other side made even, then
    the max_image_size square), rescale, normalize; no padding for one image."""
    loaded, folder = idefics3
    spec = Decoder(folder).manifest.vision
    assert (spec.image_size, spec.image_tokens, spec.preprocess.longest_edge) == (SIDE, TOKENS, LONGEST)
    img = picture(*size, mode=mode, seed=1)
    ours = preprocess(load_image(img), spec)
    ref = hf_inputs(loaded.folder, load_image(img))
    assert ref["pixel_values"].shape == (1, 1, 3, SIDE, SIDE) and bool(ref["pixel_attention_mask"].all())
    assert ours.shape == (1, 3, SIDE, SIDE)
    np.testing.assert_allclose(ours, ref["pixel_values"][0].numpy(), atol=1e-5)  # measured 1.2e-7


def test_the_longest_edge_step_is_the_processors_size_rule():
    """runtime.vision.longest_edge_size == transformers' own functions, odd sides and huge ones too."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import get_resize_output_image_size

    from cabinlm.runtime.vision import longest_edge_size

    rng = np.random.default_rng(0)
    for h, w, longest in [(480, 640, 2048), (641, 479, 1536), (1, 300, 64), (300, 1, 64), (7, 7, 5), (100, 3000, 8000)] + [
        (int(a), int(b), int(c)) for a, b, c in rng.integers(1, 5000, size=(200, 3))
    ]:
        assert longest_edge_size(h, w, longest) == get_resize_output_image_size(np.zeros((3, h, w)), longest), (h, w, longest)


def test_the_processor_expands_one_image_as_the_artifacts_prefix_image_tokens_and_suffix(idefics3):
    """Idefics3Processor's own expansion of "<image>" followed by text (one image, no splitting)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    loaded, folder = idefics3
    v = Decoder(folder).manifest.vision
    images = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST}, max_image_size={"longest_edge": SIDE},
                                       do_image_splitting=False)  # fmt: skip
    proc = Idefics3Processor(image_processor=images, tokenizer=loaded.tokenizer, image_seq_len=TOKENS)
    got = proc(images=[picture(40, 30)], text=["<image>" + TEXT])["input_ids"][0]
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert list(got) == frame_ids(v) + text
    tok = loaded.tokenizer
    assert [tok.convert_ids_to_tokens(i) for i in v.image_prefix + v.image_suffix] == [
        "<fake_token_around_image>", "<global-img>", "<fake_token_around_image>"]


def test_the_vision_graph_gives_transformers_image_features(idefics3):
    loaded, folder = idefics3
    shape = (TOKENS, 64)  # (image tokens, the text model's hidden size)
    vlm.check_the_vision_graph_gives_transformers_image_features(loaded, folder, PICTURE, "pixel_attention_mask", shape)


def test_a_processor_square_smaller_than_the_towers_image_size_takes_the_towers_own_position_buckets(tmp_path, load, export_to):
    """max_image_size 16 on a tower of image_size 32 (the processor's choice: 4 image tokens): the
    tower buckets the 4 x 4 patches' positions into its 8 x 8 table; the graph holds those rows."""
    from cabinlm.export.idefics3 import position_rows

    folder = make_tiny_idefics3(tmp_path / "m", seed=1, image_seq_len=4, max_image_size={"longest_edge": 16},
                                size={"longest_edge": 40})  # fmt: skip
    loaded = load(str(folder))
    assert position_rows(loaded.model.model.vision_model.embeddings, 16).tolist() == [
        r * 8 + c for r in (0, 2, 4, 6) for c in (0, 2, 4, 6)]
    dec = Decoder(export_to(loaded, sink=4, pinned=24, window=64, chunk=16))
    img = picture(50, 30, seed=3)
    px = hf_inputs(folder, img)
    np.testing.assert_allclose(preprocess(load_image(img), dec.manifest.vision), px["pixel_values"][0].numpy(), atol=1e-5)
    with torch.no_grad():
        ref = loaded.model.model.get_image_features(px["pixel_values"], px["pixel_attention_mask"]).pooler_output[0].numpy()
    ours = dec.vision.encode(img)
    assert ours.shape == ref.shape == (4, 64)
    np.testing.assert_allclose(ours, ref, atol=1e-4)


# -- the decoder with the frame pinned, against transformers -----------------------------------------


@pytest.mark.parametrize("head", ["", "<|im_start|>User:"])
def test_a_turn_with_a_frame_gives_transformers_logits(idefics3, head):
    loaded, folder = idefics3
    question = "what is on the road ahead?<end_of_utterance>\nAssistant:"
    vlm.check_a_turn_with_a_frame_gives_transformers_logits(loaded, folder, hf_logits, head, question, PICTURE)


def test_streaming_with_a_pinned_frame_follows_the_reference_of_the_semantics(idefics3):
    """Beyond the cache: one-token steps and 16-token chunks with the frame pinned while the window
    evicts the text around it (the tokens around the image too), then a second frame replacing the
    first, against vlm_reference.py's FrameStreamingReference (positions are ranks)."""
    loaded, folder = idefics3
    dec = Decoder(folder)
    worst = vlm.frames_against_the_reference(loaded, dec, PICTURE, [7, 8], [(0, 150), (150, 260)])
    assert dec.cache.evicted > 150  # measured 163
    assert worst < 1e-4, worst  # measured 7.6e-6 (logits up to ~5)


def test_perplexity_with_a_frame_equals_transformers_and_a_wrong_frame_does_not(idefics3, tmp_path):
    loaded, folder = idefics3
    one_frame = frame_ids(Decoder(folder).manifest.vision)
    vlm.check_perplexity_with_a_frame(loaded, folder, hf_logits, one_frame, PICTURE, tmp_path)


def test_perplexity_refuses_a_file_that_is_no_image_in_one_line(idefics3, tmp_path):
    _, folder = idefics3
    vlm.check_perplexity_refuses_a_file_that_is_no_image(folder, tmp_path)


# -- chat, sessions, serve ---------------------------------------------------------------------------


def test_the_chat_pieces_render_what_the_processors_template_renders(idefics3):
    """SmolVLM's template reads typed parts, writes <|im_start|> once, "User:" before an image and
    "User: " before text, "Assistant:" as the generation prompt (the reply brings its space)."""
    from transformers import AutoTokenizer

    loaded, folder = idefics3
    chat = Decoder(folder).manifest.chat
    assert (chat.bos, chat.user_prefix, chat.image_user_prefix, chat.assistant_prefix) == ("<|im_start|>", "User: ", "User:",
                                                                                          "Assistant:")  # fmt: skip
    tok = AutoTokenizer.from_pretrained(loaded.folder)
    msgs = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is ahead?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A car."}]},
            {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]}]  # fmt: skip
    ours = (chat.bos + chat.system_prefix + "Be brief." + chat.system_suffix + chat.image_user_prefix + "<image>What is ahead?"
            + chat.user_suffix + chat.assistant_prefix + " A car." + chat.assistant_suffix + chat.user_prefix + "Thanks!"
            + chat.user_suffix + chat.assistant_prefix)  # fmt: skip
    assert ours == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (Decoder(folder).manifest.stop_ids == [tok.convert_tokens_to_ids("<|im_end|>"),
                                                  tok.convert_tokens_to_ids("<end_of_utterance>")])  # fmt: skip


def test_a_chat_template_kept_by_the_processor_alone_is_read(tmp_path, load):
    """SmolVLM's Hub folders keep the template in chat_template.json (the processor's legacy file),
    which AutoTokenizer does not read; the export reads it as AutoProcessor does."""
    from cabinlm.export import ExportOptions, export_loaded

    folder = make_tiny_idefics3(tmp_path / "m", family="smolvlm", seed=1)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": SMOLVLM_TEMPLATE}))
    loaded = load(str(folder))
    art = export_loaded(loaded, tmp_path / "out", ExportOptions(sink=4, pinned=24, window=64, chunk=16, verify=False))
    assert (art.chat.source, art.chat.bos, art.chat.image_user_prefix) == ("model", "<|im_start|>", "User:")


def test_a_chat_turn_with_a_frame_replies_as_transformers_greedy(idefics3):
    """Dialogue.ask(text, image=...): the prompt ids are the processor's for the template's image turn
    (<|im_start|>User:<image>text<end_of_utterance>\\nAssistant:, the image expanded), the reply
    transformers' greedy tokens on those ids and the frame; a second frame replaces the first."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from cabinlm.runtime import Dialogue, open_artifact

    loaded, folder = idefics3
    dec, tok = open_artifact(folder, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=6)
    images = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST}, max_image_size={"longest_edge": SIDE},
                                       do_image_splitting=False)  # fmt: skip
    proc = Idefics3Processor(image_processor=images, tokenizer=loaded.tokenizer, image_seq_len=TOKENS,
                             chat_template=SMOLVLM_TEMPLATE)  # fmt: skip
    img = picture(*PICTURE, seed=11)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is on the road ahead?"}]}]
    prompt = list(proc(images=[img], text=[proc.apply_chat_template(msgs, add_generation_prompt=True)])["input_ids"][0])
    result = d.ask("what is on the road ahead?", image=img)
    reply = hf_greedy(hf_logits, loaded, prompt, img, dec.manifest.stop_ids, 6)
    assert d.template.start(None) == prompt[:1]  # <|im_start|>, fed when the dialogue starts
    assert result.prompt_tokens == len(prompt) - 1 and result.new_tokens == len(reply) > 0
    assert result.reply == loaded.tokenizer.backend_tokenizer.decode(reply, skip_special_tokens=False)
    d.ask("and now?", image=picture(*PICTURE, seed=12))
    assert dec.cache.frames == 2


def test_a_session_saved_with_its_frame_resumes_with_the_same_replies(idefics3, tmp_path):
    """A dialogue with a frame pinned (and the window turned over) saved to a session file; another
    dialogue loads it and answers the next turns as the first goes on to."""
    _, folder = idefics3
    vlm.check_a_session_saved_with_its_frame_resumes_with_the_same_replies(folder, PICTURE, tmp_path)


def test_chat_cli_takes_frames_by_flag_and_json_lines_and_replies_as_the_library(idefics3, tmp_path):
    """`cabinlm chat ART --image a.png` (the first turn's frame), then a JSON line with another frame:
    the replies the library's Dialogue gives for the same turns and frames."""
    from cabinlm.runtime import Dialogue, open_artifact

    _, folder = idefics3
    picture(50, 40, seed=1).save(tmp_path / "a.png")
    picture(50, 40, seed=2).save(tmp_path / "b.jpg")
    lines = "hello\n" + json.dumps({"text": "and now?", "image": str(tmp_path / "b.jpg")}) + "\nstill there?\n"
    p = subprocess.run([sys.executable, "-m", "cabinlm", "chat", str(folder), "--json", "--max-new-tokens", "4",
                        "--image", str(tmp_path / "a.png")], input=lines, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = [json.loads(line)["reply"] for line in p.stdout.splitlines()]
    dec, tok = open_artifact(folder, verify=False)
    d = Dialogue(dec, tok, max_new_tokens=4)
    expected = [d.ask("hello", image=tmp_path / "a.png").reply, d.ask("and now?", image=tmp_path / "b.jpg").reply,
                d.ask("still there?").reply]  # fmt: skip
    assert got == expected and dec.cache.frames == 2


def test_frames_replaced_over_a_long_stream_at_constant_memory(idefics3):
    """40 frames, each replacing the last in the image region, text between them evicting hundreds of
    tokens: the buffers never move and memory stays flat."""
    loaded, folder = idefics3
    vlm.forty_frames_at_constant_memory(loaded, folder, PICTURE)


def test_images_reach_an_idefics3_artifact_through_serve(idefics3, tmp_path):
    """serve's image_url (a data URL, then a file path) gives the replies the library's Dialogue gives;
    each request sends the conversation so far (test_serve's ask, the user messages' content parts)."""
    import base64

    from test_serve import Server, ask, cabin, library

    _, art = idefics3
    frames = []
    for seed in (1, 2):
        frames.append(tmp_path / f"frame{seed}.png")
        picture(52, 40, seed=seed).save(frames[-1])
    texts, images = ["what is ahead", "and now", "and this one"], [frames[0], None, frames[1]]
    d = library(art)
    expected = [d.ask(text, image=image).reply for text, image in zip(texts, images, strict=True)]
    urls = ["data:image/png;base64," + base64.b64encode(frames[0].read_bytes()).decode(), None, f"file://{frames[1]}"]
    turns = [[{"type": "text", "text": text}] + ([{"type": "image_url", "image_url": {"url": url}}] if url else [])
             for text, url in zip(texts, urls, strict=True)]  # fmt: skip
    with Server(art, tmp_path / "server.log", model="smolvlm") as server:
        client = server.client()
        replies, kinds = [], []
        for i in range(3):
            reply, usage = ask(client, turns[: i + 1], replies, "default", model="smolvlm")
            replies.append(reply)
            kinds.append(cabin(usage)["history"])
        assert replies == expected and kinds == ["extended"] * 3


# -- builds ------------------------------------------------------------------------------------------


def test_the_cpu_build_scores_a_frame_as_the_export(idefics3, tmp_path):
    """`cabinlm build --profile cpu` (an fp32-KV export: the fused decoder, tests/test_fused_vlm.py)."""
    loaded, folder = idefics3
    vlm.check_the_cpu_build_scores_a_frame_as_the_export(loaded, folder, PICTURE, tmp_path)


@pytest.mark.parametrize("profile", ["sa8775p", "sa8295p"])
def test_the_snapdragon_builds_run_a_frame_in_the_htp_simulator_as_the_export(idefics3, export_to, profile, tmp_path):
    """The HTP build of an fp16 export (the decoder and the camera encoder as context binaries,
    engines/qnn_htp/vision_build.py) scores a frame and text as the export does, to fp16's
    precision, in Qualcomm's x86 simulator; another frame moves the NLL further than that."""
    import os

    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile
    from cabinlm.runtime import stream_perplexity

    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):  # `make test` installs the qnn extra: a missing plugin fails there
            raise
        pytest.skip("onnxruntime-qnn (the `qnn` extra) is not installed")
    loaded, _ = idefics3
    art = export_to(loaded, kv="fp16", sink=4, pinned=24, window=64, chunk=16)
    built = build_artifact(art, load_profile(profile), tmp_path / f"build-{profile}")
    assert (built / "vision.ctx_qnn.bin").is_file() and Decoder(built).vision.device == "qnn-htp"
    ids = loaded.tokenizer.backend_tokenizer.encode(TEXT).ids[:40]
    nll = {}
    for name, folder, seed in (("export", art, 10), ("htp", built, 10), ("htp, another frame", built, 11)):
        dec = Decoder(folder)
        nll[name] = stream_perplexity(dec, ids, frame=dec.vision.encode(picture(*PICTURE, seed=seed))).nll
    assert type(Decoder(built).backend).__name__ == "QnnBackend"
    close = np.abs(nll["htp"] - nll["export"])
    assert close.max() < 0.2 and close.mean() < 0.02, close  # fp16 on the HTP: measured 0.06 at most
    assert np.abs(nll["htp, another frame"] - nll["export"]).mean() > 5 * close.mean()


# -- the planner ---------------------------------------------------------------------------------------


def test_the_planner_counts_the_tower_and_the_image_tokens(tiny_idefics3_dir, load):
    """vision_params_from_config == the tower's and connector's parameters as transformers holds them;
    image_tokens_from_config == the rows the tower gives; `cabinlm plan` carries both."""
    from cabinlm.source.config import image_tokens_from_config, vision_params_from_config

    loaded = load(str(tiny_idefics3_dir))
    inner = loaded.model.model
    held = sum(p.numel() for m in (inner.vision_model, inner.connector) for p in m.parameters())
    assert vision_params_from_config(tiny_idefics3_dir) == held
    assert image_tokens_from_config(tiny_idefics3_dir) == TOKENS
    p = cabinlm("plan", tiny_idefics3_dir, "--profile", "cpu", "--pinned", 24, "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert (plan["image_tokens"], plan["vision_params"]) == (TOKENS, held) and plan["vision_bytes"] > 0, plan


def test_smolvlm_256m_sizes_count_as_the_published_model(tmp_path):
    """SmolVLM-256M's geometry (SigLIP base patch 16 at 512 px, scale factor 4, SmolLM2-135M's text
    model, the processor's max_image_size 512): 64 image tokens a frame; the tower's count equals a
    transformers model built from the same config with no weights."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    from cabinlm.source.config import image_tokens_from_config, vision_params_from_config

    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=512, patch_size=16)  # fmt: skip
    text = dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5)  # fmt: skip
    cfg = SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=4, image_token_id=49190)
    cfg.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SmolVLMImageProcessor", "do_image_splitting": False, "max_image_size": {"longest_edge": 512},
        "size": {"longest_edge": 2048}, "resample": 1, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))  # fmt: skip
    with torch.device("meta"):
        model = SmolVLMForConditionalGeneration(cfg)
    held = sum(p.numel() for m in (model.model.vision_model, model.model.connector) for p in m.parameters())
    assert vision_params_from_config(tmp_path) == held
    assert image_tokens_from_config(tmp_path) == 64


# -- refusals, one line each -------------------------------------------------------------------------


@pytest.mark.parametrize("change, needle", [
    ({"do_image_splitting": True}, 'do_image_splitting is true .* set "do_image_splitting": false in that file'),
    ({"do_image_splitting": None}, "do_image_splitting is true"),  # left out: the processor's default splits
    ({"max_image_size": {"longest_edge": 36}}, "max_image_size 36 is not a multiple of patch_size 4 x scale_factor 2"),
    ({"max_image_size": {"height": 32, "width": 32}}, "an Idefics3 image processor field is missing or of the wrong type"),
    ({"max_image_size": {"longest_edge": 48}}, "image_seq_len 16 <image> tokens per image, but the tower gives 36"),
])  # fmt: skip
def test_a_processor_config_the_export_cannot_reproduce_is_refused(change, needle, tmp_path):
    from cabinlm.source.config import image_tokens_from_config

    folder = make_tiny_idefics3(tmp_path / "m")
    path = folder / "processor_config.json"
    c = json.loads(path.read_text())
    c["image_processor"].update(change)
    c["image_processor"] = {k: v for k, v in c["image_processor"].items() if v is not None}
    path.write_text(json.dumps(c))
    with pytest.raises(ModelError, match=needle) as e:
        image_tokens_from_config(folder)
    assert "\n" not in str(e.value)
    p = cabinlm("export", folder, "-o", tmp_path / "out", "--window", 64, "--pinned", 24)  # refused before the weights load
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if line.startswith("error:")]) == 1, p.stderr


def test_a_frame_size_other_than_the_processors_square_is_refused(tiny_idefics3_dir, load, tmp_path):
    from cabinlm.export import ExportOptions, export_loaded

    with pytest.raises(ModelError, match="gives the tower one 32x32 square .* pass 32x32") as e:
        export_loaded(load(str(tiny_idefics3_dir)), tmp_path / "out", ExportOptions(sink=4, pinned=24, window=64, chunk=16,
                                                                                    frame=(24, 32), verify=False))  # fmt: skip
    assert "\n" not in str(e.value)


def test_a_folder_without_the_image_tokens_in_its_tokenizer_is_refused(tmp_path, load):
    from transformers import AutoTokenizer

    from cabinlm.export import ExportOptions, export_loaded

    from conftest import _tokenizer

    folder = make_tiny_idefics3(tmp_path / "m", family="smolvlm")
    _tokenizer(SMOLVLM_TEMPLATE).save_pretrained(folder)  # the BPE tokenizer without the family's added tokens
    assert "<fake_token_around_image>" not in AutoTokenizer.from_pretrained(folder).get_vocab()
    with pytest.raises(ModelError, match="the tokenizer has no single token <fake_token_around_image>") as e:
        export_loaded(load(str(folder)), tmp_path / "out", ExportOptions(sink=4, pinned=24, window=64, chunk=16, verify=False))
    assert "\n" not in str(e.value)
