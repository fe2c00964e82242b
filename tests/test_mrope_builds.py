"""Qwen2-VL's multimodal RoPE (M-RoPE: three position components, docs/vlm.md) on the static-shape
builds: the static prefill/decode pair (ort_static) and the HTP decoder (qnn_htp, Qualcomm's x86
simulator). Both take the (3, tokens) and (3, slots) positions the runtime plans
(StepPlan.mrope_positions) as the exported graph does; a short last chunk is padded with positions
that continue all three components.

Tolerances: the static pair computes what the exported graph computes in fp32: its NLL equals
transformers' within 1e-4 (the export's own bound) and the cpu build's within 1e-4 through eviction
(measured 1.5e-5). The HTP computes in fp16 with an fp16 cache: measured against the cpu build of
the same fp16-KV export over 150 tokens (86 evicted, the frame pinned), per-token NLL differs by at
most 0.048 (v73) / 0.050 (v68), 0.007 on average (benchmarks/vlm_htp.py); the
tests allow 0.15 at any token and 0.02 on average, and another frame is > 0.1 apart on average.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.contract.engines import BackendKind
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, stream_perplexity
from cabinlm.runtime.vision import load_image

import vlm_checks as vlm
from test_backends import static_profile
from test_cli import cabinlm
from test_qwen2_vl import PICTURE, hf_logits
from vlm_checks import TEXT, picture

LAYOUT = dict(sink=4, pinned=12, window=64, chunk=16)
try:
    import onnxruntime_qnn  # noqa: F401

    HAS_QNN = True
except ImportError:
    if os.environ.get("CI"):  # `make test` installs the qnn extra: in CI a missing plugin is a failure
        raise
    HAS_QNN = False


@pytest.fixture(scope="module")
def qwen(load, tiny_qwen2_vl_dir):
    return load(str(tiny_qwen2_vl_dir))


def stream_ids(loaded, n: int = 150) -> list[int]:
    """n tokens of text: with the 14 frame tokens, far past the cache (sink 4 + pinned 12 + window 64)."""
    return (loaded.tokenizer.backend_tokenizer.encode(TEXT).ids * 4)[:n]


def nll_with_frame(folder, ids, seed: int) -> tuple[np.ndarray, Decoder]:
    dec = Decoder(folder)
    return np.asarray(stream_perplexity(dec, ids, frame=dec.vision.encode(picture(*PICTURE, seed=seed))).nll), dec


def test_the_static_pair_scores_a_frame_as_transformers(qwen, export_to, tmp_path):
    """`cabinlm perplexity BUILD --image FRAME` on the static pair: the text's NLL == transformers'
    (the stream fits the cache), a wrong frame clearly apart (vlm_checks)."""
    art = export_to(qwen, **LAYOUT)  # fp32 KV
    built = build_artifact(art, load_profile(static_profile(tmp_path)), tmp_path / "static")
    assert type(Decoder(built).backend).kind is BackendKind.STATIC_PAIR
    v = qwen.model.config
    frame_ids = [v.vision_start_token_id] + [v.image_token_id] * 12 + [v.vision_end_token_id]
    vlm.check_perplexity_with_a_frame(qwen, built, hf_logits, frame_ids, PICTURE, tmp_path)


def test_the_static_pair_scores_a_pinned_frame_through_eviction_as_the_cpu_build(qwen, export_to, tmp_path):
    art = export_to(qwen, kv="fp16", **LAYOUT)
    ids = stream_ids(qwen)
    static = build_artifact(art, load_profile(static_profile(tmp_path)), tmp_path / "static")
    cpu = build_artifact(art, load_profile("cpu"), tmp_path / "cpu")
    ref, _ = nll_with_frame(cpu, ids, seed=10)
    got, dec = nll_with_frame(static, ids, seed=10)
    assert dec.backend.graphs.static and dec.cache.evicted > 80 and dec.cache.frame_start >= 0
    np.testing.assert_allclose(got, ref, atol=1e-4)  # measured 1.5e-5
    wrong, _ = nll_with_frame(static, ids, seed=11)
    assert np.abs(wrong - ref).mean() > 0.1  # another frame: far apart


@pytest.mark.slow
@pytest.mark.skipif(not HAS_QNN, reason="onnxruntime-qnn (the `qnn` extra) is not installed")
@pytest.mark.parametrize("profile", ["sa8775p", "sa8295p"])
def test_the_htp_decoder_scores_a_pinned_frame_through_eviction_as_the_cpu_build(profile, qwen, export_to, tmp_path):
    """`cabinlm perplexity BUILD --image FRAME --nll-out` on the HTP build (Qualcomm's simulator),
    150 tokens of text after the frame (the frame pinned, the window turned over), against the cpu
    build of the same export on the same frame and tokens; the HTP build given another frame is apart."""
    art = export_to(qwen, kv="fp16", **LAYOUT)
    builds = {p: build_artifact(art, load_profile(p), tmp_path / p) for p in ("cpu", profile)}
    frame = tmp_path / "cabin.png"
    picture(*PICTURE, seed=8).save(frame)
    (tmp_path / "t.txt").write_text(TEXT * 4)
    p = cabinlm("perplexity", builds[profile], "--image", frame, "--text", tmp_path / "t.txt", "--max-tokens", 150,
                "--nll-out", tmp_path / "htp.npy", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] == 150 and json.loads(p.stdout)["backend"] == "qnn-htp"
    ids = qwen.tokenizer.backend_tokenizer.encode(TEXT * 4).ids[:150]  # the file's tokens, as the command reads them
    cpu = Decoder(builds["cpu"])
    ref = np.asarray(stream_perplexity(cpu, ids, frame=cpu.vision.encode(load_image(frame))).nll)
    diff = np.abs(np.load(tmp_path / "htp.npy") - ref)
    assert diff.max() <= 0.15 and diff.mean() <= 0.02, (diff.max(), diff.mean())
    wrong, dec = nll_with_frame(builds[profile], ids, seed=9)
    assert dec.device == "qnn-htp" and dec.vision.device == "qnn-htp"
    assert dec.cache.evicted > 80 and dec.cache.frame_start >= 0  # the frame stayed pinned through eviction
    assert np.abs(wrong - ref).mean() > 0.1  # another frame: far apart
