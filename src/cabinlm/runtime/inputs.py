"""One line of chat input -> (seat, text, image): what a car's front end or a script sends.

    plain text                               seat 1
    @2 text                                  seat 2
    {"text": ..., "image": PATH, "seat": 2}  a JSON object; image and seat are optional
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_SEAT_PREFIX = re.compile(r"^@(\d+)(?:\s+(.*))?$", re.DOTALL)


@dataclass(frozen=True)
class UserInput:
    seat: int
    text: str
    image: Path | None = None
    warning: str | None = None  # something the caller should tell the user (the line is still used)


def parse_input_line(line: str, seats: int = 1) -> UserInput:
    text, seat, image = line.strip(), 1, None
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None  # not JSON after all: plain text
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            seat, text = obj.get("seat", 1), obj["text"].strip()
            if isinstance(obj.get("image"), str):
                image = Path(obj["image"])
    else:
        m = _SEAT_PREFIX.match(text)
        if m:
            seat, text = int(m.group(1)), (m.group(2) or "").strip()
    if isinstance(seat, bool) or not isinstance(seat, int) or not 1 <= seat <= seats:
        return UserInput(1, text, image, f"seat {seat} does not exist (--seats {seats}); the message went to seat 1")
    return UserInput(seat, text, image)
