"""The vision tower of a vision-language build on Qualcomm's HTP (engines/qnn_htp/vision_build.py):
compiled by Qualcomm's compiler into its own context binary per chip and run in its x86 HTP
simulator for each frame, with CPU fallback off; a tower the HTP rejects stays on the CPU with the
node named, and the manifest says where the tower runs and why. Tiny random towers of each family.

Tolerance: the HTP computes the float tower in fp16 (a relative rounding step of 2^-11 per operation
over a few dozen operations). Measured: the largest |error| of the image embeddings is 0.1% to 0.4%
of the largest |embedding| over 8 frames (benchmarks/vlm_htp.py); the tests allow 1%, and another frame's
embeddings are > 10% apart.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from cabinlm.engines.build import build_artifact
from cabinlm.contract.manifest import FileEntry, load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder

from conftest import make_tiny_llava
from vlm_checks import picture

try:
    import onnxruntime_qnn  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # `make test` installs the qnn extra: in CI a missing plugin is a failure
        raise
    pytest.skip("onnxruntime-qnn (the `qnn` extra) is not installed: `pip install 'cabinlm[qnn]'`", allow_module_level=True)

TOLERANCE = 0.01  # of the largest |embedding| (module docstring)
LAYOUT = dict(kv="fp16", sink=4, pinned=24, window=64, chunk=16)
FRAME = (32, 24)  # (width, height) of the test frames


def family_folder(family: str, tmp: Path) -> Path:
    from conftest import make_tiny_qwen2_vl
    from test_idefics3 import make_tiny_idefics3

    if family == "llava":
        return make_tiny_llava(tmp, "clip")
    if family == "smolvlm":
        return make_tiny_idefics3(tmp, "smolvlm", seed=1)
    return make_tiny_qwen2_vl(tmp, family=family)


@pytest.fixture(scope="module")
def artifacts(load, export_to, tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = export_to(load(str(family_folder(family, tmp_path_factory.mktemp(family)))), **LAYOUT)
        return cache[family]

    return get


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("family,profile", [("llava", "sa8775p"), ("llava", "sa8295p"), ("smolvlm", "sa8775p"),
                                            ("qwen2_vl", "sa8295p"), ("qwen2_5_vl", "sa8775p")])  # fmt: skip
def test_the_tower_runs_on_the_htp_and_its_embeddings_follow_the_cpus(family, profile, artifacts, tmp_path):
    art = artifacts(family)
    built = build_artifact(art, load_profile(profile), tmp_path / profile)
    m = load_manifest(built)
    record = json.loads((built / "manifest.json").read_text())["build"]["qnn"]["vision"]
    assert record["runs_on"] == "htp" and record["activations"] == "fp16"
    assert m.files["vision_context_binary"].path == record["binary"] == "vision.ctx_qnn.bin"
    assert "vision_graph" not in m.files and not (built / "vision.onnx").exists()  # the car loads the binary only
    assert 0 < record["check"]["relative_error"] <= TOLERANCE
    dec, cpu = Decoder(built), Decoder(art)
    session = dec.vision.session  # the HTP ran it: the plugin's provider, CPU fallback off
    assert dec.vision.device == "qnn-htp" and session.get_providers()[0] == "QNNExecutionProvider"
    assert session.get_session_options().get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    for seed in (3, 4):
        got, ref = dec.vision.encode(picture(*FRAME, seed=seed)), cpu.vision.encode(picture(*FRAME, seed=seed))
        assert got.shape == ref.shape == (m.vision.image_tokens, m.vision.embed_dim)
        assert relative_error(got, ref) <= TOLERANCE
    assert relative_error(cpu.vision.encode(picture(*FRAME, seed=5)), ref) > 10 * TOLERANCE  # the test has teeth


def test_a_tower_node_the_htp_rejects_keeps_the_tower_on_the_cpu_and_the_manifest_names_it(artifacts, tmp_path):
    """Trilu has no HTP form: the tower's compile fails naming the node, the build goes on with
    vision.onnx run on the CPU, and the manifest records why; the decoder is still the HTP's."""
    art = tmp_path / "art"
    shutil.copytree(artifacts("llava"), art)
    m = load_manifest(art)
    path = art / m.files["vision_graph"].path
    g = onnx.load(str(path), load_external_data=False)
    out = g.graph.output[0].name
    last = next(n for n in g.graph.node if out in n.output)
    last.output[list(last.output).index(out)] = "image_embeds/raw"
    g.graph.node.append(onnx.helper.make_node("Trilu", ["image_embeds/raw"], [out], name="n/odd_trilu", upper=1))
    onnx.save_model(g, str(path))
    m.files["vision_graph"] = FileEntry.of(art, m.files["vision_graph"].path)
    m.save(art)
    lines: list[str] = []
    built = build_artifact(art, load_profile("sa8775p"), tmp_path / "b", log=lines.append)
    record = json.loads((built / "manifest.json").read_text())["build"]["qnn"]["vision"]
    assert record["runs_on"] == "cpu" and "n/odd_trilu (Trilu)" in record["reason"] and "vision.onnx" in record["reason"]
    assert any("stays on the CPU" in s and "n/odd_trilu (Trilu)" in s for s in lines)
    files = load_manifest(built).files
    assert "vision_graph" in files and "vision_context" not in files and not (built / "vision.ctx.onnx").exists()
    dec = Decoder(built)
    assert dec.vision.device == "cpu" and dec.backend.device == "qnn-htp"
    img = picture(*FRAME, seed=3)
    ref = Decoder(art).vision.encode(img)
    np.testing.assert_allclose(dec.vision.encode(img), ref, atol=1e-5)  # fp32 on the CPU (the build's session settings)
    assert np.all(np.tril(ref, -1) == 0)  # the edited tower (its Trilu) is what ran


def test_the_manifest_refuses_a_tower_record_that_says_neither_htp_nor_cpu():
    from cabinlm.contract.engines.qnn import QnnSettings

    base = dict(qairt_version="2.51", htp_arch=73, soc_model=52, chip="SA8775P", activations="fp16", weights="int4",
                weight_sharing=True, binaries=("d_qnn.bin",))  # fmt: skip
    for record in ({"runs_on": "htp", "binary": "vision.ctx_qnn.bin"}, {"runs_on": "cpu", "reason": "Trilu"}, {}):
        assert QnnSettings.from_dict({**base, "vision": record}).to_dict()["vision"] == record
    for bad in ({"runs_on": "gpu"}, {"reason": "x"}, ["htp"]):
        with pytest.raises(ValueError, match="build.qnn.vision"):
            QnnSettings(**base, vision=bad)
