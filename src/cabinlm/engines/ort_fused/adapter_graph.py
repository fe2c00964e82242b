"""Switchable LoRA adapters in the fused decoder (graph.fused_model of an export with --lora-rank):
the export's adapter inputs (contract/adapters.py) added beside the fused projections.

The fused decoder runs q|k|v as one matrix and gate|up as one; each targeted projection t of such a
matrix adds its own term (x A_t^T) B_t^T to its columns of the matrix's output, the base matmul left
as it is. Where the build carries cabinlm's kernel library, one node per fused matrix and layer,
ai.cabinlm::LoraTerms (kernels/lora_terms.cc), adds every targeted projection's term:

    h (1, T, in) ─ block matmul q|k|v ─ y (1, T, q + 2 kv) ─ LoraTerms(y, h, columns, seat_tokens, A_q, B_q, A_k, ...) ─> qkv

(columns: each targeted projection's first column in y; a projection the export does not target
adds nothing to its columns). The down projection's input is SiLU(gate) * up: where the build
computes it inside the down projection's kernel (BlockQ4SwiGLUMatMul), LoraSwiGLUTerms takes the
gate|up rows and computes it by the same sequence. A build without cabinlm's kernels (ONNX Runtime's
attention and matmuls) adds each term with two float32 Gemms of rank R instead:

    h ─ Squeeze (T, in) ─ Gemm A_q^T (T, R) ─ Gemm B_q^T (T, q)  ┐
                        ─ Gemm A_k^T ─ Gemm B_k^T (T, kv)       ├ Concat (T, q + 2 kv) ─ Add y ─> qkv
                        ─ Gemm A_v^T ─ Gemm B_v^T (T, kv)       ┘

(y split, the targeted parts added, and joined again where the matrix has untargeted parts).

No adapter feeds zeros: x A^T is exactly 0, so is its product with B, and y + 0 is y (LoraTerms
keeps y itself where the term is 0): the logits are those of the fused build of the same model
exported without --lora-rank, bit for bit. A build with cabinlm's block matmuls also carries the
decoder without adapter nodes (fused_model(adapters=False), weights shared), which seats without an
adapter run.

A batched graph (seats >= 2) stacks the seats' rows, seat after seat, seat_tokens giving each seat's
count; each seat feeds its own adapter (lora_a.{l}.{t}.seat{s}, io_spec.seats_io). LoraTerms takes
seat_tokens and every seat's factors and computes each row with its own seat's, by the same sequence
whatever the other rows; the Gemm path splits the rows by seat_tokens and runs each seat's Gemms over
its own rows only, with the shapes its own run has. Either way each seat's rows are what they are
alone, bit for bit.
"""

from __future__ import annotations

import numpy as np

from cabinlm.contract import io_spec
from cabinlm.contract.adapters import SwitchableLora
from cabinlm.engines.ort_fused import kernels
from cabinlm.engines.ort_fused.node_builder import NodeBuilder

# The fused matrices and the projections whose columns they hold, in column order.
FUSED_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
               "down": ("down_proj",)}  # fmt: skip


class AdapterTerms:
    """Adds the adapter terms of one fused graph (`seats`: 0, the one-seat graph; B >= 2, batched;
    `own_op`: on cabinlm's LoraTerms, the build carrying its kernel library, else on Gemms)."""

    def __init__(self, b: NodeBuilder, lora: SwitchableLora, seats: int, own_op: bool = False):
        self.b, self.lora, self.seats, self.own_op = b, lora, seats, own_op
        self._no_seats: str | None = None  # the one-seat graph's seat_tokens for LoraTerms: (0,), every row one seat's
        self._rows: dict[str, list[str]] = {}  # an activation's rows, (T, in), one entry per seat (one: unbatched)

    def targets(self, matrix: str) -> tuple[str, ...]:
        return tuple(t for t in FUSED_PARTS[matrix] if t in self.lora.targets)

    def _seat_rows(self, x: str) -> list[str]:
        """x (1, T, in) as (T, in), split by seat_tokens into each seat's rows (made once per x)."""
        if x not in self._rows:
            b = self.b
            flat = b.op("Squeeze", x, b.const(np.array([0], np.int64)), hint="lora/rows")
            if not self.seats:
                self._rows[x] = [flat]
            else:
                self._rows[x] = b.op("Split", flat, io_spec.SEAT_TOKENS, outputs=self.seats, axis=0, hint="lora/seat_rows")
        return self._rows[x]

    def _input(self, name: str, seat: int) -> str:
        return io_spec.seat_name(name, seat) if self.seats else name

    def add(self, y: str, x: str, layer: int, matrix: str, widths: tuple[int, ...], out: str | None = None) -> str:
        """y (1, T, sum(widths)), the fused matrix `matrix` of layer `layer` over x (1, T, in), plus the
        term of each targeted projection in its columns (widths: each projection's, FUSED_PARTS order).
        `out`: the result's name. The export targets one of the matrix's projections at least."""
        parts, targeted = FUSED_PARTS[matrix], self.targets(matrix)
        if self.own_op:
            return self._own_op(kernels.LORA_OP, y, x, layer, matrix, widths, out)
        b, p = self.b, f"layers.{layer}/lora_{matrix}"
        terms: dict[str, str] = {}
        for t in targeted:
            per_seat = []
            for s, rows in enumerate(self._seat_rows(x)):
                down = b.op("Gemm", rows, self._input(io_spec.lora_a_name(layer, t), s), transB=1, hint=f"{p}/{t}/a")  # (n, R)
                per_seat.append(b.op("Gemm", down, self._input(io_spec.lora_b_name(layer, t), s), transB=1,
                                     hint=f"{p}/{t}/b"))  # (n, out_t)  # fmt: skip
            terms[t] = per_seat[0] if len(per_seat) == 1 else b.op("Concat", *per_seat, axis=0, hint=f"{p}/{t}/seats")
        if len(targeted) == len(parts):  # every column adapted: one term (T, out) beside y (1, T, out)
            term = terms[parts[0]] if len(parts) == 1 else b.op("Concat", *(terms[t] for t in parts), axis=1, hint=f"{p}/term")
            return b.op("Add", y, term, out=out, hint=p)
        pieces = b.op("Split", y, b.const(np.array(widths, np.int64)), outputs=len(parts), axis=-1, hint=f"{p}/split")
        joined = [b.op("Add", piece, terms[t], hint=f"{p}/{t}") if t in terms else piece for piece, t in zip(pieces, parts)]
        return b.op("Concat", *joined, axis=-1, out=out, hint=p)

    def _own_op(self, op: str, y: str, x: str, layer: int, matrix: str, widths: tuple[int, ...], out: str | None) -> str:
        """One LoraTerms (or LoraSwiGLUTerms) node: every targeted projection's term of every seat."""
        b, parts = self.b, FUSED_PARTS[matrix]
        targeted = self.targets(matrix)
        starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        columns = b.const(np.array([starts[parts.index(t)] for t in targeted], np.int64))
        if self.seats:
            seat_tokens = io_spec.SEAT_TOKENS
        else:
            if self._no_seats is None:
                self._no_seats = b.const(np.zeros(0, np.int64))
            seat_tokens = self._no_seats
        factors = [self._input(name(layer, t), s) for s in range(max(self.seats, 1)) for t in targeted
                   for name in (io_spec.lora_a_name, io_spec.lora_b_name)]  # fmt: skip
        return b.op(op, y, x, columns, seat_tokens, *factors, domain=kernels.DOMAIN, out=out, hint=f"layers.{layer}/lora_{matrix}")

    def add_swiglu(self, y: str, gate_up: str, intermediate: int, layer: int, hidden: int) -> str:
        """y (1, T, D), the down projection of SiLU(gate) * up computed inside its kernel from gate|up
        (1, T, 2 I), plus the down projection's term over the same SiLU(gate) * up."""
        if self.own_op:
            return self._own_op(kernels.LORA_SWIGLU_OP, y, gate_up, layer, "down", (hidden,), None)
        return self.add(y, self.swiglu_input(gate_up, intermediate, layer), layer, "down", (hidden,))

    def swiglu_input(self, gate_up: str, intermediate: int, layer: int) -> str:
        """SiLU(gate) * up (1, T, I) from gate|up (1, T, 2 I): the down projection's input, for its term
        where the build computes it inside the down projection's kernel."""
        b, p = self.b, f"layers.{layer}/lora_down"
        gate, up = b.op("Split", gate_up, b.const(np.array([intermediate, intermediate], np.int64)), outputs=2, axis=-1,
                        hint=f"{p}/split")  # fmt: skip
        return b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up, hint=f"{p}/swiglu")
