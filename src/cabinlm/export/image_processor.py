"""A vision-language model's image processor, read from its folder as the plain numbers the runtime
applies (manifest.ImagePreprocess): no transformers processor runs at chat time. Qwen2-VL's is
resolved for one fixed frame size (read_qwen2_vl_processor). Standard library only.

Both layouts transformers writes are read: transformers 5's processor_config.json with the image
processor nested, and the older preprocessor_config.json on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cabinlm.errors import ModelError

IMAGE_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def image_processor_config(folder: Path) -> tuple[dict, Path]:
    """The image processor's settings in a model folder, and the file they came from.

    transformers 5 saves a processor as processor_config.json with the image processor nested under
    "image_processor" (and may write no preprocessor_config.json); earlier versions wrote the image
    processor alone to preprocessor_config.json (and a processor_config.json, if any, without it).
    Read in transformers' own order: the nested settings first, then the file of their own."""
    for name in IMAGE_PROCESSOR_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ModelError(f"{path}: cannot read it as JSON ({e})") from e
        if not isinstance(d, dict):
            raise ModelError(f"{path}: expected a JSON object, got {type(d).__name__}")
        if name == "processor_config.json":
            if "image_processor" not in d:
                continue  # a processor without a nested image processor: its own file holds it
            d = d["image_processor"]
            if not isinstance(d, dict):
                raise ModelError(f'{path}: "image_processor" must be an object, got {type(d).__name__}')
        return d, path
    raise ModelError(
        f"{folder}: a vision-language model needs its image processor: processor_config.json with an "
        '"image_processor" object (transformers 5) or preprocessor_config.json; save the model\'s processor '
        "into the folder (AutoProcessor.from_pretrained(...).save_pretrained(folder))"
    )


def image_preprocessing(folder: Path) -> dict:
    """The model's image processor as plain numbers for the runtime (manifest.ImagePreprocess)."""
    c, path = image_processor_config(folder)
    try:
        size = c.get("size") or {}
        crop = c.get("crop_size") if c.get("do_center_crop", False) else None
        return {
            "resize": ({"shortest_edge": size["shortest_edge"]} if "shortest_edge" in size else
                       {"height": size["height"], "width": size["width"]}) if c.get("do_resize", True) else None,
            "resample": int(c.get("resample", 3)),
            "crop": {"height": crop["height"], "width": crop["width"]} if crop else None,
            "rescale": float(c.get("rescale_factor", 1 / 255)) if c.get("do_rescale", True) else None,
            "mean": list(c["image_mean"]) if c.get("do_normalize", True) else None,
            "std": list(c["image_std"]) if c.get("do_normalize", True) else None,
        }  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:  # a missing key, a field of the wrong type
        raise ModelError(
            f"{path}: an image processor field is missing or of the wrong type ({type(e).__name__}: {e})"
        ) from e


# A cabin camera's frame: the default frame size is what the processor makes of this one.
CAMERA_FRAME = (480, 640)  # (height, width)
# Qwen2-VL's image processor defaults (transformers' Qwen2VLImageProcessor), for keys a folder leaves out.
_DEFAULTS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280, "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2, "resample": 3, "rescale_factor": 1 / 255,
             "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}  # fmt: skip


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image processor's size rule (transformers' smart_resize): sides multiples of
    `factor`, aspect ratio kept as closely as possible, pixels within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLProcessor:
    """Qwen2-VL's image processor as read from a folder, resolved for one frame size."""

    frame: tuple[int, int]  # (height, width) in pixels
    patch: int
    merge: int
    temporal: int
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @property
    def grid(self) -> tuple[int, int]:
        """Image tokens as (rows, cols): the patch grid after the merger."""
        return self.frame[0] // (self.patch * self.merge), self.frame[1] // (self.patch * self.merge)

    @property
    def image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def preprocess(self) -> dict:
        """manifest.ImagePreprocess's fields: resize to the frame, rescale, normalize, patchify."""
        return {"resize": {"height": self.frame[0], "width": self.frame[1]}, "resample": self.resample,
                "crop": None, "rescale": self.rescale, "mean": self.mean, "std": self.std,
                "patchify": {"patch": self.patch, "merge": self.merge, "temporal": self.temporal}}  # fmt: skip


def read_qwen2_vl_processor(folder: Path, frame: tuple[int, int] | None = None, vision_config: dict | None = None) -> Qwen2VLProcessor:
    """The folder's Qwen2-VL image processor (preprocessor_config.json with min_pixels / max_pixels,
    or transformers 5's size {shortest_edge, longest_edge}) at `frame` (default: what the processor
    makes of a 640x480 camera frame). Refused in one line: settings the export cannot reproduce."""
    c, path = image_processor_config(folder)
    c = {**_DEFAULTS, **c}
    size = c.get("size") if isinstance(c.get("size"), dict) else {}
    try:
        min_px = int(size.get("shortest_edge", c.get("min_pixels")))
        max_px = int(size.get("longest_edge", c.get("max_pixels")))
        patch, merge, temporal = int(c["patch_size"]), int(c["merge_size"]), int(c["temporal_patch_size"])
        mean = tuple(float(x) for x in c["image_mean"]) if c.get("do_normalize", True) else None
        std = tuple(float(x) for x in c["image_std"]) if c.get("do_normalize", True) else None
        rescale = float(c["rescale_factor"]) if c.get("do_rescale", True) else None
        resample = int(c["resample"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: a Qwen2-VL image processor field is missing or of the wrong type ({type(e).__name__}: {e})") from e
    if not c.get("do_resize", True):
        raise ModelError(f"{path}: do_resize is false, so each frame keeps its own size; the exported vision graph "
                         "takes one frame size: save the processor with do_resize true")  # fmt: skip
    if not c.get("do_convert_rgb", True):
        raise ModelError(f"{path}: do_convert_rgb is false; cabinlm gives the vision graph RGB frames")
    if vision_config is not None:
        want = {"patch_size": patch, "spatial_merge_size": merge, "temporal_patch_size": temporal}
        for key, value in want.items():
            if key in vision_config and vision_config[key] != value:
                raise ModelError(f"{path}: the processor's {key} {value} differs from the vision tower's "
                                 f"{vision_config[key]} (config.json); the export cannot reproduce both")  # fmt: skip
    if not (0 < min_px <= max_px) or min(patch, merge, temporal) < 1:
        raise ModelError(f"{path}: min_pixels {min_px} / max_pixels {max_px} / patch, merge and temporal sizes must be positive")
    factor = patch * merge
    if frame is None:
        frame = smart_resize(*CAMERA_FRAME, factor, min_px, max_px)
    h, w = frame
    if h % factor or w % factor or smart_resize(h, w, factor, min_px, max_px) != (h, w):
        raise ModelError(
            f"frame {w}x{h}: Qwen2-VL's processor would resize it to "
            f"{'x'.join(map(str, smart_resize(h, w, factor, min_px, max_px)[::-1]))}; pass a frame whose sides are "
            f"multiples of {factor} with {min_px}..{max_px} pixels (default: "
            f"{'x'.join(map(str, smart_resize(*CAMERA_FRAME, factor, min_px, max_px)[::-1]))})"
        )
    return Qwen2VLProcessor((h, w), patch, merge, temporal, resample, rescale, mean, std)
