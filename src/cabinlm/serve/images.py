"""OpenAI image_url parts -> what Dialogue.ask takes: a data URL decoded in memory, or a local file path.

    data:image/png;base64,iVBORw0...    decoded here (Pillow reads PNG, JPEG, BMP, ...)
    file:///var/cabin/frame.jpg         a frame the camera service wrote; read by runtime.vision
    /var/cabin/frame.jpg                the same, as a plain absolute path

Nothing is fetched from the network. Every problem is a RequestError (a 400 naming the message).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from cabinlm.errors import InputError
from cabinlm.runtime.vision import MAX_PIXELS, load_image
from cabinlm.serve.schema import RequestError

MAX_IMAGE_BYTES = 32 * 1024 * 1024


def _bad(where: str, why: str) -> RequestError:
    return RequestError(f"{where}: {why}", param=where, code="invalid_image")


def open_image(url: str, where: str):
    """A PIL RGB image, from a data URL or a local file."""
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise _bad(where, "a data URL must be data:image/<type>;base64,<data>")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(where, f"the data URL's base64 does not decode ({e})") from e
        if len(raw) > MAX_IMAGE_BYTES:
            raise _bad(where, f"the image is {len(raw)} bytes, more than {MAX_IMAGE_BYTES}")
        from PIL import Image, UnidentifiedImageError

        try:
            img = Image.open(io.BytesIO(raw))
            if img.width * img.height > MAX_PIXELS:
                size = f"{img.width}x{img.height}"
                raise _bad(where, f"{size} is more than {MAX_PIXELS / 1e6:.0f} megapixels; downscale it")
            img.load()
        except UnidentifiedImageError as e:
            raise _bad(where, "not an image Pillow can read (PNG, JPEG, BMP, ...)") from e
        except (OSError, SyntaxError, ValueError) as e:
            raise _bad(where, f"the image data is corrupt or truncated ({e})") from e
        try:
            return load_image(img)  # RGB, alpha composited on white
        except InputError as e:
            raise _bad(where, str(e)) from e
    path = Path(unquote(urlparse(url).path)) if url.startswith("file://") else Path(url)
    if not path.is_absolute():
        raise _bad(where, f"a local image path must be absolute, got {str(path)!r}")
    try:
        return load_image(path)
    except InputError as e:
        raise _bad(where, str(e)) from e
