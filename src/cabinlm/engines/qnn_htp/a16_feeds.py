"""The a16 graphs (qdq.py) driven on ONNX Runtime's CPU provider by the runtime itself: the Decoder
and the HTP backend's own contract (its slot table, masks, positions, uint8 cache buffers with zero
point 128 in empty slots), so every feed is one the HTP would be given.

    calibration_feeds   the float graph over the calibration text, every feed recorded (the ranges)
    stream_logits       a graph's logits over a text, prefill chunks from an empty cache
    stream_fidelity     the QDQ graph against the float graph over held-out text (the build's check)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

DECODE_CALIB_TOKENS = 64  # the calibration text's last tokens fed one at a time (the decode graph's ranges)


def cpu_decoder(model: onnx.ModelProto | bytes | str, artifact: Path, manifest, kv_scales: dict[str, float] | None = None):
    """The runtime (Decoder, the HTP backend's own contract: its slot table, masks, uint8 cache
    buffers, zero point 128 in empty slots) driving `model` (a graph with graph.uint8_kv's cache I/O,
    float or QDQ; a path, bytes or proto) on ONNX Runtime's CPU provider: what the HTP is fed, for
    calibration_feeds and stream_fidelity. Returns (decoder, backend).

    kv_scales: for a graph whose cache holds rotated keys (rotated_graph.rotate_cached_keys: it takes
    rope_cos / rope_sin), the cache's {input name: scale}; the backend then feeds the chunk's rotation
    rows and re-rotates the sink / pinned keys from their copy with the key tensors' scales, as on the
    HTP. The export's manifest has no build facts, so the flag and the scales come from here."""
    import onnxruntime as ort

    from cabinlm.contract import io_spec as io
    from cabinlm.engines.qnn_htp.backend import LoadedGraphs, QnnBackend
    from cabinlm.runtime import Decoder, SlotTable

    so = ort.SessionOptions()
    so.log_severity_level = 3
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    session = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    rotated = io.ROPE_COS in {i.name for i in session.get_inputs()}
    if rotated and kv_scales is None:
        raise ValueError("this graph's cache holds rotated keys (it takes rope_cos / rope_sin): pass its kv_scales")
    if not rotated and kv_scales is not None:
        raise ValueError("this graph's cache holds un-rotated keys (no rope_cos input): kv_scales are for rotated keys only")
    scales = dict(kv_scales or {})

    class OnCpu(QnnBackend):  # the HTP backend's own contract, its sessions the graph on the CPU
        cache_dtype = "uint8"  # graph.uint8_kv's cache
        rotated_keys = rotated  # what the build's manifest would say (build.qnn.rotated_keys, kv_scales)
        kv_scales = scales

    table = SlotTable(manifest.cache)
    backend = OnCpu(LoadedGraphs(manifest, session, session, False, []), table)
    dec = Decoder(artifact, manifest, _backend=backend)
    dec.cache = table
    return dec, backend


def calibration_feeds(model: onnx.ModelProto, artifact: Path, manifest, ids: list[int],
                      kv_scales: dict[str, float] | None = None) -> list[dict[str, np.ndarray]]:
    """The feeds the runtime gives the graph over `ids` (prefill chunks, the cache filling, the window
    turning over where the text is longer than it), each with the cache as it was: the CPU runs the
    float graph through the runtime's own backend (cpu_decoder; kv_scales: a graph of rotated keys)."""
    dec, backend = cpu_decoder(model, artifact, manifest, kv_scales)
    feeds: list[dict[str, np.ndarray]] = []
    for binding in (backend._prefill, backend._decode):
        run = binding.run

        def record(inputs, run=run):
            feeds.append({**{k: np.array(v) for k, v in inputs.items()},
                          **{name: ov.numpy().copy() for name, ov in backend._cache_values}})  # fmt: skip
            return run(inputs)

        binding.run = record
    lay = manifest.cache
    # a pinned head first (a system prompt: the sink and pinned slots full), so an un-rotated graph's
    # positions reach their largest rank (sink + pinned + window + chunk) and a rotated one's sink /
    # pinned keys are re-rotated as the window evicts; then prefill chunks, then decode steps. With a
    # recall region (docs/design.md, "The recall region"): once the window is full (or halfway through
    # the prefill text), the region refilled with the next R tokens, so the ranges see its chunks (the
    # window masked) and every step after it the region's keys and the window's ranks moved by it
    pinned, split = lay.sink + lay.pinned, len(ids) - DECODE_CALIB_TOKENS
    region_at = min(pinned + lay.window, (pinned + split) // 2) if lay.recall else split
    start = 0
    while start < split:
        if start >= region_at:
            end = min(start + lay.recall, split)
            dec.cache.begin_recall()
            dec.feed(np.asarray(ids[start:end]), pin="recall")
            start, region_at = end, split
            continue
        end = min(start + lay.chunk, pinned if start < pinned else split)
        dec.step(np.asarray(ids[start:end]), pin=start < pinned)
        start = end
    for t in ids[split:]:
        dec.step(np.asarray([t]))
    return feeds


def stream_logits(model: onnx.ModelProto | bytes | str, artifact: Path, manifest, ids: list[int],
                  kv_scales: dict[str, float] | None = None) -> np.ndarray:
    """(len(ids) - 1, vocab) logits of `model` fed ids[:-1] through the runtime on the CPU (cpu_decoder:
    prefill chunks from an empty cache, eviction once the window is full, as a dialogue runs)."""
    dec, _ = cpu_decoder(model, artifact, manifest, kv_scales)
    return dec.feed(np.asarray(ids[:-1]), all_logits=True)


def stream_fidelity(reference: bytes, q: onnx.ModelProto, artifact: Path, manifest, ids: list[int],
                    kv_scales: dict[str, float] | None = None) -> dict:
    """The QDQ graph q against the float graph (serialized, the same uint8 cache I/O), both fed `ids` through the
    runtime on ONNX Runtime's CPU provider (stream_logits): what the 16-bit ranges cost on text the calibration did
    not see, apart from the compiler (whose own faithfulness the build's decode check measures). A check on a
    calibration chunk cannot see a range that this text leaves (SmolLM2's graph with its offsets unfolded: 0.998
    there, perplexity 3.8e9 on the stream). Returns {"correlation": logits over all rows, "perplexity": (float
    graph, QDQ graph)}. kv_scales: both graphs' cache holds rotated keys (cpu_decoder)."""
    from cabinlm.runtime import token_nll

    ref = stream_logits(reference, artifact, manifest, ids, kv_scales)
    got = stream_logits(q, artifact, manifest, ids, kv_scales)
    if not np.isfinite(got).all():
        return {"correlation": 0.0, "perplexity": (float("nan"), float("inf"))}
    corr = float(np.corrcoef(ref.astype(np.float64).ravel(), got.astype(np.float64).ravel())[0, 1])
    ppl = tuple(float(np.exp(np.mean([token_nll(x[i], int(ids[i + 1])) for i in range(len(ids) - 1)]))) for x in (ref, got))
    return {"correlation": corr, "perplexity": ppl}
