"""Backend conformance: every backend of the runtime (runtime/backends/) against the independent
streaming reference (tests/reference.py), on one stream that exercises what each backend does
differently: sink and pinned spans (the fused cache re-rotates them), a pinned span younger than
window tokens, chunked prefill with partial chunks and chunks that wrap the ring top (static graphs
pad them), single-token decode (bound once in the fused and static backends), and hundreds of
evictions. A new backend adds its artifact to BACKENDS and must pass the same test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cabinlm.builders import build_artifact
from cabinlm.manifest import load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder
from reference import StreamingReference

LAYOUT = dict(sink=2, pinned=8, window=16, chunk=4)

# (token count, pinned) of each feed: the system prompt pinned (2 to the sink, 4 pinned), a prompt in
# chunks of 4 with a partial last chunk, decode, a pinned span after window tokens (its keys are
# younger than the window's), a prompt whose chunks wrap the ring top, and a long decode.
STREAM = [(6, True), (11, False)] + [(1, False)] * 30 + [(2, True), (7, False)] + [(1, False)] * 120 + [(9, False)]


def static_profile(folder: Path) -> Path:
    """A user's own profile file: the sa8295p profile's static shapes, on the host's CPU provider
    with fp32 KV (so the comparison with the float reference is exact)."""
    text = (Path(load_profile.__code__.co_filename).parent / "builtin" / "sa8295p.toml").read_text()
    lines = []
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        line = {
            "name": 'name = "host-static"',
            "execution_provider": 'execution_provider = "CPUExecutionProvider"',
            "kv_dtypes": 'kv_dtypes = ["fp32", "fp16"]',
            "default_kv": 'default_kv = "fp32"',
            "default_chunk": "default_chunk = 4",
            "htp_arch": "",  # HTP targets belong to QNN profiles only
            "soc_model": "",
            "htp_process_limit_bytes": "",
        }.get(key, line)
        lines.append(line)
    path = folder / "host-static.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def artifacts(load, tiny_llama_dir, export_to, tmp_path_factory) -> dict[str, Path]:
    """One artifact per backend kind, all from the same fp32-KV export."""
    art = export_to(load(str(tiny_llama_dir)), kv="fp32", **LAYOUT)
    tmp = tmp_path_factory.mktemp("backends")
    return {
        "onnxruntime-graph (export)": art,
        "onnxruntime-graph (cpu build)": build_artifact(art, load_profile("cpu"), tmp / "graph", attention="graph"),
        "onnxruntime-fused": build_artifact(art, load_profile("cpu"), tmp / "fused", attention="fused", accuracy_level=0),
        "onnxruntime-static": build_artifact(art, load_profile(static_profile(tmp)), tmp / "static"),
    }


BACKENDS = ["onnxruntime-graph (export)", "onnxruntime-graph (cpu build)", "onnxruntime-fused", "onnxruntime-static"]


def reference_logits(model, ids: np.ndarray) -> list[np.ndarray]:
    """The reference's logits for every feed of STREAM (chunks of at most `chunk` tokens)."""
    ref = StreamingReference(model, sink=LAYOUT["sink"], window=LAYOUT["window"])
    out, pos = [], 0
    for n, pin in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            stop = min(start + LAYOUT["chunk"], pos + n)
            out.append(ref.feed(ids[start:stop].tolist(), pin=pin).numpy())
        pos += n
    return out


@pytest.fixture(scope="module")
def stream(load, tiny_llama_dir):
    loaded = load(str(tiny_llama_dir))
    ids = np.random.default_rng(7).integers(3, 300, sum(n for n, _ in STREAM))
    return loaded, ids


@pytest.fixture(scope="module")
def expected(stream):
    loaded, ids = stream
    return reference_logits(loaded.model, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_follows_the_streaming_reference(backend, artifacts, stream, expected):
    _, ids = stream
    folder = artifacts[backend]
    kind = backend.split(" ")[0]
    assert load_manifest(folder).runtime_spec.backend.value == kind  # the artifact names its backend
    dec = Decoder(folder)
    assert type(dec.backend).kind.value == kind and dec.device == "onnxruntime-cpu"
    got, pos = [], 0
    for n, pin in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            stop = min(start + LAYOUT["chunk"], pos + n)
            got.append(dec.step(ids[start:stop], pin=pin).copy())
        pos += n
    assert dec.cache.evicted > 8 * LAYOUT["window"] and dec.cache.pinned_fill == 6
    worst = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
    assert worst < 2e-3, (backend, worst)


def test_the_reference_run_can_tell_a_wrong_cache_from_a_right_one(stream, expected):
    """The comparison above has teeth: the same stream without the pinned spans pinned (the system
    prompt then leaves the window) gives logits far from the expected ones."""
    loaded, ids = stream
    ref = StreamingReference(loaded.model, sink=LAYOUT["sink"], window=LAYOUT["window"])
    rows, pos = [], 0
    for n, _ in STREAM:
        for start in range(pos, pos + n, LAYOUT["chunk"]):
            rows.append(ref.feed(ids[start : min(start + LAYOUT["chunk"], pos + n)].tolist()).numpy())
        pos += n
    assert max(float(np.abs(r - e).max()) for r, e in zip(rows[-40:], expected[-40:])) > 0.1


def test_a_build_for_a_provider_this_onnxruntime_lacks_is_refused_not_run_on_the_cpu(artifacts):
    """The backend runs on the provider the manifest names, or not at all: a build that names an
    execution provider this onnxruntime does not offer is refused with the reason, never run on
    the CPU provider instead (which would make every check above pass without the chip)."""
    import dataclasses

    import onnxruntime as ort

    from cabinlm.buildspec import ExecutionProvider
    from cabinlm.runtime import BackendError

    folder = artifacts["onnxruntime-static"]
    m = load_manifest(folder)
    missing = next(p for p in ("QNNExecutionProvider", "TensorrtExecutionProvider", "CoreMLExecutionProvider")
                   if p not in ort.get_available_providers())  # fmt: skip
    other = dataclasses.replace(m, build=dataclasses.replace(m.build, provider=ExecutionProvider(missing)))
    with pytest.raises(BackendError, match=f"runs on {missing}, which this onnxruntime does not offer"):
        Decoder(folder, manifest=other)
