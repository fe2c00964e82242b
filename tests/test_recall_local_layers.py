"""The recall region on a model with sliding-window (local) layers (docs/design.md, "The recall region",
and "Layers with their own sliding window"). A tiny random Gemma 3 (conftest.make_tiny_model: local
layers of window 20 around a global one): each local layer keeps its ring of w slots and R slots of
its own for the region, after the ring; a recalled chunk sees there the region's earlier tokens and
itself only, a stream chunk the ring only, and the ring counts the stream's tokens but the recalled
ones, so a refresh moves no ring slot.

  * the bookkeeping against plain lists (numpy, no graph);
  * every engine that runs here against the independent streaming reference (tests/reference.py, its
    local region written from the rules), over the stream of tests/test_recall_cache.py: three regions
    of three lengths, hundreds of evictions, the rings turned over many times;
  * that the comparison is sharp (window tokens let see the region in a local layer are far off);
  * verified drafts as one-token steps on the fused build, session files, `cabinlm plan --recall`;
  * the TensorRT backend's host side on a fake engine against ONNX Runtime on the same graph (the HTP
    builds in Qualcomm's simulator: tests/test_qnn_recall.py).
"""

from __future__ import annotations


import numpy as np
import pytest
from conftest import make_tiny_model
from test_backends import TOLERANCE
from test_recall_cache import CASES, LAYOUT, STREAM, assert_verified_rows_are_steps, engine_artifacts, feeds, run_stream

from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.slot_state import StateError, check_state
from cabinlm.contract.slots import SlotTable
from cabinlm.engines.build import build_artifact
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder
from reference import StreamingReference
from test_tensorrt_backend import fake_tensorrt  # noqa: F401 (a fixture)

W = 20  # the tiny Gemma's sliding window


# -- the bookkeeping, in numpy ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_a_region_goes_beside_the_rings_and_moves_no_ring_slot(seed):
    lay = CacheLayout(sink=2, pinned=4, window=9, chunk=4, layers=3, kv_heads=1, head_dim=8, local_window=7,
                      local_layers=(0, 2), recall=16)  # fmt: skip
    w, R = lay.local_window, lay.recall
    assert lay.local_slots == w + R and lay.local_buffer_shape == (2, 1, w + R, 8)
    table, rng = SlotTable(lay), np.random.default_rng(seed)
    stream: list[int] = []  # local indices of the stream's tokens (every token but the recalled ones)
    region = 0  # the current region's tokens
    table.advance(table.plan(2))
    stream += [0, 1]
    for _ in range(80):
        n = int(rng.integers(1, lay.chunk + 1))
        recalled = rng.random() < 0.25
        if recalled and rng.random() < 0.3:
            table.begin_recall()
            region = 0
        if recalled and region + n > R:
            recalled = False
        plan = table.plan(n, "recall" if recalled else False)
        ring = plan.local_ring_token
        held = stream[-w:]
        assert sorted(ring[ring >= 0].tolist()) == held  # the ring: the stream's last w tokens, recalled ones aside
        mask = plan.local_attention_mask
        assert mask.shape == (n, w + R + n)
        assert (mask[:, w + R :] == 0).tolist() == [[j <= i for j in range(n)] for i in range(n)]
        if recalled:  # the region's slots after the ring; its earlier tokens only, at their ranks in the region
            assert plan.local_slots.tolist() == list(range(w + region, w + region + n))
            assert (mask[:, :w] != 0).all() and (mask[:, w : w + region] == 0).all() and (mask[:, w + region : w + R] != 0).all()
            assert plan.local_position_ids.tolist() == list(range(region, region + n))
            assert plan.local_cache_position_ids[w : w + region].tolist() == list(range(region))
            assert plan.local_extent == w + region and plan.local_index == region
            region += n
        else:  # the ring alone, within each token's window
            assert plan.local_slots.tolist() == [(len(stream) + i) % w for i in range(n)]
            assert (mask[:, w : w + R] != 0).all()
            for i in range(n):
                me = len(stream) + i
                assert {int(ring[s]) for s in range(w) if mask[i, s] == 0} == {t for t in held if me - t < w}
            assert plan.local_position_ids.tolist() == list(range(len(held), len(held) + n))
            assert plan.local_extent == (w + region if region else len(held)) and plan.local_index == len(stream)
            stream += list(range(len(stream), len(stream) + n))
        table.advance(plan)
        assert table.local_seen == len(stream) and table.recall_fill == region


def test_the_global_layers_attend_densely_while_the_stream_fits():
    """Rule 5 for the global layers, local layers beside them: while the stream fits, every chunk's
    global-layer query sees every cached token at the rank the dense sequence (sinks, pinned spans,
    recalled text, window) gives it, the region's chunk all but the window; the local layers' facts
    (the test above) leave the global layers' untouched."""
    lay = CacheLayout(sink=2, pinned=4, window=16, chunk=4, layers=3, kv_heads=1, head_dim=8, local_window=7,
                      local_layers=(0, 2), recall=16)  # fmt: skip
    table = SlotTable(lay)
    order: dict[str, list[int]] = {"sink": [], "pin": [], "recall": [], "win": []}  # stream indices by region
    for n, where in ((2, "sink"), (3, "pin"), (4, "recall"), (2, "recall"), (4, "win"), (1, "win"), (3, "win"), (4, "win")):
        if where == "recall" and not order["recall"]:
            table.begin_recall()
        plan = table.plan(n, {"pin": True, "recall": "recall"}.get(where, False))
        dense = order["sink"] + order["pin"] + order["recall"] + ([] if where == "recall" else order["win"])
        assert plan.position_ids.tolist() == list(range(len(dense), len(dense) + n))
        for slot, t in enumerate(plan.slot_token.tolist()):
            seen = plan.attention_mask[:, slot] == 0
            if t in dense:
                assert plan.cache_position_ids[slot] == dense.index(t) and seen.all(), (where, slot)
            else:
                assert not seen.any(), (where, slot)
        order[where] += list(range(table.seen, table.seen + n))
        table.advance(plan)
    assert table.evicted == 0 and table.local_seen == table.seen - 6


def test_a_saved_state_with_a_wrong_local_count_is_refused():
    lay = CacheLayout(sink=2, pinned=4, window=8, chunk=4, layers=3, kv_heads=1, head_dim=8, local_window=7,
                      local_layers=(0, 2), recall=16)  # fmt: skip
    table = SlotTable(lay)
    table.advance(table.plan(4))
    table.begin_recall()
    table.advance(table.plan(3, "recall"))
    table.advance(table.plan(4))
    state = table.state()
    assert state.local_seen == 8 and state.seen == 11
    check_state(state, lay)
    for bad in (11, 9, 3):  # no recalled token, fewer recalled than the region holds, fewer than the cache's stream tokens
        with pytest.raises(StateError, match="local"):
            check_state(type(state)(**{**state.__dict__, "local_seen": bad}), lay)
    older = type(state)(**{**state.__dict__, "local_seen": -1})  # a file written before the count: every token but the region's
    assert older.counters()["local_seen"] == 8


# -- every engine against the reference --------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(load, tmp_path_factory):
    return load(str(make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3-recall"), "gemma3")))


def reference_stream(model, ids: np.ndarray) -> list[np.ndarray]:
    ref = StreamingReference(model, sink=LAYOUT["sink"], window=LAYOUT["window"], local=True)
    out = []
    for chunk, where, first in feeds(ids):
        if where == "recall" and first:
            ref.begin_recall()
        out.append(ref.feed(chunk.tolist(), pin=where == "pin", recall=where == "recall").numpy())
    return out


@pytest.fixture(scope="module")
def stream(gemma):
    ids = np.random.default_rng(11).integers(3, 300, sum(n for n, _ in STREAM))
    return ids, reference_stream(gemma.model, ids)


@pytest.fixture(scope="module")
def artifacts(gemma, export_to, tmp_path_factory):
    return engine_artifacts(gemma, export_to, tmp_path_factory.mktemp("recall-local"))


def errors_over_the_stream(dec: Decoder, ids: np.ndarray, expected: list[np.ndarray]) -> np.ndarray:
    got = run_stream(dec, ids)
    assert dec.cache.local_seen == dec.cache.seen - (10 + 3 + 16) and dec.cache.local_seen > 8 * W
    return np.array([float(np.abs(g - e).max()) for g, e in zip(got, expected)])


@pytest.mark.parametrize("label", list(CASES))
def test_every_engine_follows_the_reference_with_a_region_beside_the_rings(label, artifacts, stream):
    ids, expected = stream
    dec = Decoder(artifacts(label))
    assert dec.layout.local_layers == (0, 2) and dec.layout.local_slots == W + LAYOUT["recall"]
    errors = errors_over_the_stream(dec, ids, expected)
    every, mean = TOLERANCE[dec.manifest.cache.kv_dtype]
    assert errors.max() < every and errors.mean() < mean, (label, errors.max(), errors.mean())


def test_the_reference_tells_window_tokens_that_see_the_region_in_a_local_layer(artifacts, stream, monkeypatch):
    """The comparison above is sharp: the exported graph's local layers letting the window's tokens see
    the region (the other rule one could write) land far from the reference."""
    from cabinlm.contract.slots import StepPlan

    right = StepPlan.local_attention_mask.func

    def sees_region(self):
        mask = right(self)
        if self.pin != "recall":
            mask[:, W : W + self.recall_fill] = 0
        return mask

    ids, expected = stream
    monkeypatch.setattr(StepPlan, "local_attention_mask", property(sees_region))
    errors = errors_over_the_stream(Decoder(artifacts("graph")), ids, expected)
    assert errors.max() > 0.05, errors.max()


def test_with_an_empty_region_the_rings_are_the_plain_rings(gemma, artifacts, export_to):
    """Rule 5: a layout with a region, none fed, computes what one without a region computes (the
    local layers' region slots masked), through ring turnover and eviction."""
    ids = np.random.default_rng(5).integers(3, 300, 90)
    plain = Decoder(export_to(gemma, kv="fp32", **{**LAYOUT, "recall": 0}))
    region = Decoder(artifacts("graph"))
    for dec in (plain, region):
        dec.feed(ids[:6], pin=True)
    for i in range(6, 90, 3):
        a, b = plain.step(ids[i : i + 3]), region.step(ids[i : i + 3])
        assert np.abs(a - b).max() < 1e-5, i


def test_verified_rows_are_one_token_steps_with_a_region_beside_the_rings(artifacts, stream):
    """cabinlm's kernel runs a verified chunk's rows as one-token steps on the rings too (each row's
    ring slot, the region masked): with recalled text cached and the rings and window turned over,
    each row is bit for bit the step a plain decode takes."""
    ids, _ = stream
    assert_verified_rows_are_steps(artifacts("fused int8"), ids)


def test_plan_counts_the_local_layers_region(tmp_path_factory):
    """`cabinlm plan --recall R` lays a local model's region out as `cabinlm export --recall R` does: R
    slots in the global layers' slot map and R beside each local layer's ring, in the KV bytes and the line."""
    import json

    from test_cli import cabinlm

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3-plan"), "gemma3")
    args = ("plan", folder, "--window", "64", "--sink", "4", "--pinned", "16", "--chunk", "8")
    plain, region = (json.loads(cabinlm(*args, *extra, "--json").stdout) for extra in ((), ("--recall", "32")))
    assert region["recall"] == 32 and region["local_layers"] == 2 and region["local_window"] == W
    lay = CacheLayout(sink=4, pinned=16, window=64, chunk=8, layers=3, kv_heads=2, head_dim=32, kv_dtype=region["kv"],
                      local_window=W, local_layers=(0, 2), recall=32)  # the tiny Gemma's heads  # fmt: skip
    assert region["kv_bytes"] - plain["kv_bytes"] == 32 * lay.layer_bytes_per_token * 3  # the global layer's and both local ones
    assert f"rings of {W} + 32 recalled" in cabinlm(*args, "--recall", "32").stdout


@pytest.mark.parametrize("backend", ["onnxruntime-graph", "onnxruntime-fused"])
def test_a_resumed_session_with_a_region_continues_exactly(backend, gemma, export_to, tmp_path):
    """A session file carries the local count (the rings' slots follow it): a dialogue whose region was
    filled, saved and resumed, replies as the one never interrupted, its buffers equal."""
    from test_local_layers import TURNS, dialogue

    from cabinlm.runtime.persist import load_session, save_session

    art = export_to(gemma, kv="int8", sink=4, pinned=60, window=96, chunk=8, recall=128)
    if backend == "onnxruntime-fused":
        art = build_artifact(art, load_profile("cpu"), tmp_path / "fused", attention="fused")
    turns = TURNS * 2
    whole = dialogue(art)
    expected = [whole.ask(t).reply for t in turns]
    cache = whole.decoder.cache
    assert cache.recalls >= 1 and cache.seen - cache.local_seen >= cache.recall_fill > 0 and cache.local_seen > 3 * W
    first = dialogue(art)
    for t in turns[:5]:
        first.ask(t)
    assert first.decoder.cache.local_seen < first.decoder.cache.seen
    save_session(tmp_path / "s", first)
    resumed = dialogue(art)
    load_session(tmp_path / "s", resumed)
    assert resumed.decoder.cache.local_seen == first.decoder.cache.local_seen
    for name, buf in first.decoder.backend.buffers().items():
        assert np.array_equal(resumed.decoder.backend.buffers()[name], buf), name
    assert [resumed.ask(t).reply for t in turns[5:]] == expected[5:]


def test_the_tensorrt_backend_runs_the_region_beside_the_rings_as_onnxruntime_runs_the_same_graph(
        gemma, export_to, tmp_path, fake_tensorrt):  # fmt: skip
    """A TensorRT build takes the exported graph with the slot table's ranks and masks as inputs, the local
    layers' too (StepPlan.local_*), and commits each local layer's new K/V into its w + R slots at
    StepPlan.local_slots (the ring's or the region's): the region beside the rings is the bookkeeping alone.
    On the CPU, against a fake engine that runs the bundle's graph (tests/test_tensorrt_backend.py: what it
    can and cannot show), the backend's host side gives, over the stream above, the logits ONNX Runtime gives
    on the same graph (held to the reference above); TensorRT's own kernels need a GPU."""
    from test_tensorrt_backend import fake_engine_build, onnxruntime_manifest

    out = fake_engine_build(export_to(gemma, kv="fp16", index_dtype="int32", **LAYOUT), tmp_path / "orin-x")
    dec = Decoder(out)
    assert dec.device == "tensorrt-cuda" and dec.layout.local_slots == W + LAYOUT["recall"]
    ids = np.random.default_rng(11).integers(3, 300, sum(n for n, _ in STREAM))
    got, want = run_stream(dec, ids), run_stream(Decoder(out, onnxruntime_manifest(out)), ids)
    assert dec.cache.local_seen == dec.cache.seen - (10 + 3 + 16) and dec.cache.local_seen > 8 * W
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) < 1e-4
