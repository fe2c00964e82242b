"""Switchable LoRA adapters (export --lora-rank, build --adapter, a seat's adapter at run time): tiny
random Llama / Qwen2 models and random PEFT adapters (test_lora.make_peft_adapter), held to PEFT's own
merge in transformers, to the streaming reference past the window, and to the base export bit for bit
with no adapter. Then the build's prepared files, seats, session files, serve, and each bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_cli import assert_clean_error, cabinlm
from test_equivalence import TOL, nll_of, reference_nll, tokens
from test_lora import DENSE, make_peft_adapter, merged_nll, peft_merged

from cabinlm.contract.adapters import TARGETS
from cabinlm.contract.errors import InputError, ModelError, OptionError
from cabinlm.export import ExportOptions, export_loaded
from cabinlm.export.adapter_files import AdapterRequest, prepare
from cabinlm.export.models import load_model
from cabinlm.runtime import Decoder


def export_switchable(model_dir: Path, out: Path, rank: int = 8, **opts) -> tuple[Path, object]:
    loaded = load_model(str(model_dir))
    export_loaded(loaded, out, ExportOptions(lora_rank=rank, verify=False, gate=False, **{**DENSE, **opts}))
    return out, loaded


def with_adapter(folder: Path, adapter: Path | None, scale: float = 1.0) -> Decoder:
    """A decoder of the export with the adapter's padded inputs fed (no build needed)."""
    dec = Decoder(folder)
    if adapter is not None:
        spec = f"{adapter}:{scale}" if scale != 1.0 else str(adapter)
        dec.backend.set_adapter(prepare(AdapterRequest.parse(f"a={spec}"), dec.manifest).arrays)
    return dec


@pytest.fixture(scope="module")
def llama_switch(tiny_llama_dir, tmp_path_factory):
    """One switchable export of the tiny Llama (rank 8, every target) and two adapters for it."""
    root = tmp_path_factory.mktemp("lora-switch")
    folder, loaded = export_switchable(tiny_llama_dir, root / "art")
    a = make_peft_adapter(tiny_llama_dir, root / "a", r=4, alpha=8, seed=11)
    b = make_peft_adapter(tiny_llama_dir, root / "b", r=8, alpha=16, seed=12, targets=["q_proj", "v_proj", "down_proj"])
    return SimpleNamespace(folder=folder, loaded=loaded, a=a, b=b, root=root)


# -- the graph: an adapter fed = PEFT's merge; none = the base export ------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_adapter_fed_to_the_switchable_graph_is_dense_equal_to_peft(arch, request, tmp_path, long_text):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=3)
    folder, loaded = export_switchable(model_dir, tmp_path / "art", rank=8)
    ids = tokens(loaded, long_text, 128)
    dec = with_adapter(folder, adapter)
    ours = nll_of(dec.feed(ids, all_logits=True), ids)
    expected = merged_nll(peft_merged(model_dir, adapter), ids)
    np.testing.assert_allclose(ours, expected, atol=TOL)
    assert np.abs(merged_nll(loaded.model, ids) - expected).max() > 50 * TOL  # the adapter moved the model


def test_an_adapter_fed_follows_the_streaming_semantics_past_the_window(tiny_llama_dir, tmp_path, long_text):
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "adapter", r=4, alpha=8, seed=5)
    folder, loaded = export_switchable(tiny_llama_dir, tmp_path / "art", rank=4, window=24, chunk=8)
    ids = tokens(loaded, long_text, 150)  # five times the cache
    reference = SimpleNamespace(model=peft_merged(tiny_llama_dir, adapter))
    expected = reference_nll(reference, ids, sink=4, window=24, chunk=8)
    dec = with_adapter(folder, adapter)
    ours = nll_of(np.concatenate([dec.step(np.array(ids[i : i + 8])).copy() for i in range(0, len(ids), 8)]), ids)
    np.testing.assert_allclose(ours, expected, atol=TOL)
    assert np.abs(ours[40:] - merged_nll(reference.model, ids)[40:]).max() > 50 * TOL  # eviction happened


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_no_adapter_is_the_base_export_bit_for_bit(arch, request, tmp_path, long_text):
    """Zeros in A and B add exact zeros: the logits are the plain export's, bit for bit, in chunks and
    in one-token steps."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    folder, loaded = export_switchable(model_dir, tmp_path / "switch", rank=8)
    plain = tmp_path / "plain"
    export_loaded(loaded, plain, ExportOptions(verify=False, gate=False, **DENSE))
    ids = np.asarray(tokens(loaded, long_text, 100))
    for chunked in (True, False):
        got = []
        for f in (folder, plain):
            dec = Decoder(f)
            got.append(dec.feed(ids, all_logits=True) if chunked else np.stack([dec.step(ids[i : i + 1])[0].copy()
                                                                                 for i in range(len(ids))]))  # fmt: skip
        np.testing.assert_array_equal(got[0], got[1])
