"""The cpu build's fused decoder (engines/ort_fused/builder.py) on ONNX Runtime: GroupQueryAttention
(or cabinlm's kernel) reads the cache in place and writes the chunk's rotated K/V after the slots in
use; the sink / pinned keys follow the evictions (rotated.py). The contract is io_spec.fused_decoder_io.
A step reads its plan only: F (plan.extent), E (plan.evicted), the fills and the slot table as it stood.

Buffers (allocated once per dialogue):

    keys, values  (layers, kv_heads, slots + chunk, head_dim)  int8 or float32: rows 0..N-1 the slots,
                  rows N.. scratch where the kernel writes a chunk that lands beyond the slots in use
    key_source    (layers, kv_heads, sink + pinned + image + recall, head_dim)  float32: the sink / pinned
                  (camera-frame, recall) tokens' keys, un-rotated, from which their rotated rows are
                  re-written as evictions and the recall region's length move them (rotated.py)
    local_keys, local_values  (local layers, kv_heads, w + R + chunk, head_dim)  the local layers' rings
                  (CacheLayout.local_layers; `layers` above are then the global ones): rows 0..w-1
                  the ring, keys rotated at their local index, never re-written; rows w..w+R-1 the
                  recall region's (R = 0 without one), rotated at their places in the region

Int8 KV has static per-channel scales (the manifest's kv_scales), held by the graph: no scale buffers.

Camera frames (a vision-language decoder, fp32 KV; graph.ineligible). A frame's chunk hands the graph
its image_embeds (the token rows replaced, as exported). The frame's keys are kept un-rotated in
key_source and re-written at their positions + E before each step (GroupQueryAttention: with the
pinned ones, RotatedKeys.refresh; cabinlm's FloatKVAttention, which rotates the sink / pinned ones
itself: FrameKeys.refresh_image); a new frame turns the window keys it moved (frames.FrameKeys, whose
buffers a session file carries). On FloatKVAttention a seat with a frame steps in batched runs too
(seats.py): its text chunks' image rows are empty, a frame's own chunks carry its image rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cabinlm.contract import io_spec as io
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import Manifest
from cabinlm.engines.backend import Backend, BackendError, StepOutput
from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.engines.onnxruntime.binding import Binding, adapter_inputs, ortvalue
from cabinlm.engines.ort_fused.frames import FrameKeys
from cabinlm.engines.onnxruntime.rotated import RingTables, RotatedKeys
from cabinlm.engines.ort_fused.row_moves import move_rows
from cabinlm.engines.ort_fused.sessions import FusedGraphs, load_fused
from cabinlm.contract.slots import SlotTable, StepPlan


class FusedBackend(Backend):
    kind = BackendKind.FUSED

    def __init__(self, graphs: FusedGraphs, table: SlotTable):
        super().__init__(graphs.manifest, table)
        self.graphs = graphs
        m = self.manifest
        lay = self.layout
        L, H, N, D = lay.buffer_shape
        dtype = np.dtype(lay.kv_dtype.numpy_name)
        self.keys = np.zeros((L, H, N + lay.chunk, D), dtype=dtype)
        self.values = np.zeros((L, H, N + lay.chunk, D), dtype=dtype)
        self.key_source = np.zeros((L, H, lay.window_start, D), dtype=np.float32)  # every slot before the window
        scales = m.kv_scales.array("rotated_keys")[list(lay.global_layers)] if lay.quantized else None
        v = m.vision
        mrope = (v.image_tokens, tuple(v.grid), tuple(v.mrope_section)) if v is not None and v.mrope else None
        self.rotated = RotatedKeys(lay, self.keys, self.key_source, m.rotary.inv_freq, m.rotary.scale, scales, graphs.rotate,
                                   mrope)  # fmt: skip
        self.local_keys = self.local_values = self.ring = None
        if lay.local_layers:
            Ll, _, R, _ = lay.local_buffer_shape
            self.local_keys = np.zeros((Ll, H, R + lay.chunk, D), dtype=dtype)
            self.local_values = np.zeros((Ll, H, R + lay.chunk, D), dtype=dtype)
            self.ring = RingTables(lay, *m.rotary.for_layer(True))
        self._heads = m.model.num_heads
        self._rows = np.arange(lay.chunk, dtype=np.int64)
        self.embed_dim = m.vision.embed_dim if m.vision is not None else 0
        if self.embed_dim:  # text chunks of a vision-language model: no image rows
            self._no_embeds = np.zeros((lay.chunk, self.embed_dim), dtype=np.float32)
            self._no_image = np.zeros((lay.chunk, 1), dtype=bool)
            self.all_image = np.ones((lay.chunk, 1), dtype=bool)
        self.frames = FrameKeys(lay, self.keys, self.rotated) if self.embed_dim else None
        # cabinlm's attention kernel rotating the sink / pinned keys itself, per row (io_spec
        # fused_decoder_io(steps=True)): no refresh of their cache rows, and chunks may run as steps
        names = {t.name for t in m.io.inputs}
        self.steps = io.ROW_SLOTS in names
        self.local_steps = io.LOCAL_ROW_SLOTS in names  # the rings' rows as steps too
        # the switchable adapter's inputs as bound (the zeros of no adapter; [] without adapter inputs),
        # and whether the seat has none (seats.BatchedSeat.plain)
        self.adapter_values: list = adapter_inputs(graphs.lora_zeros, None) if graphs.lora_zeros else []
        self.plain = True
        self._bind()

    @property
    def rows_match_steps(self) -> bool:
        # While the window fills, slots are taken in order: a chunk row sums the same keys in the same
        # order as its step, the unused slots adding exact zeros (tests/test_speculative.py). cabinlm's
        # attention kernel computes every row by one fixed sequence whatever the chunk, and with
        # row_slots lays each row out as its step (after the window's turnover too: its header);
        # GroupQueryAttention's rows were measured to match while the window fills.
        # A local ring's rows are the model's window of each token, which a chunk reads in another
        # order than steps do once the ring has turned over, unless the kernel takes each row's ring slot.
        return not self.layout.local_layers or self.local_steps

    @property
    def verifies_after_turnover(self) -> bool:
        # cabinlm's kernel takes each row's slot (and ring slot) and its own rotation of the sink /
        # pinned keys (kernels/int8_kv_attention.cc, "What row i sees"); a frame's image rows are
        # re-written once per step (FrameKeys.refresh_image), not per row, so a VLM does not.
        return self.steps and (not self.layout.local_layers or self.local_steps) and not self.embed_dim

    def buffers(self) -> dict[str, np.ndarray]:
        out = {"keys": self.keys, "values": self.values, "key_source": self.key_source}
        if self.local_keys is not None:
            out.update(local_keys=self.local_keys, local_values=self.local_values)
        if self.frames is not None:
            out.update(self.frames.buffers())
        return out

    def _layer_buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        local, j = self.layout.buffer_index(layer)
        return (self.local_keys[j], self.local_values[j]) if local else (self.keys[j], self.values[j])

    def seat(self, table: SlotTable) -> FusedBackend:
        if self.graphs.batched is not None:  # two seats now: they may step together
            self.graphs.batched.open()
        return FusedBackend(self.graphs, table)

    def reset(self) -> None:
        self.rotated.forget()
        if self.frames is not None:
            self.frames.reset()

    def restored(self) -> None:
        self.rotated.forget()
        if self.frames is not None:
            self.frames.forget()
        self._sync_kernel_source()

    def _sync_kernel_source(self) -> None:
        """The kernel's copy of the sink / pinned keys' sources, where it is not key_source itself (a
        vision-language decoder on cabinlm's kernel: key_source also holds the image rows; with a recall
        region the kernel reads them all, the frame's rows among the rows it rotates)."""
        if self._kernel_source is not None:
            P = self.layout.sink + self.layout.pinned
            self._kernel_source.reshape(self.key_source.shape[:2] + (P, -1))[...] = self.key_source[:, :, :P]

    def _bind(self) -> None:
        lay, V = self.layout, self.graphs.manifest.model.vocab_size
        kv_onnx = lay.kv_dtype.onnx_name
        # GroupQueryAttention writes the chunk's K/V through present outputs bound to the cache's own
        # memory; cabinlm's kernel writes them into its cache inputs (the graph has no present outputs).
        in_place = not any(t.name == io.present_key_name(0) for t in self.manifest.io.outputs)
        cache, aliases = [], []
        for i in range(lay.layers):
            keys, values = self._layer_buffers(i)
            k, v = ortvalue(keys[None], kv_onnx), ortvalue(values[None], kv_onnx)
            cache += [(io.key_cache_name(i), k), (io.value_cache_name(i), v)]
            if not in_place:
                aliases += [(io.present_key_name(i), k), (io.present_value_name(i), v)]
        self._kernel_source = None
        if self.steps:  # the sink / pinned keys' un-rotated copy, read by the kernel in place
            L, H, P, D = self.key_source.shape
            # the image rows after them are re-written in the cache (FrameKeys.refresh_image): the kernel's
            # (1, L * H, sink + pinned, D) kept apart, synced at commit; with a recall region it reads them all
            if lay.image and not lay.recall:
                P = lay.sink + lay.pinned
                self._kernel_source = np.zeros((1, L * H, P, D), np.float32)
            source = self._kernel_source if self._kernel_source is not None else self.key_source.reshape(1, L * H, P, D)
            cache.append((io.KEY_SOURCE, ortvalue(source, "")))
        self.cache_values = cache
        width = (self._heads + 2 * lay.kv_heads) * lay.head_dim
        f32 = np.dtype(np.float32)
        outs = [(io.LOGITS, ("rows", V), f32, "float")]
        outs += [(io.qkv_name(i), (1, "tokens", width), f32, "float") for i in range(lay.layers)]
        # a seat without an adapter runs the plain twin where the build has one (sessions.FusedGraphs.graph)
        session = self.graphs.graph(self.plain)
        # Bound with the aliases, before the outputs ORT allocates per run (which come back in binding
        # order); re-binding it later keeps its place.
        if not self.steps:
            aliases.append((io.REFRESH_KEYS, ortvalue(self.rotated.ahead_out, kv_onnx)))
        self._decode = Binding(session, cache, outs, tokens=1, rows=1, aliases=aliases)
        self._prefill = Binding(session, cache, outs, tokens=None, aliases=aliases)
        self._chunk_rows = np.arange(lay.chunk, dtype=np.int64)[None]
        # Single-token decode binds its inputs once, over buffers a step writes in place: the token,
        # F and F + 1 (seqlens_k, total_sequence_length), the rotation tables (RotatedKeys fills row
        # 0), row 0 of them and of the logits. Only the bias is rebound, when the slots in use change.
        self._ids1 = np.zeros(1, dtype=np.int64)
        self._seqlens1 = np.zeros(1, dtype=np.int32)
        self._total1 = np.zeros((), dtype=np.int32)
        self._zero_bias = np.zeros((1, 1, 1, lay.slots + 1), dtype=np.float32)
        self._bias: np.ndarray | None = None  # a one-token step's bias (_one_token_bias)
        self._bias_held: tuple | None = None  # the slots in use it was made for
        self._bias_bound: np.ndarray | None = None  # the bias the decode binding holds, kept alive while bound
        fixed = {io.INPUT_IDS: self._ids1, io.POSITION_IDS: np.zeros((1, 1), dtype=np.int64),
                 io.ROPE_COS: self.rotated.cos, io.ROPE_SIN: self.rotated.sin, io.SEQLENS_K: self._seqlens1,
                 io.TOTAL_SEQUENCE_LENGTH: self._total1, io.LOGIT_ROWS: np.zeros(1, dtype=np.int64)}  # fmt: skip
        if self.embed_dim:  # a one-token step is text (a frame's chunks run as chunks)
            fixed.update({io.IMAGE_EMBEDS: self._no_embeds[:1], io.IMAGE_MASK: self._no_image[:1]})
        if lay.local_layers:  # the rings' lengths and rotation, written in place too; their bias is all zeros
            self._local_seqlens1 = np.zeros(1, dtype=np.int32)
            self._local_total1 = np.zeros((), dtype=np.int32)
            self._local_zero_bias = np.zeros((1, 1, 1, lay.local_window + 1), dtype=np.float32)  # the ring, no region
            self._local_full_bias = np.zeros((1, 1, 1, lay.local_window + 1), dtype=np.float32)
            self._local_masked = 0  # the ring slot the full-ring bias masks now
            self._local_held: int | None = None
            fixed.update({io.LOCAL_SEQLENS_K: self._local_seqlens1, io.LOCAL_TOTAL_SEQUENCE_LENGTH: self._local_total1,
                          io.LOCAL_ROPE_COS: self.ring.cos, io.LOCAL_ROPE_SIN: self.ring.sin})  # fmt: skip
            if self.local_steps:  # one token: its own step, at F_l
                self._local_slots1 = np.zeros(1, dtype=np.int64)
                fixed[io.LOCAL_ROW_SLOTS] = self._local_slots1
        if self.steps:  # the row's slot (F: one token is its own step) and the sink / pinned keys' tables
            self._slots1 = np.zeros(1, dtype=np.int64)
            fixed[io.ROW_SLOTS] = self._slots1
            P = lay.window_start  # the rows the kernel rotates (with recalled text: every slot before the window)
            self._source_cos1 = np.zeros((1, P, lay.head_dim // 2), np.float32)
            self._source_sin1 = np.zeros_like(self._source_cos1)
            self._source_rows: int | None = None  # K bound now
        self._decode_inputs = [(name, ortvalue(arr, "")) for name, arr in fixed.items()]
        for name, ov in self._decode_inputs:
            self._decode.binding.bind_ortvalue_input(name, ov)
        self._ahead_bound = None
        self._bind_ahead()
        if session is not self.graphs.plain:
            self._bind_adapter()

    def set_adapter(self, inputs: dict[str, np.ndarray] | None) -> None:
        """The adapter's inputs bound once in both bindings (OrtValues over the caller's arrays, which
        every seat with that adapter shares: no copy), and in a batched run's binding at its next run
        (seats.SeatBatches.group); a step then feeds them without a word. None: the shared zeros, and
        the plain twin where the build has one (no adapter nodes: the bindings made again for it, as
        for the adapter graph when an adapter comes; a switch runs the seat's history again anyway)."""
        zeros = self.graphs.lora_zeros
        if not zeros:
            super().set_adapter(inputs)
        self.adapter_values = adapter_inputs(zeros, inputs)  # a new list: seats.py rebinds
        plain = inputs is None
        if self.graphs.plain is not None and plain != self.plain:
            self.plain = plain
            self._bind()
            self._sync_kernel_source()
            return
        self.plain = plain
        self._bind_adapter()

    def _bind_adapter(self) -> None:
        for binding in (self._decode.binding, self._prefill.binding):
            for name, ov in self.adapter_values:
                binding.bind_ortvalue_input(name, ov)

    def _bind_ahead(self) -> None:
        """The side inputs / output of the sink and pinned keys' next rotation (RotatedKeys.ahead),
        bound again whenever the rotated-keys helper replaces them (a new set of pinned tokens)."""
        rot = self.rotated
        if self.steps or self._ahead_bound == rot.ahead_version:
            return
        values = [(name, ortvalue(arr, "")) for name, arr in rot.ahead.items()]
        out = ortvalue(rot.ahead_out, self.layout.kv_dtype.onnx_name)
        for binding in (self._decode.binding, self._prefill.binding):
            for name, ov in values:
                binding.bind_ortvalue_input(name, ov)
            binding.bind_ortvalue_output(io.REFRESH_KEYS, out)
        self._ahead_values = (values, out)  # kept alive while bound
        self._ahead_bound = rot.ahead_version

    def run(self, plan: StepPlan, ids: np.ndarray, all_logits: bool, embeds: np.ndarray | None) -> StepOutput:
        """The kernel reads the first F slots (F = 1 + the highest in use) and writes the chunk's K/V
        into rows F..F+n-1: empty slots or scratch rows, never a cached token's."""
        if embeds is not None and not self.embed_dim:
            raise ValueError("this model has no vision input")
        self._frame_keys(plan)
        if not self.steps:
            self.rotated.refresh(plan)
        self.rotated.chunk_tables(plan)
        F = plan.extent
        if plan.tokens == 1 and embeds is None and plan.sees_window:  # a recall chunk masks the window
            return self._run_one(ids, plan, F)
        inputs = self.chunk_inputs(plan, ids, all_logits)
        if embeds is not None:
            inputs.update({io.IMAGE_EMBEDS: np.ascontiguousarray(embeds, dtype=np.float32),
                           io.IMAGE_MASK: self.all_image[: plan.tokens]})  # fmt: skip
        self._bind_ahead()
        outs = self._prefill.run(inputs)  # every output allocated for this run (Binding, tokens=None)
        return StepOutput(outs[0], (F, outs[1:]), owned=True)

    def _frame_keys(self, plan: StepPlan) -> None:
        """A vision-language seat's keys before its step: the window keys a new frame moved turned, and
        (cabinlm's kernel) the image rows re-written at positions + E. Idempotent for one plan: run()
        calls it, and chunk_inputs again, which a batched run (seats.py) calls without run()."""
        if self.frames is not None:
            self.frames.follow(plan)
            if self.steps:
                self.frames.refresh_image(plan)

    def chunk_inputs(self, plan: StepPlan, ids: np.ndarray, all_logits: bool) -> dict[str, np.ndarray]:
        """A chunk's inputs besides the cache (bound once), the rotation tables already filled for the
        plan (RotatedKeys.chunk_tables): what a chunk of any size, or a seat's rows of a batched run,
        hands the graph (a vision-language decoder's: no image rows; run() puts a frame's in)."""
        self._frame_keys(plan)
        n, N, F = plan.tokens, self.layout.slots, plan.extent
        if n == 1 and plan.sees_window:  # a seat's one-token step in a batched run: the bias a one-token step keeps
            bias = self._one_token_bias(plan)
        else:
            mask = plan.attention_mask
            bias = mask[None, None] if F == N else np.concatenate([mask[:, :F], mask[:, N:]], axis=1)[None, None]
        rows = self._rows[:n] if all_logits else self._rows[n - 1 : n]
        inputs = {
            io.INPUT_IDS: np.ascontiguousarray(ids, dtype=np.int64),
            io.POSITION_IDS: self._chunk_rows[:, :n],
            io.ROPE_COS: self.rotated.cos,
            io.ROPE_SIN: self.rotated.sin,
            io.ATTENTION_BIAS: bias,
            io.SEQLENS_K: np.array([F + n - 1], dtype=np.int32),
            io.TOTAL_SEQUENCE_LENGTH: np.array(F + n, dtype=np.int32),
            io.LOGIT_ROWS: rows,
        }
        if self.steps:
            inputs[io.SOURCE_COS], inputs[io.SOURCE_SIN] = self.rotated.source_tables(plan)
            inputs[io.ROW_SLOTS] = plan.slots if plan.steps else F + self._rows[:n]
        elif plan.steps:
            raise ValueError("this build's attention cannot run a chunk as one-token steps")
        if self.ring is not None:
            self.ring.fill(plan)
            Fl, R = plan.local_extent, self.layout.local_slots
            lmask = plan.local_attention_mask
            lbias = lmask if Fl == R else np.concatenate([lmask[:, :Fl], lmask[:, R:]], axis=1)
            inputs.update({io.LOCAL_ROPE_COS: self.ring.cos, io.LOCAL_ROPE_SIN: self.ring.sin,
                           io.LOCAL_ATTENTION_BIAS: lbias[None, None],
                           io.LOCAL_SEQLENS_K: np.array([Fl + n - 1], dtype=np.int32),
                           io.LOCAL_TOTAL_SEQUENCE_LENGTH: np.array(Fl + n, dtype=np.int32)})  # fmt: skip
            if self.local_steps:
                inputs[io.LOCAL_ROW_SLOTS] = plan.local_slots if plan.steps else Fl + self._rows[:n]
        if self.embed_dim:
            inputs.update({io.IMAGE_EMBEDS: self._no_embeds[:n], io.IMAGE_MASK: self._no_image[:n]})
        return inputs

    def _one_token_bias(self, plan: StepPlan) -> np.ndarray:
        """A one-token step's bias (1, 1, 1, F + 1), the same array while the set of slots in use stays:
        it changes only with F and the sink / pinned / camera-frame fills (a window step replaces the
        oldest window token, a slot that stays in use). Never written once made: bindings hold it."""
        F = plan.extent
        held = (F, plan.sink_fill, plan.pinned_fill, plan.image_fill, plan.frames, plan.recall_fill, plan.recalls)
        if held != self._bias_held:
            if plan.cached == F:  # every slot below F holds a token: nothing to mask
                self._bias = self._zero_bias[..., : F + 1]
            else:  # empty slots below F (pinned slots not yet used, for one): plan.attention_mask's
                bias = np.zeros((1, 1, 1, F + 1), dtype=np.float32)  # row, its slots below F and itself
                bias[0, 0, 0, :F][plan.slot_token[:F] < 0] = io.MASK_VALUE
                self._bias = bias
            self._bias_held = held
        return self._bias

    def _run_one(self, ids: np.ndarray, plan: StepPlan, F: int) -> StepOutput:
        """One token: the inputs bound at load are written in place."""
        self._ids1[0] = ids[0]
        self._seqlens1[0] = F
        self._total1[()] = F + 1
        bias = {}
        one = self._one_token_bias(plan)
        if one is not self._bias_bound:
            bias[io.ATTENTION_BIAS] = self._bias_bound = one
        if self.ring is not None:
            # One token sees every ring token while the ring fills (they are the stream's first), and all
            # but the oldest once it is full (the one w tokens back, in slot local_seen mod w): that bias is
            # bound once and its one masked slot moved in place. A recall region held: the mask's row.
            self.ring.fill(plan)
            Fl, R = plan.local_extent, self.layout.local_window
            self._local_seqlens1[0] = Fl
            self._local_total1[()] = Fl + 1
            if self.local_steps:
                self._local_slots1[0] = Fl
            if plan.recall_fill:  # the region held masked too: the mask's row, its slots below F_l and itself
                lmask = plan.local_attention_mask
                bias[io.LOCAL_ATTENTION_BIAS] = np.concatenate([lmask[:, :Fl], lmask[:, -1:]], axis=1)[None, None]
                Fl = -1  # no bias bound in place now
            elif Fl < R:
                if Fl != self._local_held:
                    bias[io.LOCAL_ATTENTION_BIAS] = self._local_zero_bias[..., : Fl + 1]
            else:
                full = self._local_full_bias
                full[0, 0, 0, self._local_masked] = 0.0
                self._local_masked = plan.local_seen % R
                full[0, 0, 0, self._local_masked] = io.MASK_VALUE
                if Fl != self._local_held:
                    bias[io.LOCAL_ATTENTION_BIAS] = full
            self._local_held = Fl
        if self.steps:
            self._slots1[0] = F
            cos, sin = self.rotated.source_tables(plan)
            K = cos.shape[1]
            self._source_cos1[:, :K] = cos
            self._source_sin1[:, :K] = sin
            if K != self._source_rows:  # views of their first K rows, bound while K stays (written in place)
                self._source_views = [(name, ortvalue(arr[:, :K], "")) for name, arr in
                                      ((io.SOURCE_COS, self._source_cos1), (io.SOURCE_SIN, self._source_sin1))]  # fmt: skip
                for name, ov in self._source_views:
                    self._decode.binding.bind_ortvalue_input(name, ov)
                self._source_rows = K
            outs = self._decode.run(bias)
            return StepOutput(outs[0], (F, outs[1:]))
        self._bind_ahead()
        self.rotated.plan_ahead(plan)
        outs = self._decode.run(bias)
        self.rotated.ahead_done()
        return StepOutput(outs[0], (F, outs[1:]))

    @property
    def seat_batches(self) -> tuple[int, ...]:
        return self.graphs.batched.sizes if self.graphs.batched is not None else ()

    def run_seats(self, seats: Sequence[Backend], plans: Sequence[StepPlan], ids: Sequence[np.ndarray],
                  all_logits: Sequence[bool] | None = None,
                  embeds: Sequence[np.ndarray | None] | None = None) -> list[StepOutput]:  # fmt: skip
        """Several seats of this loaded build in batched runs (engines/ort_fused/seats.py)."""
        if self.graphs.batched is None:
            return super().run_seats(seats, plans, ids, all_logits, embeds)
        return self.graphs.batched.run(self, seats, plans, ids, all_logits, embeds)

    def commit(self, plan: StepPlan, out: StepOutput) -> None:
        """Keep the sink / pinned tokens' un-rotated keys, then move the chunk's rows F.. into their
        slots (often the same rows: then nothing moves). A prefix plan moves its tokens only; the
        kernel's rows of the others stay in empty slots or scratch rows, masked and never read."""
        start, qkv = out.new
        lay = self.layout
        if self.frames is not None:
            self.frames.note(plan)
        self.rotated.keep_sources(plan, [qkv[i] for i in lay.global_layers] if lay.local_layers else qkv, self._heads)
        if self._kernel_source is not None and plan.slots.min() < lay.image_start:  # sink / pinned sources changed
            self._sync_kernel_source()
        if self.local_keys is not None:  # the ring's rows F_l.. into slots local_seen mod w (a region's stay)
            move_rows(self.local_keys, self.local_values, plan.local_extent, plan.local_slots)
        move_rows(self.keys, self.values, start, plan.slots)


def unavailable() -> str | None:
    """The fused decoder runs on ONNX Runtime's CPU provider; its own kernels come with each build."""
    return None


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> FusedBackend:
    return FusedBackend(load_fused(folder, manifest, threads, session_config), table)


def held_once_bytes(manifest: Manifest, seat_bytes: int) -> int:
    """What a build whose seats decode together (FusedSettings.seat_batches) holds once beyond its
    files: what its sessions pack beside the one map of its weights file (FusedSettings.packed_bytes,
    every graph's, as the planner counts them; a build that does not record them: the LM head's copy
    in the head graph's session, profiles/weights.packed_head_bytes, none where the head is cabinlm's
    BlockQ8MatMul, which every graph reads in place), and the idle seat that fills a batched run's
    empty places (one seat_bytes). 0 for a build without batched graphs."""
    from cabinlm.profiles.weights import packed_head_bytes

    facts = manifest.runtime_spec.facts_as(FusedSettings)
    if facts is None or not facts.seat_batches:
        return 0
    if facts.packed_bytes is not None:
        return sum(facts.packed_bytes.values()) + seat_bytes
    head = 0 if facts.head_kernel == "cabinlm" else packed_head_bytes(manifest.model)
    return head + seat_bytes


def custom_ops_libraries(folder: Path, spec, ort_version: str) -> list[Path]:
    """A build with cabinlm's own kernels: its kernel library, verified against the manifest
    (kernel_library.checked_library: onnxruntime's C API version, this CPU, the sha256)."""
    from cabinlm.engines.ort_fused.kernel_library import checked_library

    fused = spec.facts_as(FusedSettings)
    if fused is None or not fused.own_kernels:
        return []
    return [checked_library(folder, fused, ort_version)]
