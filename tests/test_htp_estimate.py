"""The HTP decode-speed estimate (profiles/htp_estimate.py): the bytes a decode step reads against a
count written out here from the models' shapes, the calibration against the figures it cites, and
`cabinlm plan` printing it, labelled an estimate, for HTP profiles only."""

from __future__ import annotations

from pathlib import Path

import pytest

from cabinlm.contract.layout import CacheLayout
from cabinlm.source.config import spec_from_config
from cabinlm.contract.precision import KVDType, WeightFormat
from cabinlm.profiles import load_profile
from cabinlm.profiles import htp_estimate as est
from cabinlm.profiles.planner import format_plan, plan

CONFIGS = Path(__file__).parent / "data" / "configs"


@pytest.fixture(scope="module")
def smollm2():
    return spec_from_config(CONFIGS / "smollm2-135m.json")


def layout(kv: str, window: int = 380) -> CacheLayout:
    return CacheLayout(sink=4, pinned=124, window=window, chunk=128, layers=30, kv_heads=3, head_dim=64,
                       kv_dtype=KVDType(kv))  # fmt: skip


def test_smollm2_step_bytes_against_its_shapes(smollm2):
    # SmolLM2-135M: hidden 576, 30 layers, 9 heads x 64, 3 KV heads, MLP 1536, vocab 49152, tied
    per_layer = {"q": 576 * 576, "k": 576 * 192, "v": 576 * 192, "o": 576 * 576, "gate": 576 * 1536,
                 "up": 576 * 1536, "down": 1536 * 576}  # fmt: skip
    matrices = 30 * sum(per_layer.values())
    int4 = matrices * 5 / 8 + 49152 * 576 * 9 / 8 + 2 * (30 * 2 * 576 + 576 + 576)  # codes + fp32 scale per 32; head 8-bit
    slots = 4 + 124 + 380
    fp16_kv = slots * 30 * 2 * 3 * 64 * 2
    w, kv = est.decode_step_bytes(smollm2, WeightFormat.INT4, layout("fp16"))
    assert (w, kv) == (int(int4), fp16_kv)
    w8, kv8 = est.decode_step_bytes(smollm2, WeightFormat.INT4, layout("int8"))
    assert (w8, kv8) == (w, fp16_kv // 2)  # the HTP's uint8 cache: no value scales
    wf, _ = est.decode_step_bytes(smollm2, WeightFormat.FP32, layout("fp16"))
    assert wf == 2 * (matrices + 49152 * 576 + 30 * 2 * 576 + 576 + 576)  # the HTP holds float weights in fp16
    # the fixed shapes read every slot, so the window's size is in every step
    assert est.decode_step_bytes(smollm2, WeightFormat.INT4, layout("fp16", 7936))[1] == (4 + 124 + 7936) * 23040


def test_the_calibration_models_are_the_published_configs():
    s = spec_from_config(CONFIGS / "llama-3.2-3b.json")
    assert est.LLAMA_3B == (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim,
                            s.intermediate_size, s.vocab_size, s.tie_embeddings)  # fmt: skip


def test_the_calibrations_give_the_cited_bandwidths():
    # SA8295P, Llama-3.2-1B w4 at 4096: 16 layers x (2 x 2048 x 2048 + 2 x 2048 x 512 + 3 x 2048 x 8192) at 4.125 bits,
    # the 8-bit head 128256 x 2048, fp16 KV 16 x 2 x 8 x 64 x 2 B x 4096 slots; 11.0 tok/s
    one_b = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) * 4.125 / 8 + 128256 * 2048 + 16 * 2 * 8 * 64 * 2 * 4096
    assert est.CALIBRATIONS[0].step_bytes() == int(one_b)
    assert est.chip_bandwidth(68).bandwidth == pytest.approx(one_b * 11.0)
    assert 9.5e9 < one_b * 11.0 < 10.5e9  # ~9.7 GB/s (its LPBQ scales not counted)
    v73 = est.chip_bandwidth(73)
    three_b = (28 * (2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192) * 4.125 / 8 + 128256 * 3072
               + 28 * 2 * 8 * 128 * 4096) * 14.0  # fmt: skip
    assert v73.bandwidth == pytest.approx(min(three_b, est.CALIBRATIONS[2].bandwidth) * 13.8 / 23.5)  # the 3B ratio, the smaller
    assert v73.bandwidth > est.chip_bandwidth(68).bandwidth


@pytest.mark.parametrize("profile,arch", [("sa8295p", 68), ("sa8775p", 73)])
def test_plan_prints_the_estimate_labelled_for_htp_profiles(smollm2, profile, arch):
    for kv in ("fp16", "int8"):
        p = plan(smollm2, load_profile(profile), kv=kv, sink=4, pinned=124, window=380, chunk=128)
        w, c = est.decode_step_bytes(smollm2, WeightFormat.INT4, layout(kv))
        assert p.htp_step_bytes == w + c
        assert p.htp_tokens_per_s_estimate == pytest.approx(est.chip_bandwidth(arch).bandwidth / (w + c), abs=0.05)
        text = format_plan(p)
        assert "estimate, not measured" in text and f"~{p.htp_tokens_per_s_estimate:.0f} tok/s" in text
        assert p.to_dict()["htp_estimate"] == p.htp_estimate


def test_no_estimate_where_there_is_no_htp(smollm2):
    p = plan(smollm2, load_profile("cpu"), window=380)
    assert p.htp_step_bytes == 0 and "estimate" not in format_plan(p)
