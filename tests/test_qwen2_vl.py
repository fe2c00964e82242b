"""Qwen2-VL and Qwen2.5-VL on the exported graph: the image processor at the artifact's frame size, the vision tower
with the patch merger (and Qwen2.5-VL's window attention), and the decoder's multimodal RoPE (M-RoPE) under the
cache's rank rule (docs/design.md, "Multimodal RoPE"; docs/vlm.md), each checked against transformers' own
Qwen2VLForConditionalGeneration on a tiny random model whose processor config is written as the family's Hub folders
write it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from cabinlm.contract.errors import ModelError
from cabinlm.contract.layout import CacheLayout
from cabinlm.runtime import Decoder
from cabinlm.contract.slots import SlotTable
from cabinlm.runtime.vision import load_image, preprocess

import vlm_checks as vlm
from vlm_checks import TEXT, hf_greedy, hf_inputs, picture
from vlm_reference import FrameStreamingReference

# the test frames' (width, height): the artifact's frame, smart_resize of 640x480 under max_pixels 1024
PICTURE = (32, 24)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, load, export_to):
    """Both families: Qwen2.5-VL's tower adds window attention, RMSNorm and a gated MLP; the decoder,
    the processor and the rank rule are Qwen2-VL's."""
    folder = request.getfixturevalue("tiny_qwen2_vl_dir" if request.param == "qwen2_vl" else "tiny_qwen2_5_vl_dir")
    loaded = load(str(folder))
    return loaded, export_to(loaded, sink=4, pinned=12, window=64, chunk=16)


def hf_logits(loaded, ids: list[int], img) -> np.ndarray:
    """transformers' logits for a sequence with one image (the processor's pixels and grid, and the
    token types the processor would return: 1 on the image pads)."""
    v = loaded.model.config
    px = hf_inputs(loaded.folder, img)
    types = torch.tensor([[int(i == v.image_token_id) for i in ids]])
    with torch.no_grad():
        out = loaded.model(input_ids=torch.tensor([ids]), pixel_values=px["pixel_values"],
                           image_grid_thw=px["image_grid_thw"], mm_token_type_ids=types)  # fmt: skip
    return out.logits[0].numpy()


# -- the image processor and the vision tower ------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_a_frame_of_the_artifacts_size_is_prepared_as_the_transformers_processor_does(qwen, mode):
    _, folder = qwen
    spec = Decoder(folder).manifest.vision
    assert spec.frame == (24, 32) and spec.grid == (3, 4)  # smart_resize of 640x480 under max_pixels 1024
    img = picture(*PICTURE, mode=mode, seed=1)
    ours = preprocess(load_image(img), spec)
    ref = hf_inputs(qwen[0].folder, load_image(img))
    assert ref["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert ours.shape == tuple(ref["pixel_values"].shape) == (48, 3 * 2 * 4 * 4)
    np.testing.assert_allclose(ours, ref["pixel_values"].numpy(), atol=1e-5)


@pytest.mark.parametrize("size", [(47, 61), (61, 47), (12, 90), (640, 480)])
def test_a_frame_of_another_size_is_resized_to_the_artifacts_frame_with_the_processors_filter(qwen, size):
    """The graph has one shape, so a frame of another size goes to the artifact's frame (bicubic, as
    the processor resizes); from there the processor's own steps follow."""
    _, folder = qwen
    spec = Decoder(folder).manifest.vision
    img = picture(*size, seed=2)
    ours = preprocess(load_image(img), spec)
    resized = img.resize((spec.frame[1], spec.frame[0]), resample=Image.Resampling.BICUBIC)
    np.testing.assert_allclose(ours, hf_inputs(qwen[0].folder, resized)["pixel_values"].numpy(), atol=1e-5)


def test_the_vision_graph_gives_transformers_image_embeddings(qwen):
    loaded, folder = qwen
    vlm.check_the_vision_graph_gives_transformers_image_features(loaded, folder, PICTURE, "image_grid_thw", (12, 64))


# -- the M-RoPE rank rule (numpy, against transformers' get_rope_index and a reference of the rule) --


def rule_positions(image: list[bool], grid: tuple[int, int]) -> np.ndarray:
    """(3, n): the rule of docs/design.md, "Multimodal RoPE", written out over a sequence (the cache's tokens in
    rank order, then the chunk): text tokens equal components, a frame's token k its grid offsets from where the
    frame starts, what follows the frame from its largest position + 1."""
    rows, cols = grid
    out, cur, k = [], 0, 0  # cur: the next text position; k: the frame token's index
    for i, is_image in enumerate(image):
        if is_image:  # the frame starts at cur
            out.append((cur, cur + k // cols, cur + k % cols))
            k += 1
            if i + 1 == len(image) or not image[i + 1]:  # its last token: the text goes on past the grid
                cur, k = cur + max(rows, cols), 0
        else:
            out.append((cur, cur, cur))
            cur += 1
    return np.array(out, dtype=np.int64).T.reshape(3, -1)


def check_plan(table: SlotTable, n: int, pin, frame: tuple[int, int] | None, grid) -> None:
    """The plan's positions = the rule over the cached tokens in stream order, then the chunk.
    frame: (first stream index, tokens) of the frame now pinned, or None."""
    plan = table.plan(n, pin)
    chunk, cache = plan.mrope_positions(grid[0] * grid[1], grid)
    cached = np.sort(table.slot_token[table.slot_token >= 0])
    stream = np.concatenate([cached, plan.seen + np.arange(n)])
    image = [frame is not None and frame[0] <= t < frame[0] + frame[1] for t in stream]
    ref = rule_positions(image, grid)
    np.testing.assert_array_equal(chunk, ref[:, len(cached):])
    for slot in np.flatnonzero(table.slot_token >= 0):
        rank = int(np.searchsorted(cached, table.slot_token[slot]))
        np.testing.assert_array_equal(cache[:, slot], ref[:, rank])
    assert not cache[:, table.slot_token < 0].any()
    table.advance(plan)


@pytest.mark.parametrize("before", [1, 9])  # the frame partly in the sink (sink 4), or after the sink is full
def test_mrope_positions_are_transformers_rope_index_while_the_stream_fits(qwen, before):
    loaded, _ = qwen
    v = loaded.model.config
    grid, I = (3, 4), 12
    ids = [7] * (before - 1) + [v.vision_start_token_id] + [v.image_token_id] * I + [v.vision_end_token_id] + [9] * 20
    ref, _ = loaded.model.model.get_rope_index(torch.tensor([ids]), torch.tensor([[int(i == v.image_token_id) for i in ids]]),
                                               image_grid_thw=torch.tensor([[1, 6, 8]]))  # fmt: skip
    ref = ref[:, 0].numpy()
    lay = CacheLayout(sink=4, pinned=4, image=I, window=40, chunk=8, layers=1, kv_heads=1, head_dim=2)
    table = SlotTable(lay)
    got = np.zeros_like(ref)
    for start, n, pin in [(0, before, False), (before, I, "image"), (before + I, 21, False)]:
        if pin == "image":
            table.begin_frame()
        for s in range(start, start + n, 5):
            m = min(5, start + n - s)
            plan = table.plan(m, pin)
            chunk, cache = plan.mrope_positions(I, grid)
            got[:, s : s + m] = chunk
            held = table.slot_token >= 0
            np.testing.assert_array_equal(cache[:, held], ref[:, table.slot_token[held]])  # every cached token too
            table.advance(plan)
    np.testing.assert_array_equal(got, ref)


def test_after_evictions_positions_are_the_rule_over_the_ranks_and_a_new_frame_replaces_the_old():
    grid, I = (3, 4), 12
    lay = CacheLayout(sink=4, pinned=2, image=I, window=10, chunk=8, layers=1, kv_heads=1, head_dim=2)
    table = SlotTable(lay)
    rng = np.random.default_rng(0)
    frame = None
    for turn in range(6):
        for _ in range(int(rng.integers(1, 4))):
            check_plan(table, int(rng.integers(1, 7)), False, frame, grid)
        table.begin_frame()
        frame = (table.seen, I)
        check_plan(table, 5, "image", frame, grid)  # a frame fed in two chunks
        check_plan(table, 7, "image", frame, grid)
        for _ in range(int(rng.integers(2, 8))):  # one-token steps and chunks, the window turning over
            check_plan(table, int(rng.integers(1, 7)), False, frame, grid)
    assert table.evicted > 30 and table.frames == 6


def test_a_restored_table_knows_where_its_frame_starts():
    lay = CacheLayout(sink=4, pinned=2, image=12, window=16, chunk=12, layers=1, kv_heads=1, head_dim=2)
    for before in (1, 7):  # the frame partly in the sink, or wholly in the image region
        table = SlotTable(lay)
        table.advance(table.plan(before))
        table.begin_frame()
        table.advance(table.plan(12, "image"))
        table.advance(table.plan(9))
        other = SlotTable(lay)
        other.restore(table.state())
        assert other.frame_start == table.frame_start == before
        a, b = table.plan(3), other.plan(3)
        for x, y in zip(a.mrope_positions(12, (3, 4)), b.mrope_positions(12, (3, 4))):
            np.testing.assert_array_equal(x, y)


def test_a_table_saved_between_begin_frame_and_the_frame_goes_on_as_the_uninterrupted_one():
    lay = CacheLayout(sink=4, pinned=2, image=12, window=16, chunk=12, layers=1, kv_heads=1, head_dim=2)
    for frames_before in (0, 1):  # the first frame, or a frame replacing one
        table = SlotTable(lay)
        table.advance(table.plan(6))
        for _ in range(frames_before):
            table.begin_frame()
            table.advance(table.plan(12, "image"))
            table.advance(table.plan(5))
        table.begin_frame()
        other = SlotTable(lay)
        other.restore(table.state())
        for n, pin in ((12, "image"), (3, False)):
            a, b = table.plan(n, pin), other.plan(n, pin)
            for x, y in zip(a.mrope_positions(12, (3, 4)), b.mrope_positions(12, (3, 4))):
                np.testing.assert_array_equal(x, y)
            table.advance(a)
            other.advance(b)
        assert other.frame_start == table.frame_start == 6 + 17 * frames_before


# -- the exported decoder against transformers -------------------------------------------------------


@pytest.mark.parametrize("head", ["", "<|im_start|>user\n"])
def test_a_turn_with_a_frame_gives_transformers_logits(qwen, head):
    loaded, folder = qwen
    question = " what is on the road ahead?<|im_end|>\n"
    vlm.check_a_turn_with_a_frame_gives_transformers_logits(loaded, folder, hf_logits, head, question, PICTURE)


class MRopeStreamingReference(FrameStreamingReference):
    """vlm_reference.py's cache semantics with M-RoPE: the cached tokens then the chunk, in stream
    order, get the rule's positions (rule_positions), and frequency pair j turns with the component
    of its section."""

    def __init__(self, model, sink: int, window: int, grid: tuple[int, int]):
        cfg = model.config.text_config
        D, theta = cfg.hidden_size // cfg.num_attention_heads, cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        super().__init__(model, model.model.language_model, sink, window, inv_freq)
        self.grid, self.section = grid, cfg.rope_parameters["mrope_section"]

    def positions(self, frame: list[bool]) -> np.ndarray:  # (3, cached + n)
        return rule_positions(frame, self.grid)

    def rope(self, x: torch.Tensor, pos: np.ndarray) -> torch.Tensor:  # x (heads, n, D), pos (3, n)
        comp = torch.from_numpy(np.repeat(np.arange(3), self.section))  # each frequency pair's component
        p = torch.from_numpy(pos).double()[comp]  # (D/2, n)
        return self.rotate(x, (p * self.inv_freq[:, None]).T)  # angles (n, D/2)


def mrope_stream_against_reference(loaded, dec: Decoder) -> float:
    """Beyond the cache: the frame pinned after a user head, then one-token steps and 16-token chunks
    while the window evicts the text around it (and the <|vision_end|> after it), against
    MRopeStreamingReference. Returns the worst logit difference over every fed token."""
    v = dec.manifest.vision
    lay = dec.layout
    ref = MRopeStreamingReference(loaded.model, lay.sink, lay.window, v.grid)
    embed = loaded.model.model.language_model.embed_tokens
    img = picture(*PICTURE, seed=7)
    frame = dec.vision.encode(img)
    tok = loaded.tokenizer.backend_tokenizer
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False).ids + list(v.image_prefix)
    text = list(v.image_suffix) + tok.encode(TEXT * 2, add_special_tokens=False).ids[:180]
    worst = 0.0

    def both(ours: np.ndarray, theirs: torch.Tensor) -> None:
        nonlocal worst
        worst = max(worst, float(np.abs(ours - theirs.numpy()).max()))

    both(dec.feed(head, all_logits=True), ref.feed(embed(torch.tensor(head))))
    dec.cache.begin_frame()
    both(dec.feed([v.image_token_id] * v.image_tokens, pin="image", all_logits=True, embeds=frame),
         ref.feed(torch.from_numpy(frame), frame=True))  # fmt: skip
    i = 0
    while i < len(text):
        n = 16 if (i // 40) % 2 else 1  # stretches of one-token steps and of chunks
        ids = text[i : i + n]
        both(dec.feed(ids, all_logits=True), ref.feed(embed(torch.tensor(ids))))
        i += n
    assert dec.cache.evicted > 60 and dec.cache.evicted == ref.seen - len(ref.entries)
    return worst


def test_streaming_with_a_pinned_frame_follows_the_reference_of_the_semantics(qwen):
    """Beyond the cache, against MRopeStreamingReference (mrope_stream_against_reference)."""
    loaded, folder = qwen
    worst = mrope_stream_against_reference(loaded, Decoder(folder))
    assert worst < 1e-4, worst  # measured 4e-6 (logits up to ~5)


# -- `cabinlm perplexity ART --image FRAME` ----------------------------------------------------------


def test_perplexity_with_a_frame_equals_transformers_and_a_wrong_frame_does_not(qwen, tmp_path):
    loaded, folder = qwen
    v = loaded.model.config
    frame_ids = [v.vision_start_token_id] + [v.image_token_id] * 12 + [v.vision_end_token_id]
    vlm.check_perplexity_with_a_frame(loaded, folder, hf_logits, frame_ids, PICTURE, tmp_path)


def test_perplexity_refuses_an_image_for_a_text_model_and_a_file_that_is_no_image(qwen, tmp_path):
    _, folder = qwen
    vlm.check_perplexity_refuses_a_file_that_is_no_image(folder, tmp_path)


# -- refusals, one line each ------------------------------------------------------------------------


def test_a_vision_language_family_cabinlm_does_not_export_is_refused_by_name(tiny_qwen2_vl_dir, tmp_path):
    from cabinlm.source.config import spec_from_config

    for model_type, arch, name in (("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3-VL"),
                                   ("mllama", "MllamaForConditionalGeneration", "Llama 3.2 Vision")):  # fmt: skip
        d = json.loads((tiny_qwen2_vl_dir / "config.json").read_text())
        d.update(model_type=model_type, architectures=[arch])
        (tmp_path / "config.json").write_text(json.dumps(d))
        with pytest.raises(ModelError, match=f"{name} is a vision-language family cabinlm does not export") as e:
            spec_from_config(tmp_path)
        assert "\n" not in str(e.value) and "Qwen2VLForConditionalGeneration" in str(e.value)


@pytest.mark.parametrize("change, needle", [
    ({"do_resize": False}, "do_resize is false"),
    ({"patch_size": 8}, "the processor's patch_size 8 differs from the vision tower's 4"),
    ({"max_pixels": "many"}, "a Qwen2-VL image processor field is missing or of the wrong type"),
])  # fmt: skip
def test_a_processor_config_the_export_cannot_reproduce_is_refused(tiny_qwen2_vl_dir, tmp_path, change, needle):
    from cabinlm.source.config import image_tokens_from_config

    folder = tmp_path / "m"
    shutil.copytree(tiny_qwen2_vl_dir, folder)
    c = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**c, **change}))
    with pytest.raises(ModelError, match=needle) as e:
        image_tokens_from_config(folder)
    assert "\n" not in str(e.value)


def test_a_frame_size_the_processor_would_change_is_refused_and_one_it_keeps_is_taken(tiny_qwen2_vl_dir):
    from cabinlm.source.config import image_tokens_from_config

    assert image_tokens_from_config(tiny_qwen2_vl_dir) == 12  # 32x24: smart_resize of 640x480
    assert image_tokens_from_config(tiny_qwen2_vl_dir, (32, 32)) == 16
    with pytest.raises(ModelError, match="frame 30x24: Qwen2-VL's processor would resize it to 32x24"):
        image_tokens_from_config(tiny_qwen2_vl_dir, (24, 30))
    with pytest.raises(ModelError, match="would resize it"):  # 48x48 pixels: more than max_pixels 1024
        image_tokens_from_config(tiny_qwen2_vl_dir, (48, 48))


def test_the_cpu_build_keeps_the_multimodal_rotation_and_scores_as_the_export(qwen, tmp_path):
    """`cabinlm build --profile cpu` (the exported graph, optimized offline) leaves the cached keys'
    rotation as exported: ONNX Runtime's RotaryEmbedding takes one position per token, M-RoPE three."""
    loaded, folder = qwen
    vlm.check_the_cpu_build_scores_a_frame_as_the_export(loaded, folder, PICTURE, tmp_path)


def test_frames_replaced_over_a_long_stream_at_constant_memory_and_a_resumed_cache_goes_on_alike(qwen):
    """40 frames, each replacing the last in the image region, text between them evicting hundreds
    of tokens: the buffers never move, memory stays flat, and a second decoder given the first's slot
    state (SlotTable.restore: where the frame starts is derived again) and buffers, as a session file
    restores them, gives the same logits from there on, bit for bit."""
    from cabinlm.runtime.perplexity import feed_frame

    loaded, folder = qwen
    dec, text, frames = vlm.forty_frames_at_constant_memory(loaded, folder, PICTURE)
    resumed = Decoder(folder)
    resumed.cache.restore(dec.cache.state())
    for name, buf in dec.backend.buffers().items():
        resumed.backend.buffers()[name][...] = buf
    assert resumed.cache.frame_start == dec.cache.frame_start
    for chunk in (text[:1], text[1:17], text[17:18]):
        np.testing.assert_array_equal(resumed.feed(chunk, all_logits=True), dec.feed(chunk, all_logits=True))
    feed_frame(dec, frames[1])
    feed_frame(resumed, frames[1])
    np.testing.assert_array_equal(resumed.feed(text[:5], all_logits=True), dec.feed(text[:5], all_logits=True))


def test_a_chat_turn_with_a_frame_replies_as_transformers_greedy(qwen):
    """Dialogue.ask(text, image=...): the user turn as the family's template and processor lay it
    out (<|im_start|>user\\n <|vision_start|> the image pads <|vision_end|> text <|im_end|>\\n
    <|im_start|>assistant\\n), the reply greedy; transformers' greedy tokens on the same ids and frame."""
    from cabinlm.runtime import Dialogue, open_artifact

    loaded, folder = qwen
    dec, tok = open_artifact(folder, verify=False)
    v = dec.manifest.vision
    d = Dialogue(dec, tok, max_new_tokens=6)
    btok = loaded.tokenizer.backend_tokenizer
    for turn, seed in enumerate((11, 12)):
        img = picture(*PICTURE, seed=seed)
        prompt = (btok.encode("<|im_start|>user\n", add_special_tokens=False).ids + list(v.image_prefix)
                  + [v.image_token_id] * v.image_tokens + list(v.image_suffix)
                  + btok.encode("what is on the road ahead?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids)  # fmt: skip
        result = d.ask("what is on the road ahead?", image=img)
        if turn:
            continue  # the second turn's transformers sequence would need the first turn too; fed to replace the frame
        reply = hf_greedy(hf_logits, loaded, prompt, img, dec.manifest.stop_ids, 6)
        assert result.prompt_tokens == len(prompt)
        assert result.reply == btok.decode(reply, skip_special_tokens=False)
    assert dec.cache.frames == 2


def test_a_session_saved_with_its_frame_resumes_with_the_same_replies(qwen, tmp_path):
    """A dialogue with a frame pinned (and the window turned over) saved to a session file; a new
    process's dialogue loads it and answers the next turns as the first goes on to."""
    _, folder = qwen
    vlm.check_a_session_saved_with_its_frame_resumes_with_the_same_replies(folder, PICTURE, tmp_path)


@pytest.mark.parametrize("profile", ["orin-x"])
def test_engines_without_multimodal_rope_refuse_it_in_one_line(qwen, profile, export_to, tmp_path):
    """The TensorRT builds take one position per token: a Qwen2-VL artifact is refused before
    anything compiles, naming the reason and the profile that runs it (not a traceback in the build's
    own check). The static pair and the HTP run M-RoPE: tests/test_mrope_builds.py."""
    from cabinlm.engines.build import BuildError, build_artifact
    from cabinlm.profiles import load_profile

    loaded, _ = qwen
    folder = export_to(loaded, kv="fp16", sink=4, pinned=12, window=64, chunk=16)  # a KV type each profile runs
    with pytest.raises(BuildError, match="multimodal RoPE .* not written for TensorRT yet; "
                                         "the cpu profile runs it") as e:  # fmt: skip
        build_artifact(folder, load_profile(profile), tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out" / "manifest.json").exists()
