"""Seats: named conversations on one loaded model, and admission control.

`--seats N` dialogues are made at start (Decoder.seat(): the model's sessions and weights held once,
each seat its own cache buffers, so memory is fixed from the first request on). The request's `user`
field names a seat. A name the server has not seen takes a free seat; when every seat already has a
name, the request is refused with 503 (code "seats_full") rather than queued or evicting somebody's
conversation: the caller learns at once, and frees one with DELETE /v1/seats/NAME. A name's first
request that is refused or fails gives the seat back (give_back): only an answered request keeps one.

Requests on one seat run one after another, in arrival order (Seat.lock); requests on different seats
run side by side, sharing the model between tokens (runtime.model_turns.ModelTurns).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cabinlm.contract.errors import CabinlmError
from cabinlm.runtime.dialogue import Dialogue
from cabinlm.serve.history import SeatRecord
from cabinlm.serve.request_error import RequestError
from cabinlm.serve.store import SeatStore


@dataclass(eq=False)
class Seat:
    name: str
    dialogue: Dialogue
    record: SeatRecord | None  # the history the cache holds; None: unknown (the next request starts over)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time, in arrival order
    last: dict[str, Any] | None = None  # the last turn's numbers (GET /v1/seats)
    answered: int = 0  # turns this seat answered since the server started (cut-short ones too)
    new: bool = False  # claimed by a request of this server that has not been answered yet
    requests: int = 0  # requests holding or waiting for the seat (ChatService.start / _leave)

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def describe(self) -> dict[str, Any]:
        cache = self.dialogue.decoder.cache
        return {
            "name": self.name,
            "busy": self.busy,
            "turns": self.dialogue.turns,
            "answered": self.answered,
            "exchanges": None if self.record is None else len(self.record.exchanges),
            "cache_tokens": cache.length,
            "seen_tokens": cache.seen,
            "evicted_tokens": cache.evicted,
            "last": self.last,
        }


def fresh_record(d: Dialogue) -> SeatRecord:
    """A dialogue just made or reset holds its system prompt and nothing else."""
    return SeatRecord(d.system, [])


class SeatManager:
    """Names -> seats. Used from the event loop's thread only (no locking needed)."""

    def __init__(self, dialogues: list[Dialogue]):
        if not dialogues:
            raise CabinlmError("a server needs at least one seat (--seats 1 or more)")
        self.total = len(dialogues)
        # Free dialogues and what they hold, popped from the end (seat 1 first). A freed seat's record
        # is None: its old conversation is still cached, and the next request starts over from its own
        # history (under the model lock, in a worker; the event loop never runs the model).
        self._free: list[tuple[Dialogue, SeatRecord | None]] = [(d, fresh_record(d)) for d in reversed(dialogues)]
        self.seats: dict[str, Seat] = {}

    def claim(self, name: str) -> Seat:
        """The seat that name holds, or a free one given that name; RequestError 503 when none is free."""
        seat = self.seats.get(name)
        if seat is not None:
            return seat
        if not self._free:
            raise RequestError(
                f"all {self.total} seats are taken ({', '.join(sorted(self.seats))}); a new conversation needs a "
                f"free seat: free one with DELETE /v1/seats/NAME, or start the server with --seats {self.total + 1}",
                status=503, code="seats_full", type="unavailable_error", param="user",
            )  # fmt: skip
        d, record = self._free.pop()
        seat = self.seats[name] = Seat(name, d, record, new=True)
        return seat

    def give_back(self, seat: Seat) -> None:
        """A seat claimed new whose requests all ended unanswered: free again, its cache as it is (its
        record says what it holds, or None: the next request on it starts over)."""
        if self.seats.get(seat.name) is seat and not seat.busy:
            del self.seats[seat.name]
            self._free.append((seat.dialogue, seat.record))

    def free(self, name: str) -> None:
        """Give a seat back, forgetting its name (404 for an unknown name, 409 while it answers)."""
        seat = self.seats.get(name)
        if seat is None:
            raise RequestError(f"no seat is named {name!r} (GET /v1/seats lists them)", status=404,
                               code="seat_not_found")  # fmt: skip
        if seat.busy:
            raise RequestError(f"seat {name!r} is answering a request; free it when it is idle", status=409,
                               code="seat_busy")  # fmt: skip
        del self.seats[name]
        self._free.append((seat.dialogue, None))

    def resume(self, store: SeatStore) -> list[str]:
        """Give every seat saved in the store its dialogue back (runtime SessionError if a file is
        damaged or from another build: the server does not start, and the file is left as it was)."""
        names = store.names()
        if len(names) > len(self._free):
            raise CabinlmError(
                f"{store.folder} holds {len(names)} seats ({', '.join(names)}) but the server has {len(self._free)} "
                f"free; start it with --seats {len(names) + len(self.seats)} or more, or move some files away"
            )
        for name in names:
            d, _ = self._free[-1]
            record = store.load(name, d)  # raises before changing anything if the file is refused
            self._free.pop()
            self.seats[name] = Seat(name, d, record)
        return names
