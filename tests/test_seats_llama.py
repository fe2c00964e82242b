"""The llama.cpp peer of `cabinlm bench --seats N`: llama.cpp decoding N sequences in one
batch (bench/llama_seats.LlamaCppSeats, one sequence id per dialogue) on the same scripted turns as
cabinlm's seats. It needs llama-cpp-python (`make bench-deps`); without it these tests skip and print
why (`make test` does not install the bench extras)."""

from __future__ import annotations

import pytest

from cabinlm.bench.catalog import available


def _skip_without_llama_cpp() -> None:
    reason = available("llama.cpp")
    if reason:
        print(f"skipping: {reason}")
        pytest.skip(f"llama.cpp: {reason}")


@pytest.fixture(scope="module")
def gguf():
    from cabinlm.export.models import fetch_alias

    return fetch_alias("smollm2-135m")


def test_sequences_in_one_batch_decode_as_each_sequence_alone(smollm2_fused, gguf):
    """Two sequences stepped in one llama_decode choose, token for token, what each chooses when it is
    the only sequence (a reference: the same engine with one sequence, fed one token at a time)."""
    _skip_without_llama_cpp()
    from cabinlm.bench.llama_seats import LlamaCppSeats

    prompts = [[1, 9690, 198, 2683, 359, 253], [1, 4093, 198, 19556, 30, 657, 1296]]
    together = LlamaCppSeats(gguf, 1, seats=2, n_ctx_seq=256)
    try:
        nxt = {s: together.feed(s, p) for s, p in enumerate(prompts)}
        got = {s: [t] for s, t in nxt.items()}
        for _ in range(12):
            nxt = together.step(nxt)
            for s, t in nxt.items():
                got[s].append(t)
    finally:
        together.close()
    for s, p in enumerate(prompts):
        alone = LlamaCppSeats(gguf, 1, seats=1, n_ctx_seq=256)
        try:
            want = [alone.feed(0, p)]
            for _ in range(12):
                want.append(alone.step({0: want[-1]})[0])
        finally:
            alone.close()
        assert got[s] == want, s


def test_the_peer_decodes_cabinlms_replies_in_one_batch(smollm2_fused, gguf):
    """Fed cabinlm's together-mode replies, the peer decodes the same number of steps per seat and
    round, and its own greedy choice agrees with cabinlm's on most steps (two int4 engines on one GGUF);
    on its own it stops where its replies end."""
    _skip_without_llama_cpp()
    from cabinlm.bench.llama_seats import run_llama_seats
    from cabinlm.bench.seats import run_seats

    ours = run_seats(smollm2_fused, 2, 1, 10, 1, 0, "together")
    peer = run_llama_seats(smollm2_fused, gguf, 2, 1, 10, 1, 0, replies=ours.warmup_replies + ours.replies)
    assert peer.decoded == ours.decoded and peer.replies == ours.replies
    ok, steps = peer.agree
    assert steps >= sum(ours.decoded) and ok >= 0.6 * steps, (ok, steps)
    d = peer.to_dict()
    assert d["aggregate_decode_tok_s"] > 0 and len(d["per_seat_decode_tok_s"]) == 2 and d["ttft_ms_median"] > 0
    free = run_llama_seats(smollm2_fused, gguf, 2, 1, 10, 1, 0)
    assert all(0 < len(r) <= 10 for r in free.replies)
