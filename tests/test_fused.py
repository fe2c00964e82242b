"""The cpu build's fused decoder (builders/ort_fused.py, engines/onnxruntime/rotated.py): the same logits as the
exported graph, step by step, with eviction, pinning and sinks at work; sessions and seats on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from test_cli import assert_clean_error, cabinlm

from cabinlm.engines.build import build_artifact
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, Dialogue, open_artifact
from cabinlm.runtime.persist import load_session, save_session

ACC0 = {"session.qdq_matmulnbits_accuracy_level": "0"}  # the export's quantized matmuls in float32
LAYOUT = dict(sink=2, pinned=10, window=16, chunk=4)


def fused_build(art: Path, out: Path, **kw) -> Path:
    if not (out / "manifest.json").exists():
        build_artifact(art, load_profile("cpu"), out, attention="fused", accuracy_level=0, **kw)
    return out


def drive(decoders, rng, steps: int = 60) -> float:
    """The same stream through every decoder: a pinned system prompt, prefill chunks of 1..chunk,
    a second pinned span after the window has turned over (its rank then falls with every
    eviction), then single-token decode far past the cache. Returns the largest logit difference."""
    worst = 0.0
    for d in decoders:
        d.reset()

    def feed(ids, **kw):
        nonlocal worst
        outs = [d.feed(ids, all_logits=True, **kw) for d in decoders]
        worst = max(worst, max(float(np.abs(o - outs[0]).max()) for o in outs[1:]))

    feed(rng.integers(3, 300, 5), pin=True)
    for _ in range(steps // 2):
        feed(rng.integers(3, 300, int(rng.integers(1, 5))))
    feed(rng.integers(3, 300, 3), pin=True)
    for _ in range(steps):
        feed(rng.integers(3, 300, 1))
    assert len({d.cache.evicted for d in decoders}) == 1 and decoders[0].cache.evicted > 3 * LAYOUT["window"]
    return worst


@pytest.mark.parametrize("arch,weights,head", [("llama", "fp32", None), ("qwen2", "fp32", None), ("llama", "int4", None),
                                               ("qwen2", "int8", None), ("llama", "int4", "int4")])  # fmt: skip
def test_fused_build_gives_the_exported_graphs_logits_with_eviction_and_pins(arch, weights, head, load, tiny_llama_dir,
                                                                             tiny_qwen2_dir, export_to, tmp_path):  # fmt: skip
    """fp32 KV: the rotated cache with virtual positions is the rank semantics exactly (the exported
    graph is itself checked against transformers and the reference implementation)."""
    src = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    art = export_to(load(str(src)), kv="fp32", weights=weights, head=head, **LAYOUT)
    out = fused_build(art, tmp_path / "fused")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["build"]["backend"] == "onnxruntime-fused" and manifest["format_version"] == 4
    m = onnx.load(str(out / "decoder.opt.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("GroupQueryAttention") == 2  # one per layer of the tiny model
    assert "Softmax" not in ops and ops.count("RotaryEmbedding") == 1  # the sink / pinned keys' side rotation
    fused = Decoder(out)
    assert manifest["build"]["session"]["denormal_as_zero"] is True
    assert fused.backend.graphs.decoder.get_session_options().get_session_config_entry("session.set_denormal_as_zero") == "1"
    worst = drive([Decoder(art, session_config=ACC0), fused], np.random.default_rng(1))
    assert worst < 1e-4


def test_fused_decode_with_a_full_pinned_region_and_with_none(load, tiny_llama_dir, export_to, tmp_path):
    """Single-token decode binds its inputs once and its bias only when the slots in use change:
    a pinned region filled to the last slot (no slot below F is empty: a zero bias), a layout with
    no pinned slots, and the window filling up (F grows every step), against the exported graph."""
    for pinned in (4, 0):
        layout = dict(sink=2, pinned=pinned, window=12, chunk=4)
        art = export_to(load(str(tiny_llama_dir)), kv="fp32", **layout)
        ref, dec = Decoder(art, session_config=ACC0), Decoder(fused_build(art, tmp_path / f"fused-p{pinned}"))
        rng = np.random.default_rng(pinned)
        worst = 0.0
        if pinned:
            ids = rng.integers(3, 300, 2 + pinned)  # the sink, then every pinned slot
            worst = float(np.abs(ref.feed(ids, pin=True) - dec.feed(ids, pin=True)).max())
            assert dec.cache.length == dec.cache.extent == 2 + pinned
        for t in range(40):
            ids = rng.integers(3, 300, 1)
            worst = max(worst, float(np.abs(ref.step(ids) - dec.step(ids)).max()))
        assert dec.cache.evicted > 12 and dec.backend._bias_held[0] == dec.layout.slots
        assert worst < 1e-4


def test_sink_and_pinned_ranks_match_the_slot_tables_ranks(load, tiny_llama_dir, export_to, tmp_path):
    """The refresh's ranks of the sink and pinned keys (a shortcut while they are the oldest tokens)
    against the ranks the plan works out from the whole slot table, before and after a pinned span
    that comes after window tokens."""
    art = export_to(load(str(tiny_llama_dir)), kv="fp32", **LAYOUT)
    dec = Decoder(fused_build(art, tmp_path / "fused"))
    c, rot = dec.cache, dec.backend.rotated
    sink, pinned = LAYOUT["sink"], LAYOUT["pinned"]

    def check():
        slots = np.concatenate([np.arange(c.sink_fill), sink + np.arange(c.pinned_fill)]).astype(np.int64)
        plan = c.plan(1)
        np.testing.assert_array_equal(rot._ranks(plan, slots), plan.cache_position_ids[slots])

    dec.feed(np.arange(3, 8), pin=True)
    check()
    dec.feed(np.arange(20, 60))  # the window turns over
    check()
    dec.feed(np.arange(60, 63), pin=True)  # pinned tokens younger than the window's
    check()
    assert not np.array_equal(rot._ranks(c.plan(1), np.arange(sink + 6)), np.arange(sink + 6))  # the slow way taken
    dec.feed(np.arange(70, 100))
    check()
    assert c.pinned_fill == 6 < pinned  # 5 pinned tokens: 2 went to the sink


@pytest.mark.parametrize("kernel", ["cabinlm", "onnxruntime"])
def test_fused_int8_kv_stays_close_to_float_kv(kernel, load, tiny_llama_dir, export_to, tmp_path):
    """Static per-channel int8 scales (keys per rotation pair): the fused int8 build's logits stay as
    close to float KV as the exported graph's own int8 KV does (same order of error), with cabinlm's
    attention kernel and with ONNX Runtime's."""
    loaded = load(str(tiny_llama_dir))
    ref = Decoder(export_to(loaded, kv="fp32", **LAYOUT))
    art8 = export_to(loaded, kv="int8", **LAYOUT)
    scales = json.loads((art8 / "manifest.json").read_text())["kv_scales"]
    assert np.asarray(scales["rotated_keys"]).shape == np.asarray(scales["keys"]).shape
    pair = np.asarray(scales["rotated_keys"])
    half = pair.shape[-1] // 2
    np.testing.assert_array_equal(pair[..., :half], pair[..., half:])  # one scale per rotation pair
    assert (pair >= np.asarray(scales["keys"]) - 1e-7).all()  # a pair (with headroom) bounds each of its channels
    fused = Decoder(fused_build(art8, tmp_path / "fused8", attention_kernel=kernel))
    assert fused.manifest.build.facts.attention_kernel == kernel
    graph8 = Decoder(art8)
    err_fused = drive([ref, fused], np.random.default_rng(2))
    err_graph = drive([ref, graph8], np.random.default_rng(2))
    assert 0 < err_fused < max(3 * err_graph, 0.5)


def test_pinned_keys_are_rewritten_from_float_sources_not_from_quantized_data(load, tiny_llama_dir, export_to, tmp_path):
    """Sink / pinned keys are re-written at rank + evictions before a step (a build on ONNX Runtime's
    GroupQueryAttention, which reads them from the cache; cabinlm's kernel rotates them itself,
    tests/test_kernels.py); doing it twice, or after a thousand evictions, gives the bytes a fresh
    rotation of the float32 source gives."""
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    dec = Decoder(fused_build(art, tmp_path / "fused8", attention_kernel="onnxruntime"))
    assert not dec.backend.steps
    dec.feed(np.arange(3, 10), pin=True)
    for t in range(400):
        dec.step(np.array([20 + t % 200]))
    c, kv, rot = dec.cache, dec.backend, dec.backend.rotated
    plan = c.plan(1)
    rot.forget()
    rot.refresh(plan)
    first = kv.keys[:, :, :7].copy()
    rot.forget()
    rot.refresh(plan)
    np.testing.assert_array_equal(kv.keys[:, :, :7], first)
    session, rot.session = rot.session, None  # the numpy fallback: the same arithmetic
    assert session is not None  # the build's rotation graph is in use
    rot.forget()
    rot.refresh(plan)
    assert np.abs(kv.keys[:, :, :7].astype(np.int32) - first).max() <= 1
    rot.session = session
    # independent numpy: rotate the float source at rank + evictions, quantize with the static scales
    pos = np.arange(7) + c.evicted
    ang = pos[:, None] * np.asarray(dec.manifest.rotary.inv_freq)[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    src = kv.key_source[:, :, :7].astype(np.float64)
    h = src.shape[-1] // 2
    rotated = np.concatenate([src[..., :h] * cos - src[..., h:] * sin, src[..., h:] * cos + src[..., :h] * sin], -1)
    scale = dec.manifest.kv_scales.array("rotated_keys")[:, :, None, :]
    expect = np.clip(np.rint(rotated / scale), -127, 127)
    assert np.abs(first.astype(np.int32) - expect).max() <= 1  # float32 vs float64 rounding at .5


def test_decode_steps_rotate_the_next_steps_pinned_keys_as_the_rotation_graph_does(load, tiny_llama_dir, export_to, tmp_path):
    """A steady decode step rotates the sink / pinned keys for the next step on the side (in the
    decoder graph); the next refresh copies them in. They must be the bytes the rotation graph
    writes from the float sources, and the side path must stand aside while a pinned span is
    younger than window tokens (their ranks then fall with each eviction). (GroupQueryAttention builds:
    cabinlm's kernel rotates them itself.)"""
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    dec = Decoder(fused_build(art, tmp_path / "fused8", attention_kernel="onnxruntime"))
    c, kv, rot = dec.cache, dec.backend, dec.backend.rotated
    rows = LAYOUT["sink"] + 5
    dec.feed(np.arange(3, 10), pin=True)  # 2 sink + 5 pinned

    def steps(count: int) -> int:
        taken = 0
        for t in range(count):
            dec.step(np.array([20 + t % 200]))
            plan = c.plan(1)
            if rot._ahead != (c.evicted, c.sink_fill, c.pinned_fill):
                continue
            taken += 1
            rot.refresh(plan)  # the side path: a copy
            got = kv.keys[:, :, :rows].copy()
            kv.keys[:, :, :rows] = 0
            rot.forget()
            rot.refresh(plan)  # the rotation graph, from the float sources
            np.testing.assert_array_equal(kv.keys[:, :, :rows], got)
        return taken

    assert steps(LAYOUT["window"] - 1) == 0  # the window fills: nothing is evicted, nothing to refresh
    assert steps(40) >= 39
    dec.feed(np.arange(60, 63), pin=True)  # pinned tokens younger than the window's
    assert steps(LAYOUT["window"] - 2) == 0
    assert steps(20) >= 18  # those window tokens are gone: the pinned tokens are the oldest again


def test_a_fused_session_resumes_exactly_and_seats_stay_apart(load, tiny_qwen2_dir, export_to, tmp_path):
    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")
    out = fused_build(art, tmp_path / "fused")
    turns = ["check the route", "and the weather", "play some music", "how far is it", "thanks", "one more thing"]

    def dialogue():
        dec, tok = open_artifact(out, verify=False)
        return Dialogue(dec, tok, max_new_tokens=6)

    whole = dialogue()
    expected = [whole.ask(t).reply for t in turns]
    assert whole.decoder.cache.evicted > 0
    first = dialogue()
    for t in turns[:3]:
        first.ask(t)
    save_session(tmp_path / "s", first)
    resumed = dialogue()
    load_session(tmp_path / "s", resumed)
    np.testing.assert_array_equal(resumed.decoder.backend.key_source, first.decoder.backend.key_source)
    assert [resumed.ask(t).reply for t in turns[3:]] == expected[3:]
    other = Dialogue(first.decoder.seat(), first.tok, max_new_tokens=6)
    assert other.decoder.backend.keys.ctypes.data != first.decoder.backend.keys.ctypes.data
    assert [other.ask(t).reply for t in turns] == expected


def test_attention_choice_is_explained(load, tiny_qwen2_dir, export_to, tmp_path):
    art16 = export_to(load(str(tiny_qwen2_dir)), kv="fp16", **LAYOUT)
    p = cabinlm("build", art16, "--profile", "cpu", "-o", tmp_path / "a", "--attention", "fused")
    assert_clean_error(p, "fp16 KV")
    p = cabinlm("build", art16, "--profile", "cpu", "-o", tmp_path / "b")  # auto: keeps the graph, says why
    assert p.returncode == 0 and "kept the exported attention (fp16 KV" in p.stderr + p.stdout
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["build"]["backend"] == "onnxruntime-graph"
    p = cabinlm("build", art16, "--profile", "cpu", "-o", tmp_path / "c", "--attention", "sideways")
    # an unknown choice is refused by the command line itself, naming the choices
    said = " ".join(p.stderr.replace("│", " ").split())  # typer draws its usage error in a box
    assert p.returncode == 2 and "Traceback" not in p.stderr and "'sideways' is not one of" in said, p.stderr
    p = cabinlm("build", art16, "--profile", "cpu", "-o", tmp_path / "d", "--minimums", "int3")
    said = " ".join(p.stderr.replace("│", " ").split())
    assert p.returncode == 2 and "Traceback" not in p.stderr and "'int3' is not one of 'int8', 'exact'" in said, p.stderr


@pytest.mark.slow
def test_smollm2_fused_int8_kv_perplexity_stays_within_half_a_percent(smollm2, export_to, long_text, tmp_path):
    """Static per-channel scales are enough on the real model: the fused int8 build (float32
    activations, to isolate the KV) within 0.5% of float32 KV, eviction active (as test_kvquant)."""
    from cabinlm.runtime import Tokenizer
    from cabinlm.runtime.perplexity import chunked_perplexity

    layout = dict(sink=4, pinned=0, window=252, chunk=64)
    fp32 = export_to(smollm2, **layout)
    ids = Tokenizer(fp32 / "tokenizer.json").encode(long_text, add_special_tokens=True)[:1500]
    fused = fused_build(export_to(smollm2, kv="int8", **layout), tmp_path / "fused8")
    base = chunked_perplexity(Decoder(fp32), ids).ppl
    got = chunked_perplexity(Decoder(fused), ids).ppl
    assert got / base - 1 <= 0.005, (got, base)


def test_smollm2_gguf_blocks_give_the_exported_graphs_logits(smollm2, export_to, tmp_path):
    """The GGUF's own Q4_1 / Q8_0 blocks through MatMulNBits (a Q4_1 minimum moved by the kernel's
    implicit zero point 8, a Q8_0 table as 8-bit blocks): with float KV and float activations the
    fused build's logits are the exported graph's, through eviction."""
    art = export_to(smollm2, sink=4, pinned=60, window=124, chunk=32, weights="int4")
    out = fused_build(art, tmp_path / "fused", minimums="exact")
    a, b = Decoder(art, session_config=ACC0), Decoder(out)
    ids = np.arange(1000, 1300)
    np.testing.assert_allclose(b.feed(ids[:8], pin=True, all_logits=True), a.feed(ids[:8], pin=True, all_logits=True),
                               atol=2e-3, rtol=0)  # fmt: skip
    for start in range(8, 300, 32):
        chunk = ids[start : start + 32]
        np.testing.assert_allclose(b.feed(chunk, all_logits=True), a.feed(chunk, all_logits=True), atol=2e-3, rtol=0)
    assert a.cache.evicted == b.cache.evicted > 100


def test_q4_1_blocks_as_int8_move_each_block_by_one_small_constant():
    """Q4_1 (d * q + m) as 8-bit codes with an integer zero point, checked against the float64
    values block by block: a block holding zero moves as a whole by one constant (the levels keep
    their spacing) of at most d / 34; a block far from zero is re-rounded value by value within
    half its new step; a constant block is kept."""
    from cabinlm.engines.ort_fused.block_layouts import q4_1_as_int8

    rng = np.random.default_rng(0)
    K, N = 96, 40
    q = rng.integers(0, 16, (K, N)).astype(np.uint8)
    q[0:32:2, 0], q[1:32:2, 0] = 0, 15  # a block spanning all 16 levels
    d = rng.uniform(1e-3, 2e-2, (K // 32, N)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(0, 15, (K // 32, N))).astype(np.float16).astype(np.float32)
    q[32:64, 1] = np.arange(32) % 16
    m[1, 1] = -0.5 * 15 * d[1, 1]  # zero in the middle of the block
    m[0, 2] = 0.3  # every value positive, far from zero
    m[1, 2] = -7.0  # every value far below zero
    d[2, 3], q[64:96, 3] = 0.0, 0  # a constant block (one level)
    q8, s, z = q4_1_as_int8(q, d, m)
    assert q8.dtype == z.dtype == np.uint8 and s.dtype == np.float32
    true = d.astype(np.float64)[:, None] * q.reshape(3, 32, N) + m[:, None]
    got = s.astype(np.float64)[:, None] * (q8.reshape(3, 32, N).astype(np.float64) - z[:, None])
    shift = got - true
    assert (np.abs(shift).max(axis=1) <= s * (0.5 + 1e-4)).all()  # within half a new step (float32 s), everywhere
    holds_zero = (true.min(axis=1) <= 0) & (true.max(axis=1) >= 0)
    assert holds_zero.mean() > 0.8
    spread = shift.max(axis=1) - shift.min(axis=1)
    assert (spread[holds_zero] <= 1e-4 * s[holds_zero]).all(), spread[holds_zero].max()  # one constant per block
    assert (np.abs(shift).max(axis=1)[holds_zero] <= d[holds_zero] * (1 / 34 + 1e-4)).all()
    assert not holds_zero[0, 2] and not holds_zero[1, 2]
    assert abs(got[2, :, 3] - true[2, :, 3]).max() <= abs(m[2, 3]) * 1e-6  # the constant block
    assert np.abs(shift).max() > 0  # not a copy: the minimums do move


@pytest.mark.slow
def test_smollm2_q4_1_as_int8_blocks_stay_close_to_the_exact_build(smollm2, export_to, long_text, tmp_path):
    """--minimums int8 against the exact build on the real model (float KV, float activations, so
    only the re-expressed blocks differ): the same next token almost everywhere, logits close."""
    art = export_to(smollm2, sink=4, pinned=60, window=124, chunk=32, weights="int4")
    exact = Decoder(fused_build(art, tmp_path / "exact", minimums="exact"))
    int8 = Decoder(fused_build(art, tmp_path / "int8", minimums="int8"))
    graph = onnx.load(str(tmp_path / "int8" / "decoder.opt.onnx"), load_external_data=False)
    bits = {a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {8} and not any(n.op_type == "Gemm" for n in graph.graph.node)  # no block-sum kernels left
    from cabinlm.runtime import Tokenizer

    ids = Tokenizer(tmp_path / "int8" / "tokenizer.json").encode(long_text, add_special_tokens=True)[:256]
    a, b = exact.feed(ids, all_logits=True), int8.feed(ids, all_logits=True)
    agree, worst = (a.argmax(-1) == b.argmax(-1)).mean(), np.abs(a - b).max()
    print(f"next-token agreement {agree:.3f}, max |logit diff| {worst:.3f}")
    assert agree >= 0.95 and worst < 2.0, (agree, worst)
    manifests = {name: json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("exact", "int8")}
    assert manifests["int8"]["build"]["fused"]["minimums"] == "int8"
    assert manifests["exact"]["build"]["fused"]["minimums"] == "exact"
    built = {name: m["quality"]["build"]["weights_bytes"] for name, m in manifests.items()}
    for name, size in built.items():  # the weights as each build holds them
        assert size == (tmp_path / name / "decoder.opt.onnx.data").stat().st_size
    assert built["int8"] > built["exact"]  # 8 bits against 4 + minimums


def test_an_interrupt_inside_the_key_refresh_leaves_no_stale_key(load, tiny_llama_dir, export_to, tmp_path):
    """Ctrl-C while the sink / pinned keys are being re-rotated (inside the rotation graph's run):
    the step is abandoned, and the next one re-does the refresh (it is recorded only after the keys
    are written), so the logits equal an uninterrupted decoder's fed the same tokens. (GroupQueryAttention
    builds: cabinlm's kernel has no refresh.)"""
    art = export_to(load(str(tiny_llama_dir)), kv="int8", **LAYOUT)
    out = fused_build(art, tmp_path / "fused8", attention_kernel="onnxruntime")
    a, b = Decoder(out), Decoder(out)
    rng = np.random.default_rng(5)
    system = rng.integers(3, 300, 7)
    a.feed(system, pin=True)
    b.feed(system, pin=True)
    for _ in range(LAYOUT["window"] // 2):  # the window fills: from here each 2-token chunk evicts
        ids = rng.integers(3, 300, 2)
        a.step(ids), b.step(ids)
    rot = b.backend.rotated
    real, calls = rot.session, {"n": 0}

    class Interrupted:
        def run(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt  # arrives while the rotation runs
            return real.run(*args, **kwargs)

    rot.session = Interrupted()
    interrupted = 0
    for t in range(20):
        ids = rng.integers(3, 300, 2)
        want = a.step(ids)
        try:
            got = b.step(ids)
        except KeyboardInterrupt:
            interrupted += 1
            got = b.step(ids)  # the same chunk again: the cache was not touched
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"chunk {t}")
    assert interrupted == 1 and calls["n"] > 5 and b.cache.evicted > 20
