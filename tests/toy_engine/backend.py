"""The toy's runtime side: io_spec.decoder_io over a numpy cache, one `session.run` per step.

    keys, values   (layers, kv_heads, slots, head_dim)  float32, un-rotated, written by commit
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from cabinlm.contract import io_spec as io
from cabinlm.contract.manifest import Manifest
from cabinlm.contract.slots import SlotTable, StepPlan
from cabinlm.engines.backend import Backend, StepOutput


class ToyBackend(Backend):
    # kind: set by toy_engine.register() (a kind registered at run time)

    def __init__(self, session: ort.InferenceSession, manifest: Manifest, table: SlotTable):
        super().__init__(manifest, table)
        self.session = session
        L, H, N, D = self.layout.buffer_shape
        self.keys = np.zeros((L, H, N, D), dtype=np.float32)
        self.values = np.zeros((L, H, N, D), dtype=np.float32)

    def run(self, plan: StepPlan, ids: np.ndarray, all_logits: bool, embeds: np.ndarray | None) -> StepOutput:
        if embeds is not None:
            raise ValueError("the toy engine runs text models only")
        n = plan.tokens
        feed = {io.INPUT_IDS: np.asarray(ids, dtype=np.int64), io.POSITION_IDS: plan.position_ids.astype(np.int64),
                io.CACHE_POSITION_IDS: plan.cache_position_ids.astype(np.int64),
                io.ATTENTION_MASK: plan.attention_mask,
                io.LOGIT_ROWS: np.arange(0 if all_logits else n - 1, n, dtype=np.int64)}
        for layer in range(self.layout.layers):
            feed[io.key_cache_name(layer)] = self.keys[layer]
            feed[io.value_cache_name(layer)] = self.values[layer]
        L = self.layout.layers
        names = [io.LOGITS] + [io.new_key_name(i) for i in range(L)] + [io.new_value_name(i) for i in range(L)]
        out = self.session.run(names, feed)
        return StepOutput(out[0], (out[1 : 1 + L], out[1 + L : 1 + 2 * L]), owned=True)

    def commit(self, plan: StepPlan, out: StepOutput) -> None:
        slots = plan.slots
        new_keys, new_values = out.new
        for layer in range(self.layout.layers):
            self.keys[layer][:, slots] = new_keys[layer][:, : len(slots)]
            self.values[layer][:, slots] = new_values[layer][:, : len(slots)]

    def buffers(self) -> dict[str, np.ndarray]:
        return {"keys": self.keys, "values": self.values}

    def seat(self, table: SlotTable) -> ToyBackend:
        return ToyBackend(self.session, self.manifest, table)


def unavailable() -> str | None:
    return None


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> ToyBackend:
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / manifest.files["graph"].path), so, providers=["CPUExecutionProvider"])
    return ToyBackend(session, manifest, table)
