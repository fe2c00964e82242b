"""Qwen2-VL and Qwen2.5-VL on the exported graph: the image processor at the artifact's frame size, the
vision tower with the patch merger (and Qwen2.5-VL's window attention), and the decoder's multimodal RoPE (M-RoPE) under the cache's rank rule
(DESIGN.md, docs/vlm.md), each checked against transformers' own Qwen2VLForConditionalGeneration on a
tiny random model whose processor config is written as the family's Hub folders write it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from cabinlm.errors import ModelError
from cabinlm.layout import CacheLayout
from cabinlm.runtime import Decoder
from cabinlm.runtime.slots import SlotTable
from cabinlm.runtime.vision import load_image, preprocess

TEXT = ("The driver asked the assistant about the weather, the route and the charging stations on the way. "
        "Keep a safe distance and take a break every two hours.")  # fmt: skip


def picture(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((h, w, 4)) * 255).astype(np.uint8), "RGBA")
    return img if mode == "RGBA" else img.convert(mode)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, load, export_to):
    """Both families: Qwen2.5-VL's tower adds window attention, RMSNorm and a gated MLP; the decoder,
    the processor and the rank rule are Qwen2-VL's."""
    folder = request.getfixturevalue("tiny_qwen2_vl_dir" if request.param == "qwen2_vl" else "tiny_qwen2_5_vl_dir")
    loaded = load(str(folder))
    return loaded, export_to(loaded, sink=4, pinned=12, window=64, chunk=16)


def hf_inputs(folder, img):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)(images=img, return_tensors="pt")


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


def nll_of(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
    return lse - z[np.arange(len(targets)), targets]


# -- the image processor and the vision tower ------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_a_frame_of_the_artifacts_size_is_prepared_as_the_transformers_processor_does(qwen, mode):
    _, folder = qwen
    spec = Decoder(folder).manifest.vision
    assert spec.frame == (24, 32) and spec.grid == (3, 4)  # smart_resize of 640x480 under max_pixels 1024
    img = picture(32, 24, mode=mode, seed=1)
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
    dec = Decoder(folder)
    img = picture(32, 24, seed=3)
    px = hf_inputs(loaded.folder, img)
    with torch.no_grad():
        ref = loaded.model.model.get_image_features(px["pixel_values"], px["image_grid_thw"]).pooler_output[0].numpy()
    ours = dec.vision.encode(img)
    assert ours.shape == ref.shape == (12, 64)
    np.testing.assert_allclose(ours, ref, atol=1e-4)  # measured 7e-6 (values up to ~9)
    assert np.abs(dec.vision.encode(picture(32, 24, seed=4)) - ref).max() > 0.1  # another frame: other embeddings


# -- the M-RoPE rank rule (numpy, against transformers' get_rope_index and a reference of the rule) --


def rule_positions(image: list[bool], grid: tuple[int, int]) -> np.ndarray:
    """(3, n): DESIGN.md's rule written out over a sequence (the cache's tokens in rank order, then the
    chunk): text tokens equal components, a frame's token k its grid offsets from where the frame
    starts, what follows the frame from its largest position + 1."""
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


# -- the exported decoder against transformers -------------------------------------------------------


@pytest.mark.parametrize("head", ["", "<|im_start|>user\n"])
def test_a_turn_with_a_frame_gives_transformers_logits(qwen, head):
    """The frame at the stream's start (its first tokens then sit in the sink) or after text; chunks of
    16 tokens; every token's logits."""
    loaded, folder = qwen
    dec = Decoder(folder)
    v = dec.manifest.vision
    tok = loaded.tokenizer.backend_tokenizer
    head_ids = tok.encode(head, add_special_tokens=False).ids + list(v.image_prefix)
    tail = list(v.image_suffix) + tok.encode(" what is on the road ahead?<|im_end|>\n", add_special_tokens=False).ids
    img = picture(32, 24, seed=5)
    ids = head_ids + [v.image_token_id] * v.image_tokens + tail
    ref = hf_logits(loaded, ids, img)
    ours = [dec.feed(head_ids, all_logits=True)]
    dec.cache.begin_frame()
    ours.append(dec.feed([v.image_token_id] * v.image_tokens, pin="image", all_logits=True, embeds=dec.vision.encode(img)))
    ours.append(dec.feed(tail, all_logits=True))
    np.testing.assert_allclose(np.concatenate(ours), ref, atol=1e-4)  # measured 5e-6 (logits up to ~5)
    other = hf_logits(loaded, ids, picture(32, 24, seed=6))
    assert np.abs(other[-1] - ref[-1]).max() > 1e-2  # the comparison can tell frames apart


class MRopeStreamingReference:
    """The cache semantics with a pinned frame, written for this test in plain PyTorch from
    DESIGN.md with the transformers model's own sub-modules (nothing shared with the graph or the
    slot table): each cached token keeps the K/V it was given when fed; at every chunk the cached
    tokens then the chunk, in stream order, get the rule's positions (rule_positions), RoPE is applied
    with them (M-RoPE: frequency pair j turns with the component of its section), every chunk token
    attends to every cached token and causally to the chunk; then the chunk joins the cache, the first
    `sink` tokens and the frame stay, the oldest others beyond `window` are dropped."""

    def __init__(self, model, sink: int, window: int, grid: tuple[int, int]):
        self.m, self.sink, self.window, self.grid = model, sink, window, grid
        cfg = model.config.text_config
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = cfg.hidden_size // self.H
        theta = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.D, 2, dtype=torch.float64) / self.D))
        self.section = cfg.rope_parameters["mrope_section"]
        self.entries: list[tuple[int, bool, bool, list]] = []  # (stream index, pinned, frame token, [(k, v)] per layer)
        self.seen = 0

    def _rope(self, x: torch.Tensor, pos: np.ndarray) -> torch.Tensor:  # x (heads, n, D), pos (3, n)
        comp = torch.from_numpy(np.repeat(np.arange(3), self.section))  # each frequency pair's component
        p = torch.from_numpy(pos).double()[comp]  # (D/2, n)
        f = (p * self.inv_freq[:, None]).T  # (n, D/2)
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        x1, x2 = x[..., : self.D // 2], x[..., self.D // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    @torch.no_grad()
    def feed(self, x: torch.Tensor, frame: bool = False) -> torch.Tensor:
        """x (n, hidden): the chunk's input rows (token embeddings, or the frame's image embeddings)."""
        lm, n, cached = self.m.model.language_model, len(x), len(self.entries)
        pos = rule_positions([e[2] for e in self.entries] + [frame] * n, self.grid)
        new_kv = [[] for _ in range(n)]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = torch.cat([torch.ones(n, cached, dtype=torch.bool), causal], dim=1)
        G = self.H // self.Hkv
        for li, layer in enumerate(lm.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(n, self.H, self.D).transpose(0, 1)
            k = a.k_proj(h).view(n, self.Hkv, self.D).transpose(0, 1)
            v = a.v_proj(h).view(n, self.Hkv, self.D).transpose(0, 1)
            for t in range(n):
                new_kv[t].append((k[:, t], v[:, t]))
            K = torch.stack([e[3][li][0] for e in self.entries] + [k[:, t] for t in range(n)], dim=1)
            V = torch.stack([e[3][li][1] for e in self.entries] + [v[:, t] for t in range(n)], dim=1)
            K = self._rope(K, pos).repeat_interleave(G, dim=0)
            Q = self._rope(q, pos[:, cached:])
            scores = (Q @ K.transpose(1, 2) * a.scaling).masked_fill(~allowed, float("-inf"))
            out = (scores.softmax(-1) @ V.repeat_interleave(G, dim=0)).transpose(0, 1).reshape(n, -1)
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.m.lm_head(lm.norm(x))
        for t in range(n):
            idx = self.seen + t
            self.entries.append((idx, frame or idx < self.sink, frame, new_kv[t]))
        self.seen += n
        unpinned = [i for i, e in enumerate(self.entries) if not e[1]]
        drop = set(unpinned[: max(0, len(unpinned) - self.window)])
        self.entries = [e for i, e in enumerate(self.entries) if i not in drop]
        return logits


def test_streaming_with_a_pinned_frame_follows_the_reference_of_the_semantics(qwen):
    """Beyond the cache: one-token steps and 16-token chunks with the frame pinned while the window
    evicts the text around it (and the <|vision_end|> after it), against MRopeStreamingReference."""
    loaded, folder = qwen
    dec = Decoder(folder)
    v = dec.manifest.vision
    lay = dec.layout
    ref = MRopeStreamingReference(loaded.model, lay.sink, lay.window, v.grid)
    embed = loaded.model.model.language_model.embed_tokens
    img = picture(32, 24, seed=7)
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
    assert worst < 1e-4, worst  # measured 4e-6 (logits up to ~5)


# -- `cabinlm perplexity ART --image FRAME` ----------------------------------------------------------


def cabinlm(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cabinlm", *map(str, args)], capture_output=True, text=True, timeout=300)


def test_perplexity_with_a_frame_equals_transformers_and_a_wrong_frame_does_not(qwen, tmp_path):
    loaded, folder = qwen
    v = loaded.model.config
    frame, wrong = tmp_path / "cabin.png", tmp_path / "other.png"
    picture(32, 24, seed=8).save(frame)
    picture(32, 24, seed=9).save(wrong)
    (tmp_path / "t.txt").write_text(TEXT)
    text = loaded.tokenizer.backend_tokenizer.encode(TEXT).ids[:60]  # the stream fits the cache: exactly the model
    ids = [v.vision_start_token_id] + [v.image_token_id] * 12 + [v.vision_end_token_id] + text
    first = len(ids) - len(text)  # the text's first token
    ref = nll_of(hf_logits(loaded, ids, load_image(frame))[first:-1], text[1:])  # text tokens 2..N
    for image, out in ((frame, tmp_path / "nll.npy"), (wrong, tmp_path / "wrong.npy")):
        p = cabinlm("perplexity", folder, "--image", image, "--text", tmp_path / "t.txt", "--nll-out", out,
                    "--max-tokens", 60, "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["tokens"] == len(text)
    ours, theirs_wrong = np.load(tmp_path / "nll.npy"), np.load(tmp_path / "wrong.npy")
    assert ours.shape == ref.shape == (len(text) - 1,)
    np.testing.assert_allclose(ours, ref, atol=1e-4)  # fp32 throughout; measured ~3e-6
    assert np.abs(theirs_wrong - ref).mean() > 0.1  # another frame: measured 0.45 on average (2.1 at most)


def test_perplexity_refuses_an_image_for_a_text_model_and_a_file_that_is_no_image(qwen, tmp_path):
    _, folder = qwen
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "no.png").write_bytes(b"not a picture")
    p = cabinlm("perplexity", folder, "--image", tmp_path / "no.png", "--text", tmp_path / "t.txt")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'no.png'}: not an image Pillow can read (PNG, JPEG, BMP, ...)"]


# -- refusals, one line each ------------------------------------------------------------------------


def test_a_vision_language_family_cabinlm_does_not_export_is_refused_by_name(tiny_qwen2_vl_dir, tmp_path):
    from cabinlm.model_config import spec_from_config

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
    from cabinlm.model_config import image_tokens_from_config

    folder = tmp_path / "m"
    shutil.copytree(tiny_qwen2_vl_dir, folder)
    c = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**c, **change}))
    with pytest.raises(ModelError, match=needle) as e:
        image_tokens_from_config(folder)
    assert "\n" not in str(e.value)


def test_a_frame_size_the_processor_would_change_is_refused_and_one_it_keeps_is_taken(tiny_qwen2_vl_dir):
    from cabinlm.model_config import image_tokens_from_config

    assert image_tokens_from_config(tiny_qwen2_vl_dir) == 12  # 32x24: smart_resize of 640x480
    assert image_tokens_from_config(tiny_qwen2_vl_dir, (32, 32)) == 16
    with pytest.raises(ModelError, match="frame 30x24: Qwen2-VL's processor would resize it to 32x24"):
        image_tokens_from_config(tiny_qwen2_vl_dir, (24, 30))
    with pytest.raises(ModelError, match="would resize it"):  # 48x48 pixels: more than max_pixels 1024
        image_tokens_from_config(tiny_qwen2_vl_dir, (48, 48))


def test_the_cpu_build_keeps_the_multimodal_rotation_and_scores_as_the_export(qwen, tmp_path):
    """`cabinlm build --profile cpu` (the exported graph, optimized offline) leaves the cached keys'
    rotation as exported: ONNX Runtime's RotaryEmbedding takes one position per token, M-RoPE three."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile
    from cabinlm.runtime import stream_perplexity

    loaded, folder = qwen
    built = build_artifact(folder, load_profile("cpu"), tmp_path / "build-cpu")
    ids = loaded.tokenizer.backend_tokenizer.encode(TEXT).ids[:40]
    results = []
    for art in (folder, built):
        dec = Decoder(art)
        results.append(stream_perplexity(dec, ids, frame=dec.vision.encode(picture(32, 24, seed=10))).nll)
    assert Decoder(built).manifest.build is not None
    np.testing.assert_allclose(results[1], results[0], atol=1e-5)


def test_frames_replaced_over_a_long_stream_at_constant_memory_and_a_resumed_cache_goes_on_alike(qwen):
    """40 frames, each replacing the last in the image region, text between them evicting hundreds
    of tokens: the buffers never move, memory stays flat, and a second decoder given the first's slot
    state (SlotTable.restore: where the frame starts is derived again) and buffers, as a session file
    restores them, gives the same logits from there on, bit for bit."""
    import gc

    from cabinlm.runtime.memory import rss_mb
    from cabinlm.runtime.perplexity import feed_frame

    loaded, folder = qwen
    dec = Decoder(folder)
    tok = loaded.tokenizer.backend_tokenizer
    text = tok.encode(TEXT, add_special_tokens=False).ids
    frames = [dec.vision.encode(picture(32, 24, seed=s)) for s in range(4)]
    kv = dec.backend
    addresses = (kv.keys.ctypes.data, kv.values.ctypes.data)
    samples = []
    dec.feed(text[:2])  # the first frame after two tokens: its first tokens sit in the sink
    for i in range(40):
        feed_frame(dec, frames[i % 4])
        dec.feed(text[(i * 7) % 50 : (i * 7) % 50 + 23])
        if i in (10, 39):
            gc.collect()
            samples.append(rss_mb())
    assert dec.cache.frames == 40 and dec.cache.evicted > 500
    assert (kv.keys.ctypes.data, kv.values.ctypes.data) == addresses
    assert samples[1] - samples[0] < 8.0, samples
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
        img = picture(32, 24, seed=seed)
        prompt = (btok.encode("<|im_start|>user\n", add_special_tokens=False).ids + list(v.image_prefix)
                  + [v.image_token_id] * v.image_tokens + list(v.image_suffix)
                  + btok.encode("what is on the road ahead?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids)  # fmt: skip
        result = d.ask("what is on the road ahead?", image=img)
        if turn:
            continue  # the second turn's transformers sequence would need the first turn too; fed to replace the frame
        ids, reply = list(prompt), []
        for _ in range(6):
            t = int(hf_logits(loaded, ids, img)[-1].argmax())
            if t in dec.manifest.stop_ids:
                break
            ids.append(t)
            reply.append(t)
        assert result.prompt_tokens == len(prompt)
        assert result.reply == btok.decode(reply, skip_special_tokens=False)
    assert dec.cache.frames == 2


def test_a_session_saved_with_its_frame_resumes_with_the_same_replies(qwen, tmp_path):
    """A dialogue with a frame pinned (and the window turned over) saved to a session file; a new
    process's dialogue loads it and answers the next turns as the first goes on to."""
    from cabinlm.runtime import Dialogue, open_artifact
    from cabinlm.runtime.persist import load_session, save_session

    _, folder = qwen
    dialogues = []
    for _ in range(2):
        dec, tok = open_artifact(folder, verify=False)
        dialogues.append(Dialogue(dec, tok, max_new_tokens=8))
    first, second = dialogues
    first.ask("the cabin camera, please", image=picture(32, 24, seed=13))
    for i in range(6):
        first.ask(f"turn {i}: anything new on the road ahead?")
    assert first.decoder.cache.evicted > 0
    save_session(tmp_path / "s.session", first)
    load_session(tmp_path / "s.session", second)
    assert second.decoder.cache.frame_start == first.decoder.cache.frame_start >= 0
    for text in ("and the weather?", "how far to the charging station?"):
        assert second.ask(text).reply == first.ask(text).reply


@pytest.mark.parametrize("profile", ["sa8775p", "sa8295p", "orin-x"])
def test_engines_without_multimodal_rope_refuse_it_in_one_line(qwen, profile, export_to, tmp_path):
    """The Snapdragon and TensorRT builds take one position per token: a Qwen2-VL artifact is refused
    before anything compiles, naming the reason and the profile that runs it (not a traceback in the
    build's own check)."""
    from cabinlm.engines.build import BuildError, build_artifact
    from cabinlm.profiles import load_profile

    loaded, _ = qwen
    folder = export_to(loaded, kv="fp16", sink=4, pinned=12, window=64, chunk=16)  # a KV type each profile runs
    with pytest.raises(BuildError, match="multimodal RoPE .* not (compiled|written) for (the HTP|TensorRT) yet; "
                                         "the cpu profile runs it") as e:  # fmt: skip
        build_artifact(folder, load_profile(profile), tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out" / "manifest.json").exists()
