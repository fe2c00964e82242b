"""Camera frames: load an image (Pillow), prepare it as the model's image processor does (numpy),
and run the vision graph to the image-token embeddings the decoder pins in its image region."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np

from cabinlm.contract.errors import InputError
from cabinlm.contract.manifest import VisionSpec

MAX_PIXELS = 64_000_000  # larger images are refused (a cabin camera frame is a few megapixels)


def load_image(source, name: str | None = None):
    """A PIL RGB image from a path, an image file's bytes (a data URL's payload: `name` says what
    messages call it) or a PIL image. Grayscale, palette and alpha images are converted (alpha
    composited on white, as the transformers processors do); anything else is an InputError."""
    from PIL import Image

    if isinstance(source, Image.Image):
        img = source
    elif isinstance(source, (bytes, bytearray, memoryview)):
        img = _open_checked(io.BytesIO(source), name or "the image")
    else:
        path = Path(source)
        if not path.is_file():
            raise InputError(f"{path}: no such image file")
        img = _open_checked(path, str(path))
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _open_checked(fp, where: str):
    """Image.open and load with every refusal an InputError naming `where`: decompression bombs,
    more than MAX_PIXELS, text metadata past Pillow's limits, data Pillow cannot read."""
    from PIL import Image, UnidentifiedImageError

    # Pillow checks the size in the header before it decodes anything: a decompression bomb (a
    # few kB of PNG that inflate to gigabytes) warns beyond MAX_IMAGE_PIXELS and raises beyond
    # twice that. The limit is set to ours (process-wide: Pillow has no per-call limit) and the
    # warning made an error here, so that both are refusals. (catch_warnings swaps the process's
    # filters: two threads opening images at once may see each other's; both refuse bombs.)
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(fp)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InputError(f"{where}: refused as a decompression bomb ({e}); a frame may have at most "
                         f"{MAX_PIXELS / 1e6:.0f} megapixels") from e  # fmt: skip
    except UnidentifiedImageError as e:
        raise InputError(f"{where}: not an image Pillow can read (PNG, JPEG, BMP, ...)") from e
    except ValueError as e:  # PNG text chunks beyond Pillow's limits (1 MiB each, 64 MiB in all)
        raise _metadata_refused(where, e) from e
    except OSError as e:
        raise InputError(f"{where}: cannot open the image ({e})") from e
    if img.width * img.height > MAX_PIXELS:
        img.close()
        raise InputError(
            f"{where}: {img.width}x{img.height} is {img.width * img.height / 1e6:.0f} megapixels, more than "
            f"{MAX_PIXELS / 1e6:.0f}; downscale it first"
        )
    try:
        img.load()  # reads the chunks after the pixels too: text there is checked here
    except ValueError as e:
        raise _metadata_refused(where, e) from e
    except (OSError, SyntaxError) as e:  # truncated or corrupt data
        raise InputError(f"{where}: the image data is corrupt or truncated ({e})") from e
    return img


def _metadata_refused(where: str, e: ValueError) -> InputError:
    """Pillow's ValueErrors while reading: text chunks past its limits (the reason in its message),
    or data it cannot decode."""
    if "text chunk" in str(e).lower() or "MAX_TEXT" in str(e):
        return InputError(f"{where}: refused, its text metadata is too large ({e}); save the frame without it")
    return InputError(f"{where}: the image data is corrupt ({e})")


def preprocess(img, spec: VisionSpec) -> np.ndarray:
    """(1, 3, S, S) float32 pixel values: resize, center crop, rescale, normalize, channels first; or
    with preprocess.patchify (Qwen2-VL) the frame's flattened patches (N, 3 * T * p * p)."""
    from PIL import Image

    p = spec.preprocess
    if p.longest_edge is not None:  # Idefics3: the longest edge first, then the square below
        w, h = img.size
        height, width = longest_edge_size(h, w, p.longest_edge)
        img = img.resize((width, height), resample=Image.Resampling(p.resample))
    resize = p.resize
    if resize:
        if "shortest_edge" in resize:
            short = resize["shortest_edge"]
            w, h = img.size
            if w <= h:
                size = (short, int(short * h / w))
            else:
                size = (int(short * w / h), short)
        else:
            size = (resize["width"], resize["height"])
        img = img.resize(size, resample=Image.Resampling(p.resample))
    x = np.asarray(img, dtype=np.uint8)  # (H, W, 3)
    crop = p.crop
    if crop:
        ch, cw = crop["height"], crop["width"]
        h, w = x.shape[:2]
        if h < ch or w < cw:  # pad with zeros to the crop size, centred
            padded = np.zeros((max(h, ch), max(w, cw), 3), dtype=x.dtype)
            top, left = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
            padded[top : top + h, left : left + w] = x
            x, (h, w) = padded, padded.shape[:2]
        top, left = (h - ch) // 2, (w - cw) // 2
        x = x[top : top + ch, left : left + cw]
    y = x.astype(np.float32)
    if p.rescale is not None:
        y = y * np.float32(p.rescale)
    if p.mean is not None:
        y = (y - np.asarray(p.mean, dtype=np.float32)) / np.asarray(p.std, dtype=np.float32)
    if p.patchify is not None:
        return patchify(y.transpose(2, 0, 1), spec)
    y = np.ascontiguousarray(y.transpose(2, 0, 1)[None])
    if y.shape != (1, 3, spec.image_size, spec.image_size):
        raise InputError(f"the prepared image is {y.shape[2:]}, the vision graph takes {spec.image_size}x{spec.image_size}")
    return y


# Idefics3's processor keeps a resized frame within 4096 pixels a side (its MAX_IMAGE_SIZE).
_IDEFICS3_MAX_SIDE = 4096


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) Idefics3's image processor resizes a frame to for size {"longest_edge": n}
    (transformers' _resize_output_size_rescale_to_max_len, then ..._scale_below_upper_bound at
    4096): the longest side n, the other int(n / aspect), made even, at least 1."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _IDEFICS3_MAX_SIDE:
        width, height = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE / aspect)
    elif height > width and height > _IDEFICS3_MAX_SIDE:
        height, width = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def patchify(image: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """(3, H, W) float32 -> (N, 3 * T * p * p) float32, Qwen2-VL's processor's layout: patches of p x p
    in windows of m x m patches (windows row-major, patches row-major inside each), each patch
    repeated T times along time (one still frame), flattened channels, time, rows, cols."""
    c = spec.preprocess.patchify
    p, m, T = c["patch"], c["merge"], c["temporal"]
    C, H, W = image.shape
    if (H, W) != tuple(spec.frame):
        raise InputError(f"the prepared image is {W}x{H}, the vision graph takes {spec.frame[1]}x{spec.frame[0]}")
    gh, gw = H // p, W // p
    x = image.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, C * T * p * p), dtype=np.float32)


class VisionEncoder:
    """The camera encoder: one fixed-size image in, (image_tokens, embed_dim) out, on the session its
    engine opened (engines.registry.open_camera_encoder; device: what it runs on, e.g. "cpu", "qnn-htp")."""

    def __init__(self, session, spec: VisionSpec, device: str = "cpu"):
        self.spec, self.device, self.session = spec, device, session

    def encode(self, image) -> np.ndarray:
        pixels = preprocess(load_image(image), self.spec)
        return self.session.run(None, {"pixel_values": pixels})[0]


def open_encoder(folder: Path, manifest, threads: int | None = None) -> VisionEncoder:
    """The artifact's camera encoder, as the build's engine runs it (an HTP build: the tower's context
    binary, CPU fallback off; every other: the vision graph on ONNX Runtime's CPU provider)."""
    from cabinlm.engines.onnxruntime.session import vision_session
    from cabinlm.engines.registry import open_camera_encoder

    opened = open_camera_encoder(folder, manifest, threads)
    session, device = opened if opened is not None else (vision_session(folder, manifest, threads), "cpu")
    return VisionEncoder(session, manifest.vision, device)
