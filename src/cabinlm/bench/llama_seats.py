"""llama.cpp decoding several dialogues in one batch: the peer of `cabinlm bench --seats N
--baseline llama.cpp` (bench/seats.py's modes are cabinlm's), on llama-cpp-python's low-level batch
API: the engine (LlamaCppSeats) and its run of the bench's scripted rounds (run_llama_seats).

Imported by the bench's child process (bench/seats_child.py); llama_cpp is imported when the engine
is made.
"""

from __future__ import annotations

import time
from pathlib import Path

from cabinlm.contract.files import FileRole
from cabinlm.bench.catalog import INSTALL, BaselineError, BaselineUnavailable
from cabinlm.bench.peers import load_llama_model
from cabinlm.bench.protocol import ContextFull
from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.bench.seats import SeatsRun
from cabinlm.runtime.memory import rss_mb


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


def run_llama_seats(artifact: Path, gguf: Path, seats: int, rounds: int, max_new: int, threads: int, seed: int,
                    system: str = SYSTEM, replies: list[list[int]] | None = None) -> SeatsRun:  # fmt: skip
    """The peer: llama.cpp decoding the seats' sequences in one batch (LlamaCppSeats), on
    the same token ids as run_seats (the artifact's tokenizer and chat template, the same scripted
    turns per seat, the system prompt as each sequence's first tokens), prompts fed seat after seat,
    then one llama_decode per step for every seat still replying.

    replies: a cabinlm run's replies (run_seats' warmup_replies + replies): each seat then decodes
    exactly as many steps as it did there and is fed those reply tokens, so both engines decode the
    same dialogues token for token (llama.cpp's own argmax is still computed every step; `agree`
    counts the steps where it chose cabinlm's token). Without them: llama.cpp's own greedy replies."""
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.runtime.template import Template
    from cabinlm.runtime.tokenizer import Tokenizer

    m = load_manifest(artifact)
    tok = Tokenizer(Path(artifact) / m.files[FileRole.TOKENIZER].path)
    template = Template(tok, m.chat)
    stop = set(m.stop_ids)
    if replies is not None and len(replies) != (rounds + 1) * seats:
        raise ValueError(f"replies holds {len(replies)} replies, not {(rounds + 1) * seats} ({rounds + 1} rounds x {seats} seats)")
    scripts = [user_turns(seed + i) for i in range(seats)]
    run = SeatsRun("llama.cpp", seats, rounds, decoded=[0] * seats, rss_start_mb=rss_mb())
    engine = LlamaCppSeats(gguf, threads, seats, n_ctx_seq=(rounds + 1) * (max_new + 512) + 512)
    run.config = engine.config  # type: ignore[attr-defined]
    agree = steps = 0
    try:
        start = template.start(system)
        pending: list[list[int]] = [list(start) for _ in range(seats)]
        for r in range(rounds + 1):
            if r == 1:
                run.warmup_replies = run.replies
                run.decoded, run.decode_s, run.prefill_s, run.ttft_s, run.replies = [0] * seats, 0.0, 0.0, [], []
            forced = replies[r * seats : (r + 1) * seats] if replies is not None else None
            t0 = time.perf_counter()
            nxt: list[int] = []
            for i in range(seats):
                nxt.append(engine.feed(i, pending[i] + template.user(next(scripts[i]))))
                run.ttft_s.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            run.prefill_s += t1 - t0
            if forced is not None:  # cabinlm's replies: its steps, its tokens
                got: list[list[int]] = [[] for _ in range(seats)]
                for i in range(seats):
                    agree += bool(forced[i]) and nxt[i] == forced[i][0]
                    steps += bool(forced[i])
                # seat i steps while it has fed fewer than len(reply) tokens, and once more where the
                # reply ended at a stop id (len < max_new): the step that chose it
                todo = [len(f) - (len(f) == max_new) if f else 0 for f in forced]
                fed = [0] * seats
                while any(fed[i] < todo[i] for i in range(seats)):
                    live = [i for i in range(seats) if fed[i] < todo[i]]
                    out = engine.step({i: forced[i][fed[i]] for i in live})
                    for i in live:
                        run.decoded[i] += 1
                        fed[i] += 1
                        want = forced[i][fed[i]] if fed[i] < len(forced[i]) else None
                        agree += out[i] == want or (want is None and out[i] in stop)
                        steps += 1
                reps = [list(f) for f in forced]
            else:
                reps = [[t] if t not in stop else [] for t in nxt]
                live = [i for i in range(seats) if reps[i]]
                while live:
                    live = [i for i in live if len(reps[i]) < max_new]
                    if not live:
                        break
                    out = engine.step({i: reps[i][-1] for i in live})
                    still = []
                    for i in live:
                        run.decoded[i] += 1
                        if out[i] not in stop:
                            reps[i].append(out[i])
                            still.append(i)
                    live = still
            run.decode_s += time.perf_counter() - t1
            for i in range(seats):
                last = reps[i][-1:] if len(reps[i]) == max_new else []
                pending[i] = last + template.closing()
            run.replies += reps
    finally:
        engine.close()
    run.rss_end_mb = rss_mb()
    run.agree = (agree, steps)  # type: ignore[attr-defined]
    return run
