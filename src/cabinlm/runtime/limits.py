"""Option values checked before anything heavy is loaded: what they must be, and what this machine holds.

    check_count(name, value, least)    a whole number >= least (--max-new-tokens, --tokens, ...)
    check_threads(threads)             1 .. THREADS_PER_CORE x the cores
    check_seat_count(seats)            1..MAX_SEATS
    seat_limit(manifest)               the seats the available memory holds, at most MAX_SEATS
    check_seats(seats, manifest)       refuses more than seat_limit
    check_output_file(name, path)      a file that can be written later: its folder exists (--nll-out)
    check_system_prompt(system, manifest, tokenizer)   the system prompt fits the pinned region (--system)
    check_images(images, manifest)     images are sent only to a vision-language model (--image)

Every refusal is an OptionError naming the option as the command line spells it, and the value, so
a message reads the same from the library and from the CLI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cabinlm.contract.buildspec import THREADS_PER_CORE
from cabinlm.contract.errors import OptionError
from cabinlm.contract.manifest import Manifest
from cabinlm.runtime.memory import available_bytes
from cabinlm.runtime.template import Template, system_overflow
from cabinlm.runtime.tokenizer import Tokenizer

MAX_SEATS = 64  # a cabin's seats with room to spare; more conversations than this belong in more processes


def check_count(name: str, value: int | None, least: int, most: int | None = None) -> None:
    """value is None (not set) or a whole number in least..most."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"--{name} must be a whole number, got {value!r}")
    if value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"{least}..{most}"
        raise OptionError(f"--{name} must be {bound}, got {value}")


def check_threads(threads: int | None, name: str = "threads") -> None:
    """None (the engine's default: all cores) or 1..THREADS_PER_CORE x the cores."""
    cores = os.cpu_count() or 1
    check_count(name, threads, 1)
    if threads is not None and threads > THREADS_PER_CORE * cores:
        raise OptionError(
            f"--{name} {threads}: this machine has {cores} core{'s' if cores != 1 else ''}; give "
            f"1..{THREADS_PER_CORE * cores} (threads beyond the cores only wait for each other), or leave it out "
            "to use every core"
        )


@dataclass(frozen=True)
class SeatLimit:
    """How many seats fit, and the numbers behind it (for the message)."""

    seats: int
    per_seat_bytes: int  # an upper estimate of one seat's buffers
    weights_bytes: int  # the artifact's files, loaded once for all seats, and what its sessions pack (together_bytes)
    available_bytes: int | None  # None: unknown here (no /proc/meminfo)


def seat_bytes(manifest: Manifest) -> int:
    """An upper estimate of one seat's memory: its cache buffers twice over (the fused build adds a
    chunk of spare ring slots and the sink/pinned keys unrotated in float32), one chunk of float32
    logits, and 1 MiB of small buffers."""
    lay, vocab = manifest.cache, manifest.model.vocab_size
    return 2 * lay.cache_bytes + lay.chunk * vocab * 4 + (1 << 20)


def together_bytes(manifest: Manifest) -> int:
    """What the loaded build holds once beyond its files and its seats' buffers, as its engine says
    (engines.registry.held_once_bytes: a build whose seats decode together packs its batched graphs'
    weights and keeps an idle seat; 0 for most builds)."""
    from cabinlm.engines.registry import held_once_bytes

    return held_once_bytes(manifest, seat_bytes(manifest))


def seat_limit(manifest: Manifest, available: int | None = None) -> SeatLimit:
    """The most seats `manifest`'s model can hold here: what available memory (default: read from the
    OS now) leaves after the weights, per seat_bytes, and never more than MAX_SEATS (nor fewer than 1:
    whether the model itself fits is for loading it to find out)."""
    per_seat = seat_bytes(manifest)
    weights = sum(f.bytes for f in manifest.files.values()) + together_bytes(manifest)
    available = available_bytes() if available is None else available
    seats = MAX_SEATS if available is None else max(1, min(MAX_SEATS, (available - weights) // per_seat))
    return SeatLimit(seats, per_seat, weights, available)


def check_seat_count(seats: int) -> None:
    """1..MAX_SEATS, whatever the model: checked before even its manifest is read."""
    check_count("seats", seats, 1)
    if seats > MAX_SEATS:
        raise OptionError(f"--seats {seats}: at most {MAX_SEATS} seats on one loaded model; run several processes "
                          "for more conversations")  # fmt: skip


def check_seats(seats: int, manifest: Manifest, available: int | None = None) -> None:
    """check_seat_count, and no more seats than seat_limit: what this machine's memory holds."""
    check_seat_count(seats)
    limit = seat_limit(manifest, available)
    if seats <= limit.seats:
        return
    mib = 1 << 20
    raise OptionError(
        f"--seats {seats}: this machine has {limit.available_bytes / mib:.0f} MiB of memory available; the model "
        f"takes {limit.weights_bytes / mib:.0f} MiB and each seat up to {limit.per_seat_bytes / mib:.1f} MiB "
        f"(its {manifest.cache.slots}-slot {manifest.cache.kv_dtype.value} cache and buffers), so {limit.seats} "
        f"seat{'s' if limit.seats != 1 else ''} fit; lower --seats, or export a smaller --window or --kv"
    )


def check_output_file(name: str, path: Path | None) -> None:
    """A file to be written after a long run: its folder must exist now, and the path not be a folder."""
    if path is None:
        return
    folder = path.parent
    if not folder.is_dir():
        raise OptionError(f"--{name} {path}: the folder {folder} does not exist; create it or choose another path")
    if path.is_dir():
        raise OptionError(f"--{name} {path} is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise OptionError(f"--{name} {path}: the folder {folder} is not writable")


def check_images(images: bool, manifest: Manifest, option: str = "--image") -> None:
    """A caller that will send camera frames (`cabinlm chat --image`) needs a model with vision input."""
    if images and manifest.vision is None:
        raise OptionError(f"{option}: this model has no vision input; export a vision-language model to send images")


def check_system_prompt(system: str | None, manifest: Manifest, tokenizer: Tokenizer,
                        option: str | None = "--system") -> None:  # fmt: skip
    """The system prompt (None: the model's default) fits where a Dialogue pins it: the sink and
    pinned slots. Rendered by the Dialogue's own renderer (runtime/template.py) with the tokenizer
    alone, so a prompt that does not fit is refused before the model loads rather than after.
    option: the option that gave `system`, as the message names it (None: no option gives it, e.g.
    `cabinlm serve`'s default or the bench's script; the message then suggests re-exporting only)."""
    text = manifest.chat.default_system if system is None else system
    if not text:
        return
    n = len(Template(tokenizer, manifest.chat).start(text))
    why = system_overflow(n, manifest.cache, None if option is None else f"give a shorter {option}")
    if why is None:
        return
    if system is None:
        whose = "the model's default system prompt is"
    else:
        whose = f"{option} is" if option is not None else "the system prompt is"
    raise OptionError(f"{whose} {why}")
