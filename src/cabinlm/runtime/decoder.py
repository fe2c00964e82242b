"""The decoder: one dialogue's slot bookkeeping and one backend, chunks in, logits out.

    Decoder.step(ids)
      plan = slots.plan(n, pin)       contract/slots.py: destination slots, positions, mask, the fills
      out  = backend.run(plan, ...)   engines/<engine>/backend.py: the graph over the cache (nothing committed)
      with Ctrl-C held:
        backend.commit(plan, out)     the chunk's K/V into their slots, in place
        slots.advance(plan)           the bookkeeping follows the data

The Decoder never asks which backend it drives. Seats (several dialogues on one loaded model) share
the backend's loaded graphs and weights; each has its own table and buffers.

Switchable LoRA adapters (an export with --lora-rank, a build with --adapter): each seat has its own
adapter or none (Decoder.adapter), the prepared arrays loaded once for all seats (runtime/adapters.py).
Such a decoder keeps its history (runtime/history.py), the steps it committed since its reset, in
order: its cached K/V were computed with its adapter, so set_adapter re-runs that history with the new
one, and the cache is then the one a fresh seat with that adapter fed the same steps holds. A session
file keeps the history (runtime/persist.py), so a resumed seat can switch too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cabinlm.contract.errors import InputError
from cabinlm.contract.manifest import Manifest, load_manifest
from cabinlm.engines.backend import Backend
from cabinlm.engines.registry import open_backend
from cabinlm.runtime.history import History, Kind
from cabinlm.runtime.interrupts import defer_sigint
from cabinlm.contract.slots import SlotTable, StepPlan


class Decoder:
    """Feeds token chunks through the artifact's backend and keeps its fixed-size cache up to date."""

    def __init__(self, folder: str | Path, manifest: Manifest | None = None, threads: int | None = None,
                 session_config: dict[str, str] | None = None, *, _backend: Backend | None = None, _vision=None):
        """session_config: extra ONNX Runtime session entries (see engines.registry.open_backend)."""
        self.folder = Path(folder)
        self.manifest = manifest if manifest is not None else load_manifest(self.folder)
        self.layout = self.manifest.cache
        self.cache = SlotTable(self.layout)  # the bookkeeping; the buffers are the backend's
        if _backend is None:
            _backend = open_backend(self.folder, self.manifest, self.cache, threads, session_config)
        self.backend = _backend
        self.vision = _vision
        # Where steps go when seats decode together under a scheduler (runtime.model_turns.SeatSteps): it
        # runs them itself, with other seats' steps, through Decoder._step / step_seats. None: here.
        self.together = None
        if _vision is None and self.manifest.vision is not None:
            from cabinlm.runtime.vision import open_encoder

            # The camera-frame encoder: on the HTP where an HTP build compiled it, else on the CPU provider.
            self.vision = open_encoder(self.folder, self.manifest, threads)
        self.adapters = None  # runtime.adapters.AdapterSet where the artifact takes adapter inputs
        if self.manifest.lora is not None:
            from cabinlm.runtime.adapters import AdapterSet

            self.adapters = AdapterSet(self.folder, self.manifest)
        self.adapter: str | None = None
        # The steps committed since the reset, where adapters can switch; None: unknown (a camera frame
        # fed, a cache restored from a session file without one), or the artifact has no adapter inputs.
        self.history: History | None = History() if self.adapters is not None else None

    @property
    def device(self) -> str:
        """What the decoder graphs run on (e.g. "onnxruntime-cpu")."""
        return self.backend.device

    def seat(self) -> Decoder:
        """Another dialogue seat on the same loaded model: graphs and weights shared (held once),
        the slot table and cache buffers the new seat's own."""
        other = Decoder.__new__(Decoder)
        other.folder, other.manifest, other.layout = self.folder, self.manifest, self.layout
        other.cache = SlotTable(self.layout)
        other.backend = self.backend.seat(other.cache)
        other.vision = self.vision
        other.together = self.together
        other.adapters, other.adapter = self.adapters, None
        other.history = History() if self.adapters is not None else None
        return other

    def reset(self) -> None:
        self.cache.reset()
        self.backend.reset()
        if self.adapters is not None:
            self.history = History()

    def known_history(self) -> History | None:
        """The history, where it is this cache's: None where it is unknown, or where the cache was put
        back to an earlier state behind the decoder's back (its tokens are then not the stream's)."""
        h = self.history
        return h if h is not None and h.tokens == self.cache.seen and h.recalls == self.cache.recalls else None

    def begin_recall(self) -> None:
        """New recalled text replaces the recall region's whole (SlotTable.begin_recall); its chunks
        follow with pin="recall"."""
        self.cache.begin_recall()
        if self.history is not None:
            self.history.begin_recall()

    def set_adapter(self, name: str | None, replay: bool = True) -> None:
        """This seat's adapter (a name the build prepared; None: the base model). The cached K/V came
        from the previous adapter, so a change re-runs the seat's history with the new one, chunk for
        chunk (replay), or resets the cache (replay=False: the caller feeds a history itself). An
        unknown name, or an artifact without adapter inputs: InputError, nothing changed."""
        if self.adapters is None:
            if name is None:
                return
            raise InputError(f"adapter {name!r}: this artifact takes no switchable adapters; export the model with "
                             "--lora-rank R and build it with --adapter NAME=DIR")  # fmt: skip
        self.adapters.check(name)
        if name == self.adapter:
            return
        steps = self.known_history()
        if replay and steps is None and self.cache.length:
            raise InputError(f"adapter {name!r}: this seat's history is unknown (a camera frame was fed, its cache was "
                             "put back to an earlier state, or came from a session file that does not keep it), so its "
                             "cache cannot be rebuilt with another adapter; start a new dialogue to change its "
                             "adapter")  # fmt: skip
        # None: the backend's own zeros, or a graph without adapter nodes (the fused build's plain twin)
        self.backend.set_adapter(None if name is None else self.adapters.feeds(name))
        self.adapter = name
        self.reset()
        if replay and steps is not None:
            self._replay(steps)

    def _replay(self, steps: History) -> None:
        """Run a history again on this (reset) seat, every step planned as it was."""
        for kind, ids in steps:
            if kind is Kind.BEGIN_RECALL:
                self.begin_recall()
            elif kind is Kind.VERIFIED:
                self._verify(ids, lambda logits, n=len(ids): n)
            else:
                self._step(ids, kind.pin, None, "last")

    def resume_adapter(self, name: str | None, history: History | None = None) -> None:
        """A session file's adapter: its inputs bound, the cache left as restored (it was computed
        with that adapter), and the history the file kept (None: unknown)."""
        if self.adapters is None and name is None:
            return
        self.set_adapter(name, replay=False)
        self.history = history

    def step(self, ids: np.ndarray, pin: bool | str = False, embeds: np.ndarray | None = None,
             logits: str = "all") -> np.ndarray:
        """Run one chunk (1..chunk tokens) and commit its K/V. Returns logits (tokens, vocab), or
        with logits="last" only the last token's (1, vocab): the graph then computes just that row.
        The array may be a view of the backend's output buffer, which the next step rewrites: copy
        it to keep it.

        pin: True for the pinned region, "image" for the camera-frame region (embeds: the frame's
        image-token embeddings, (tokens, embed_dim))."""
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if embeds is not None and self.manifest.vision is None:
            raise ValueError("this model has no vision input")
        if self.together is not None:
            return self.together.step(self, ids, pin, embeds, logits)
        return self._step(ids, pin, embeds, logits)

    def _step(self, ids: np.ndarray, pin: bool | str, embeds: np.ndarray | None, logits: str) -> np.ndarray:
        """step() on this seat alone."""
        plan = self.cache.plan(len(ids), pin)
        out = self.backend.run(plan, ids, logits == "all", embeds)
        with defer_sigint():
            self.backend.commit(plan, out)
            self.cache.advance(plan)
            self._record(ids, pin)
        return out.logits

    def _record(self, ids: np.ndarray, pin: bool | str, verified: bool = False) -> None:
        if self.history is not None:
            if pin == "image":  # a frame's embeddings are not kept: its history cannot be run again
                self.history = None
            else:
                self.history.add(ids, pin, verified)

    def draft_room(self) -> int:
        """How many drafts one verify() may carry after the stream's last token (0 or less: none).
        A verified chunk's row i must compute what the one-token step after its first i tokens would.
        Where the backend can run a chunk as steps (Backend.verifies_after_turnover: each row sees the
        cache without the window tokens the steps before it evict, and the sink / pinned keys as its
        own step rotates them), that holds for the whole dialogue: a chunk's worth, once the sink is
        full. Elsewhere a chunk's tokens all see the cache as it was before the chunk (docs/design.md, "The cache"), so
        once the window is full row i would still see the i oldest window tokens and sit i positions
        further from the sink and pinned tokens: drafting then runs only while the window fills. And
        never where the backend's chunk rows are not its steps (Backend.verifies_drafts), so a reply
        is token for token what plain decoding gives (greedy) or distributed as it."""
        if not self.backend.verifies_drafts:
            return 0
        if self.backend.verifies_after_turnover:
            return self.layout.chunk - 1 if self.cache.sink_fill == self.layout.sink else 0
        return min(self.layout.chunk - 1, self.layout.window - self.cache.window_fill - 1)

    def verify(self, ids: np.ndarray, accept) -> tuple[np.ndarray, int]:
        """Speculative decoding's check: run ids (1..chunk window tokens: the last token and the
        drafts after it) as one chunk with every token's logits, ask accept(logits) how many of the
        first tokens join the stream (1..len(ids)), and commit only those. The graph returns the new
        K/V without writing the cache's slots (engines/backend.py), so rejected drafts need no
        rollback: the cache is what feeding the accepted tokens alone would have made it.
        Returns (logits (tokens, vocab), accepted). Under a scheduler (Decoder.together) the chunk
        rides with other seats' steps like any step (seats_together), with the same result."""
        if self.together is not None:
            return self.together.verify(self, np.ascontiguousarray(ids, dtype=np.int64), accept)
        return self._verify(ids, accept)

    def _verify(self, ids: np.ndarray, accept) -> tuple[np.ndarray, int]:
        """verify() on this seat alone."""
        logits, k = seats_together([self], [ids], accepts=[accept])[0]
        return logits, k

    def plan_chunk(self, n: int, pin: bool | str = False, verify: bool = False) -> StepPlan:
        """The plan of this seat's next chunk of n tokens (nothing changes yet): a step's (pinned where
        pin), or a verification's (verify: window tokens, as one-token steps where the backend runs a
        chunk's rows so, Backend.verifies_after_turnover). The plan of a verification's first k
        tokens is a prefix of its plan: the same slots, positions and mask rows for those tokens."""
        if verify:
            if pin:
                raise ValueError("a verified chunk holds window tokens: it is not pinned")
            return self.cache.plan(n, steps=self.backend.verifies_after_turnover)
        return self.cache.plan(n, pin)

    def feed(self, ids, pin: bool | str = False, all_logits: bool = False, embeds: np.ndarray | None = None) -> np.ndarray:
        """Feed any number of tokens in chunks. Returns the last token's logits (vocab,), or all (n, vocab)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("feed() needs at least one token")
        C = self.layout.chunk
        parts = []
        for start in range(0, len(ids), C):
            rows = None if embeds is None else embeds[start : start + C]
            logits = self.step(ids[start : start + C], pin=pin, embeds=rows, logits="all" if all_logits else "last")
            if all_logits:
                parts.append(logits.copy())
        if all_logits:
            return np.concatenate(parts, axis=0)
        return logits[-1].copy()


def step_seats(decoders: Sequence[Decoder], chunks: Sequence, pins: Sequence[bool] | None = None) -> list[np.ndarray]:
    """One step for several seats together: seat i's chunk chunks[i] (1..chunk tokens; a decode step is
    one) planned on its own slot table (pinned where pins[i]), all run by the backend's run_seats (the
    fused cpu build: one graph run per batch of seats, FusedSettings.seat_batches; elsewhere each seat
    alone), then every seat's K/V committed and its table advanced, with Ctrl-C held over all the
    commits: an interrupted step leaves every seat as it was. Returns each seat's last token's logits
    (vocab,), what decoders[i].step(chunks[i], pin, logits="last") gives (bit for bit on the fused cpu
    build: tests/test_batched_seats.py).

    The decoders are seats of one loaded model (Decoder.seat), each at most once; which seats step
    together may change from one step to the next (a seat joins or leaves between steps). Seats that
    verify drafts in the same run: seats_together."""
    return [logits[-1] for logits, _ in seats_together(decoders, chunks, pins)]


def seats_together(decoders: Sequence[Decoder], chunks: Sequence, pins: Sequence[bool | str] | None = None,
                   accepts: Sequence[Callable[[np.ndarray], int] | None] | None = None,
                   embeds: Sequence[np.ndarray | None] | None = None) -> list[tuple[np.ndarray, int]]:  # fmt: skip
    """step_seats where some seats verify drafts (speculative decoding) in the same run:

        seat i plain      (accepts[i] None)  its chunk planned, run and committed whole, as step_seats;
                                             -> (its last token's logits (1, vocab), len(chunk))
        seat i verifying  (accepts[i] given) its chunk [token, d1 .. dk] planned as Decoder.verify plans
                                             it, run with every row's logits, k = accepts[i](logits)
                                             (1..len(chunk)), and only the first k tokens committed
                                             (their plan: a prefix of the chunk's, Decoder.plan_chunk)
                                             -> (every row's logits (tokens, vocab), k)
        seat i's frame    (embeds[i] given)  a camera frame's chunk (pins[i] "image", its image-token
                                             embeddings), planned, run and committed as its own step

    One run_seats for all (the fused cpu build: a seat's rows of every kind in one batched run), then
    every accept called, then every seat's commit with Ctrl-C held over all of them: a step interrupted
    anywhere (an accept that raises included) leaves every seat as it was. Each seat's logits and cache
    are what its own Decoder.step / Decoder.verify gives (bit for bit on the fused cpu build:
    tests/test_batched_drafting.py). The arrays returned are the caller's (copies, or arrays no later run
    writes: StepOutput.owned)."""
    if not decoders:
        return []
    n = len(decoders)
    chunks = [np.ascontiguousarray(c, dtype=np.int64) for c in chunks]
    pins = list(pins) if pins is not None else [False] * n
    checks = list(accepts) if accepts is not None else [None] * n
    frames = list(embeds) if embeds is not None else [None] * n
    if not n == len(chunks) == len(pins) == len(checks) == len(frames):
        extra = f", {len(checks)} accept callbacks" if accepts is not None else ""
        extra += f", {len(frames)} embeddings" if embeds is not None else ""
        raise ValueError(f"step_seats: {n} seats, {len(chunks)} chunks, {len(pins)} pins{extra}")
    for d, a, e in zip(decoders, checks, frames):
        if e is not None and (a is not None or d.manifest.vision is None):
            raise ValueError("embeddings go with a camera frame's chunk of a vision-language model, "
                             "never with a verified one")
    plans = [d.plan_chunk(len(c), p, a is not None) for d, c, p, a in zip(decoders, chunks, pins, checks)]
    outs = decoders[0].backend.run_seats([d.backend for d in decoders], plans, chunks, [a is not None for a in checks],
                                         frames if embeds is not None else None)  # fmt: skip
    kept, got = [], []
    for d, c, plan, out, accept in zip(decoders, chunks, plans, outs, checks):
        if accept is None:
            kept.append(plan)
            got.append((out.logits[-1:].copy(), len(c)))
            continue
        k = int(accept(out.logits))
        if not 1 <= k <= len(c):
            raise ValueError(f"accept() must keep 1..{len(c)} tokens, got {k}")
        kept.append(plan if k == len(c) else d.plan_chunk(k, verify=True))  # a prefix of the chunk's plan
        got.append((out.logits if out.owned else out.logits.copy(), k))
    with defer_sigint():
        for d, c, pin, plan, out, (_, k), accept in zip(decoders, chunks, pins, kept, outs, got, checks):
            d.backend.commit(plan, out)
            d.cache.advance(plan)
            d._record(c[:k], pin, accept is not None)
    return got
