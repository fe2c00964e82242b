"""The sessions of one loaded fused cpu build, which every dialogue (seat) on it shares: the decoder
graph's, the sink / pinned keys' refresh graph's, and, from the build's second seat on, the batched
graphs' and their LM head's (FusedSettings.seat_batches), and, in a build of an export with adapter
inputs, the twins of the decoder graphs without them (FusedSettings.plain_graphs), which seats
without an adapter run; every decoder graph reading its weights from one read-only map of the
weights file where the build has batched graphs or plain twins."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cabinlm.contract.files import FileRole, seats_graph
from cabinlm.contract import io_spec as io
from cabinlm.engines.backend import BackendError
from cabinlm.engines.ort_fused.seats import SeatBatches
from cabinlm.engines.onnxruntime.session import check_io, mapped_weights, open_session, session_options
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.manifest import Manifest


@dataclass
class FusedGraphs:
    """What every dialogue on one loaded fused build shares."""

    manifest: Manifest
    # the decoder graph (with adapter inputs, in an export with --lora-rank); None until a seat first
    # takes an adapter where the build has the plain twin (graph() opens it)
    decoder: ort.InferenceSession | None
    rotate: ort.InferenceSession | None  # the sink / pinned keys' refresh graph (numpy without it)
    weights: list[tuple[str, ort.OrtValue]] = field(default_factory=list)  # every graph's weights, one map, kept alive here
    # seats decoding together (FusedSettings.seat_batches): the batched graphs and what their runs keep
    # (seats.SeatBatches); None for a build without them
    batched: SeatBatches | None = None
    # the switchable LoRA inputs' zeros (no adapter: the base model), by input name, read-only, bound by
    # every seat without an adapter ({}: an export without --lora-rank); calloc'ed pages, resident
    # only once a graph reads them (where there is no plain twin, or a batch mixes seats with and without)
    lora_zeros: dict[str, np.ndarray] = field(default_factory=dict)
    # the decoder without adapter inputs (FusedSettings.plain_graphs), which a seat without an adapter
    # runs: the same weights, bit for bit the decoder fed zeros; None: every seat runs `decoder`
    plain: ort.InferenceSession | None = None
    open_decoder: Callable[[], ort.InferenceSession] | None = None  # opens `decoder` where it is None

    def graph(self, plain: bool) -> ort.InferenceSession:
        """The session a seat runs: the plain twin for a seat without an adapter where the build has
        one, else the decoder graph, opened on first use where the twin serves the seats without."""
        if plain and self.plain is not None:
            return self.plain
        if self.decoder is None:
            assert self.open_decoder is not None
            self.decoder = self.open_decoder()
        return self.decoder


def load_fused(folder: Path, manifest: Manifest, threads: int | None, extra: dict[str, str] | None) -> FusedGraphs:
    """The build's sessions. A build with batched graphs (FusedSettings.seat_batches) hands every
    decoder session its weights from one read-only map of the weights file (held once); a build
    without them lets ONNX Runtime load the weights file itself, as before."""
    spec = manifest.runtime_spec
    facts = spec.facts_as(FusedSettings)
    weights: list[tuple[str, ort.OrtValue]] = []
    if facts is not None and facts.shared_weights is not None:
        try:
            weights = mapped_weights(folder, facts.shared_weights)
        except ValueError as e:
            raise BackendError(f"{folder}: {e}; run `cabinlm build` again") from e

    def options(head: bool = False, batched: bool = False) -> ort.SessionOptions:
        so = session_options(spec, threads, extra)
        for name, ov in weights:
            so.add_initializer(name, ov)
        # Each session has a thread pool of its own whose threads spin for a while after a run (2^20
        # pauses) and take a core from whichever session runs next. A batched step runs the layers'
        # session, then the head's: the head's threads spinning into the next step took the cores
        # from the layers (4 seats on 2 cores: 26 ms a step with both spinning, 7 ms with the head's
        # threads asleep after its run, 10 ms with neither spinning).
        if head:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        elif batched:
            # The batched graph's threads stop spinning when its run returns, so that the head, and a
            # prompt's prefill on the one-seat session right after a batched step, have the cores
            # (measured on 2 cores: that prefill 104-117 ms with them spinning, 77-83 without, 74-86 after
            # a one-seat step). The one-seat session keeps spinning between its own steps.
            so.add_session_config_entry("session.force_spinning_stop", "1")
        return so

    def open_decoder() -> ort.InferenceSession:
        decoder = open_session(folder / manifest.files[FileRole.GRAPH].path, options(), spec)
        check_io(decoder, manifest.io, folder, built=True)
        return decoder

    batches = tuple(facts.seat_batches) if facts is not None else ()
    own_head = facts is not None and facts.head_kernel == "cabinlm"  # the batched graphs end in logits: no head graph
    twins = facts is not None and facts.plain_graphs and manifest.lora is not None
    roles = [seats_graph(b) for b in batches] + ([FileRole.GRAPH_HEAD] if batches and not own_head else [])
    if twins:
        roles += [FileRole.GRAPH_PLAIN] + [seats_graph(b, plain=True) for b in batches]
    for role in roles:
        if role not in manifest.files:
            raise BackendError(f"{folder}: the build's facts name its graph {role}, which its files do not list; run `cabinlm build` again")
    lora_names = {t.name for t in manifest.lora.inputs(manifest.model.num_layers, manifest.lora_shapes)} if twins else set()
    plain_io = dataclasses.replace(manifest.io, inputs=tuple(t for t in manifest.io.inputs if t.name not in lora_names))
    plain = None
    if twins:  # the decoder graph waits for a seat's first adapter: a dialogue without holds its twin's session only
        plain = open_session(folder / manifest.files[FileRole.GRAPH_PLAIN].path, options(), spec)
        check_io(plain, plain_io, folder, built=True)
    decoder = None if twins else open_decoder()

    def open_batched() -> tuple[dict[int, ort.InferenceSession], dict[int, ort.InferenceSession], ort.InferenceSession | None]:
        model = manifest.model
        seats, plain_seats = {}, {}
        for b in batches:
            seats[b] = open_session(folder / manifest.files[seats_graph(b)].path, options(batched=True), spec)
            check_io(seats[b], io.seats_io(manifest.io, b, model.hidden_size, head=own_head), folder, built=True)
            if twins:
                plain_seats[b] = open_session(folder / manifest.files[seats_graph(b, plain=True)].path, options(batched=True), spec)
                check_io(plain_seats[b], io.seats_io(plain_io, b, model.hidden_size, head=own_head), folder, built=True)
        if own_head:
            return seats, plain_seats, None
        head = open_session(folder / manifest.files[FileRole.GRAPH_HEAD].path, options(head=True), spec)
        check_io(head, io.head_io(model.hidden_size, model.vocab_size), folder, built=True)
        return seats, plain_seats, head

    rotate = None
    if FileRole.ROTATE_GRAPH in manifest.files:
        rotate = open_session(folder / manifest.files[FileRole.ROTATE_GRAPH].path, session_options(spec, 1), spec)
    return FusedGraphs(manifest, decoder, rotate, weights, SeatBatches(batches, open_batched) if batches else None,
                       lora_zeros=lora_zeros(manifest), plain=plain, open_decoder=open_decoder)  # fmt: skip


def lora_zeros(manifest: Manifest) -> dict[str, np.ndarray]:
    """The zeros of no adapter, by input name ({} without adapter inputs): read-only views of one
    zeroed allocation, each 64-byte aligned. One allocation this large is fresh pages from the OS,
    resident only where a run reads them (a seat without an adapter on the adapter graph); small
    arrays one by one would each be cleared, and resident, from the start (16 MB for SmolLM2 at rank 16)."""
    specs = manifest.lora.inputs(manifest.model.num_layers, manifest.lora_shapes) if manifest.lora else ()
    sizes = [int(np.prod(t.shape)) for t in specs]
    starts = np.concatenate([[0], np.cumsum([-(-n // 16) * 16 for n in sizes])]).astype(np.int64)
    flat = np.zeros(int(starts[-1]), np.float32)
    flat.flags.writeable = False
    return {t.name: flat[a : a + n].reshape(t.shape) for t, a, n in zip(specs, starts, sizes)}
