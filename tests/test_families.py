"""The model families beyond Llama / Qwen2: Qwen3 (RMSNorm of each q / k head before
RoPE), Mistral (Llama-like, with a `sliding_window`), Phi-3 (fused qkv_proj and gate_up_proj) and
Gemma 3 (sandwich norms, GELU-tanh, scaled embeddings, local sliding-window layers of window 20
around a global one, so its local rings wrap in every test: tests/test_local_layers.py has the rest),
each a tiny random-weight transformers model built here (conftest.make_tiny_model), held to the same
two facts as tests/test_equivalence.py: dense attention while the stream fits the cache, the
streaming reference past it. Then the cpu build of each, and what a family variant is refused for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny_model
from test_equivalence import TOL, graph_nll, hf_dense_nll, nll_of, reference_nll, tokens

from cabinlm.contract.errors import ModelError
from cabinlm.runtime import Decoder

FAMILIES = ["qwen3", "mistral", "phi3", "gemma3"]
LOCAL = {"gemma3"}  # families whose tiny model has local sliding-window layers (per-layer cache geometry)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family_dir(arch, **config overrides) -> a tiny model folder (one per arch and overrides)."""
    made: dict = {}

    def make(arch: str, **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return make


# -- (a) dense while the stream fits, (b) the streaming semantics past the window -------------------


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-token", "chunked"])
def test_each_family_is_dense_while_the_stream_fits(arch, chunked, family_dir, load, export_to, long_text):
    loaded = load(str(family_dir(arch)))
    folder = export_to(loaded, sink=4, pinned=0, window=124, chunk=16)
    ids = tokens(loaded, long_text, 128)  # exactly fills sink + window
    np.testing.assert_allclose(graph_nll(folder, ids, chunked), hf_dense_nll(loaded, ids), atol=TOL)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("chunk", [1, 8], ids=["one-token", "chunk8"])
def test_each_family_follows_the_streaming_semantics_past_the_window(arch, chunk, family_dir, load, export_to, long_text):
    loaded = load(str(family_dir(arch)))
    folder = export_to(loaded, sink=4, pinned=0, window=24, chunk=8)
    ids = tokens(loaded, long_text, 150)  # five times the cache
    ref = reference_nll(loaded, ids, sink=4, window=24, chunk=chunk, local=arch in LOCAL)
    dec = Decoder(folder)
    assert bool(dec.layout.local_layers) == (arch in LOCAL)
    rows = [dec.step(np.array(ids[i : i + chunk])).copy() for i in range(0, len(ids), chunk)]
    ours = nll_of(np.concatenate(rows), ids)
    np.testing.assert_allclose(ours, ref, atol=TOL)
    # The comparison can tell: past the window, the streaming result differs from dense attention.
    assert np.abs(ours[40:] - hf_dense_nll(loaded, ids)[40:]).max() > 50 * TOL


def test_the_reference_is_dense_for_each_family(family_dir, load, long_text):
    """The reference's own Qwen3 norms, Phi-3 split and Gemma 3 local windows, checked where it must
    equal transformers."""
    for arch in FAMILIES:
        loaded = load(str(family_dir(arch)))
        ids = tokens(loaded, long_text, 60)
        np.testing.assert_allclose(reference_nll(loaded, ids, 4, 100, 7, local=True), hf_dense_nll(loaded, ids), atol=TOL)


def test_qwen3_norms_are_in_the_graph_and_its_head_dim_is_its_own(family_dir, load, export_to):
    """What the dense test could pass without only by luck: head_dim 32 is not hidden / heads (16),
    and the q / k norm weights (random, away from 1) are initializers of every layer."""
    import onnx

    loaded = load(str(family_dir("qwen3")))
    assert loaded.spec.head_dim == 32 and loaded.spec.hidden_size // loaded.spec.num_heads == 16
    folder = export_to(loaded, sink=4, pinned=0, window=124, chunk=16)
    names = {i.name for i in onnx.load(str(folder / "decoder.onnx"), load_external_data=False).graph.initializer}
    for i in range(loaded.spec.num_layers):
        assert {f"layers.{i}.q_norm.weight", f"layers.{i}.k_norm.weight"} <= names


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
def test_int8_kv_calibrates_the_keys_the_graph_caches(arch, family_dir, load, export_to, long_text):
    """Qwen3 caches k_norm's outputs and Phi-3's keys are columns of qkv_proj: the key / value scales
    come from those (a scale taken from k_proj alone would clip Qwen3's normed keys)."""
    loaded = load(str(family_dir(arch)))
    ids = tokens(loaded, long_text, 120)
    fp32 = graph_nll(export_to(loaded, sink=4, pinned=0, window=60, chunk=16, kv="fp32"), ids, chunked=True)
    int8 = graph_nll(export_to(loaded, sink=4, pinned=0, window=60, chunk=16, kv="int8"), ids, chunked=True)
    assert abs(int8.mean() - fp32.mean()) / fp32.mean() < 0.02


# -- the chat template pieces --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,pieces",
    [
        ("qwen3", ("<|im_start|>user\n", "<|im_end|>\n", "<|im_start|>assistant\n", "<|im_end|>\n")),
        ("mistral", ("[INST] ", " [/INST]", "", "<|im_end|>")),
        ("phi3", ("<|user|>\n", "<|end|>\n", "<|assistant|>\n", "<|end|>\n")),
        ("gemma3", ("<start_of_turn>user\n", "<end_of_turn>\n", "<start_of_turn>model\n", "<end_of_turn>\n")),
    ],
)
def test_each_familys_chat_template_exports_as_pieces(arch, pieces, family_dir, load, export_to):
    folder = export_to(load(str(family_dir(arch))), sink=4, pinned=0, window=124, chunk=16)
    chat = json.loads((folder / "manifest.json").read_text())["chat"]
    assert chat["source"] == "model"
    assert (chat["user_prefix"], chat["user_suffix"], chat["assistant_prefix"], chat["assistant_suffix"]) == pieces


# -- (c) the cpu build ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_cpu_build_of_each_family_runs_and_matches_the_export(arch, family_dir, load, export_to, tmp_path):
    """Every family takes the fused decoder (Qwen3 with its q / k norms emitted before the attention
    kernel): the export's logits, with eviction and pins."""
    import onnx

    from cabinlm.engines.build import build_artifact
    from cabinlm.engines.ort_fused.graph import ineligible
    from cabinlm.contract.manifest import Manifest
    from cabinlm.profiles import load_profile

    art = export_to(load(str(family_dir(arch))), kv="fp32", sink=2, pinned=10, window=16, chunk=4)
    assert ineligible(Manifest.from_dict(json.loads((art / "manifest.json").read_text()))) is None
    out = build_artifact(art, load_profile("cpu"), tmp_path / "build-cpu", accuracy_level=0)
    assert json.loads((out / "manifest.json").read_text())["build"]["backend"] == "onnxruntime-fused"
    ops = [n.op_type for n in onnx.load(str(out / "decoder.opt.onnx"), load_external_data=False).graph.node]
    # the first input norm and the final one, plus Qwen3's q and k norms in each of the 2 layers, or
    # Gemma 3's q and k norms and its attention / MLP output norms in each of its 3
    assert ops.count("SimplifiedLayerNormalization") == {"qwen3": 6, "gemma3": 14}.get(arch, 2)
    ref, built = Decoder(art, session_config={"session.qdq_matmulnbits_accuracy_level": "0"}), Decoder(out)
    rng = np.random.default_rng(0)
    worst = 0.0

    def feed(ids, **kw):
        nonlocal worst
        worst = max(worst, float(np.abs(ref.feed(ids, all_logits=True, **kw) - built.feed(ids, all_logits=True, **kw)).max()))

    feed(rng.integers(3, 300, 5), pin=True)
    for _ in range(20):
        feed(rng.integers(3, 300, int(rng.integers(1, 5))))
    for _ in range(40):
        feed(rng.integers(3, 300, 1))
    assert ref.cache.evicted == built.cache.evicted > 3 * 16
    assert worst < 1e-4


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
def test_the_int8_kv_cpu_build_stays_close_to_fp32(arch, family_dir, load, export_to, tmp_path, long_text):
    """The fused int8 cache holds rotated keys, scaled by the calibrated rotated_keys scales: for
    Qwen3 those of the normed keys, for Phi-3 of qkv_proj's k columns."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    loaded = load(str(family_dir(arch)))
    ids = tokens(loaded, long_text, 120)
    fp32 = graph_nll(export_to(loaded, sink=4, pinned=0, window=60, chunk=16, kv="fp32"), ids, chunked=True)
    art = export_to(loaded, sink=4, pinned=0, window=60, chunk=16, kv="int8")
    out = build_artifact(art, load_profile("cpu"), tmp_path / "build-cpu", accuracy_level=0)
    assert json.loads((out / "manifest.json").read_text())["build"]["backend"] == "onnxruntime-fused"
    int8 = graph_nll(out, ids, chunked=True)
    assert abs(int8.mean() - fp32.mean()) / fp32.mean() < 0.02


# -- (d) what is refused, in one line that names it -----------------------------------------------------


def _config(folder: Path, tmp_path: Path, **changes) -> Path:
    d = json.loads((folder / "config.json").read_text())
    d.update(changes)
    out = tmp_path / "config.json"
    out.write_text(json.dumps(d))
    return out


def _refused(path: Path, *words: str) -> str:
    from cabinlm.source.config import spec_from_config

    with pytest.raises(ModelError) as e:
        spec_from_config(path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_phi3_long_context_rope_is_refused_by_name(kind, family_dir, tmp_path):
    scaling = {"type": kind, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 256}
    _refused(_config(family_dir("phi3"), tmp_path, rope_scaling=scaling, rope_parameters=None), repr(kind))


def test_phi3_partial_rotary_is_refused(family_dir, tmp_path):
    _refused(_config(family_dir("phi3"), tmp_path, partial_rotary_factor=0.75), "partial_rotary_factor")


def test_qwen3_with_attention_bias_is_refused(family_dir, tmp_path):
    _refused(_config(family_dir("qwen3"), tmp_path, attention_bias=True), "qwen3", "attention_bias")


def test_an_unsupported_sibling_architecture_is_refused_by_name(family_dir, tmp_path):
    path = _config(family_dir("qwen3"), tmp_path, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    _refused(path, "Qwen3MoeForCausalLM")


def test_a_sliding_window_shorter_than_the_cache_is_refused_before_the_weights_load(family_dir, tmp_path):
    """Mistral's sliding_window 64 against sink 4 + window 124 + chunk 16 = 144 keys a query sees."""
    from cabinlm.export import ExportOptions, export_model

    folder = family_dir("mistral", sliding_window=64)
    with pytest.raises(ModelError) as e:
        export_model(str(folder), tmp_path / "out", ExportOptions(sink=4, pinned=0, window=124, chunk=16, verify=False,
                                                                  gate=False))  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg and "sliding_window 64" in msg and "144" in msg, msg
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_sliding_window_as_long_as_the_cache_is_exported_dense_exact(family_dir, load, export_to, long_text):
    """sliding_window 64 = sink 4 + window 44 + chunk 16: every query the graph runs sees every key
    transformers' sliding mask lets it see, so the export is the model (and past the cache, the
    streaming semantics take over as for any model)."""
    loaded = load(str(family_dir("mistral", sliding_window=64)))
    folder = export_to(loaded, sink=4, pinned=0, window=44, chunk=16)
    ids = tokens(loaded, long_text, 64)
    np.testing.assert_allclose(graph_nll(folder, ids, chunked=True), hf_dense_nll(loaded, ids), atol=TOL)


def test_which_configs_slide():
    """Mistral and Phi-3 slide when sliding_window is set; Qwen2 / Qwen3 only on layers marked
    sliding (their configs carry a sliding_window they do not use)."""
    from cabinlm.source.config import attention_window, local_layers

    assert attention_window({"model_type": "mistral", "sliding_window": 4096}) == 4096
    assert attention_window({"model_type": "mistral"}) == 4096  # transformers' default for a bare config
    assert attention_window({"model_type": "mistral", "sliding_window": None}) is None
    assert attention_window({"model_type": "phi3", "sliding_window": 2047}) == 2047
    full = ["full_attention"] * 4
    assert attention_window({"model_type": "qwen3", "sliding_window": 4096, "layer_types": full}) is None
    # some layers slide, some do not: per-layer cache geometry (local_layers), not one window for all
    mixed = {"model_type": "qwen3", "sliding_window": 512, "layer_types": full[:2] + ["sliding_attention"] * 2}
    assert attention_window(mixed) is None and local_layers(mixed) == (2, 3)
    assert attention_window({"model_type": "qwen3", "sliding_window": 512, "layer_types": ["sliding_attention"] * 4}) == 512
    older = {"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True, "max_window_layers": 2,
             "num_hidden_layers": 4}  # fmt: skip
    assert attention_window(older) is None and local_layers(older) == (2, 3)
    gemma = {"model_type": "gemma3_text", "sliding_window": 512, "num_hidden_layers": 12, "sliding_window_pattern": 6}
    assert local_layers(gemma) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # every sixth layer global
    assert attention_window({"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False,
                             "max_window_layers": 2, "num_hidden_layers": 4}) is None  # fmt: skip


def test_a_gguf_of_an_unsupported_architecture_is_refused_in_one_line_naming_it(tmp_path):
    """A real GGUF file (written with gguf-py) whose architecture neither transformers nor cabinlm reads."""
    import gguf

    from cabinlm.export import ExportOptions, export_model

    path = tmp_path / "neox.gguf"
    w = gguf.GGUFWriter(str(path), "gptneox")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError) as e:
        export_model(str(path), tmp_path / "out", ExportOptions(verify=False, gate=False))
    assert "\n" not in str(e.value) and "gptneox" in str(e.value)
    assert not (tmp_path / "out").exists()
