"""Seats decoding together on the fused cpu build: several seats' chunks in one run of a batched graph
(graph.fused_model(seats=B), io_spec.seats_io), the LM head in that graph where it runs on cabinlm's
BlockQ8MatMul (FusedSettings.head_kernel "cabinlm"), else in the head graph they share.

    seat 0 rows ┐                                   ┌ seat 0's Int8KVAttention over seat 0's cache ┐
    seat 1 rows ├ every weight matmul over all rows ┤ ...                                          ├ ... ─ head ─ logits (seats, vocab)
    ...         ┘                                   └ seat B-1's over its own cache                ┘

Each seat's rows are computed as its own run would compute them: the weight matmuls take every seat's
rows (BlockQ4MatMul and BlockQ8MatMul compute each row by the same sequence whatever the rows beside it), and the
attention is each seat's own node over its own cache, fed the inputs of its own chunk
(FusedBackend.chunk_inputs). So a seat's logits are its solo logits bit for bit, and each seat
commits its own step exactly as alone (FusedBackend.commit). Places of a batch no seat takes are
filled by the idle seat, whose output is dropped.

Switchable LoRA adapters (an export with --lora-rank): each seat binds its own adapter's inputs. A
batch in which no seat has an adapter runs the batched graph's plain twin where the build carries one
(FusedSettings.plain_graphs: no adapter inputs, bit for bit that graph fed zeros), as such a seat's
own steps run the plain one-seat graph; a batch with an adapter anywhere runs the adapter graph, the
zeros bound for the seats without.

SeatBatches owns all of it for one loaded build: the batched sessions (opened when the build gets
its second seat), the bindings of the last groups of seats and what each has bound, the head's
bindings, and the idle seat. A seat reaches it through the FusedGraphs its build shares
(sessions.py); a seat offers a batched run the BatchedSeat surface below, nothing more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cabinlm.contract import io_spec as io
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.slots import SlotTable, StepPlan
from cabinlm.engines.backend import Backend, StepOutput

if TYPE_CHECKING:
    import onnxruntime as ort

    from cabinlm.engines.onnxruntime.rotated import RotatedKeys


class BatchedSeat(Protocol):
    """What a batched run asks of a seat of the fused build (backend.FusedBackend): the build it
    shares, its cache buffers to bind, and its own chunk's inputs, computed as its own run would."""

    graphs: Any  # the FusedGraphs its loaded build shares (sessions.py); graphs.batched: the SeatBatches
    layout: CacheLayout
    rotated: RotatedKeys  # its sink / pinned keys' tables for a chunk (chunk_tables)
    steps: bool  # its attention takes a chunk as one-token steps (row_slots)
    embed_dim: int  # image rows' width (0: a text model)
    cache_values: list[tuple[str, ort.OrtValue]]  # its cache buffers, by input name
    # its LoRA adapter's inputs (an export with --lora-rank; [] without), by input name: a new list
    # whenever the seat's adapter changes (FusedBackend.set_adapter), the arrays shared with other seats
    adapter_values: list[tuple[str, ort.OrtValue]]
    plain: bool  # it has no adapter (the zeros in adapter_values): a batch of such seats may run the plain twin
    all_image: np.ndarray  # (chunk, 1) bool, all true: a camera frame chunk's image mask

    def seat(self, table: SlotTable) -> BatchedSeat: ...

    def chunk_inputs(self, plan: StepPlan, ids: np.ndarray, all_logits: bool) -> dict[str, np.ndarray]: ...

    def run(self, plan: StepPlan, ids: np.ndarray, all_logits: bool, embeds: np.ndarray | None) -> StepOutput: ...


IDLE_IDS = np.zeros(1, dtype=np.int64)  # the idle seat's token (any id: its output is dropped)
# Inputs a seat keeps in arrays of its own, written in place (RotatedKeys.chunk_tables, RingTables.fill)
# before each run: bound once per binding, never copied.
KEPT_BY_SEAT = (io.ROPE_COS, io.ROPE_SIN, io.LOCAL_ROPE_COS, io.LOCAL_ROPE_SIN)
HEAD_BOUND_ROWS = 8  # the largest row count whose logits array stays bound (a decode run's: one row a seat)
GROUPS_KEPT = 16  # bindings kept for the last groups of seats (a serve's seats are few and fixed at start)


@dataclass
class SeatGroup:
    """One group of seats, in order, and the batched graph's binding for it."""

    seats: tuple[BatchedSeat, ...]  # kept alive with the binding of their buffers
    binding: Any  # ort.IOBinding: every seat's cache bound once, as a seat's own decode binding binds its cache
    session: Any  # the batched graph it binds: the adapter graph, or its plain twin (no seat with an adapter)
    adapters: list[Any]  # each seat's adapter_values as bound (rebound only when the seat's list changes)
    # The binding's inputs ({name: (the array bound to it, ours)}): an array of ours is written in place
    # while the name's shape and type stay, bound again when they change; a seat's own array that it
    # keeps valid (KEPT_BY_SEAT, a one-token step's bias) is bound as it is, again only when another comes.
    inputs: dict[str, tuple[np.ndarray, bool]] = field(default_factory=dict)
    # A decode run's outputs (one row per seat): arrays of our own, bound once, that every decode run of
    # this group writes into ((rows, [hidden or logits, qkv.0, ...]) or None). Safe to reuse: step_seats
    # commits every seat (which copies what it keeps of qkv) before the next run, and the head's logits
    # are arrays of their own.
    decode_outputs: tuple[int, list[np.ndarray]] | None = None


class SeatBatches:
    """The batched graphs of one loaded fused build and everything their runs keep (module docstring)."""

    def __init__(self, sizes: tuple[int, ...],
                 opener: Callable[[], tuple[dict[int, Any], dict[int, Any], Any]]) -> None:  # fmt: skip
        self.sizes = sizes  # the batch sizes the build carries (FusedSettings.seat_batches)
        self._opener: Callable[[], tuple[dict[int, Any], dict[int, Any], Any]] | None = opener
        # once open: the batched graph of each size, their plain twins ({} where the build has none),
        # and their LM head (io_spec.head_io; None where the batched graphs hold the head themselves,
        # FusedSettings.head_kernel "cabinlm")
        self.sessions: dict[int, ort.InferenceSession] = {}
        self.plain_sessions: dict[int, ort.InferenceSession] = {}
        self.head: ort.InferenceSession | None = None
        self._groups: dict[tuple, SeatGroup] = {}  # by (plain twin, the seats' ids), oldest first
        self._output_names: dict[int, list[str]] = {}  # batch size -> its graph's output names, in order
        # the head's binding per number of rows: (binding, hidden (rows, D), logits (rows, vocab)), bound
        # once; the logits are read (step_seats copies each seat's row) before the next run rewrites them
        self._head_bindings: dict[int, tuple[Any, np.ndarray, np.ndarray]] = {}
        self.idle: BatchedSeat | None = None  # the place no seat takes in a batched run (idle_step)
        self.idle_table: SlotTable | None = None  # its table: always empty

    def open(self) -> None:
        """Open the batched graphs' sessions, once: when the loaded build gets its second seat (the
        first moment seats can step together). A dialogue alone (chat, bench, perplexity) never
        holds them: ONNX Runtime packs a copy of every MatMulNBits matrix per session, the LM head's
        alone vocab x hidden x ~1.35 bytes (226 MB for Gemma 3's 262k x 640)."""
        if self._opener is not None:
            self.sessions, self.plain_sessions, self.head = self._opener()
            self._opener = None

    def run(self, solo: BatchedSeat, seats: Sequence[Backend], plans: Sequence[StepPlan],
            ids: Sequence[np.ndarray], all_logits: Sequence[bool] | None = None,
            embeds: Sequence[np.ndarray | None] | None = None) -> list[StepOutput]:  # fmt: skip
        """The seats in runs of the largest batch while more seats are left than it holds, then the
        rest (2 or more) in the smallest batch that holds it, the places left taken by the idle seat
        (idle_step), or a rest of one seat alone (a (2, 4) build: 3 seats, one run of the graph for 4;
        5: 4, then one alone; 7: 4, then 3 in the graph for 4). `solo`: any seat of the loaded build.
        all_logits[i]: seat i gets every row's logits (a verified draft), else its last row's; embeds[i]:
        seat i's chunk is a camera frame's (its image-token embeddings, (tokens, embed_dim))."""
        every = list(all_logits) if all_logits is not None else [False] * len(seats)
        frames = list(embeds) if embeds is not None else [None] * len(seats)
        if not len(seats) == len(plans) == len(ids) == len(every) == len(frames):
            raise ValueError(f"run_seats: {len(seats)} seats, {len(plans)} plans, {len(ids)} chunks, {len(every)} flags, "
                             f"{len(frames)} embeddings")  # fmt: skip
        if any(getattr(getattr(b, "graphs", None), "batched", None) is not self for b in seats):
            raise ValueError("run_seats takes seats of this loaded build (Decoder.seat), not another's")
        if len({id(b) for b in seats}) != len(seats):
            raise ValueError("run_seats: a seat appears twice in one step")
        fused: list[BatchedSeat] = list(seats)  # type: ignore[arg-type]  # checked above: this build's seats
        outs: list[StepOutput] = []
        start = 0
        while start < len(fused):
            rest = len(fused) - start
            if rest == 1:
                outs.append(fused[start].run(plans[start], ids[start], every[start], frames[start]))
                start += 1
                continue
            b = min([b for b in self.sizes if b >= rest] or [max(self.sizes)])
            n = min(b, rest)
            pad = [self.idle_step(solo) for _ in range(b - n)]
            got = self.run_batch([*fused[start : start + n], *(p[0] for p in pad)],
                                 [*plans[start : start + n], *(p[1] for p in pad)],
                                 [*ids[start : start + n], *(p[2] for p in pad)],
                                 [*every[start : start + n], *(False for _ in pad)],
                                 [*frames[start : start + n], *(None for _ in pad)])  # fmt: skip
            start += n
            if start < len(fused):  # another run of the head follows: keep these logits out of its way
                got = [o if o.owned else StepOutput(o.logits.copy(), o.new, owned=True) for o in got]
            outs += got[:n]
        return outs

    def idle_step(self, solo: BatchedSeat) -> tuple[BatchedSeat, StepPlan, np.ndarray]:
        """A place of a batched run no seat takes: the idle seat (made once per loaded build, cache
        buffers of its own, never committed, its table never advanced) feeding one token into its empty
        cache, so its attention reads no slot; its output is dropped. Its rows cost one row of each
        weight matmul."""
        if self.idle is None or self.idle_table is None:
            self.idle = solo.seat(SlotTable(solo.layout))
            self.idle_table = SlotTable(solo.layout)
        return self.idle, self.idle_table.plan(1), IDLE_IDS

    def group(self, seats: Sequence[BatchedSeat]) -> SeatGroup:
        """The batched graph's binding for these seats in this order, their caches bound once, and each
        seat's adapter inputs bound again only when its adapter changed (a new adapter_values list):
        kept for the last GROUPS_KEPT groups of seats. The graph: the plain twin where no seat has an
        adapter and the build has one, else the adapter graph (the zeros for the seats without)."""
        plain = len(seats) in self.plain_sessions and all(seat.plain for seat in seats)
        session = (self.plain_sessions if plain else self.sessions)[len(seats)]
        key = (plain, *(id(b) for b in seats))
        g = self._groups.get(key)
        if g is None or not all(a is b for a, b in zip(g.seats, seats)):
            binding = session.io_binding()
            for s, seat in enumerate(seats):
                for name, ov in seat.cache_values:
                    binding.bind_ortvalue_input(io.seat_name(name, s), ov)
            if len(self._groups) >= GROUPS_KEPT:  # groups seen long ago
                del self._groups[next(iter(self._groups))]
            g = self._groups[key] = SeatGroup(tuple(seats), binding, session, [None] * len(seats))
        for s, seat in enumerate(seats):
            if plain:
                break  # the plain twin takes no adapter inputs
            if g.adapters[s] is not seat.adapter_values:
                for name, ov in seat.adapter_values:
                    g.binding.bind_ortvalue_input(io.seat_name(name, s), ov)
                g.adapters[s] = seat.adapter_values  # kept alive while bound
        return g

    def run_batch(self, seats: Sequence[BatchedSeat], plans: Sequence[StepPlan],
                  ids: Sequence[np.ndarray], all_logits: Sequence[bool],
                  embeds: Sequence[np.ndarray | None] | None = None) -> list[StepOutput]:  # fmt: skip
        """One run of the batched graph for len(seats) seats (io_spec.seats_io): seat s's inputs under
        its own names, its cache bound in place (the kernel writes its chunk's K/V into seat s's rows F..,
        as its own run would), the rows stacked seat after seat; the logits of each seat's last row, or
        of every row of a seat with all_logits[s] (a verified draft: logit_rows names them all).

            rows      [ seat 0: a b c | seat 1: d | seat 2: e f g h ]     seat_tokens (3, 1, 4)
            logit_rows   (2,            3,         4, 5, 6, 7)            seat 2 verifies: all its rows
            logits    (6, vocab): seat 0's row 0, seat 1's row 1, seat 2's rows 2..5

        embeds[s]: seat s's chunk is a camera frame's: its image rows (image_embeds.seat{s}, image_mask.seat{s}
        all true), as its own run() puts them in."""
        frames = list(embeds) if embeds is not None else [None] * len(seats)
        g = self.group(seats)
        counts = np.array([p.tokens for p in plans], dtype=np.int64)
        ends = np.cumsum(counts)
        starts = ends - counts
        picked = [np.arange(a, e) if every else np.array([e - 1])
                  for a, e, every in zip(starts, ends, all_logits, strict=True)]  # fmt: skip
        inputs = {io.INPUT_IDS: np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
                  io.SEAT_TOKENS: counts, io.LOGIT_ROWS: np.concatenate(picked).astype(np.int64)}  # fmt: skip
        kept = set()
        for s, (seat, plan, chunk) in enumerate(zip(seats, plans, ids, strict=True)):
            if plan.tokens != len(chunk):
                raise ValueError(f"seat {s}: a plan of {plan.tokens} tokens for a chunk of {len(chunk)}")
            if plan.steps and not seat.steps:
                raise ValueError("this build's attention cannot run a chunk as one-token steps")
            seat.rotated.chunk_tables(plan)
            own = seat.chunk_inputs(plan, chunk, all_logits=True)
            if frames[s] is not None:
                if not seat.embed_dim:
                    raise ValueError("this model has no vision input")
                own[io.IMAGE_EMBEDS] = np.ascontiguousarray(frames[s], dtype=np.float32)
                own[io.IMAGE_MASK] = seat.all_image[: plan.tokens]
            for name in io.SHARED_BY_SEATS:
                own.pop(name)
            names = _seat_names(s)
            for name, value in own.items():
                inputs[names[name]] = value
            kept.update(names[n] for n in KEPT_BY_SEAT if n in own)
            if plan.tokens == 1 and plan.sees_window:  # FusedBackend._one_token_bias: the same array while the slots in use stay
                kept.add(names[io.ATTENTION_BIAS])
        _bind_inputs(g, inputs, kept)
        rows = int(ends[-1])
        got = self._run(g, rows)  # in declared order: logits or hidden, then qkv.{l}
        qkv = got[1:]
        # (logit rows, vocab): the graph's own (its head on BlockQ8MatMul), or the head graph's over its hidden rows
        logits = got[0] if self.head is None else self._head_logits(got[0])
        # a decode run's logits lie in arrays every decode run rewrites (_run, _head_logits); any other
        # run's are arrays ONNX Runtime allocated for it alone
        owned = rows != len(seats) and (self.head is None or len(logits) > HEAD_BOUND_ROWS)
        to = np.cumsum([len(p) for p in picked])
        return [StepOutput(logits[t - len(p) : t], (plan.extent, [q[:, a:e] for q in qkv]), owned=owned)
                for p, t, plan, a, e in zip(picked, to, plans, starts, ends)]  # fmt: skip

    def _head_logits(self, hidden: np.ndarray) -> np.ndarray:
        """The LM head over hidden (rows, D): (rows, vocab) logits, written into the array bound for
        this many rows (_head_bindings), valid until the next run of the head for as many rows. Row
        counts above HEAD_BOUND_ROWS (a run with a verified draft's rows) get arrays of their own per run:
        their counts vary from run to run, and each bound count would keep a (rows, vocab) array."""
        head = self.head
        assert head is not None
        rows = hidden.shape[0]
        if rows > HEAD_BOUND_ROWS:
            return head.run(None, {io.HIDDEN: hidden})[0]  # type: ignore[no-any-return]
        entry = self._head_bindings.get(rows)
        if entry is None:
            vocab = head.get_outputs()[0].shape[-1]
            binding = head.io_binding()
            own = np.empty(hidden.shape, np.float32)
            logits = np.empty((rows, vocab), np.float32)
            binding.bind_cpu_input(io.HIDDEN, own)
            binding.bind_output(io.LOGITS, "cpu", element_type=np.float32, shape=logits.shape,
                                buffer_ptr=logits.ctypes.data)  # fmt: skip
            entry = self._head_bindings[rows] = (binding, own, logits)
        binding, own, logits = entry
        np.copyto(own, hidden)
        head.run_with_iobinding(binding)
        return logits


    def _run(self, g: SeatGroup, rows: int) -> list[np.ndarray]:
        """Run the batched graph for the group; its outputs. A decode run (one row per seat) writes into
        the group's own arrays (SeatGroup.decode_outputs: allocated and bound on the first, then reused:
        no allocation and no binding per step); other runs let ONNX Runtime allocate, as the outputs'
        shapes vary."""
        seats = len(g.seats)
        session, binding = g.session, g.binding
        names = self._output_names.get(seats)  # the adapter graph's and its plain twin's alike
        if names is None:
            names = self._output_names[seats] = [o.name for o in session.get_outputs()]
        held = g.decode_outputs
        if rows == seats:
            if held is None or held[0] != rows:
                shapes = {o.name: o.shape for o in session.get_outputs()}
                arrays = [np.empty((rows, shapes[n][-1]) if n in (io.HIDDEN, io.LOGITS) else (1, rows, shapes[n][-1]), np.float32)
                          for n in names]  # fmt: skip
                for n, a in zip(names, arrays):
                    binding.bind_output(n, "cpu", element_type=np.float32, shape=a.shape, buffer_ptr=a.ctypes.data)
                held = g.decode_outputs = (rows, arrays)
            session.run_with_iobinding(binding)
            return held[1]
        if held is not None:  # bound to our arrays: let ONNX Runtime allocate again
            g.decode_outputs = None
        for n in names:
            binding.bind_output(n, "cpu")
        session.run_with_iobinding(binding)
        return [o.numpy() for o in binding.get_outputs()]


def _bind_inputs(g: SeatGroup, inputs: dict[str, np.ndarray], kept: set[str] = frozenset()) -> None:
    """The run's inputs into the group's binding (SeatGroup.inputs): a name in `kept` bound to the seat's own
    array unless it is bound already; any other copied into the array of ours already bound under that
    name where its shape and type are the same (a few bytes to a few KB: cheaper than binding), else
    copied into a new array of ours and bound."""
    held, binding = g.inputs, g.binding
    for name, value in inputs.items():
        have, ours = held.get(name, (None, False))
        if name in kept:
            if have is not value:
                binding.bind_cpu_input(name, value)
                held[name] = (value, False)
            continue
        value = np.asarray(value)
        if ours and have.shape == value.shape and have.dtype == value.dtype:
            np.copyto(have, value)
        else:
            have = np.array(value, order="C")  # a copy of our own
            binding.bind_cpu_input(name, have)
            held[name] = (have, True)


@functools.lru_cache(maxsize=64)
def _seat_names(seat: int) -> dict[str, str]:
    """Every per-seat input's name in a batched graph for seat `seat` (io.seat_name), made once."""
    return _SeatNames(seat)


class _SeatNames(dict):
    def __init__(self, seat: int):
        super().__init__()
        self.seat = seat

    def __missing__(self, name: str) -> str:
        self[name] = io.seat_name(name, self.seat)
        return self[name]
