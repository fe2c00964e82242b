"""The recall region on every engine that runs here (docs/design.md, "The recall region"), against the
independent streaming reference (tests/reference.py): the region's chunks see the sink, the pinned
spans and the region's own earlier tokens, never the window; their positions are their ranks, and the
window's ranks follow the region's length. The stream below refreshes the region three times with
three lengths (so the window's ranks move up and down), with hundreds of evictions between, and
single-token decode after each refresh (bound once in the fused backend).

Engines: the exported graph on ONNX Runtime (pure bookkeeping: slots.py), the static pair, the fused
cpu build over fp32 KV (GroupQueryAttention: the region's keys refreshed with the pinned ones) and
over int8 KV (cabinlm's kernel: the region's keys rotated from their float copies per row, chunks
run as one-token steps when drafts are verified); the TensorRT backend's host side on a fake engine.
The HTP builds in Qualcomm's simulator: tests/test_qnn_recall.py; a camera frame with a region:
tests/test_vlm_recall.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cabinlm.engines.build import build_artifact
from cabinlm.engines.ort_fused.kernels import compiler
from cabinlm.contract.errors import InputError
from cabinlm.contract.layout import CacheLayout, KVDType, LayoutError
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder
from reference import StreamingReference
from test_backends import TOLERANCE, static_profile
from test_tensorrt_backend import fake_tensorrt  # noqa: F401 (a fixture)

# TOLERANCE: tests/test_backends.py's (fp32 rounding; int8 KV's rounding, measured there). On this stream
# the fused int8 build's logits are 0.84 (every feed) and 0.22 (mean) from the reference; the window keys
# rotated as if the region did not move their ranks give 4.9 and 0.75 (the test below).

LAYOUT = dict(sink=2, pinned=8, recall=16, window=16, chunk=4)

# (token count, where): "pin" the pinned system prompt, "win" window tokens, "recall" a new region's
# text (begin_recall first; fed in chunks), with decode (single tokens) between.
STREAM = ([(6, "pin"), (11, "win")] + [(1, "win")] * 30 + [(10, "recall"), (7, "win")] + [(1, "win")] * 60
          + [(3, "recall")] + [(1, "win")] * 40 + [(9, "win"), (16, "recall"), (5, "win")] + [(1, "win")] * 20)  # fmt: skip

CASES = {
    "graph": ("fp32", None, ()),
    "static": ("fp32", "static", ()),
    "fused fp32": ("fp32", "cpu", (("attention", "fused"), ("accuracy_level", 0), ("attention_kernel", "onnxruntime"))),
    "fused fp32 kernel": ("fp32", "cpu", (("attention", "fused"), ("accuracy_level", 0), ("attention_kernel", "cabinlm"))),
    "fused int8": ("int8", "cpu", (("attention", "fused"), ("accuracy_level", 0))),
}


def feeds(ids: np.ndarray):
    """(chunk ids, where, first chunk of its feed) over STREAM, in chunks of at most `chunk` tokens."""
    pos = 0
    for n, where in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            yield ids[start : min(start + LAYOUT["chunk"], pos + n)], where, start == pos
        pos += n


@pytest.fixture(scope="module")
def stream(load, tiny_llama_dir):
    loaded = load(str(tiny_llama_dir))
    ids = np.random.default_rng(11).integers(3, 300, sum(n for n, _ in STREAM))
    ref = StreamingReference(loaded.model, sink=LAYOUT["sink"], window=LAYOUT["window"])
    expected = []
    for chunk, where, first in feeds(ids):
        if where == "recall" and first:
            ref.begin_recall()
        expected.append(ref.feed(chunk.tolist(), pin=where == "pin", recall=where == "recall").numpy())
    return loaded, ids, expected


def engine_artifacts(loaded, export_to, tmp: Path):
    """label -> the artifact CASES[label] names for `loaded` (exported with LAYOUT, built once)."""
    made: dict[str, Path] = {}

    def get(label: str) -> Path:
        kv, profile, options = CASES[label]
        if "fused" in label and options[-1][-1] != "onnxruntime" and compiler.unavailable() is not None:
            pytest.skip(f"cabinlm's attention kernel cannot be compiled here: {compiler.unavailable()}")
        if label not in made:
            art = export_to(loaded, kv=kv, **LAYOUT)
            if profile is None:
                made[label] = art
            else:
                prof = load_profile(static_profile(tmp) if profile == "static" else profile)
                made[label] = build_artifact(art, prof, tmp / label.replace(" ", "-"), **dict(options))
        return made[label]

    return get


@pytest.fixture(scope="module")
def artifacts(stream, export_to, tmp_path_factory):
    return engine_artifacts(stream[0], export_to, tmp_path_factory.mktemp("recall"))


def run_stream(dec: Decoder, ids: np.ndarray) -> list[np.ndarray]:
    got = []
    for chunk, where, first in feeds(ids):
        if where == "recall" and first:
            dec.cache.begin_recall()
        pin = {"pin": True, "recall": "recall"}.get(where, False)
        got.append(dec.step(chunk, pin=pin).copy())
    assert dec.cache.evicted > 6 * LAYOUT["window"] and dec.cache.recall_fill == 16 and dec.cache.recalls == 3
    return got


@pytest.mark.parametrize("label", list(CASES))
def test_every_engine_follows_the_reference_with_a_recall_region(label, artifacts, stream):
    _, ids, expected = stream
    dec = Decoder(artifacts(label))
    assert dec.layout.recall == LAYOUT["recall"]
    errors = np.array([float(np.abs(g - e).max()) for g, e in zip(run_stream(dec, ids), expected)])
    every, mean = TOLERANCE[dec.manifest.cache.kv_dtype]
    assert errors.max() < every and errors.mean() < mean, (label, errors.max(), errors.mean())


def test_the_reference_tells_a_region_that_sees_the_window(artifacts, stream, monkeypatch):
    """The comparison above is sharp: the graph's region let see the window is far from the reference."""
    from cabinlm.contract.slots import StepPlan

    _, ids, expected = stream
    right = StepPlan.attention_mask.func

    def sees_window(self):
        pin, self.pin = self.pin, False
        try:
            return right(self)
        finally:
            self.pin = pin

    monkeypatch.setattr(StepPlan, "attention_mask", property(sees_window))
    dec = Decoder(artifacts("graph"))
    errors = np.array([float(np.abs(g - e).max()) for g, e in zip(run_stream(dec, ids), expected)])
    assert errors.max() > 0.05, errors.max()


def test_the_int8_tolerance_fails_window_keys_that_ignore_the_region(artifacts, stream, monkeypatch):
    """The fused build rotates each key once at rank + O, O = E - r (StepPlan.offset): with O = E (the
    region's length left out) the window keys sit at the wrong distances, far outside the int8 tolerance."""
    from cabinlm.contract.slots import StepPlan

    _, ids, expected = stream
    folder = artifacts("fused int8")
    monkeypatch.setattr(StepPlan, "offset", property(lambda self: self.evicted))
    monkeypatch.setattr(StepPlan, "row_offset", property(lambda self: self.row_evicted))
    errors = np.array([float(np.abs(g - e).max()) for g, e in zip(run_stream(Decoder(folder), ids), expected)])
    every, mean = TOLERANCE[KVDType.INT8]
    assert errors.max() > 2 * every and errors.mean() > 1.5 * mean, (errors.max(), errors.mean())


def test_dense_while_the_stream_fits(stream):
    """Rule 5: while the stream fits, a cache whose region holds recalled text is dense attention over
    (sinks, pinned spans, recalled text, window) fed in that order: the region refreshed before any
    window token, the reference's logits are a plain causal pass over that sequence."""
    import torch

    loaded = stream[0]
    ids = np.random.default_rng(3).integers(3, 300, 6 + 9 + 10)
    ref = StreamingReference(loaded.model, sink=LAYOUT["sink"], window=LAYOUT["window"])
    ref.feed(ids[:6].tolist(), pin=True)
    ref.begin_recall()
    ref.feed(ids[6:10].tolist(), recall=True)
    ref.feed(ids[10:15].tolist(), recall=True)
    got = ref.feed(ids[15:].tolist()).numpy()
    with torch.no_grad():
        dense = loaded.model(torch.tensor(ids[None])).logits[0, 15:].numpy()
    assert np.abs(got - dense).max() < 2e-4


def test_the_layout_refuses_what_a_region_cannot_go_with():
    base = dict(sink=2, pinned=4, window=8, chunk=4, layers=2, kv_heads=1, head_dim=8)
    lay = CacheLayout(**base, recall=16)
    assert lay.slots == 2 + 4 + 16 + 8 and lay.recall_start == 6 and lay.window_start == 22
    assert CacheLayout(**base).recall == 0  # an older manifest's cache: no "recall" key
    assert CacheLayout(**base, image=4, recall=16).window_start == 2 + 4 + 4 + 16  # a frame goes with a region
    local = CacheLayout(**base, recall=16, local_window=4, local_layers=(0,))  # the region beside the ring
    assert local.local_slots == 4 + 16 and local.local_ring_bytes == (4 + 16) * local.layer_bytes_per_token
    for bad, word in ((dict(sink=0), "sink"),):
        with pytest.raises(LayoutError, match=word):
            CacheLayout(**{**base, **bad, "recall": 16})
    with pytest.raises(LayoutError, match="recall"):
        CacheLayout(**base, recall=-1)
    with pytest.raises(LayoutError, match="multiple of 16; give --recall 16"):
        CacheLayout(**base, recall=6)


def test_a_region_too_long_or_before_the_sink_is_refused():
    from cabinlm.contract.slots import SlotTable

    table = SlotTable(CacheLayout(sink=2, pinned=4, window=8, chunk=4, layers=1, kv_heads=1, head_dim=8, recall=16))
    with pytest.raises(ValueError, match="after the sink"):
        table.plan(2, pin="recall")
    table.advance(table.plan(2))
    table.begin_recall()
    for _ in range(3):
        table.advance(table.plan(4, pin="recall"))
    table.advance(table.plan(3, pin="recall"))
    with pytest.raises(InputError, match="recall region has 1 free"):
        table.plan(2, pin="recall")
    assert table.length == 17 and table.extent == 2 + 4 + 15
    with pytest.raises(ValueError, match="no recall region"):
        SlotTable(CacheLayout(sink=2, pinned=4, window=8, chunk=4, layers=1, kv_heads=1, head_dim=8)).begin_recall()


def test_kv_types_here():
    assert {c[0] for c in CASES.values()} <= {k.value for k in KVDType}


def test_verified_rows_are_one_token_steps_with_a_region(artifacts, stream):
    """cabinlm's kernel runs a verified chunk's rows as one-token steps (StepPlan.steps): with recalled
    text cached and the window turned over, each row is bit for bit the step a plain decode takes."""
    _, ids, _ = stream
    assert_verified_rows_are_steps(artifacts("fused int8"), ids)


def assert_verified_rows_are_steps(folder: Path, ids: np.ndarray) -> None:
    """Two seats fed STREAM; one verifies a 4-token draft, the other takes it as one-token steps: each
    verified row is the step's logits bit for bit, and so is the step after."""
    one, chunked = Decoder(folder), Decoder(folder)
    run_stream(one, ids)
    run_stream(chunked, ids)
    assert chunked.backend.verifies_after_turnover and chunked.draft_room() == LAYOUT["chunk"] - 1
    draft = np.array([17, 42, 99, 5], dtype=np.int64)
    rows, kept = chunked.verify(draft, lambda logits: len(draft))
    steps = [one.step(draft[i : i + 1]).copy()[-1] for i in range(len(draft))]
    assert kept == len(draft)
    for i in range(len(draft)):
        assert np.array_equal(rows[i], steps[i]), i
    assert np.array_equal(chunked.step(draft[:1]), one.step(draft[:1]))


def test_plan_counts_the_region(tiny_llama_dir):
    """`cabinlm plan --recall R` lays the region out as `cabinlm export --recall R` does: its slots in the
    KV line and the JSON, the window searched with them taken; a bad R is one line, as export says it."""
    import json

    from test_cli import assert_clean_error, cabinlm

    plain, region = (json.loads(cabinlm("plan", tiny_llama_dir, *extra, "--json").stdout)
                     for extra in ((), ("--recall", "64")))  # fmt: skip
    assert region["recall"] == 64 and plain["recall"] == 0
    assert region["window"] + 64 <= plain["window"]  # the model's positions hold the region too
    assert "+64+" in cabinlm("plan", tiny_llama_dir, "--recall", "64").stdout  # sink+pinned+recall+window slots
    assert_clean_error(cabinlm("plan", tiny_llama_dir, "--recall", "40"), "multiple of 16", "--recall 48")
    # a region the model's 512 positions cannot hold beside a window: the largest that fits, a multiple of 16
    assert_clean_error(cabinlm("plan", tiny_llama_dir, "--recall", "4000"), "give --recall 256 or less")
    assert_clean_error(cabinlm("export", tiny_llama_dir, "-o", "never", "--recall", "4000"), "give --recall")


def test_the_tensorrt_backend_runs_the_region_as_onnxruntime_runs_the_same_graph(stream, export_to, tmp_path,
                                                                                 fake_tensorrt):
    """A TensorRT build takes the exported graph (un-rotated keys, the slot table's ranks and mask as inputs), so
    the region is the bookkeeping alone there too. On the CPU, against a fake engine that runs the bundle's graph
    (tests/test_tensorrt_backend.py: what it can and cannot show), the TensorRT backend's host side gives, over
    the stream above, the logits ONNX Runtime gives on the same graph (whose export the tests above hold to the
    reference); TensorRT's own kernels need a GPU."""
    from test_tensorrt_backend import fake_engine_build, onnxruntime_manifest

    loaded, ids, _ = stream
    art = export_to(loaded, kv="fp16", index_dtype="int32", **LAYOUT)
    out = fake_engine_build(art, tmp_path / "orin-x")
    dec = Decoder(out)
    assert dec.device == "tensorrt-cuda" and dec.layout.recall == LAYOUT["recall"]
    got, want = run_stream(dec, ids), run_stream(Decoder(out, onnxruntime_manifest(out)), ids)
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) < 1e-4


def test_a_span_pinned_after_window_tokens_is_refused_where_keys_are_rotated(artifacts, stream):
    """With a region the window ranks after every pinned token, so a span pinned after window tokens raises the
    window's ranks: the exported graph follows the reference there (it rotates every key at its rank each step),
    a build that rotates window keys once is refused in one line, its cache untouched (O counts the frame and the
    region, not late pins: followed, its logits would be 3.3 away)."""
    loaded, ids, _ = stream
    ref = StreamingReference(loaded.model, sink=LAYOUT["sink"], window=LAYOUT["window"])
    feeds = [(ids[:6], True), (ids[6:10], False), (ids[10:26], "recall"), (ids[26:28], True), (ids[28:30], False)]
    decs = [Decoder(artifacts("graph")), Decoder(artifacts("fused fp32"))]
    for chunk, pin in feeds:
        if pin == "recall":
            ref.begin_recall()
            for d in decs:
                d.cache.begin_recall()
        want = ref.feed(chunk.tolist(), pin=pin is True, recall=pin == "recall").numpy()
        assert np.abs(decs[0].feed(chunk, pin=pin, all_logits=True) - want).max() < 2e-3
        if pin is True and decs[1].cache.window_fill:
            seen = decs[1].cache.seen
            with pytest.raises(InputError, match="pinned after window tokens .* pin spans before any window token") as e:
                decs[1].feed(chunk, pin=True)
            assert "\n" not in str(e.value) and decs[1].cache.seen == seen
        else:
            decs[1].feed(chunk, pin=pin)
