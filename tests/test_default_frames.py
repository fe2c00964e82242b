"""The frame an export takes when no frame is named, for every vision-language family: one the
model's own processor leaves at its size, from a processor with a fixed pixel budget and from one
with a range. The reference is transformers' image processor for the family, built from the folder."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from cabinlm.contract.errors import ModelError
from cabinlm.contract.manifest import load_manifest
from cabinlm.runtime.vision import load_image, preprocess

from conftest import QWEN2_VL_PREPROCESSOR, make_tiny_qwen2_vl
from test_cli import cabinlm
from test_idefics3 import LONGEST, SIDE, make_tiny_idefics3
from vlm_checks import hf_inputs, picture

CACHE = dict(sink=4, pinned=12, window=64, chunk=16)  # a small cache; every option but the frame
# The tiny Qwen2-VL tower's patch 4 x merge 2 = 8 pixels a token side. 32x32 pixels = 16 tokens: the
# released models' fixed 12544-pixel budget (112x112, patch 14 x merge 2 = 28) scaled to this tower.
# smart_resize makes 32x24 of a 640x480 frame there, which it would resize again to 40x32.
QWEN_BUDGETS = {"fixed": (1024, 1024, (32, 32)), "ranged": (256, 1024, (24, 32))}  # min, max, the frame (h, w)


def export_without_frame_options(folder: Path, out: Path):
    """`cabinlm export FOLDER` as a function: ExportOptions without frame, the model's cache check
    before its weights load included."""
    from cabinlm.export import ExportOptions, export_model

    return export_model(str(folder), out, ExportOptions(**CACHE, verify=False, gate=False))


def unchanged(img, mean, std) -> np.ndarray:
    """(3, H, W): the frame's own pixels, rescaled and normalized, with no resize."""
    x = np.asarray(img.convert("RGB"), dtype=np.float32) / np.float32(255)
    return ((x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)).transpose(2, 0, 1)


@pytest.fixture(scope="module", params=[(f, b) for f in ("qwen2_vl", "qwen2_5_vl") for b in QWEN_BUDGETS])
def qwen_export(request, tmp_path_factory):
    family, budget = request.param
    lo, hi, frame = QWEN_BUDGETS[budget]
    folder = make_tiny_qwen2_vl(tmp_path_factory.mktemp(f"{family}-{budget}"), family=family, min_pixels=lo, max_pixels=hi)
    out = tmp_path_factory.mktemp(f"{family}-{budget}-artifact")
    return folder, export_without_frame_options(folder, out), frame, (lo, hi)


def test_an_export_without_frame_options_picks_a_frame_qwen2_vls_processor_keeps(qwen_export):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    folder, manifest, frame, (lo, hi) = qwen_export
    v = manifest.vision
    assert v.frame == frame and v.grid == (frame[0] // 8, frame[1] // 8) and v.image_tokens == v.grid[0] * v.grid[1]
    assert smart_resize(*v.frame, factor=8, min_pixels=lo, max_pixels=hi) == v.frame
    img = picture(v.frame[1], v.frame[0], seed=1)
    ref = hf_inputs(folder, img)
    assert ref["image_grid_thw"].tolist() == [[1, v.frame[0] // 4, v.frame[1] // 4]]  # patches of the frame itself
    ours = preprocess(load_image(img), v)
    assert ours.shape == tuple(ref["pixel_values"].shape)
    np.testing.assert_allclose(ours, ref["pixel_values"].numpy(), atol=1e-5)


def test_cabinlm_export_of_a_qwen2_vl_folder_with_a_fixed_pixel_budget_takes_a_frame_its_processor_keeps(tmp_path):
    lo, hi, frame = QWEN_BUDGETS["fixed"]
    folder = make_tiny_qwen2_vl(tmp_path / "m", min_pixels=lo, max_pixels=hi)
    p = cabinlm("export", folder, "-o", tmp_path / "art", *(f"--{k}={v}" for k, v in CACHE.items()), "--no-verify")
    assert p.returncode == 0, p.stderr
    assert load_manifest(tmp_path / "art").vision.frame == frame


def qwen_config_folder(folder: Path, **processor) -> Path:
    """A Qwen2-VL folder's config.json (a tower of patch 14, merge 2: 28 pixels a token side, as the
    released models') and its preprocessor_config.json with `processor` over the tiny defaults: what
    the export reads before any weights load, and what transformers builds the processor from."""
    folder.mkdir(parents=True, exist_ok=True)
    vision = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "embed_dim": 32, "hidden_size": 64}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
                                                    "vision_config": vision}))  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps({**QWEN2_VL_PREPROCESSOR, "patch_size": 14, **processor}))
    return folder


@pytest.mark.parametrize("lo, hi, frame", [
    (12544, 12544, (112, 112)),  # 16 tokens, 4 x 4: smart_resize makes 112x84 of 640x480, and 140x112 of that
    (56 * 56, 28 * 28 * 1280, (476, 644)),  # the released models' range: smart_resize's 644x476 itself
    (28 * 28 * 1280, 28 * 28 * 1280, (896, 1120)),  # a budget fixed at their most: 1280 tokens, 32 x 40
    (10000, 13000, (84, 140)),  # 13..16 tokens: 3 x 5 the nearest to 4:3 in the budget
    (100, 500, (28, 28)),  # below one token: smart_resize keeps one token's 28x28
])  # fmt: skip
def test_the_default_frame_is_one_transformers_qwen2_vl_processor_keeps_for_any_pixel_budget(tmp_path, lo, hi, frame):
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from cabinlm.source.processor import read_qwen2_vl_processor
    from cabinlm.source.config import image_tokens_from_config

    folder = qwen_config_folder(tmp_path, min_pixels=lo, max_pixels=hi)
    proc = read_qwen2_vl_processor(folder)
    assert proc.frame == frame and image_tokens_from_config(folder) == (frame[0] // 28) * (frame[1] // 28)
    assert smart_resize(*frame, factor=28, min_pixels=lo, max_pixels=hi) == frame
    px = AutoImageProcessor.from_pretrained(folder)(images=picture(frame[1], frame[0]), return_tensors="np")
    assert px["image_grid_thw"].tolist() == [[1, frame[0] // 14, frame[1] // 14]]


def test_a_frame_named_explicitly_that_the_processor_would_resize_is_still_refused_naming_the_default(tmp_path):
    from cabinlm.source.config import image_tokens_from_config

    folder = qwen_config_folder(tmp_path, min_pixels=12544, max_pixels=12544)
    with pytest.raises(ModelError, match=r"frame 112x84: Qwen2-VL's processor would resize it to 140x112; .*"
                                         r"\(default: 112x112\)") as e:  # fmt: skip
        image_tokens_from_config(folder, (84, 112))
    assert "\n" not in str(e.value)
    assert image_tokens_from_config(folder, (112, 112)) == 16
    with pytest.raises(ModelError, match=r"frame 5628x28: Qwen2-VL's processor refuses it \(aspect ratio 201 is above 200\)") as e:
        image_tokens_from_config(qwen_config_folder(tmp_path, min_pixels=28 * 28, max_pixels=28 * 28 * 400), (28, 5628))
    assert "\n" not in str(e.value)


def test_a_pixel_budget_in_which_the_processor_keeps_no_frame_is_refused_in_one_line_naming_one_that_does(tmp_path):
    """10000 pixels is no whole number of 28x28 tokens: every frame smart_resize makes there is resized again."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from cabinlm.source.processor import read_qwen2_vl_processor
    from cabinlm.source.config import image_tokens_from_config

    folder = qwen_config_folder(tmp_path, min_pixels=10000, max_pixels=10000)
    with pytest.raises(ModelError, match=r"min_pixels 10000 \.\. max_pixels 10000 holds no frame Qwen2-VL's processor "
                                         r"keeps .*; set max_pixels to 12544 \(a 112x112 frame\) or more") as e:  # fmt: skip
        image_tokens_from_config(folder)
    assert "\n" not in str(e.value)
    frame = read_qwen2_vl_processor(qwen_config_folder(tmp_path, min_pixels=10000, max_pixels=12544)).frame
    assert smart_resize(*frame, factor=28, min_pixels=10000, max_pixels=12544) == frame


# -- LLaVA: the tower's square ---------------------------------------------------------------------


def test_an_export_without_frame_options_picks_a_frame_llavas_processor_keeps(tiny_llava_dir, tmp_path):
    from transformers import AutoImageProcessor

    v = export_without_frame_options(tiny_llava_dir, tmp_path / "art").vision
    S = v.image_size
    img = picture(S, S, seed=1)
    hf = AutoImageProcessor.from_pretrained(tiny_llava_dir)
    ref = hf(images=img, return_tensors="np")["pixel_values"]
    assert ref.shape == (1, 3, S, S)
    np.testing.assert_allclose(ref[0], unchanged(img, hf.image_mean, hf.image_std), atol=1e-5)
    np.testing.assert_allclose(preprocess(load_image(img), v), ref, atol=1e-5)


@pytest.mark.parametrize("change, made", [
    ({"do_center_crop": True, "crop_size": {"height": 24, "width": 24}}, "24x24 (its crop_size)"),
    ({"do_center_crop": False, "size": {"shortest_edge": 36}}, "36x36 (its size)"),
])  # fmt: skip
def test_a_llava_processor_that_would_resize_the_towers_square_is_refused_in_one_line(tiny_llava_dir, tmp_path, change, made):
    from cabinlm.export import ExportOptions, export_loaded
    from cabinlm.export.models import load_model

    folder = tmp_path / "m"
    shutil.copytree(tiny_llava_dir, folder)
    path = folder / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ModelError, match=re.escape(f"the image processor makes a 30x30 frame {made}, but the vision "
                                                   "tower takes 30x30 images")) as e:  # fmt: skip
        export_loaded(load_model(str(folder)), tmp_path / "art", ExportOptions(**CACHE, verify=False, gate=False))
    assert "\n" not in str(e.value)


# -- Idefics3 / SmolVLM: the max_image_size square -------------------------------------------------


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("longest", [SIDE, LONGEST])  # size["longest_edge"]: the square itself, or above it
def test_an_export_without_frame_options_picks_a_frame_idefics3s_processor_keeps(tmp_path, family, longest):
    from transformers import AutoImageProcessor

    folder = make_tiny_idefics3(tmp_path / "m", family=family, seed=1, size={"longest_edge": longest})
    v = export_without_frame_options(folder, tmp_path / "art").vision
    assert v.image_size == SIDE
    img = picture(SIDE, SIDE, seed=1)
    ref = hf_inputs(folder, img)
    assert ref["pixel_values"].shape == (1, 1, 3, SIDE, SIDE) and bool(ref["pixel_attention_mask"].all())
    np.testing.assert_allclose(preprocess(load_image(img), v), ref["pixel_values"][0].numpy(), atol=1e-5)
    if longest == SIDE:  # both resizes are to the frame's own size: its pixels go through as they are
        hf = AutoImageProcessor.from_pretrained(folder)
        np.testing.assert_allclose(ref["pixel_values"][0, 0].numpy(), unchanged(img, hf.image_mean, hf.image_std), atol=1e-5)
