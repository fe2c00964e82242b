"""The recall region (docs/design.md, "The recall region") on the HTP builds, compiled by Qualcomm's compiler for
sa8295p (v68: one binary per graph, no weight-sharing twin to compile) and run in its x86 simulator, over
tests/test_recall_cache.py's stream: the region refilled three times with three lengths (the window's ranks moving
up and down), hundreds of evictions between, decode after each refill.

    fp16 KV   keys un-rotated in the cache, rotated in the graph at the slot table's ranks: the region is the
              bookkeeping alone (its chunk's mask, the window's ranks after it)
    int8 KV   the uint8 cache with keys rotated once, when written, at rank + O (O = E - r, StepPlan.offset): the
              region's keys' fp16 copy kept in key_source after the pinned ones and re-rotated at rank + O with
              them (engines/onnxruntime/rotated.RotatedKeys, shared with the fused cpu build)

Tolerances are test_qnn's (fp16 against the CPU running the same export) and test_qnn_kv8's (the uint8 cache against
the CPU's float32-KV export, and loosely against the CPU's int8 export). Measured over this stream (170 feeds), as
(worst, median) of a feed's max |logit error| / max |logit|, and top-1 agreement:

    HTP fp16 KV                     vs the CPU, the same export            0.043 / 0.010 / 98%
    HTP uint8 cache, rotated keys   vs the CPU float32-KV export           0.080 / 0.026 / 97%
                                    vs the CPU int8 export                 0.44  / 0.071 / 88%
    the same, window keys at O = E  vs the CPU float32-KV export           1.57  / 0.039 / 81%   (the test's teeth)
    HTP fp16 KV, the region's chunks seeing the window, vs the CPU         1.58  / 0.19  / 73%   (measured once)
    (the CPU int8 export vs its float32-KV twin: 0.41 / 0.064 / 90%)

Time on 2 cores: the two builds about 20 s, each stream in the simulator 13 to 17 s.

A model with sliding-window (local) layers (the tiny Gemma 3, below): its HTP builds keep un-rotated keys, fp16 or
uint8, so the region beside the rings is the bookkeeping alone. Over a short stream (50 feeds, two regions):

    HTP fp16 KV                     vs the CPU, the same export            0.014 / 0.006 / 98%
    HTP uint8 cache                 vs the CPU float32-KV export           0.052 / 0.026 / 98%
                                    vs the CPU int8 export                 0.16  / 0.041 / 92%
    HTP fp16 KV, window tokens seeing the region in a local layer          1.07  / 0.36  / 74%   (the test's teeth)

Time on 2 cores: the exports, two builds and streams about 40 s.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from cabinlm.engines.build import build_artifact
from cabinlm.contract.layout import KVDType
from cabinlm.contract.manifest import load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder

try:
    import onnxruntime_qnn  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("onnxruntime-qnn (the `qnn` extra) is not installed: `pip install 'cabinlm[qnn]'`", allow_module_level=True)

from test_qnn import EXACT, agreement, close  # noqa: E402
from test_qnn_kv8 import FLOAT, SAME_EXPORT  # noqa: E402
from test_qnn_kv8 import close as close_kv8  # noqa: E402
from test_recall_cache import LAYOUT, STREAM, run_stream  # noqa: E402


def stream_ids() -> np.ndarray:
    return np.random.default_rng(13).integers(3, 300, sum(n for n, _ in STREAM))


@pytest.fixture(scope="module")
def recall_exports(load, tiny_llama_dir, export_to):
    """int4 weight blocks (what `cabinlm export --profile sa8295p` writes) with fp16, int8 and fp32 KV."""
    loaded = load(str(tiny_llama_dir))
    return {kv: export_to(loaded, kv=kv, weights="int4", **LAYOUT) for kv in ("fp16", "int8", "fp32")}


@pytest.fixture(scope="module")
def recall_builds(recall_exports, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qnn-recall")
    return {kv: build_artifact(recall_exports[kv], load_profile("sa8295p"), tmp / kv) for kv in ("fp16", "int8")}


def streamed(folder, ids, **kw) -> list[np.ndarray]:
    return run_stream(Decoder(folder, **kw), ids)


@pytest.fixture(scope="module")
def cpu_logits(recall_exports):
    ids = stream_ids()
    return ids, {kv: streamed(art, ids, session_config=EXACT) for kv, art in recall_exports.items()}


@pytest.mark.slow
def test_the_fp16_build_follows_the_cpu_with_a_recall_region(recall_builds, cpu_logits):
    ids, cpu = cpu_logits
    m = load_manifest(recall_builds["fp16"])
    assert m.cache.recall == 16 and m.build.facts.kv_cache == "fp16" and not m.build.facts.rotated_keys
    got = streamed(recall_builds["fp16"], ids)
    assert close(got, cpu["fp16"]), agreement(got, cpu["fp16"])


@pytest.mark.slow
def test_the_uint8_cache_with_rotated_keys_follows_the_cpu_with_a_recall_region(recall_builds, cpu_logits, monkeypatch):
    """The region's keys re-rotated from their fp16 copy at rank + O, the window's written at rank + O: as close
    to the float32-KV export as test_qnn_kv8's stream without a region; with O = E (the region's length left out
    of the window keys' rotation) the same build fails both bounds."""
    from cabinlm.contract.slots import StepPlan

    ids, cpu = cpu_logits
    build = recall_builds["int8"]
    facts = load_manifest(build).build.facts
    assert facts.kv_cache == "uint8" and facts.rotated_keys
    dec = Decoder(build)
    got = run_stream(dec, ids)
    assert close_kv8(got, cpu["fp32"], FLOAT), agreement(got, cpu["fp32"])
    assert close_kv8(got, cpu["int8"], SAME_EXPORT), agreement(got, cpu["int8"])
    lay = dec.layout
    source = dec.backend.buffers()["key_source"]  # (layers, kv_heads, sink + pinned + recall, head_dim) fp16
    assert source.dtype == np.float16 and source.shape == (2, 2, lay.window_start, lay.head_dim)
    assert (source[:, :, lay.recall_start : lay.recall_start + dec.cache.recall_fill] != 0).any(axis=(0, 1, 3)).all()

    monkeypatch.setattr(StepPlan, "offset", property(lambda self: self.evicted))
    wrong = streamed(build, ids)
    assert not close_kv8(wrong, cpu["fp32"], FLOAT), agreement(wrong, cpu["fp32"])


def test_plan_counts_the_regions_key_copy(tiny_llama_dir, recall_builds):
    """`cabinlm plan --recall` for the HTP's uint8 cache counts what the backend holds: the cache and the fp16
    copy of the sink, pinned and recall keys."""
    from cabinlm.source.config import spec_from_config
    from cabinlm.profiles.planner import plan

    spec = spec_from_config(tiny_llama_dir)
    p = plan(spec, load_profile("sa8295p"), kv=KVDType.INT8, window=LAYOUT["window"], sink=LAYOUT["sink"],
             pinned=LAYOUT["pinned"], chunk=LAYOUT["chunk"], recall=LAYOUT["recall"])  # fmt: skip
    bufs = Decoder(recall_builds["int8"]).backend.buffers()
    assert p.kv_bytes == sum(b.nbytes for b in bufs.values())


def test_the_a16_calibration_feeds_include_a_region_refill(recall_exports):
    """The 16-bit build's calibration (a16_feeds.calibration_feeds, the float graph on the CPU through the runtime)
    refills the recall region once the window is full: the ranges see the region's chunks (the window masked
    while it holds tokens) and the steps after it."""
    from cabinlm.engines.qnn_htp.a16_feeds import calibration_feeds
    from cabinlm.engines.qnn_htp.qdq import a16_float_graph

    art = recall_exports["int8"]
    m = load_manifest(art)
    lay = m.cache
    model, _, scales, rotated = a16_float_graph(art, m)
    assert rotated
    ids = list(np.random.default_rng(5).integers(3, 300, 160))
    feeds = calibration_feeds(model, art, m, ids, scales)
    N = lay.slots
    sees_window = [bool((f["attention_mask"][:, lay.window_start : N] == 0).any()) for f in feeds]
    region = [i for i in range(sees_window.index(True), len(feeds)) if not sees_window[i]]
    assert len(region) == -(-lay.recall // lay.chunk), region  # the region's chunks, once window tokens were cached
    assert region == list(range(region[0], region[0] + len(region)))
    after = feeds[region[-1] + 1]["attention_mask"]
    assert (after[:, lay.recall_start : lay.window_start] == 0).all() and (after[:, lay.window_start : N] == 0).any()


# -- a model with sliding-window (local) layers ----------------------------------------------------------------
# The tiny Gemma 3 (conftest.make_tiny_model: local layers of window 20 around a global one): its HTP builds keep
# un-rotated keys in every layer, fp16 or uint8 (rotated keys are for models without local layers), so the region
# beside the rings (docs/design.md, "The recall region", on local layers) is the bookkeeping alone: each local
# layer's w + R slots, the region's chunk at its places in the region and masked to it, the ring counting stream
# tokens only. A short stream (two regions, the rings and the window turned over) keeps the simulator's time low;
# tests/test_recall_local_layers.py holds the CPU's run of the same export to the reference over a longer one.

LOCAL_W = 20  # the tiny Gemma's sliding window
SHORT = ([(6, "pin"), (11, "win")] + [(1, "win")] * 12 + [(10, "recall"), (7, "win")] + [(1, "win")] * 16
         + [(3, "recall"), (9, "win")] + [(1, "win")] * 8)  # fmt: skip


def short_stream(dec: Decoder, ids: np.ndarray) -> list[np.ndarray]:
    got, pos, chunk = [], 0, LAYOUT["chunk"]
    for n, where in SHORT:
        if where == "recall":
            dec.cache.begin_recall()
        pin = {"pin": True, "recall": "recall"}.get(where, False)
        for start in range(pos, pos + n, chunk):
            got.append(dec.step(ids[start : min(start + chunk, pos + n)], pin=pin).copy())
        pos += n
    cache = dec.cache
    assert cache.recalls == 2 and cache.recall_fill == 3 and cache.local_seen == cache.seen - 13
    assert cache.local_seen > 3 * LOCAL_W and cache.evicted > 2 * LAYOUT["window"]  # the rings and window turned over
    return got


@pytest.fixture(scope="module")
def local_runs(load, export_to, tmp_path_factory):
    """{kv: (HTP logits, CPU logits of the same export, the build)} for fp16 and int8 KV; the CPU's fp32-KV logits."""
    from conftest import make_tiny_model

    tmp = tmp_path_factory.mktemp("qnn-recall-local")
    gemma = load(str(make_tiny_model(tmp / "tiny-gemma3", "gemma3")))
    ids = np.random.default_rng(17).integers(3, 300, sum(n for n, _ in SHORT))
    runs = {}
    for kv in ("fp16", "int8", "fp32"):
        art = export_to(gemma, kv=kv, weights="int4", **LAYOUT)
        cpu = short_stream(Decoder(art, session_config=EXACT), ids)
        if kv == "fp32":
            runs[kv] = (None, cpu, None)
            continue
        build = build_artifact(art, load_profile("sa8295p"), tmp / kv)
        m = load_manifest(build)
        assert m.cache.local_layers == (0, 2) and m.cache.local_slots == LOCAL_W + LAYOUT["recall"]
        assert m.build.facts.kv_cache == ("uint8" if kv == "int8" else "fp16") and not m.build.facts.rotated_keys
        dec = Decoder(build)
        assert dec.device == "qnn-htp"
        runs[kv] = (short_stream(dec, ids), cpu, build)
    return runs


def test_the_fp16_build_follows_the_cpu_with_a_region_beside_the_rings(local_runs):
    got, cpu, _ = local_runs["fp16"]
    assert close(got, cpu), agreement(got, cpu)


@pytest.mark.slow
def test_the_htp_tells_window_tokens_that_see_the_region_in_a_local_layer(local_runs, monkeypatch):
    """The comparison above is sharp: the fp16 build's local layers letting window tokens see the region (the
    other rule one could write) fail it."""
    from cabinlm.contract.slots import StepPlan

    right = StepPlan.local_attention_mask.func

    def sees_region(self):
        mask = right(self)
        if self.pin != "recall":
            mask[:, LOCAL_W : LOCAL_W + self.recall_fill] = 0
        return mask

    _, cpu, build = local_runs["fp16"]
    monkeypatch.setattr(StepPlan, "local_attention_mask", property(sees_region))
    wrong = short_stream(Decoder(build), np.random.default_rng(17).integers(3, 300, sum(n for n, _ in SHORT)))
    assert not close(wrong, cpu), agreement(wrong, cpu)


def test_the_uint8_cache_follows_the_cpu_with_a_region_beside_the_rings(local_runs):
    got, cpu, _ = local_runs["int8"]
    assert close_kv8(got, local_runs["fp32"][1], FLOAT), agreement(got, local_runs["fp32"][1])
    assert close_kv8(got, cpu, SAME_EXPORT), agreement(got, cpu)
