"""OpenAI image_url parts -> what Dialogue.ask takes: a data URL decoded in memory, or a local file path.

    data:image/png;base64,iVBORw0...    decoded here (Pillow reads PNG, JPEG, BMP, ...)
    file:///var/cabin/frame.jpg         a frame the camera service wrote; read by runtime.vision
    /var/cabin/frame.jpg                the same, as a plain absolute path

Nothing is fetched from the network. Both are read by runtime.vision.load_image, with the checks
`cabinlm chat` makes of a frame (decompression bombs, megapixels, oversized PNG text, corrupt data).
Every problem is a RequestError (a 400 naming the message part and the reason).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

from cabinlm.contract.errors import InputError
from cabinlm.runtime.vision import load_image
from cabinlm.serve.request_error import RequestError

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
        try:  # the checks `cabinlm chat` makes of a frame: bombs, megapixels, text metadata, corrupt data
            return load_image(raw, name="the data URL's image")  # RGB, alpha composited on white
        except InputError as e:
            raise _bad(where, str(e)) from e
    path = Path(unquote(urlparse(url).path)) if url.startswith("file://") else Path(url)
    if not path.is_absolute():
        raise _bad(where, f"a local image path must be absolute, got {str(path)!r}")
    try:
        return load_image(path)
    except InputError as e:
        raise _bad(where, str(e)) from e
