"""One inference at a time on the shared model, handed from seat to seat between tokens, in arrival order.

The seats share one loaded model (ONNX Runtime sessions and weights). Each request runs in its own
worker thread and holds ModelTurns while it feeds or decodes; between two reply tokens it calls
pass_turn(), which hands the model to the longest-waiting request (if any) and queues behind it:

    time ->   seat A: [prefill A][tok][tok]       [tok]       [tok][tok] ...
              seat B:                   [prefill B]    [tok]
                                     ^ B arrives: A passes the model on at its next token

So a reply's time to first token is bounded by one prefill (plus one token per waiting seat), not by
another seat's whole reply, and N streaming seats decode round-robin at 1/N of the solo speed each.
A prefill (a prompt, or a seat starting over from a long history) is not split.

Where the build's seats decode together (a fused cpu build's batched graphs), SeatSteps below keeps
these turns and lets the seat that passed the model on ride: its steps, verified drafts and camera
frames' chunks go with the holder's in one run.

A plain threading.Lock is not used: its release-then-acquire lets the releasing thread take it again
at once (no hand-over), which would starve every other seat.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cabinlm.runtime.decoder import Decoder


class ModelTurns:
    """A first-come-first-served lock with direct hand-over."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiting: collections.deque[threading.Event] = collections.deque()

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()  # set by release(): the model is ours, never free in between

    def release(self) -> None:
        with self._mutex:
            if self._waiting:
                self._waiting.popleft().set()  # hand over; _held stays True
            else:
                self._held = False

    def pass_turn(self) -> None:
        """Let every request that was waiting run once before this one goes on (no-op when none waits)."""
        with self._mutex:
            if not self._waiting:
                return
        self.release()
        self.acquire()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def __enter__(self) -> ModelTurns:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Posted:
    """A step posted by a seat that rides (holds no model): run by the model's holder along with its own.
    (The holder's own step is described the same way, never posted.)"""

    __slots__ = ("dec", "ids", "pin", "accept", "embeds", "done", "logits", "kept", "error", "lead")

    def __init__(self, dec, ids: np.ndarray, pin: bool | str, accept=None, embeds: np.ndarray | None = None):
        self.dec, self.ids, self.pin = dec, ids, pin
        self.accept = accept  # a verified draft's accept (Decoder.verify), run in the holder's thread; None: a step
        self.embeds = embeds  # a camera frame's chunk: its image-token embeddings
        self.done = threading.Event()  # set once the step ran (logits or error), or the model is handed over (lead)
        self.logits: np.ndarray | None = None  # what the seat's own step / verify returns: (1, vocab) / (tokens, vocab)
        self.kept = 0  # how many of its tokens were committed (a verified draft's accepted ones)
        self.error: BaseException | None = None
        self.lead = False  # the model was handed to this rider: it runs its step itself

    def check(self) -> None:
        """Raises what the seat's own step would raise for a chunk its table refuses (nothing changes)."""
        self.dec.plan_chunk(len(self.ids), self.pin, self.accept is not None)


class SeatSteps(ModelTurns):
    """ModelTurns for a build whose seats decode together (Backend.seat_batches): the same turns, in
    the same order, with the same hand-over, and one thing more. A seat that passes its turn on
    between two tokens (pass_turn, another request waiting) no longer queues for the model: it *rides*.
    Its next steps and verified drafts (Decoder.step and Decoder.verify route them here:
    Decoder.together) are posted, and whoever holds the model runs them with its own step or verified
    draft in one batched run (runtime.seats_together):

        time ->   seat A:  [prefill A][tok A] (rides)   [tok A ........ A's steps go with B's, then C's]
                  seat B:        waits  [prefill B + A's tok][B's draft + A's][tok B + A's draft] (rides) ...
                  seat C:              waits                              [prefill C + A's + B's] ...

    A rider's step is run as its own step would be, bit for bit, and a verified draft commits the
    tokens its own accept() keeps, as its own Decoder.verify would (tests/test_batched_seats.py,
    test_batched_drafting.py), so replies are those of turns taken one after another, drafting or
    not. Admission does not change: a new turn still waits for the model in arrival order (acquire)
    and takes it at the holder's next pass_turn; its prefill chunks then carry the riders' decode
    steps, so their replies go on while it prefills. The holder waits at most RIDER_WAIT_S for riders
    that have their step's result but have not posted the next one yet (a rider between two tokens:
    sampling, streaming its text). When the holder's turn ends with riders posted and no turn queued,
    the oldest rider takes the model. A camera frame's chunks ride too (its embeddings go with the
    step). A step that cannot ride (a plain chunk with every row's logits) takes the model in turn; the
    holder runs the posted steps before anything it runs alone."""

    RIDER_WAIT_S = 0.004

    def __init__(self, max_batch: int):
        super().__init__()
        self.max_batch = max_batch  # seats one run may take: the build's largest batch
        self._posted: collections.deque[_Posted] = collections.deque()
        self._riders = 0  # threads riding now (posted or between two of their steps)
        self._changed = threading.Condition(self._mutex)  # a step posted, or a rider gone
        self._local = threading.local()  # .riding: this thread passed its turn on and holds no model
        self.batched_runs = 0  # runs of two or more seats' steps (reports, tests)
        self.verified_riding = 0  # verified drafts that ran with other seats' steps (reports, tests)

    def join(self, dec: Decoder) -> None:
        """Route this seat's steps and verified drafts through these turns (Decoder.together)."""
        dec.together = self

    def _riding(self) -> bool:
        return getattr(self._local, "riding", False)

    def _stop_riding(self) -> None:
        """Under the mutex: this thread rides no more (it holds the model, or its turn ended)."""
        self._local.riding = False
        self._riders -= 1
        self._changed.notify_all()

    def acquire(self) -> None:
        super().acquire()
        self._local.riding = False

    def release(self) -> None:
        with self._mutex:
            if self._riding():  # a turn that ends while riding holds nothing
                self._stop_riding()
                return
            if self._waiting:  # a turn waits: it takes the model (and the riders along)
                self._waiting.popleft().set()
            elif self._posted:  # none: the oldest rider takes it
                rider = self._posted.popleft()
                rider.lead = True
                rider.done.set()
            else:
                self._held = False

    def pass_turn(self) -> None:
        """Between two tokens: if a turn waits, the model goes to it and this seat rides from here on."""
        if self._riding():
            return
        with self._mutex:
            if not self._waiting:
                return
            self._waiting.popleft().set()  # hand over; _held stays True
            self._local.riding = True
            self._riders += 1

    def hold(self) -> None:
        """The calling seat is about to run something alone (a plain chunk with every row's logits):
        take the model in turn if it rides; the riders' posted steps run first, together."""
        self._take_model()
        self._run_posted()

    def _take_model(self) -> None:
        if self._riding():
            with self._mutex:
                self._stop_riding()
            super().acquire()

    def step(self, dec, ids: np.ndarray, pin: bool | str, embeds: np.ndarray | None, logits: str) -> np.ndarray:
        """Decoder.step of a seat under this scheduler (Decoder.together)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if logits == "all" and len(ids) > 1:  # every row's logits of a plain chunk: alone
            self.hold()
            return dec._step(ids, pin, embeds, logits)
        return self._go(_Posted(dec, ids, pin, embeds=embeds))[0]

    def verify(self, dec, ids: np.ndarray, accept) -> tuple[np.ndarray, int]:
        """Decoder.verify of a seat under this scheduler: the verified draft rides (or carries the
        riders) as a step does; accept() runs in the thread of whoever holds the model."""
        return self._go(_Posted(dec, ids, False, accept))

    def _go(self, own: _Posted) -> tuple[np.ndarray, int]:
        """The seat's step or verified draft: posted while it rides (the holder runs it), else run by
        this thread with the riders' posted steps. Returns (logits, tokens committed)."""
        if self._riding():
            with self._mutex:
                if self._held:
                    self._posted.append(own)
                    self._changed.notify_all()
                else:  # nobody holds the model: this seat takes it
                    self._held = True
                    self._stop_riding()
            if self._riding():
                own.done.wait()
                if not own.lead:
                    if own.error is not None:
                        raise own.error
                    return own.logits, own.kept
                with self._mutex:  # handed the model (release): this seat holds it now
                    self._stop_riding()
        own.check()  # a chunk the table refuses is refused before riders are taken
        riders = self._ready(self._take(self.max_batch - 1))
        if not riders:
            if own.accept is not None:
                return own.dec._verify(own.ids, own.accept)
            return own.dec._step(own.ids, own.pin, own.embeds, "last"), len(own.ids)
        return self._run([own, *riders], riders)

    def _take(self, room: int, wait: bool = True) -> list[_Posted]:
        """Up to `room` posted steps, oldest first; wait: after waiting (at most RIDER_WAIT_S) for
        every rider to post, so that the holder's step takes them along."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: len(self._posted) >= min(room, self._riders), timeout=self.RIDER_WAIT_S)
            return [self._posted.popleft() for _ in range(min(room, len(self._posted)))]

    @staticmethod
    def _ready(riders: list[_Posted]) -> list[_Posted]:
        """The riders whose chunk their table takes; the others get the table's error (as their own
        step would raise it) and ride no further."""
        ok = []
        for r in riders:
            try:
                r.check()
            except Exception as e:  # noqa: BLE001 - handed to the rider's thread, which raises it
                r.error = e
                r.done.set()
            else:
                ok.append(r)
        return ok

    def _run(self, steps: list[_Posted], riders: list[_Posted]) -> tuple[np.ndarray, int]:
        """One seats_together over `steps` (the holder's own first, if any, then the riders'); every
        rider woken with its result, or with the error that stopped the run (an interrupted run
        commits no seat's step). Returns the first step's (logits, tokens committed)."""
        from cabinlm.runtime.decoder import seats_together

        try:
            got = seats_together([s.dec for s in steps], [s.ids for s in steps], [s.pin for s in steps],
                                 [s.accept for s in steps], [s.embeds for s in steps])  # fmt: skip
        except BaseException as e:
            for r in riders:
                r.error = e
                r.done.set()
            raise
        for r, (logits, kept) in zip(riders, got[len(got) - len(riders) :]):
            r.logits, r.kept = logits, kept
            r.done.set()
        if len(steps) > 1:
            self.batched_runs += 1
            self.verified_riding += sum(s.accept is not None for s in steps)
        return got[0]

    def _run_posted(self) -> None:
        riders = self._ready(self._take(self.max_batch, wait=False))
        if riders:
            self._run(riders, riders)


def share_model(decoders: Sequence[Decoder]) -> ModelTurns:
    """The turns the seats of one loaded model take on it: SeatSteps where its build's seats decode
    together (Backend.seat_batches) and there are two or more seats, every seat's steps and verified
    drafts routed through it (SeatSteps.join); plain ModelTurns otherwise. The caller (serve) holds,
    passes and releases the turns; how the seats' steps run together is this module's."""
    batches = decoders[0].backend.seat_batches
    if not batches or len(decoders) < 2:
        return ModelTurns()
    model = SeatSteps(max(batches))
    for d in decoders:
        model.join(d)
    return model
