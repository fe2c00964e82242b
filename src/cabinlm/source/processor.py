"""A vision-language model's image processor, read from its folder as the plain numbers the runtime
applies (manifest.ImagePreprocess): no transformers processor runs at chat time. Qwen2-VL's is
resolved for one fixed frame size (read_qwen2_vl_processor). Standard library only.

Both layouts transformers writes are read: transformers 5's processor_config.json with the image
processor nested, and the older preprocessor_config.json on its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cabinlm.contract.errors import ModelError

IMAGE_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def processor_files(folder: Path, names: tuple[str, ...]) -> Iterator[tuple[Path, Any]]:
    """(path, its JSON value) for each of these files the folder holds, in this order, each read when
    the loop reaches it: a file that is no JSON is refused naming it, one the loop does not reach is
    not read."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ModelError(f"{path}: cannot read it as JSON ({e})") from e
        yield path, d


def image_processor_config(folder: Path) -> tuple[dict, Path]:
    """The image processor's settings in a model folder, and the file they came from.

    transformers 5 saves a processor as processor_config.json with the image processor nested under
    "image_processor" (and may write no preprocessor_config.json); earlier versions wrote the image
    processor alone to preprocessor_config.json (and a processor_config.json, if any, without it).
    Read in transformers' own order: the nested settings first, then the file of their own."""
    for path, d in processor_files(folder, IMAGE_PROCESSOR_FILES):
        if not isinstance(d, dict):
            raise ModelError(f"{path}: expected a JSON object, got {type(d).__name__}")
        if path.name == "processor_config.json":
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


def image_preprocessing(folder: Path, square: int | None = None) -> dict:
    """The model's image processor as plain numbers for the runtime (manifest.ImagePreprocess).
    square: the side of the one image size the vision graph takes (LLaVA's tower, image_size), its
    default frame: refused in one line when the processor makes a frame of that size another size."""
    c, path = image_processor_config(folder)
    try:
        size = c.get("size") or {}
        crop = c.get("crop_size") if c.get("do_center_crop", False) else None
        prep = {
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
    if square is not None:
        # A square frame keeps its shape through a shortest-edge resize; a center crop (padded where the
        # frame is smaller) gives the crop's size whatever came before it.
        resize, crop = prep["resize"], prep["crop"]
        if crop is not None:
            made, field = (crop["height"], crop["width"]), "crop_size"
        elif resize is None:
            made, field = (square, square), "size"
        elif "shortest_edge" in resize:
            made, field = (resize["shortest_edge"],) * 2, "size"
        else:
            made, field = (resize["height"], resize["width"]), "size"
        if made != (square, square):
            raise ModelError(
                f"{path}: the image processor makes a {square}x{square} frame {made[1]}x{made[0]} (its {field}), but the "
                f"vision tower takes {square}x{square} images (config.json vision_config.image_size); save the tower's "
                "own image processor into the folder"
            )
    return prep


# A cabin camera's frame: the default frame size is the size the processor keeps nearest to it.
CAMERA_FRAME = (480, 640)  # (height, width)
MAX_FRAME_SIDE = 8192  # the largest frame side ExportOptions takes, in pixels
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


def keeps(frame: tuple[int, int], factor: int, min_pixels: int, max_pixels: int) -> bool:
    """The processor leaves a frame of this (height, width) at its size: smart_resize's fixed point."""
    try:
        return smart_resize(*frame, factor, min_pixels, max_pixels) == tuple(frame)
    except ValueError:  # an aspect ratio above 200: the processor refuses the frame
        return False


def default_frame(factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int] | None:
    """The (height, width) an export takes when no frame is named: always one smart_resize keeps.

    What the processor makes of a 640x480 camera frame when it keeps that size (it does whenever that
    size's pixel count lies within [min_pixels, max_pixels]). smart_resize rounds its sides after
    scaling, so with a narrow budget (min_pixels == max_pixels) its answer can fall outside the budget
    and be resized again; then, of the sizes it keeps (sides multiples of `factor` up to
    MAX_FRAME_SIDE), the one nearest the camera's aspect ratio, then nearest the camera's pixel count
    brought into the budget. None: the processor keeps no size."""
    camera = smart_resize(*CAMERA_FRAME, factor, min_pixels, max_pixels)
    if keeps(camera, factor, min_pixels, max_pixels):
        return camera
    aspect = math.log(CAMERA_FRAME[1] / CAMERA_FRAME[0])
    pixels = math.log(min(max(CAMERA_FRAME[0] * CAMERA_FRAME[1], min_pixels), max_pixels))
    cell, most = factor * factor, MAX_FRAME_SIDE // factor  # one grid cell's pixels, the most cells a side
    best = None
    for rows in range(1, most + 1):
        lo, hi = -(-min_pixels // (rows * cell)), max_pixels // (rows * cell)  # columns within the budget
        wide = rows * CAMERA_FRAME[1] / CAMERA_FRAME[0]
        for cols in {lo, hi, math.floor(wide), math.ceil(wide), min(max(round(wide), lo), hi)}:
            frame = (rows * factor, cols * factor)
            if not 1 <= cols <= most or not keeps(frame, factor, min_pixels, max_pixels):
                continue
            key = (abs(math.log(cols / rows) - aspect), abs(math.log(rows * cols * cell) - pixels), rows)
            if best is None or key < best[0]:
                best = (key, frame)
    return None if best is None else best[1]


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
    or transformers 5's size {shortest_edge, longest_edge}) at `frame` (default: default_frame, a size
    the processor keeps). Refused in one line: settings the export cannot reproduce, a frame the
    processor would resize."""
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
    default = default_frame(factor, min_px, max_px)
    if default is None:
        side = math.ceil(math.sqrt(min_px) / factor) * factor  # the smallest square frame min_pixels allows
        raise ModelError(
            f"{path}: min_pixels {min_px} .. max_pixels {max_px} holds no frame Qwen2-VL's processor keeps (sides "
            f"multiples of patch_size x merge_size = {factor}); set max_pixels to {side * side} (a {side}x{side} frame) or more"
        )
    h, w = default if frame is None else frame
    if h % factor or w % factor or not keeps((h, w), factor, min_px, max_px):
        try:
            change = f"would resize it to {'x'.join(map(str, smart_resize(h, w, factor, min_px, max_px)[::-1]))}"
        except ValueError as e:
            change = f"refuses it ({e})"
        raise ModelError(
            f"frame {w}x{h}: Qwen2-VL's processor {change}; pass a frame whose sides are multiples of {factor} "
            f"with {min_px}..{max_px} pixels (default: {default[1]}x{default[0]})"
        )
    return Qwen2VLProcessor((h, w), patch, merge, temporal, resample, rescale, mean, std)


# Idefics3's image processor defaults (transformers' Idefics3ImageProcessor), for keys a folder leaves out.
_IDEFICS3_DEFAULTS = {"do_image_splitting": True, "max_image_size": {"longest_edge": 364}, "size": {"longest_edge": 4 * 364},
                      "resample": 1, "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
# The strings Idefics3's processor writes around one image's tokens when it does not split the image
# (Idefics3Processor / SmolVLMProcessor: <fake_token_around_image><global-img><image> x n<fake_token_around_image>).
IDEFICS3_IMAGE_PREFIX = "<fake_token_around_image><global-img>"
IDEFICS3_IMAGE_SUFFIX = "<fake_token_around_image>"


@dataclass(frozen=True)
class Idefics3Processor:
    """Idefics3's (SmolVLM's) image processor without image splitting, as read from a folder: every
    frame is first resized so that its longest edge is `longest_edge` (the aspect ratio kept, the
    other side made even: `size`), then to a square of `frame` x `frame` (`max_image_size`), both
    with `resample`; then rescaled and normalized. The vision graph takes that square."""

    frame: int  # max_image_size["longest_edge"]: the square the tower sees
    longest_edge: int | None  # size["longest_edge"]; None when do_resize is false (only the square resize)
    patch: int
    scale: int  # the connector's pixel-shuffle scale_factor
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @property
    def image_tokens(self) -> int:
        """(frame / patch)^2 patches, merged scale x scale by the pixel shuffle."""
        return (self.frame // self.patch) ** 2 // self.scale**2

    def preprocess(self) -> dict:
        """manifest.ImagePreprocess's fields (runtime/vision.py applies them)."""
        return {"longest_edge": self.longest_edge, "resize": {"height": self.frame, "width": self.frame},
                "resample": self.resample, "crop": None, "rescale": self.rescale, "mean": self.mean, "std": self.std}  # fmt: skip


def _processor_field(folder: Path, key: str):
    """A processor's own field (not its image processor's): processor_config.json's top level."""
    for _, d in processor_files(folder, ("processor_config.json",)):
        return d.get(key) if isinstance(d, dict) else None
    return None


def read_idefics3_processor(folder: Path, vision_config: dict, scale_factor, frame: tuple[int, int] | None = None) -> Idefics3Processor:
    """The folder's Idefics3 / SmolVLM image processor, for the exported vision graph's one square
    frame. Refused in one line: settings the export cannot reproduce (image splitting, a size the
    tower's patches or the pixel shuffle do not divide, image_seq_len other than the tower's count)."""
    c, path = image_processor_config(folder)
    c = {**_IDEFICS3_DEFAULTS, **c}
    if c.get("do_image_splitting"):
        raise ModelError(
            f"{path}: do_image_splitting is true (each frame cut into tiles of max_image_size plus the whole frame, "
            "a token count that depends on the frame's size); the exported vision graph takes one image of one size: "
            'set "do_image_splitting": false in that file (the processor then gives the whole frame as one '
            "max_image_size square, as transformers does with do_image_splitting=False) and export again"
        )
    if not c.get("do_convert_rgb", True):
        raise ModelError(f"{path}: do_convert_rgb is false; cabinlm gives the vision graph RGB frames")
    try:
        side = c["max_image_size"]["longest_edge"]
        size = c["size"] if c.get("do_resize", True) else None
        longest = size["longest_edge"] if size is not None else None
        patch, scale = vision_config.get("patch_size", 32), scale_factor
        if not all(type(v) is int for v in (side, patch, scale) + ((longest,) if size is not None else ())):
            raise TypeError(f"max_image_size {side!r}, size {longest!r}, patch_size {patch!r}, scale_factor {scale!r} "
                            "must be whole numbers")  # fmt: skip
        mean = tuple(float(x) for x in c["image_mean"]) if c.get("do_normalize", True) else None
        std = tuple(float(x) for x in c["image_std"]) if c.get("do_normalize", True) else None
        rescale = float(c["rescale_factor"]) if c.get("do_rescale", True) else None
        resample = int(c["resample"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: an Idefics3 image processor field is missing or of the wrong type "
                         f"({type(e).__name__}: {e}); size and max_image_size are {{\"longest_edge\": n}}") from e  # fmt: skip
    if min(side, patch, scale) < 1 or (longest is not None and longest < 1):
        raise ModelError(f"{path}: max_image_size {side}, size {longest}, patch_size {patch} and scale_factor {scale} must be positive")
    if side % patch or (side // patch) % scale:
        raise ModelError(f"{path}: max_image_size {side} is not a multiple of patch_size {patch} x scale_factor {scale}: "
                         "the tower's pixel shuffle cannot merge its patches")  # fmt: skip
    proc = Idefics3Processor(side, longest, patch, scale, resample, rescale, mean, std)
    seq_len = _processor_field(folder, "image_seq_len")
    if seq_len is not None and seq_len != proc.image_tokens:
        raise ModelError(f"{folder / 'processor_config.json'}: image_seq_len {seq_len} <image> tokens per image, but the "
                         f"tower gives {proc.image_tokens} for a {side}x{side} frame ((max_image_size / patch_size)^2 / "
                         f"scale_factor^2); the export cannot reproduce both")  # fmt: skip
    if frame is not None and tuple(frame) != (side, side):
        raise ModelError(f"frame {frame[1]}x{frame[0]}: Idefics3's processor without image splitting gives the tower "
                         f"one {side}x{side} square (max_image_size); leave the frame size out or pass {side}x{side}")  # fmt: skip
    return proc
