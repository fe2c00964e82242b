"""Calibration text for int8 / fp8 KV: a built-in mix of prose and in-car dialogue, or the user's file.

Each source is split 60 / 40: the first part calibrates the key scales, the held-back part feeds the
quality gate (so the gate never scores text the scales were fitted on).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.manifest import ChatTemplate

CALIB_FRACTION = 0.6


def _split(ids: list[int]) -> tuple[list[int], list[int]]:
    cut = int(len(ids) * CALIB_FRACTION)
    return ids[:cut], ids[cut:]


def _builtin(name: str) -> str:
    return resources.files("cabinlm.contract").joinpath("data", name).read_text(encoding="utf-8")


def dialogue_text(chat: ChatTemplate, system: str | None) -> str:
    lines = [line for line in _builtin("calibration_dialogue.txt").splitlines() if line and not line.startswith("#")]
    text = chat.system_prefix + system + chat.system_suffix if system else ""
    for user, reply in zip(lines[0::2], lines[1::2]):
        text += chat.user_prefix + user + chat.user_suffix + chat.assistant_prefix + reply + chat.assistant_suffix
    return text


def calibration_tokens(loaded, chat: ChatTemplate, path: Path | None) -> tuple[list[int], list[int], str]:
    """(calibration ids, held-back ids, description of the source)."""
    tok = loaded.tokenizer.backend_tokenizer
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CabinlmError(f"--calib {path}: cannot read it as UTF-8 text ({e})") from e
        ids = tok.encode(text).ids
        if len(ids) < 256:
            raise CabinlmError(f"--calib {path}: only {len(ids)} tokens; give at least 256 (a few thousand is better)")
        calib, held = _split(ids)
        return calib, held, str(path)
    prose = tok.encode(_builtin("calibration_prose.txt")).ids
    dialogue = tok.encode(dialogue_text(chat, chat.default_system or "You are the car's assistant."), add_special_tokens=False).ids
    p_cal, p_held = _split(prose)
    d_cal, d_held = _split(dialogue)
    return p_cal + d_cal, d_held + p_held, "built-in mix (1911 encyclopaedia prose + in-car dialogue)"
