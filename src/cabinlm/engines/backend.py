"""The backend interface: what the Decoder asks of an engine, and nothing more.

A backend owns one dialogue's cache buffers, in the memory its engine reads (host arrays for ONNX
Runtime on the CPU), allocated once over the artifact's CacheLayout; the slot bookkeeping
(contract/slots.py) is the Decoder's and the same for every backend. One step:

    plan = table.plan(n, pin)           where the chunk goes, its positions, the mask   (Decoder)
    out  = backend.run(plan, ids, ...)  the graph over the cache; nothing is committed    (backend)
    backend.commit(plan, out)           the chunk's K/V into their slots, in place        (backend)
    table.advance(plan)                 the bookkeeping follows the data                  (Decoder)

`run` and `commit` read the plan, never the table: a plan carries every fact of the table a step
needs (runtime/slots.StepPlan: positions, destination slots, the fills, E, F, the slot table as it
stood), so what a backend computes is a function of (plan, ids, its buffers) alone.
`run` may write only into rows no cached token occupies (scratch rows or empty slots): until
`commit`, the cache still describes the table's state, so an interrupted step loses nothing.
Backends that share loaded weights between dialogues (seats) do it through `seat()`.

What the reply loop needs to know about a backend are properties, never its kind:

    fixed_chunk        a chunk of 2+ tokens costs a whole `chunk`-token run (static graphs)
    verifies_drafts    a chunk's rows see the chunk's own K/V as the cache will hold them, so a
                       verified draft is exact; False: the reply loop never drafts
    rows_match_steps   and bit for bit: drafting is on by default
    verifies_after_turnover   a chunk's rows can be its one-token steps after the window has turned
                       over (StepPlan.steps): drafting goes on for the whole dialogue
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from cabinlm.contract.engines import BackendKind
from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.layout import CacheLayout, KVDType
from cabinlm.contract.manifest import Manifest

if TYPE_CHECKING:  # the runtime's bookkeeping: annotations only (cabinlm.runtime imports this module)
    from cabinlm.contract.slots import SlotTable, StepPlan


class BackendError(CabinlmError):
    """The artifact's backend or execution provider cannot run here, or its graphs do not load."""


@dataclass
class StepOutput:
    """What one run returns: the logits rows asked for, and the chunk's K/V in the backend's own
    form (`new`), which only that backend's commit reads."""

    logits: np.ndarray  # (rows, vocab) float32
    new: Any = field(default=None, repr=False)
    # True: the arrays are this run's own (no later run writes them), so a caller keeps them without a
    # copy; False: they may be the backend's reused output buffers, valid until its next run
    owned: bool = False


class Backend(abc.ABC):
    """One engine running the decoder over one dialogue's fixed cache buffers."""

    kind: ClassVar[BackendKind]

    def __init__(self, manifest: Manifest, table: SlotTable):
        """table: the Decoder's bookkeeping, advanced only by the Decoder. A backend does not keep
        or read it (every step's facts come with the plan); engines.registry.open_backend and seat()
        still hand it over."""
        self.manifest = manifest
        self.layout = manifest.cache

    @property
    def device(self) -> str:
        """What the graphs run on, for reports: the engine and its provider, e.g. "onnxruntime-cpu"."""
        spec = self.manifest.runtime_spec
        return f"{spec.engine}-{spec.provider.name.removesuffix('ExecutionProvider').lower()}"

    @property
    def fixed_chunk(self) -> bool:
        """Every chunk of 2+ tokens runs a graph of exactly `chunk` tokens (padded): a short chunk,
        e.g. a speculative draft check, costs as much as a full one."""
        return False

    @property
    def verifies_drafts(self) -> bool:
        """Row i of a chunk attends to the chunk's tokens before it as the cache will hold them
        (quantized as stored), so verifying drafts in one chunk is plain decoding to rounding. False
        where a chunk attends to its own K/V at a precision the cache does not keep: the reply loop
        then never drafts (Decoder.draft_room is 0), even when asked to."""
        return True

    @property
    def rows_match_steps(self) -> bool:
        """Row i of a verified chunk gives, bit for bit, the logits of the (i+1)-th of one-token steps
        over the same tokens, wherever drafting runs (true of the fused cpu decoder, while the window
        fills and, with cabinlm's attention kernel, after it has turned over: tests/test_speculative.py
        checks it on SmolLM2). Where it is not, rows and steps agree only to rounding, which int8 activation
        quantization can amplify past a greedy near-tie: a verified draft could then pick another
        token than plain decoding, so drafting is not on by default there."""
        return False

    @property
    def verifies_after_turnover(self) -> bool:
        """A chunk planned as one-token steps (StepPlan.steps) computes row i as the step after the
        chunk's first i tokens would, after the window has turned over too: it sees the cache without
        the oldest window tokens those steps overwrite, and the sink / pinned keys as that step's own
        rotation has them. Drafting then goes on for the whole dialogue (Decoder.draft_room); False:
        drafts are verified only while the window fills, and the backend never gets a plan as steps."""
        return False

    @abc.abstractmethod
    def run(self, plan: StepPlan, ids: np.ndarray, all_logits: bool, embeds: np.ndarray | None) -> StepOutput:
        """The graph over the cache for one planned chunk of 1..chunk tokens. Logits of every token
        (all_logits) or of the last one only. embeds: image-token embeddings (vision-language)."""

    @abc.abstractmethod
    def commit(self, plan: StepPlan, out: StepOutput) -> None:
        """Write the chunk's K/V into the plan's slots, in place (the caller holds Ctrl-C). The plan
        may be a prefix of the one that ran (speculative decoding keeps the accepted tokens only):
        then only its first plan.tokens tokens are written, and no slot in use changes for the others."""

    @abc.abstractmethod
    def buffers(self) -> dict[str, np.ndarray]:
        """The cache's own memory (host views), by name, in a fixed order: session files save and
        restore exactly these bytes."""

    def set_adapter(self, inputs: dict[str, np.ndarray] | None) -> None:
        """Feed these switchable LoRA adapter inputs (io_spec.lora_inputs, read-only arrays kept alive by
        the caller) to this seat's every later run; None: the zeros of no adapter. The cache is not
        touched: what it holds was computed with the previous adapter (the Decoder rebuilds it)."""
        raise BackendError(f"{self.kind.value} builds do not take switchable LoRA adapters; run the export, or "
                           "its cpu build")  # fmt: skip

    def reset(self) -> None:
        """The table was reset: drop anything derived from the cached tokens."""

    def restored(self) -> None:
        """The buffers and the table were just overwritten from a session file."""

    @abc.abstractmethod
    def seat(self, table: SlotTable) -> Backend:
        """Another dialogue on the same loaded engine: weights shared, buffers its own."""

    @property
    def seat_batches(self) -> tuple[int, ...]:
        """How many seats (2 or more) one graph run of run_seats can take: the build's batched graphs.
        Empty: run_seats runs each seat alone."""
        return ()

    def run_seats(self, seats: Sequence[Backend], plans: Sequence[StepPlan], ids: Sequence[np.ndarray],
                  all_logits: Sequence[bool] | None = None,
                  embeds: Sequence[np.ndarray | None] | None = None) -> list[StepOutput]:  # fmt: skip
        """Several seats' chunks (seats: backends of this loaded engine, made by seat(); plans and ids:
        each seat's own, planned on its own table) in as few graph runs as the build allows, each
        seat's last token's logits (1, vocab), or every token's (tokens, vocab) where all_logits[i] (a
        verified draft); embeds[i]: seat i's chunk is a camera frame's (its image-token embeddings, as
        run() takes them). Nothing is committed: each seat's output goes to that seat's commit, exactly
        as its own run's would. A seat's output is what its own run gives (bit for bit where the build
        says so: tests/test_batched_seats.py, test_batched_drafting.py, test_batched_frames.py). Here:
        each seat alone."""
        every = list(all_logits) if all_logits is not None else [False] * len(seats)
        rows = list(embeds) if embeds is not None else [None] * len(seats)
        return [b.run(p, i, a, e) for b, p, i, a, e in zip(seats, plans, ids, every, rows, strict=True)]

    def nbytes(self) -> int:
        """Bytes held by the cache buffers, read from the arrays themselves."""
        return int(sum(b.nbytes for b in self.buffers().values()))


def exported_graph_verifies_drafts(layout: CacheLayout) -> bool:
    """Backend.verifies_drafts of the exported graph's contract (io_spec.decoder_io), whatever engine
    runs it: with fp8 KV a chunk's tokens attend to each other's K/V unquantized (the graph quantizes
    only what it returns for the cache), so a verified draft would see keys its step does not."""
    return layout.kv_dtype is not KVDType.FP8
