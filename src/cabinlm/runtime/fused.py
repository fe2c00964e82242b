"""The decoder's steps on a fused cpu build (builders/ort_fused.py): ONNX Runtime's GroupQueryAttention
reads the cache in place and writes the chunk's rotated K/V after the slots in use; the sink /
pinned keys follow E (runtime/rotated.py). A mixin of runtime.session.Decoder, which owns the
sessions, the cache and the graph-kind-independent steps."""

from __future__ import annotations

import numpy as np

from cabinlm import manifest as mf
from cabinlm.runtime.binding import Binding, defer_sigint, ortvalue


class FusedSteps:
    """Binding and stepping of a fused build (Decoder.step and Decoder._bind call in here)."""

    def _bind_fused(self) -> None:
        lay, V = self.layout, self.manifest.model.vocab_size
        kv_onnx = lay.kv_dtype.onnx_name
        c = self.cache
        cache_values, aliases = [], []
        for i in range(lay.layers):
            k, v = ortvalue(c.keys[i][None], kv_onnx), ortvalue(c.values[i][None], kv_onnx)
            cache_values += [(mf.key_cache_name(i), k), (mf.value_cache_name(i), v)]
            aliases += [(mf.present_key_name(i), k), (mf.present_value_name(i), v)]
        self._cache_values = cache_values
        width = (self.manifest.model.num_heads + 2 * lay.kv_heads) * lay.head_dim
        f32 = np.dtype(np.float32)
        outs = [(mf.LOGITS, ("rows", V), f32, "float")]
        outs += [(mf.qkv_name(i), (1, "tokens", width), f32, "float") for i in range(lay.layers)]
        session = self.sessions["graph"]
        # Bound with the aliases, before the outputs ORT allocates per run (which come back in binding
        # order); re-binding it later keeps its place.
        aliases.append((mf.REFRESH_KEYS, ortvalue(self.rotated.ahead_out, kv_onnx)))
        self._decode = Binding(session, cache_values, outs, tokens=1, rows=1, aliases=aliases)
        self._prefill = Binding(session, cache_values, outs, tokens=None, aliases=aliases)
        self._chunk_rows = np.arange(lay.chunk, dtype=np.int64)[None]
        # Single-token decode binds its inputs once, over buffers a step writes in place: the token,
        # F and F + 1 (seqlens_k, total_sequence_length), the rotation tables (RotatedKeys fills row
        # 0), row 0 of them and of the logits. Only the bias is rebound, when F changes.
        self._ids1 = np.zeros(1, dtype=np.int64)
        self._seqlens1 = np.zeros(1, dtype=np.int32)
        self._total1 = np.zeros((), dtype=np.int32)
        self._zero_bias = np.zeros((1, 1, 1, lay.slots + 1), dtype=np.float32)
        self._bias: np.ndarray | None = None  # the bias bound now, kept alive while bound
        self._bias_held: tuple | None = None  # the slots in use it was made for
        fixed = {mf.INPUT_IDS: self._ids1, mf.POSITION_IDS: np.zeros((1, 1), dtype=np.int64),
                 mf.ROPE_COS: self.rotated.cos, mf.ROPE_SIN: self.rotated.sin, mf.SEQLENS_K: self._seqlens1,
                 mf.TOTAL_SEQUENCE_LENGTH: self._total1, mf.LOGIT_ROWS: np.zeros(1, dtype=np.int64)}  # fmt: skip
        self._decode_inputs = [(name, ortvalue(arr, "")) for name, arr in fixed.items()]
        for name, ov in self._decode_inputs:
            self._decode.binding.bind_ortvalue_input(name, ov)
        self._ahead_bound = None
        self._bind_ahead()

    def _bind_ahead(self) -> None:
        """The side inputs / output of the sink and pinned keys' next rotation (RotatedKeys.ahead),
        bound again whenever the rotated-keys helper replaces them (a new set of pinned tokens)."""
        rot = self.rotated
        if self._ahead_bound == rot.ahead_version:
            return
        values = [(name, ortvalue(arr, "")) for name, arr in rot.ahead.items()]
        out = ortvalue(rot.ahead_out, self.layout.kv_dtype.onnx_name)
        for binding in (self._decode.binding, self._prefill.binding):
            for name, ov in values:
                binding.bind_ortvalue_input(name, ov)
            binding.bind_ortvalue_output(mf.REFRESH_KEYS, out)
        self._ahead_values = (values, out)  # kept alive while bound
        self._ahead_bound = rot.ahead_version

    def _step_fused(self, ids: np.ndarray, pin: bool | str, mode: str) -> np.ndarray:
        """One chunk through a fused build (builders/ort_fused.py, runtime/rotated.py): the kernel writes
        the chunk's rotated K/V after the slots in use; commit moves them into their slots."""
        n, N = len(ids), self.layout.slots
        plan = self.cache.plan(n, pin)
        self.rotated.refresh(plan)
        self.rotated.chunk_tables(plan)
        # Attend to the slots in use only (F of N): the kernel reads rows 0..F-1 and writes the
        # chunk's K/V into rows F..F+n-1, empty slots or the scratch rows after the last slot.
        F = self.cache.extent
        if n == 1:
            return self._decode_fused(ids, plan, F)
        mask = plan.attention_mask
        bias = mask[None, None] if F == N else np.concatenate([mask[:, :F], mask[:, N:]], axis=1)[None, None]
        rows = self._last_row[n - 1] if mode == "last" else self._all_rows[:n]
        inputs = {
            mf.INPUT_IDS: np.ascontiguousarray(ids, dtype=np.int64),
            mf.POSITION_IDS: self._chunk_rows[:, :n],
            mf.ROPE_COS: self.rotated.cos,
            mf.ROPE_SIN: self.rotated.sin,
            mf.ATTENTION_BIAS: bias,
            mf.SEQLENS_K: np.array([F + n - 1], dtype=np.int32),
            mf.TOTAL_SEQUENCE_LENGTH: np.array(F + n, dtype=np.int32),
            mf.LOGIT_ROWS: rows.astype(np.int64, copy=False),
        }
        self._bind_ahead()
        outs = self._prefill.run(inputs)
        with defer_sigint():
            self.rotated.keep_sources(plan, outs[1:], self.manifest.model.num_heads)
            self.cache.commit_rows(plan, F)
        return outs[0]

    def _decode_fused(self, ids: np.ndarray, plan, F: int) -> np.ndarray:
        """One token through a fused build: the inputs bound at load are written in place."""
        self._ids1[0] = ids[0]
        self._seqlens1[0] = F
        self._total1[()] = F + 1
        c = self.cache
        bias = {}
        # The bias changes only with the set of slots in use: F, and the sink / pinned / camera-frame
        # fills (a window step replaces the oldest window token, a slot that stays in use).
        held = (F, c.sink_fill, c.pinned_fill, c.image_fill, c.frames)
        if held != self._bias_held:
            if c.length == F:  # every slot below F holds a token: nothing to mask
                self._bias = self._zero_bias[..., : F + 1]
            else:  # empty slots below F (pinned slots not yet used, for one): the plan's mask
                mask = plan.attention_mask
                self._bias = np.concatenate([mask[:, :F], mask[:, self.layout.slots :]], axis=1)[None, None]
            bias[mf.ATTENTION_BIAS] = self._bias
            self._bias_held = held
        rot = self.rotated
        self._bind_ahead()
        rot.plan_ahead(plan)
        outs = self._decode.run(bias)
        rot.ahead_done()
        with defer_sigint():
            self.rotated.keep_sources(plan, outs[1:], self.manifest.model.num_heads)
            self.cache.commit_rows(plan, F)
        return outs[0]
