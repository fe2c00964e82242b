"""Per-layer cache geometry (docs/design.md, "Layers with their own sliding window"). A tiny random Gemma 3
(conftest.make_tiny_model: local layers of window 20 around a global one) keeps a ring of 20 slots
for each local layer and the sink + pinned + window slot map for the global one:

  * the ring bookkeeping against a plain list of the stream's last tokens (numpy, no graph);
  * every engine that runs here against the independent streaming reference (tests/reference.py,
    its local layers written from the specification), through pins, ring turnover and eviction;
  * what the rings cost (bytes read from the buffers), session files, drafting past turnover;
  * what is refused: a chunk the ring cannot hold, an engine without the rings, a manifest that lies.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_tiny_model
from test_backends import BACKENDS, CASES, FP16_COMPUTE, HOST_STATIC, LAYOUT, STREAM, TOLERANCE, relative_errors, static_profile, why_not_here

from cabinlm.engines.build import build_artifact
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.errors import LayoutError, ManifestError
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.manifest import Manifest, load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, Dialogue, open_artifact
from cabinlm.runtime.persist import load_session, save_session
from cabinlm.contract.slots import SlotTable
from cabinlm.runtime.speculative import PromptLookupDrafting
from reference import StreamingReference

W = 20  # the tiny Gemma's sliding window: rings of 20 slots


@pytest.fixture(scope="module")
def gemma(load, tmp_path_factory):
    return load(str(make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")))


# -- the ring bookkeeping, in numpy ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_rings_hold_the_streams_last_tokens_and_each_token_sees_its_window(seed):
    lay = CacheLayout(sink=2, pinned=6, window=9, chunk=5, layers=3, kv_heads=1, head_dim=8, local_window=7, local_layers=(0, 2))
    table, rng = SlotTable(lay), np.random.default_rng(seed)
    stream: list[int] = []  # every stream index fed so far, the plain way
    for _ in range(60):
        n = int(rng.integers(1, lay.chunk + 1))
        pin = bool(rng.random() < 0.1) and table.pinned_free >= n
        plan = table.plan(n, pin)
        held = stream[-(W_ := lay.local_window) :]  # the ring: the last w tokens, pinned or not
        ring = plan.local_ring_token
        assert sorted(ring[ring >= 0].tolist()) == held and W_ == lay.local_slots
        for slot, t in enumerate(ring):  # token t sits in slot t mod R
            assert t < 0 or t % W_ == slot
        ranks = plan.local_cache_position_ids
        assert [int(ranks[t % W_]) for t in held] == list(range(len(held)))  # ranks in stream order
        assert plan.local_position_ids.tolist() == list(range(len(held), len(held) + n))
        mask = plan.local_attention_mask
        for i in range(n):  # token seen + i sees the ring tokens within w of it, itself included
            me = len(stream) + i
            seen_ring = {int(ring[s]) for s in range(W_) if mask[i, s] == 0}
            assert seen_ring == {t for t in held if me - t < lay.local_window}
            assert (mask[i, W_:] == 0).tolist() == [j <= i for j in range(n)]
        assert plan.local_slots.tolist() == [(len(stream) + i) % W_ for i in range(n)]
        stream += list(range(len(stream), len(stream) + n))
        table.advance(plan)


def test_the_rings_cost_what_the_layout_says_and_a_fraction_of_a_uniform_cache(gemma, export_to):
    folder = export_to(gemma, kv="int8", **LAYOUT)
    dec = Decoder(folder)
    lay = dec.layout
    assert lay.local_layers == (0, 2) and lay.local_window == W and lay.local_slots == W
    bufs = dec.backend.buffers()
    assert bufs["keys"].shape == (1, lay.kv_heads, lay.slots, lay.head_dim)
    assert bufs["local_keys"].shape == (2, lay.kv_heads, W, lay.head_dim)
    assert dec.backend.nbytes() == lay.cache_bytes  # counted by the layout, read from the arrays
    per_token_layer = 2 * lay.kv_heads * lay.head_dim * 1 + 2 * lay.kv_heads  # int8 K, V + fp16 value scale
    assert lay.cache_bytes == per_token_layer * (lay.slots + 2 * W)
    assert lay.uniform().cache_bytes == per_token_layer * 3 * lay.slots


def test_a_chunk_the_ring_cannot_hold_is_refused_in_one_line():
    with pytest.raises(LayoutError) as e:
        CacheLayout(sink=4, pinned=0, window=64, chunk=32, layers=2, kv_heads=1, head_dim=8, local_window=20, local_layers=(0,))
    assert "\n" not in str(e.value) and "--chunk 32" in str(e.value) and "at most 20" in str(e.value)
    for bad in (dict(local_window=20), dict(local_layers=(0,)), dict(local_window=20, local_layers=(0, 1)),
                dict(local_window=20, local_layers=(1, 0, 1))):  # fmt: skip
        with pytest.raises(LayoutError):
            CacheLayout(sink=4, pinned=0, window=64, chunk=8, layers=2, kv_heads=1, head_dim=8, **bad)


def test_a_manifest_whose_rings_do_not_match_its_graph_is_refused(gemma, export_to, tmp_path):
    folder = export_to(gemma, **LAYOUT)
    d = json.loads((folder / "manifest.json").read_text())
    assert d["cache"]["local_layers"] == [0, 2] and d["model"]["local_layers"] == [0, 2]
    assert Manifest.from_dict(d).cache == load_manifest(folder).cache  # round trip
    d["cache"]["local_layers"] = [0]  # the graph's I/O declares two rings
    with pytest.raises(ManifestError):
        Manifest.from_dict(d)


# -- every engine against the streaming reference -------------------------------------------------


def reference_logits(model, ids: np.ndarray) -> list[np.ndarray]:
    ref = StreamingReference(model, sink=LAYOUT["sink"], window=LAYOUT["window"], local=True)
    out, pos = [], 0
    for n, pin in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            out.append(ref.feed(ids[start : min(start + LAYOUT["chunk"], pos + n)].tolist(), pin=pin).numpy())
        pos += n
    return out


@pytest.fixture(scope="module")
def stream(gemma):
    ids = np.random.default_rng(7).integers(3, 300, sum(n for n, _ in STREAM))
    return ids, reference_logits(gemma.model, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_engine_runs_the_local_rings_as_the_reference(backend, gemma, export_to, stream, tmp_path_factory):
    case = CASES[backend]
    art = export_to(gemma, kv=case.kv, **LAYOUT)
    if case.kind is BackendKind.TENSORRT:  # the bundle builds anywhere (its graph with the rings passes the check);
        # the engine needs TensorRT (tests/test_tensorrt_backend.py runs the backend's host side with the rings)
        out = build_artifact(art, load_profile(case.profile), tmp_path_factory.mktemp("trt") / "out")
        assert load_manifest(out).cache.local_layers == (0, 2)
    why = why_not_here(case)
    if why is not None:
        pytest.skip(f"{backend}: the {case.kind.value} engine cannot run here: {why}")
    folder = art
    if case.profile is not None:
        tmp = tmp_path_factory.mktemp("local-build")
        profile = load_profile(static_profile(tmp) if case.profile == HOST_STATIC else case.profile)
        folder = build_artifact(art, profile, tmp / "out", **dict(case.options))
    dec = Decoder(folder)
    assert type(dec.backend).kind is case.kind and dec.device == case.device and dec.layout.local_layers == (0, 2)
    if case.kind is BackendKind.QNN_HTP:  # the sessions say what really runs: the HTP, CPU fallback off
        for session in (dec.backend.graphs.prefill, dec.backend.graphs.decode):
            assert session.get_providers()[0] == "QNNExecutionProvider", session.get_providers()
            assert session.get_session_options().get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    ids, expected = stream
    got, pos = [], 0
    for n, pin in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            got.append(dec.step(ids[start : min(start + LAYOUT["chunk"], pos + n)], pin=pin).copy())
        pos += n
    assert dec.cache.seen > 8 * W and dec.cache.evicted > 8 * LAYOUT["window"]  # rings and window turned over
    if case.fp16_compute:
        worst, median, top1 = relative_errors(got, expected)
        assert worst <= FP16_COMPUTE[0] and median <= FP16_COMPUTE[1] and top1 >= FP16_COMPUTE[2], (backend, worst, median, top1)
        return
    errors = np.array([float(np.abs(g - e).max()) for g, e in zip(got, expected)])
    every, mean = TOLERANCE[dec.manifest.cache.kv_dtype]
    assert errors.max() < every and errors.mean() < mean, (backend, errors.max(), errors.mean())


def test_the_reference_can_tell_rings_from_a_uniform_cache(gemma, stream):
    """The comparison above can fail: the same stream with the local layers on the slot map differs."""
    ids, expected = stream
    ref = StreamingReference(gemma.model, sink=LAYOUT["sink"], window=LAYOUT["window"], local=False)
    got, pos = [], 0
    for n, pin in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            got.append(ref.feed(ids[start : min(start + LAYOUT["chunk"], pos + n)].tolist(), pin=pin).numpy())
        pos += n
    assert max(float(np.abs(g - e).max()) for g, e in zip(got, expected)) > 1.0


# -- sessions and drafting through ring turnover --------------------------------------------------

TURNS = ["check the route and the weather", "check the route and the weather again", "play some music",
         "how far is it to the charging station", "check the route", "thanks, check the route and the weather"]  # fmt: skip


def dialogue(folder, spec: bool = False) -> Dialogue:
    dec, tok = open_artifact(folder, verify=False)
    return Dialogue(dec, tok, system="Answer briefly.", max_new_tokens=12, drafting=PromptLookupDrafting() if spec else None)


@pytest.fixture(scope="module")
def builds(gemma, export_to, tmp_path_factory):
    art = export_to(gemma, kv="int8", sink=4, pinned=60, window=96, chunk=8)
    fused = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("local-fused") / "out", attention="fused")
    return {"onnxruntime-graph": art, "onnxruntime-fused": fused}


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_a_resumed_session_continues_the_rings_exactly(backend, builds, tmp_path):
    whole = dialogue(builds[backend])
    expected = [whole.ask(t).reply for t in TURNS]
    assert whole.decoder.cache.seen > 3 * W
    first = dialogue(builds[backend])
    for t in TURNS[:3]:
        first.ask(t)
    save_session(tmp_path / "s", first)
    resumed = dialogue(builds[backend])
    load_session(tmp_path / "s", resumed)
    for name, buf in first.decoder.backend.buffers().items():
        assert np.array_equal(resumed.decoder.backend.buffers()[name], buf), name
    assert [resumed.ask(t).reply for t in TURNS[3:]] == expected[3:]


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_greedy_drafting_past_ring_turnover_gives_the_plain_replies(backend, builds):
    """The exported graph verifies drafts row by row: each row's ring mask is its own window, so a
    verified draft is what plain decoding computes, rings turned over or not. The fused build runs a
    verification's rows as one-token steps (each row's ring slot, kernels/int8_kv_attention.cc), so
    it goes on drafting after the window and the rings have turned over."""
    folder = builds[backend]
    plain, spec = dialogue(folder), dialogue(folder, spec=True)
    expected = [plain.ask(t).reply for t in TURNS * 2]
    results, turned = [], []
    for t in TURNS * 2:
        turned.append(spec.decoder.cache.evicted > 0)
        results.append(spec.ask(t))
    assert [r.reply for r in results] == expected
    assert sum(r.drafted_tokens for r in results) > 0
    if backend == "onnxruntime-fused":
        assert spec.decoder.backend.verifies_after_turnover and spec.decoder.backend.rows_match_steps
        assert sum(r.drafted_tokens for r, t in zip(results, turned) if t) > 0


def test_fused_chunk_rows_are_its_steps_after_the_rings_turn_over(builds):
    """Bit for bit, with the rings and the window turned over: each row of a verification chunk is
    the one-token step it stands for, and a partly accepted chunk leaves the rings and every slot in
    use as plain steps do."""
    folder = builds["onnxruntime-fused"]
    rng = np.random.default_rng(4)
    steps, chunks = Decoder(folder), Decoder(folder)
    for d in (steps, chunks):
        d.feed(np.arange(3, 13), pin=True)
        d.feed(np.arange(20, 130))  # past the rings (w) and the window (96)
    assert chunks.cache.evicted > 0 and chunks.cache.seen > 2 * W
    for it in range(40):
        n = int(rng.integers(2, 9))
        ids = rng.integers(3, 300, n)
        one = np.stack([steps.step(ids[i : i + 1])[0].copy() for i in range(n)])
        k = n if it % 3 == 0 else int(rng.integers(1, n))
        rows, kept = chunks.verify(ids, lambda logits: k)
        assert kept == k and np.array_equal(rows, one), it
        for i in range(k, n):
            chunks.step(ids[i : i + 1])
        used = np.flatnonzero(steps.cache.slot_token >= 0)
        for name, buf in steps.backend.buffers().items():
            other = chunks.backend.buffers()[name]
            if name in ("keys", "values"):
                buf, other = buf[:, :, used], other[:, :, used]
            elif name.startswith("local_"):
                buf, other = buf[:, :, :W], other[:, :, :W]  # the ring (scratch rows after it)
            np.testing.assert_array_equal(buf, other, err_msg=f"{name} after chunk {it}")
