"""LoRA adapters merged at export (export/lora.py): tiny random Llama / Qwen2 models, random adapters
made with PEFT itself (its B factors set non-zero: PEFT starts them at zero, which would hide every
mistake), held to PEFT's own merge (`merge_and_unload`) in transformers. Then the same factors as a
llama.cpp GGUF LoRA file, the GGUF block import beside a merge, and each bad input in one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tiny_model
from test_cli import assert_clean_error, cabinlm
from test_equivalence import TOL, graph_nll, nll_of, reference_nll, tokens

from cabinlm.contract.errors import ModelError, OptionError
from cabinlm.export import ExportOptions, export_loaded, merge_lora
from cabinlm.export.lora import LoraRequest, read_adapter
from cabinlm.export.models import decoder_weights, load_model
from cabinlm.runtime import Decoder

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DENSE = dict(sink=4, pinned=0, window=124, chunk=16)  # 128 slots: the test's stream fits


def make_peft_adapter(model_dir: Path, out: Path, *, r: int = 4, alpha: float = 8, targets=ALL, seed: int = 1,
                      zero: bool = False, **config) -> Path:  # fmt: skip
    """A PEFT LoRA folder for the model in model_dir, with random A and B (B = 0 when zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "lora_B" in name:
                p.copy_(torch.zeros(p.shape) if zero else torch.randn(p.shape, generator=g) * 0.3)
    peft.save_pretrained(out)
    return out


def peft_merged(model_dir: Path, adapter: Path):
    """PEFT's own merge of the adapter folder into the base model (read back from disk)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()


def export_with(model_dir: Path, out: Path, lora: Path | str | None, **opts) -> tuple[Path, object]:
    """A fresh load (a merge changes the loaded model's weights), exported with the adapter merged."""
    loaded = load_model(str(model_dir))
    request = None if lora is None else (LoraRequest.parse(lora) if isinstance(lora, str) else LoraRequest(lora))
    export_loaded(loaded, out, ExportOptions(lora=request, verify=False, gate=False, **{**DENSE, **opts}))
    return out, loaded


def merged_nll(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return nll_of(model(torch.tensor([ids])).logits[0].numpy(), ids)


def graph_logits(folder: Path, ids: list[int]) -> np.ndarray:
    return Decoder(folder).feed(np.asarray(ids, dtype=np.int64), all_logits=True).copy()


@pytest.fixture(scope="module")
def llama_adapter(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("lora-llama") / "adapter")


# -- merged adapters against PEFT ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_merged_peft_adapter_is_dense_equal_to_peft_merge_and_unload(arch, request, tmp_path, long_text):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=3)
    folder, loaded = export_with(model_dir, tmp_path / "art", adapter)
    reference = peft_merged(model_dir, adapter)
    # The merged weights are PEFT's, number for number.
    ours = dict(loaded.model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0, msg=name)
    ids = tokens(loaded, long_text, 128)
    expected = merged_nll(reference, ids)
    np.testing.assert_allclose(graph_nll(folder, ids, chunked=True), expected, atol=TOL)
    # The comparison can tell: the adapter moved the model away from its base.
    base = load_model(str(model_dir))
    assert np.abs(merged_nll(base.model, ids) - expected).max() > 50 * TOL
    lora = json.loads((folder / "manifest.json").read_text())["quality"]["lora"]
    assert lora == {"source": str(adapter), "format": "peft", "file": "adapter_model.safetensors",
                    "sha256": hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest(),
                    "rank": 4, "alpha": 8.0, "rslora": False, "scale": 1.0, "targets": sorted(ALL),
                    "matrices": 14, "base_model": str(model_dir)}  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 8], ids=["one-token", "chunk8"])
def test_a_merged_adapter_follows_the_streaming_semantics_past_the_window(chunk, tiny_llama_dir, llama_adapter,
                                                                           tmp_path, long_text):  # fmt: skip
    folder, loaded = export_with(tiny_llama_dir, tmp_path / "art", llama_adapter, window=24, chunk=8)
    ids = tokens(loaded, long_text, 150)  # five times the cache
    reference = SimpleNamespace(model=peft_merged(tiny_llama_dir, llama_adapter))
    expected = reference_nll(reference, ids, sink=4, window=24, chunk=chunk)
    dec = Decoder(folder)
    ours = nll_of(np.concatenate([dec.step(np.array(ids[i : i + chunk])).copy() for i in range(0, len(ids), chunk)]), ids)
    np.testing.assert_allclose(ours, expected, atol=TOL)
    assert np.abs(ours[40:] - merged_nll(reference.model, ids)[40:]).max() > 50 * TOL  # eviction happened


def test_the_cli_merges_an_adapter_and_checks_the_result_against_transformers(tiny_qwen2_dir, tmp_path):
    """Through `cabinlm export --lora`: --verify compares the graph with the merged transformers model."""
    adapter = make_peft_adapter(tiny_qwen2_dir, tmp_path / "adapter", targets=["q_proj", "up_proj"])
    p = cabinlm("export", tiny_qwen2_dir, "-o", tmp_path / "art", "--window", 124, "--chunk", 16, "--lora", f"{adapter}:0.5")
    assert p.returncode == 0, p.stderr
    assert f"LoRA {adapter} merged" in p.stdout and "merged LoRA" in p.stderr
    quality = json.loads((tmp_path / "art" / "manifest.json").read_text())["quality"]
    assert quality["lora"]["scale"] == 0.5 and quality["lora"]["targets"] == ["q_proj", "up_proj"]
    assert quality["dense_check"]["max_abs_logit_diff"] < TOL


def test_rslora_scales_by_alpha_over_the_root_of_the_rank(tiny_qwen2_dir, tmp_path, long_text):
    adapter = make_peft_adapter(tiny_qwen2_dir, tmp_path / "adapter", r=8, alpha=4, targets=["q_proj", "v_proj", "down_proj"],
                                use_rslora=True, seed=5)  # fmt: skip
    assert read_adapter(adapter).pairs[0].scaling == pytest.approx(4 / 8**0.5)  # not 4 / 8
    folder, loaded = export_with(tiny_qwen2_dir, tmp_path / "art", adapter)
    ids = tokens(loaded, long_text, 128)
    np.testing.assert_allclose(graph_nll(folder, ids, chunked=True), merged_nll(peft_merged(tiny_qwen2_dir, adapter), ids),
                               atol=TOL)  # fmt: skip
    assert json.loads((folder / "manifest.json").read_text())["quality"]["lora"]["rslora"] is True


def test_the_scale_multiplies_the_adapters_own(tiny_llama_dir, llama_adapter, tmp_path):
    """--lora DIR:0.5 adds half of what PEFT's merge adds to every weight."""
    _, half = export_with(tiny_llama_dir, tmp_path / "half", f"{llama_adapter}:0.5")
    base = load_model(str(tiny_llama_dir)).model
    full = peft_merged(tiny_llama_dir, llama_adapter)
    w = lambda m: m.model.layers[1].mlp.down_proj.weight  # noqa: E731
    torch.testing.assert_close(w(half.model) - w(base), (w(full) - w(base)) * 0.5, rtol=1e-5, atol=1e-6)
    assert half.lora.to_dict()["scale"] == 0.5


def test_a_zero_adapter_exports_the_base_model_bit_for_bit(tiny_qwen2_dir, tmp_path, long_text):
    adapter = make_peft_adapter(tiny_qwen2_dir, tmp_path / "adapter", zero=True)
    with_zero, loaded = export_with(tiny_qwen2_dir, tmp_path / "zero", adapter)
    plain, _ = export_with(tiny_qwen2_dir, tmp_path / "plain", None)
    ids = tokens(loaded, long_text, 100)
    np.testing.assert_array_equal(graph_logits(with_zero, ids), graph_logits(plain, ids))


def test_fan_in_fan_out_is_ignored_on_linear_projections_as_peft_does(tiny_llama_dir, llama_adapter, tmp_path, long_text):
    """PEFT turns fan_in_fan_out off for nn.Linear: the merge is the same with it set."""
    adapter = shutil.copytree(llama_adapter, tmp_path / "fifo")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "fan_in_fan_out": True}))
    _, loaded = export_with(tiny_llama_dir, tmp_path / "art", adapter)
    reference = dict(peft_merged(tiny_llama_dir, adapter).named_parameters())
    for name, p in loaded.model.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=0, atol=0, msg=name)


# -- GGUF LoRA (llama.cpp's adapter format) ------------------------------------------------------------

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def write_gguf_lora(peft_dir: Path, path: Path, arch: str, heads: tuple[int, int], alpha: float) -> Path:
    """The PEFT adapter's factors as llama.cpp's converter writes them: blk.N.attn_q.weight.lora_a / _b,
    and for "llama" files the RoPE halves of q's and k's rows interleaved (on B, the output side)."""
    import gguf
    from safetensors.numpy import load_file

    def permute(b: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
        return b.reshape(n_head, 2, b.shape[0] // n_head // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for key, a in sorted(load_file(peft_dir / "adapter_model.safetensors").items()):
        if ".lora_A." not in key:
            continue
        b = load_file(peft_dir / "adapter_model.safetensors")[key.replace("lora_A", "lora_B")]
        i = int(key.split("layers.")[1].split(".")[0])
        proj = key.split(".lora_A")[0].rsplit(".", 1)[1]
        if arch == "llama" and proj in ("q_proj", "k_proj"):
            b = permute(b, heads[0] if proj == "q_proj" else heads[1])
        name = f"blk.{i}.{GGUF_NAMES[proj]}.weight"
        w.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
        w.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_lora_exports_equal_to_the_peft_adapter_it_was_written_from(arch, request, tmp_path, long_text):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    peft_dir = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=7)
    gguf_file = write_gguf_lora(peft_dir, tmp_path / "adapter.gguf", arch, (4, 2), alpha=8)
    from_peft, loaded = export_with(model_dir, tmp_path / "peft", peft_dir)
    from_gguf, merged = export_with(model_dir, tmp_path / "gguf", gguf_file)
    ours = dict(merged.model.named_parameters())
    for name, p in loaded.model.named_parameters():  # q / k rows un-interleaved: the same weights
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0, msg=name)
    ids = tokens(loaded, long_text, 100)
    np.testing.assert_array_equal(graph_logits(from_gguf, ids), graph_logits(from_peft, ids))
    lora = json.loads((from_gguf / "manifest.json").read_text())["quality"]["lora"]
    assert (lora["format"], lora["file"], lora["rank"], lora["alpha"], lora["matrices"]) == ("gguf", "adapter.gguf", 4, 8.0, 14)


@pytest.mark.slow
def test_a_gguf_base_re_quantizes_only_the_merged_matrices(tmp_path):
    """SmolLM2's Q4_1 / Q8_0 blocks are imported as they are, but for the matrices an adapter changed:
    those are W + delta, quantized from float32."""
    from safetensors.numpy import save_file

    from cabinlm.export import wquant

    loaded = load_model("smollm2-135m")
    rng = np.random.default_rng(0)
    hidden, inter = loaded.spec.hidden_size, loaded.spec.intermediate_size
    (tmp_path / "adapter").mkdir()
    save_file({"base_model.model.model.layers.3.mlp.down_proj.lora_A.weight": rng.standard_normal((2, inter), np.float32),
               "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight": rng.standard_normal((hidden, 2), np.float32) * 0.01},
              tmp_path / "adapter" / "adapter_model.safetensors")  # fmt: skip
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    logs: list[str] = []
    merge_lora(loaded, LoraRequest(tmp_path / "adapter"), logs.append)
    q = decoder_weights(loaded, "int4", logs.append)
    f = decoder_weights(loaded, "fp32")
    assert q.weight_source == {"imported": 210, "quantized": 1, "lora_requantized": 1, "head": "int8"}
    assert any("1 of them merged with the LoRA adapter, so re-quantized" in line for line in logs)
    np.testing.assert_array_equal(q.layers[3].down.dequantize(), wquant.quantize(f.layers[3].down, "int4").dequantize())
    np.testing.assert_array_equal(q.layers[2].down.dequantize(), f.layers[2].down)  # imported: the file's numbers


# -- what is refused ---------------------------------------------------------------------------------------


def refused(model_dir: Path, adapter: Path) -> str:
    loaded = load_model(str(model_dir))
    with pytest.raises(ModelError) as e:
        merge_lora(loaded, LoraRequest(adapter))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--lora {adapter}")
    return msg


def test_an_adapter_for_another_base_model_is_refused_by_the_cli_before_the_weights_load(tiny_llama_dir, tmp_path):
    other = make_tiny_model(tmp_path / "wider", "llama", hidden_size=32, intermediate_size=64)
    adapter = make_peft_adapter(other, tmp_path / "adapter", targets=["q_proj"])
    p = cabinlm("export", tiny_llama_dir, "-o", tmp_path / "o", "--window", 124, "--chunk", 16, "--lora", adapter)
    assert_clean_error(p, "layers.0.self_attn.q_proj", "(4, 32)", "expected A (r, 64)", "another base model")
    assert p.returncode == 2 and "loading" not in p.stderr


def test_a_target_module_the_model_lacks_is_refused(tiny_llama_dir, tmp_path):
    deeper = make_tiny_model(tmp_path / "deeper", "llama", num_hidden_layers=3)
    adapter = make_peft_adapter(deeper, tmp_path / "adapter", targets=["v_proj"])
    assert "targets layers.2.self_attn.v_proj, but the model has 2 layers" in refused(tiny_llama_dir, adapter)


def test_a_truncated_or_missing_safetensors_file_is_refused(llama_adapter, tiny_llama_dir, tmp_path):
    cut = shutil.copytree(llama_adapter, tmp_path / "cut")
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "not a readable safetensors file" in refused(tiny_llama_dir, cut)
    (cut / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in refused(tiny_llama_dir, cut)


@pytest.mark.parametrize(
    "config, needle",
    [({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save")],
    ids=["dora", "modules-to-save"],
)
def test_what_a_merge_cannot_hold_is_refused(config, needle, tiny_llama_dir, tmp_path):
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "adapter", targets=["q_proj"], **config)
    msg = refused(tiny_llama_dir, adapter)
    assert needle in msg and "cannot hold" in msg


def test_another_peft_type_is_refused(tiny_llama_dir, tmp_path):
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    get_peft_model(base, IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])).save_pretrained(tmp_path / "ia3")
    assert "peft_type 'IA3'; cabinlm merges LoRA adapters only" in refused(tiny_llama_dir, tmp_path / "ia3")


def test_a_truncated_gguf_lora_is_refused(tiny_llama_dir, llama_adapter, tmp_path):
    data = write_gguf_lora(llama_adapter, tmp_path / "a.gguf", "llama", (4, 2), alpha=8).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    assert "not a readable GGUF file" in refused(tiny_llama_dir, tmp_path / "cut.gguf")


def test_a_gguf_lora_for_another_architecture_is_refused(tiny_llama_dir, llama_adapter, tmp_path):
    gguf_file = write_gguf_lora(llama_adapter, tmp_path / "qwen.gguf", "qwen2", (4, 2), alpha=8)
    assert "an adapter for GGUF architecture 'qwen2', but the model (LlamaForCausalLM) is 'llama'" in refused(tiny_llama_dir, gguf_file)


def test_a_loaded_model_takes_one_adapter(tiny_llama_dir, llama_adapter, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    first = merge_lora(loaded, LoraRequest(llama_adapter))
    assert merge_lora(loaded, LoraRequest(llama_adapter)) is first  # the same request: already merged
    other = shutil.copytree(llama_adapter, tmp_path / "other")
    with pytest.raises(Exception, match="already has .* merged"):
        merge_lora(loaded, LoraRequest(other))


def test_the_lora_option_parses_a_scale_after_the_last_colon(tmp_path):
    assert LoraRequest.parse("ad:0.5") == LoraRequest(Path("ad"), 0.5)
    assert LoraRequest.parse("ad") == LoraRequest(Path("ad"), 1.0)
    assert LoraRequest.parse("a:b") == LoraRequest(Path("a:b"), 1.0)  # a colon in a name, not a scale
    with pytest.raises(OptionError, match="finite"):
        LoraRequest.parse("ad:nan")
    with pytest.raises(OptionError, match="no such folder or file"):
        ExportOptions(lora=LoraRequest(tmp_path / "missing"))
