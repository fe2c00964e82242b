"""The two core correctness facts of docs/design.md ("The cache"), against independent references:

1. while the stream fits in the cache, the graph is dense attention: per-token NLL equals
   `transformers`' own forward pass;
2. beyond the cache, it is the sink + rolling-window semantics: per-token NLL equals the plain
   PyTorch reference in tests/reference.py, for one-token steps and for chunked prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cabinlm.runtime import Decoder
from cabinlm.runtime.perplexity import token_nll
from reference import StreamingReference

TOL = 1e-3


def nll_of(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """NLL of ids[1:] given logits rows 0..n-2."""
    return np.array([token_nll(logits[i], ids[i + 1]) for i in range(len(ids) - 1)])


def hf_dense_nll(loaded, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits[0].numpy()
    return nll_of(logits, ids)


def graph_nll(folder, ids: list[int], chunked: bool) -> np.ndarray:
    dec = Decoder(folder)
    if chunked:
        logits = dec.feed(ids, all_logits=True)
    else:
        logits = np.stack([dec.step(np.array([t]))[0].copy() for t in ids])
    return nll_of(logits, ids)


def reference_nll(loaded, ids: list[int], sink: int, window: int, chunk: int, local: bool = False) -> np.ndarray:
    """local: the model's sliding-window layers keep their own window (per-layer cache geometry)."""
    ref = StreamingReference(loaded.model, sink=sink, window=window, local=local)
    rows = [ref.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return nll_of(torch.cat(rows).numpy(), ids)


def tokens(loaded, text: str, n: int) -> list[int]:
    ids = loaded.tokenizer.backend_tokenizer.encode(text).ids
    assert len(ids) >= n, f"need {n} tokens, text has {len(ids)}"
    return ids[:n]


# -- tiny random-weight models: Llama (untied head) and Qwen2 (tied head, q/k/v biases) -------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-token", "chunked"])
def test_tiny_models_are_dense_while_the_stream_fits(arch, chunked, request, load, export_to, long_text):
    loaded = load(str(request.getfixturevalue(f"tiny_{arch}_dir")))
    folder = export_to(loaded, sink=4, pinned=0, window=124, chunk=16)
    ids = tokens(loaded, long_text, 128)  # exactly fills sink + window
    np.testing.assert_allclose(graph_nll(folder, ids, chunked), hf_dense_nll(loaded, ids), atol=TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("sink", [4, 0], ids=["sink4", "window-only"])
@pytest.mark.parametrize("chunk", [1, 8], ids=["one-token", "chunk8"])
def test_tiny_models_follow_the_streaming_semantics_past_the_window(
    arch, sink, chunk, request, load, export_to, long_text
):
    loaded = load(str(request.getfixturevalue(f"tiny_{arch}_dir")))
    folder = export_to(loaded, sink=sink, pinned=0, window=24, chunk=8)
    ids = tokens(loaded, long_text, 150)  # five times the cache
    ref = reference_nll(loaded, ids, sink=sink, window=24, chunk=chunk)
    dec = Decoder(folder)
    rows = [dec.step(np.array(ids[i : i + chunk])).copy() for i in range(0, len(ids), chunk)]
    ours = nll_of(np.concatenate(rows), ids)
    np.testing.assert_allclose(ours, ref, atol=TOL)
    # The comparison can tell: past the window, the streaming result differs from dense attention.
    dense = hf_dense_nll(loaded, ids)
    assert np.abs(ours[40:] - dense[40:]).max() > 50 * TOL


def test_the_reference_itself_is_dense_while_the_stream_fits(load, tiny_llama_dir, long_text):
    loaded = load(str(tiny_llama_dir))
    ids = tokens(loaded, long_text, 60)
    np.testing.assert_allclose(reference_nll(loaded, ids, 4, 100, 7), hf_dense_nll(loaded, ids), atol=TOL)


# -- the real model ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_is_dense_while_the_stream_fits(smollm2, export_to, long_text):
    folder = export_to(smollm2, sink=4, pinned=124, window=252, chunk=64)
    ids = tokens(smollm2, long_text, 300)
    expected = hf_dense_nll(smollm2, ids)
    np.testing.assert_allclose(graph_nll(folder, ids, chunked=True), expected, atol=TOL)
    np.testing.assert_allclose(graph_nll(folder, ids[:120], chunked=False), expected[:119], atol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 16], ids=["one-token", "chunk16"])
def test_smollm2_follows_the_streaming_semantics_past_the_window(chunk, smollm2, export_to, long_text):
    folder = export_to(smollm2, sink=4, pinned=0, window=60, chunk=16)
    ids = tokens(smollm2, long_text, 256)
    ref = reference_nll(smollm2, ids, sink=4, window=60, chunk=chunk)
    dec = Decoder(folder)
    rows = [dec.step(np.array(ids[i : i + chunk])).copy() for i in range(0, len(ids), chunk)]
    np.testing.assert_allclose(nll_of(np.concatenate(rows), ids), ref, atol=TOL)


@pytest.mark.slow
def test_smollm2_fp16_kv_stays_close_to_fp32(smollm2, export_to, long_text):
    ids = tokens(smollm2, long_text, 200)
    fp32 = graph_nll(export_to(smollm2, sink=4, pinned=0, window=60, chunk=16), ids, chunked=True)
    fp16 = graph_nll(export_to(smollm2, sink=4, pinned=0, window=60, chunk=16, kv="fp16"), ids, chunked=True)
    assert abs(fp16.mean() - fp32.mean()) / fp32.mean() < 0.005
