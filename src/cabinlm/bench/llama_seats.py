"""llama.cpp decoding several dialogues in one batch: the peer of `cabinlm bench --seats N
--baseline llama.cpp` (bench/seats.py), on llama-cpp-python's low-level batch API.

Imported by the bench's child process; llama_cpp is imported when the engine is made.
"""

from __future__ import annotations

from pathlib import Path

from cabinlm.bench.catalog import INSTALL, BaselineError, BaselineUnavailable
from cabinlm.bench.peers import load_llama_model
from cabinlm.bench.protocol import ContextFull


class LlamaCppSeats:
    """llama.cpp decoding several sequences in one batch, the way llama.cpp's server (-np N) does:
    one context with n_seq_max = seats and a KV cache of n_ctx_seq cells per sequence (not unified:
    each sequence attends only its own cells), one sequence id per dialogue. `feed` prefills one
    sequence's tokens (in n_batch chunks); `step` decodes one token for each of several sequences in
    ONE llama_decode (a llama_batch of one row per sequence, each row's logits out)."""

    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, seats: int, n_ctx_seq: int):
        import numpy as np

        try:
            import llama_cpp as L
        except Exception as e:  # noqa: BLE001 - a broken build: say so with the install command
            raise BaselineUnavailable(f"llama-cpp-python does not import ({e}): {INSTALL['llama.cpp']}") from e
        if seats < 1 or n_ctx_seq < 1:
            raise ValueError(f"seats and n_ctx_seq must be >= 1, got {seats} and {n_ctx_seq}")
        self.L, self.np = L, np
        self.log, self._log_cb, self.model = load_llama_model(L, path)
        cp = L.llama_context_default_params()
        cp.n_seq_max = seats
        cp.n_ctx = seats * n_ctx_seq
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = False  # each sequence's own cells (llama.h: better when sequences share no prefix)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BaselineError(f"llama.cpp cannot create a context ({'; '.join(list(self.log)[-3:])})")
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model)))
        self.seats = seats
        self.pos = [0] * seats  # each sequence's next position
        self.n_ctx_seq = int(L.llama_n_ctx(self.ctx)) // seats
        self.config = {"name": "gguf", "weights": "the GGUF file as is", "kv": "f16", "n_seq_max": seats,
                       "n_ctx": int(L.llama_n_ctx(self.ctx)), "kv_unified": bool(getattr(cp, "kv_unified", False)),
                       "threads": threads, "llama_cpp_python": L.__version__}  # fmt: skip
        self.batch = L.llama_batch_init(max(512, seats), 0, 1)

    def _decode(self, rows: list[tuple[int, int]], logits_rows: set[int]) -> None:
        """rows: (sequence, token) in order, each at its sequence's next position."""
        b, L = self.batch, self.L
        for i, (seq, token) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = self.pos[seq]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if i in logits_rows else 0
            self.pos[seq] += 1
        b.n_tokens = len(rows)
        for seq, _ in rows:
            if self.pos[seq] > self.n_ctx_seq:
                raise ContextFull(f"sequence {seq} past its {self.n_ctx_seq} cells (n_ctx / n_seq_max)")
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise ContextFull(f"llama_decode returned {rc} for {len(rows)} rows" + (f" [{self.log[-1]}]" if self.log else ""))

    def logits(self, row: int):
        return self.np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))

    def feed(self, seq: int, ids: list[int]) -> int:
        """Prefill one sequence; the argmax after its last token."""
        for i in range(0, len(ids), 512):
            chunk = ids[i : i + 512]
            self._decode([(seq, t) for t in chunk], {len(chunk) - 1})
        return int(self.logits(len(ids[i : i + 512]) - 1).argmax())

    def step(self, tokens: dict[int, int]) -> dict[int, int]:
        """One token for each of these sequences in one llama_decode: each one's argmax after it."""
        rows = list(tokens.items())
        self._decode(rows, set(range(len(rows))))
        return {seq: int(self.logits(i).argmax()) for i, (seq, _) in enumerate(rows)}

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)
