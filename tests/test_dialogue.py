"""Dialogue on the fixed cache: pinned system prompt, long runs at constant memory, bad input."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from cabinlm.contract.errors import InputError
from cabinlm.runtime import Decoder, Dialogue, Sampler, Tokenizer, open_artifact
from cabinlm.runtime.memory import rss_mb
from cabinlm.runtime.tokenizer import StreamDecoder

TURNS = [
    "How far is the next charging station?",
    "Turn the temperature down by two degrees.",
    "What is the speed limit on this road?",
    "Play something relaxing.",
]


@pytest.fixture(scope="module")
def tiny_artifact(load, tiny_qwen2_dir, export_to):
    return export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=64, chunk=16)


def test_the_system_prompt_stays_pinned_through_hundreds_of_turns(tiny_artifact):
    dec, tok = open_artifact(tiny_artifact)
    d = Dialogue(dec, tok, system="Answer briefly.", max_new_tokens=6)
    lay = dec.layout
    n_sys = dec.cache.seen
    kv = dec.backend
    pinned_before = (kv.keys[:, :, : lay.window_start].copy(), dec.cache.slot_token[: lay.window_start].copy())
    addresses = (kv.keys.ctypes.data, kv.values.ctypes.data)
    shapes = (kv.keys.shape, kv.values.shape)
    for i in range(300):
        r = d.ask(TURNS[i % len(TURNS)])
        assert r.cache_tokens <= lay.slots
    assert dec.cache.evicted > 10 * lay.window  # far past the window
    # The system prompt's tokens are still cached, untouched, in their slots.
    assert (dec.cache.slot_token[:n_sys] == np.arange(n_sys)).all()
    assert (kv.keys[:, :, : lay.window_start] == pinned_before[0]).all()
    assert (dec.cache.slot_token[: lay.window_start] == pinned_before[1]).all()
    # Every buffer kept its size and address.
    assert (kv.keys.ctypes.data, kv.values.ctypes.data) == addresses
    assert (kv.keys.shape, kv.values.shape) == shapes
    # The buffers the graph reads are still the cache's own memory (bound once at load).
    bound = [ov.data_ptr() for _, ov in kv._cache_values]
    expected = []
    for layer in range(lay.layers):
        expected += [kv.keys[layer].ctypes.data, kv.values[layer].ctypes.data]
    assert bound == expected


@pytest.mark.slow
def test_smollm2_dialogue_memory_does_not_grow_with_turns(smollm2, export_to):
    folder = export_to(smollm2, sink=4, pinned=60, window=124, chunk=32)
    dec, tok = open_artifact(folder)
    d = Dialogue(dec, tok, max_new_tokens=8)
    samples = []
    for i in range(160):
        d.ask(TURNS[i % len(TURNS)])
        if i >= 40 and i % 20 == 0:
            gc.collect()
            samples.append(rss_mb())
    assert dec.cache.evicted > 5 * dec.layout.window
    # After warm-up (allocator arenas settle during the first turns), memory is flat.
    assert max(samples) - samples[0] < 8.0, samples


def test_a_message_longer_than_the_window_is_refused_and_loses_nothing(tiny_artifact):
    dec, tok = open_artifact(tiny_artifact)
    d = Dialogue(dec, tok, max_new_tokens=4)
    d.ask("hello")
    state = (dec.cache.seen, dec.cache.slot_token.copy(), dec.backend.keys.copy())
    with pytest.raises(InputError, match="window holds 64"):
        d.ask("check the mirrors and the route " * 40)
    assert dec.cache.seen == state[0] and (dec.cache.slot_token == state[1]).all()
    assert (dec.backend.keys == state[2]).all()
    assert d.ask("hello").turn == 2  # the session goes on


def test_a_system_prompt_larger_than_the_pinned_region_is_refused(tiny_artifact):
    dec, tok = open_artifact(tiny_artifact)
    with pytest.raises(InputError, match="--pinned"):
        Dialogue(dec, tok, system="Keep a safe distance. " * 20)


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(tiny_artifact):
    def reply(sampler):
        dec, tok = open_artifact(tiny_artifact)
        return Dialogue(dec, tok, sampler=sampler, max_new_tokens=12).ask("route to the station").reply

    assert reply(Sampler(temperature=0.9, top_p=0.9, seed=7)) == reply(Sampler(temperature=0.9, top_p=0.9, seed=7))
    assert reply(Sampler()) == reply(Sampler())


def test_the_reply_is_the_streamed_text(tiny_artifact):
    dec, tok = open_artifact(tiny_artifact)
    d = Dialogue(dec, tok, sampler=Sampler(temperature=1.0, seed=3), max_new_tokens=30)
    parts: list[str] = []
    r = d.ask("what is the weather", on_text=parts.append)
    assert "".join(parts) == r.reply
    assert r.new_tokens > 0 and r.finish in ("stop", "length")


def test_stream_decoder_handles_multibyte_characters(tiny_artifact):
    tok = Tokenizer(tiny_artifact / "tokenizer.json")
    ids = tok.encode("Grüße aus München — 15 °C, Straße frei ✓")
    sd = StreamDecoder(tok)
    text = "".join(sd.push(i) for i in ids) + sd.flush()
    assert text == tok.decode(ids)


def test_sampler_rejects_bad_settings():
    from cabinlm.contract.errors import OptionError

    # NaN fails every comparison: a check written as "refuse < 0" once let temperature nan through
    bad = [dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0),
           dict(top_p=1.5), dict(top_p=float("nan")), dict(top_k=-2), dict(seed=-1)]  # fmt: skip
    for kw in bad:
        with pytest.raises(OptionError, match=f"--{next(iter(kw)).replace('_', '-')}"):
            Sampler(**kw)


def test_interrupting_a_reply_keeps_the_dialogue_consistent(tiny_artifact, monkeypatch):
    dec, tok = open_artifact(tiny_artifact)
    d = Dialogue(dec, tok, max_new_tokens=20)
    real_step, calls = Decoder.step, {"n": 0}

    def flaky_step(self, ids, pin=False, embeds=None, logits="all"):
        calls["n"] += 1
        if calls["n"] == 4:  # Ctrl-C arrives while the graph runs, before its K/V are committed
            raise KeyboardInterrupt
        return real_step(self, ids, pin, embeds, logits)

    monkeypatch.setattr(Decoder, "step", flaky_step)
    r = d.ask("where is the next charging station")
    assert r.finish == "interrupted"
    seen = dec.cache.seen
    monkeypatch.setattr(Decoder, "step", real_step)
    r2 = d.ask("thanks")
    # The sampled-but-unfed token and the closing of the interrupted turn were fed first.
    assert r2.prompt_tokens > len(d.render_user("thanks"))
    assert dec.cache.seen > seen


def test_ctrl_c_between_prefill_chunks_lets_the_prompt_join_the_cache_whole(tiny_artifact, monkeypatch):
    """A real SIGINT delivered while the first chunk of a long prompt runs: the prompt's chunks all
    join the cache (none is left half-fed), the turn ends before any reply token, and the next turn
    feeds only the closing of this one and its own prompt."""
    import signal

    dec, tok = open_artifact(tiny_artifact)
    d = Dialogue(dec, tok, max_new_tokens=8)
    d.ask("hello")
    before = dec.cache.seen
    real_step, calls = Decoder.step, {"n": 0}

    def step_with_sigint(self, ids, pin=False, embeds=None, logits="all"):
        calls["n"] += 1
        if calls["n"] == 1:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C arrives during the first prefill chunk
        return real_step(self, ids, pin, embeds, logits)

    monkeypatch.setattr(Decoder, "step", step_with_sigint)
    text = "check the mirrors and the route " * 2
    r = d.ask(text)
    monkeypatch.setattr(Decoder, "step", real_step)
    assert r.finish == "interrupted" and r.new_tokens == 0 and calls["n"] > 1  # several chunks ran
    assert dec.cache.seen - before == r.prompt_tokens  # the whole prompt, nothing more
    r2 = d.ask("thanks")
    closing = len(tok.encode(dec.manifest.chat.assistant_suffix))
    assert r2.prompt_tokens == closing + len(d.render_user("thanks"))
