"""Switchable LoRA adapters on the fused cpu decoder (engines/ort_fused/adapter_graph.py): a built
adapter gives the exported graph's logits with the same adapter (to the fused engine's usual tolerance,
through eviction and pins) and PEFT's merge; no adapter gives the fused build of the same model
exported without adapter inputs, bit for bit; a fused build of such an export has no adapter nodes;
and seats with different adapters (and one without) decoding together in the batched graphs each get
their own logits, bit for bit as alone, across a switch of one seat's adapter. On cabinlm's kernels the
terms are one LoraTerms node per fused matrix (kernels/lora_terms.cc), and a build on its block
matmuls carries plain twins of its graphs that seats without an adapter run (alone, and in batches
where no seat has one); a batch mixing seats with and without runs the adapter graph, zeros for the
seats without, which must give the plain twin's logits bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from test_batched_seats import Pair, step_together
from test_equivalence import TOL, nll_of, tokens
from test_fused import ACC0, LAYOUT, drive
from test_lora import DENSE, make_peft_adapter, merged_nll, peft_merged

from cabinlm.contract.engines.fused import FusedSettings
from cabinlm.contract.manifest import load_manifest
from cabinlm.engines.build import build_artifact
from cabinlm.engines.ort_fused import kernels
from cabinlm.export.adapter_files import AdapterRequest, prepare
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder


def built(art, out, adapters: dict, **kw):
    """The export's fused cpu build with these adapters (name -> PEFT folder) prepared."""
    m = load_manifest(art)
    prepared = [prepare(AdapterRequest.parse(f"{n}={d}"), m) for n, d in adapters.items()]
    return build_artifact(art, load_profile("cpu"), out, adapters=prepared, **kw)


def exported_with(art, adapter, **kw) -> Decoder:
    """The exported graph (float32 activations) with the adapter's inputs fed."""
    dec = Decoder(art, **kw)
    dec.backend.set_adapter(prepare(AdapterRequest.parse(f"x={adapter}"), dec.manifest).arrays)
    return dec


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-adapters")
    return {"a": make_peft_adapter(tiny_llama_dir, root / "a", r=4, alpha=8, seed=21),
            "b": make_peft_adapter(tiny_llama_dir, root / "b", r=8, alpha=16, seed=22, targets=["q_proj", "v_proj", "down_proj"]),
            "c": make_peft_adapter(tiny_llama_dir, root / "c", r=2, alpha=4, seed=23, targets=["o_proj", "gate_proj"]),
            "d": make_peft_adapter(tiny_llama_dir, root / "d", r=8, alpha=8, seed=24)}  # fmt: skip


def lora_ops(folder, graph: str = "decoder.opt.onnx") -> list[str]:
    """The adapter nodes' operators of a build's graph."""
    return [n.op_type for n in onnx.load(str(folder / graph), load_external_data=False).graph.node if "lora" in n.name]


@pytest.mark.parametrize("kernel", ["onnxruntime", "cabinlm"])
def test_a_fused_build_with_an_adapter_gives_the_exported_graphs_logits(kernel, load, tiny_llama_dir, export_to, adapters,
                                                                         tmp_path):  # fmt: skip
    """fp32 KV and weights, float32 activations on both: the fused decoder with each adapter (every
    projection; q, v and down only) follows the exported graph with it through pins and eviction,
    its terms on Gemms (ONNX Runtime's attention: no kernel library) or on cabinlm's LoraTerms."""
    art = export_to(load(str(tiny_llama_dir)), kv="fp32", weights="fp32", lora_rank=8, **LAYOUT)
    out = built(art, tmp_path / "fused", {"a": adapters["a"], "b": adapters["b"]}, attention="fused", accuracy_level=0,
                attention_kernel=kernel)  # fmt: skip
    m = load_manifest(out)
    assert m.runtime_spec.backend.value == "onnxruntime-fused" and m.lora.names == ("a", "b")
    ops = lora_ops(out)
    if kernel == "cabinlm":  # one node per fused matrix and layer (the down projection's input a MatMul's here)
        assert sorted(set(ops)) == [kernels.LORA_OP] and len(ops) == 4 * 2
    else:
        assert kernels.LORA_OP not in ops and ops.count("Gemm") == 2 * 7 * 2
    # a: every projection, at scale 2 with factors of 0.3 randn, perturbs the tiny model so much that
    # float32 rounding differences grow tenfold (each projection's alone stays below 2e-5)
    for name, tol in (("a", 1e-3), ("b", 1e-4)):
        fused = Decoder(out)
        fused.set_adapter(name)
        ref = exported_with(art, adapters[name], session_config=ACC0)
        assert drive([ref, fused], np.random.default_rng(3)) < tol
        base = Decoder(out)
        fused.reset()
        for d in (base, fused):
            d.feed(np.arange(3, 8), pin=True)
        assert np.abs(fused.feed(np.arange(8, 20), all_logits=True) - base.feed(np.arange(8, 20), all_logits=True)).max() > 1e-2


def test_a_fused_build_with_an_adapter_gives_peft_merged_models_logits(load, tiny_llama_dir, export_to, adapters,
                                                                       long_text, tmp_path):  # fmt: skip
    loaded = load(str(tiny_llama_dir))
    art = export_to(loaded, kv="fp32", weights="fp32", lora_rank=8, **DENSE)
    out = built(art, tmp_path / "fused", {"a": adapters["a"]}, attention="fused", accuracy_level=0)
    ids = tokens(loaded, long_text, 100)
    dec = Decoder(out)
    dec.set_adapter("a")
    ours = nll_of(dec.feed(np.asarray(ids), all_logits=True), ids)
    np.testing.assert_allclose(ours, merged_nll(peft_merged(tiny_llama_dir, adapters["a"]), ids), atol=TOL)


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_no_adapter_is_the_fused_build_of_the_export_without_adapter_inputs_bit_for_bit(weights, load, tiny_llama_dir,
                                                                                       export_to, adapters, tmp_path):  # fmt: skip
    """int4: cabinlm's block matmuls, the down projection's SwiGLU inside its kernel (the adapter term
    computes SiLU(gate) * up beside it). The plain export's fused graph takes no adapter node."""
    loaded = load(str(tiny_llama_dir))
    opts = dict(kv="int8", weights=weights, head="int4" if weights == "int4" else None, **LAYOUT)
    plain = build_artifact(export_to(loaded, **opts), load_profile("cpu"), tmp_path / "plain")
    switch = built(export_to(loaded, lora_rank=8, **opts), tmp_path / "switch", {"d": adapters["d"]})
    graph = onnx.load(str(plain / "decoder.opt.onnx"), load_external_data=False)
    assert not [n for n in graph.graph.node if "lora" in n.name] and not [i for i in graph.graph.input if "lora" in i.name]
    adapted = onnx.load(str(switch / "decoder.opt.onnx"), load_external_data=False)
    assert sum("lora" in i.name for i in adapted.graph.input) == 2 * 7 * 2  # 2 layers, 7 projections, A and B
    facts = load_manifest(switch).runtime_spec.facts_as(FusedSettings)
    ops = lora_ops(switch)
    if weights == "int4":  # LoraTerms for q|k|v, o, gate|up, LoraSwiGLUTerms for down; plain twins of every graph
        assert ops.count(kernels.LORA_OP) == 3 * 2 and ops.count(kernels.LORA_SWIGLU_OP) == 2 and len(ops) == 8
        assert facts.plain_graphs and {"graph_plain", "graph_plain_seats2", "graph_plain_seats4"} <= set(load_manifest(switch).files)
        for twin in ("decoder.plain.onnx", "decoder.plain.seats2.onnx"):
            g = onnx.load(str(switch / twin), load_external_data=False)
            assert not lora_ops(switch, twin) and not [i for i in g.graph.input if "lora" in i.name]
        assert [p.name for p in switch.glob("*.data")] == ["decoder.opt.onnx.data"]  # one weights file for every graph
        fresh = Decoder(switch).backend
        assert fresh._decode.session is fresh.graphs.plain and fresh.graphs.decoder is None  # no adapter: the twin alone
    else:  # fp32 weights on MatMul, which packs its weights per session: no twin, the adapter graph fed zeros
        assert not facts.plain_graphs and "graph_plain" not in load_manifest(switch).files and kernels.LORA_OP in ops
    ids = np.random.default_rng(5).integers(3, 300, 60)
    for chunked in (True, False):
        got = []
        for dec in (Decoder(plain), Decoder(switch), Decoder(switch)):
            if len(got) == 2:  # an adapter bound, then none again
                dec.set_adapter("d")
                dec.set_adapter(None)
            dec.feed(ids[:6], pin=True)
            got.append(dec.feed(ids[6:], all_logits=True) if chunked else np.stack([dec.step(ids[i : i + 1])[0].copy()
                                                                                   for i in range(6, len(ids))]))  # fmt: skip
        np.testing.assert_array_equal(got[1], got[0])
        np.testing.assert_array_equal(got[2], got[0])
    d = Decoder(switch)
    d.set_adapter("d")
    d.feed(ids[:6], pin=True)
    assert np.abs(d.feed(ids[6:], all_logits=True) - got[0]).max() > 1e-2  # the adapter moves the model


@pytest.mark.parametrize("weights", ["int4", "fp32"])
def test_seats_with_different_adapters_decode_together_as_each_alone(weights, load, tiny_llama_dir, export_to, adapters,
                                                                     tmp_path):  # fmt: skip
    """Four seats with adapters a, b, none and c in the batched graphs, each step against the same seat
    alone, bit for bit, through pins and eviction; then the third seat switches to d (its history run
    again) and a fifth seat with a joins (a run of four, then one alone)."""
    opts = dict(kv="int8", weights=weights, head="int4" if weights == "int4" else None, lora_rank=8, **LAYOUT)
    out = built(export_to(load(str(tiny_llama_dir)), **opts), tmp_path / "build", adapters)
    assert {"graph_seats2", "graph_seats4"} <= set(load_manifest(out).files)

    def seats(names):
        first = Decoder(out)
        ds = [first] + [first.seat() for _ in names[1:]]
        for d, n in zip(ds, names):
            d.set_adapter(n)
        return ds

    names = ["a", "b", None, "c"]
    pairs = [Pair(t, a) for t, a in zip(seats(names), seats(names))]
    rng = np.random.default_rng(7)
    step_together(pairs, [rng.integers(3, 300, 1 + i) for i in range(4)], [True] * 4)
    step_together(pairs, [rng.integers(3, 300, 1 + i) for i in range(4)])
    for _ in range(40):
        step_together(pairs, [[int(p.last.argmax())] for p in pairs])
    assert all(p.together.cache.evicted > LAYOUT["window"] for p in pairs)  # the window turned over
    assert len({int(p.last.argmax()) for p in pairs} | {p.last.tobytes() for p in pairs}) > 4  # the seats differ
    for p in pairs[2:3]:
        p.together.set_adapter("d")
        p.alone.set_adapter("d")
    fifth = Pair(pairs[0].together.seat(), pairs[0].alone.seat())
    fifth.together.set_adapter("a")
    fifth.alone.set_adapter("a")
    pairs.append(fifth)
    step_together(pairs, [[int(p.last.argmax())] for p in pairs[:4]] + [rng.integers(3, 300, 3)])
    for _ in range(10):
        step_together(pairs, [[int(p.last.argmax())] for p in pairs])
    batched = pairs[0].together.backend.graphs.batched
    if weights == "int4":  # then every seat drops its adapter: a batch of such seats runs the plain twin
        for p in pairs:
            p.together.set_adapter(None)
            p.alone.set_adapter(None)
        for _ in range(4):
            step_together(pairs, [[int(p.last.argmax())] for p in pairs])
        assert batched.plain_sessions and any(key[0] for key in batched._groups)
    assert any(not key[0] for key in batched._groups)
    for p in pairs:
        np.testing.assert_array_equal(p.together.cache.slot_token, p.alone.cache.slot_token)
        for name, buf in p.together.backend.buffers().items():
            np.testing.assert_array_equal(buf, p.alone.backend.buffers()[name], err_msg=name)
