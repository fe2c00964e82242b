"""A vision-language model's image processor, read from its folder as the plain numbers the runtime
applies (manifest.ImagePreprocess): no transformers processor runs at chat time.

Both layouts transformers writes are read: transformers 5's processor_config.json with the image
processor nested, and the older preprocessor_config.json on its own.
"""

from __future__ import annotations

import json
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
