"""A decode-speed ESTIMATE for Qualcomm HTP builds, not a measurement: nothing of cabinlm
has run on an SA8295P or an SA8775P, and the x86 simulator's seconds are not the chip's.

A bandwidth model: a decode step of the fixed-shape graph reads every weight of the decode binary
once (as the binary holds them) and the whole KV cache (every slot, full or not: the shapes are
fixed), so

    tokens/s  ~=  effective bandwidth / bytes read per step

The effective bandwidth of a chip is calibrated on Qualcomm's published decode speeds of its own
LLM binaries (the history of ai-hub-models' perf.yaml files, github.com/quic/ai-hub-models), counting their
bytes per step the same way from the models' shapes (CALIBRATIONS; their config.json). It folds in
everything that is not bandwidth (compute, fp16 vs int16 activations, per-run overhead), so it only
transfers to a build of the same kind. Small models are dominated by fixed per-run overhead the
model does not see: for them the figure is an upper bound.

Bytes a cabinlm decode step reads (decode_step_bytes):
    weights   every matrix at the build's bits + one bit of float32 block scale per 32 weights, the
              output head as 8-bit blocks (as engines/qnn_htp/builder.py builds them), norms and the one
              row a step gathers from the fp16 token table
    KV        CacheLayout's slots at fp16, or the uint8 cache (qnn_htp/spec.uint8_cache_bytes)
"""

from __future__ import annotations

from dataclasses import dataclass

from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.manifest import ModelSpec
from cabinlm.contract.precision import WeightFormat
from cabinlm.contract.engines.qnn import uint8_cache_bytes

GB = 1e9


@dataclass(frozen=True)
class Calibration:
    """One published decode speed and the bytes that model's step reads, counted from its shapes.
    Llama layers: (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied)."""

    chip: str
    model: str
    build: str  # Qualcomm's name of the precision
    tokens_per_s: float
    context: int
    shapes: tuple[int, int, int, int, int, int, int, bool]
    body_bits: float  # bits per body weight as their binary holds it
    kv_bytes: int  # bytes per cached K or V value
    source: str

    def step_bytes(self) -> int:
        d, n, h, hkv, dh, i, v, tied = self.shapes
        body = n * (2 * d * h * dh + 2 * d * hkv * dh + 3 * d * i)  # q, o; k, v; gate, up, down
        head = v * d  # 8-bit per channel (their LM head), tied or not: a step reads one head
        kv = n * 2 * hkv * dh * self.context * self.kv_bytes
        return int(body * self.body_bits / 8 + head + kv)

    @property
    def bandwidth(self) -> float:
        """Effective bytes/s: the bytes one step reads times the published steps per second."""
        return self.step_bytes() * self.tokens_per_s


AIHUB = "Qualcomm AI Hub, ai-hub-models perf.yaml (qai_hub_models/models/*/perf.yaml), Genie runtime"
LLAMA_1B = (2048, 16, 32, 8, 64, 8192, 128256, True)  # meta-llama/Llama-3.2-1B config.json
LLAMA_3B = (3072, 28, 24, 8, 128, 8192, 128256, True)  # meta-llama/Llama-3.2-3B config.json
LLAMA_8B = (4096, 32, 32, 8, 128, 14336, 128256, False)  # meta-llama/Llama-3.1-8B config.json
# w4: int4 weights (LPBQ blocks of 64 with an 8-bit scale each: 4.125 bits), fp16 activations, fp16 KV.
# w4a16: the same weights, int16 activations, uint8 KV.
CALIBRATIONS = (
    Calibration("SA8295P", "Llama-3.2-1B", "w4", 11.0, 4096, LLAMA_1B, 4.125, 2, AIHUB),
    Calibration("SA8255P", "Llama-3.2-3B", "w4a16", 14.0, 4096, LLAMA_3B, 4.125, 1, AIHUB),
    Calibration("SA8255P", "Llama-3.1-8B", "w4a16", 7.9, 4096, LLAMA_8B, 4.125, 1, AIHUB),
)
# fp16 activations cost on a v73-class HTP against int16 ones, from the same publisher's Snapdragon 8
# Elite figures (Llama-3.2-1B w4 33.7 vs w4a16 53.6 tok/s; 3B 13.8 vs 23.5): the smaller ratio.
FP16_ACTIVATIONS_FACTOR = min(33.7 / 53.6, 13.8 / 23.5)


@dataclass(frozen=True)
class ChipBandwidth:
    bandwidth: float  # effective bytes/s for cabinlm's builds (fp16 activations)
    derivation: str


def chip_bandwidth(htp_arch: int) -> ChipBandwidth:
    """The effective bandwidth for cabinlm's HTP builds (fp16 activations on both chips) by HTP arch.

    v68 (SA8295P): Qualcomm's own SA8295P build is fp16 activations, int4 weights: taken as it is.
    v73 (SA8775P): no SA8775P LLM figure is published; SA8255P is the same HTP v73 generation (derived:
    treated as the same class), and its w4a16 figures are the lower of the two models' bandwidths,
    scaled by FP16_ACTIVATIONS_FACTOR because cabinlm's v73 build runs fp16 activations, not int16."""
    if htp_arch <= 68:
        c = CALIBRATIONS[0]
        return ChipBandwidth(c.bandwidth, f"{c.chip} {c.model} {c.build} {c.tokens_per_s:g} tok/s at context "
                                          f"{c.context} ({c.step_bytes() / GB:.2f} GB per step)")  # fmt: skip
    v73 = [c for c in CALIBRATIONS if c.chip == "SA8255P"]
    low = min(v73, key=lambda c: c.bandwidth)
    bw = low.bandwidth * FP16_ACTIVATIONS_FACTOR
    figures = ", ".join(f"{c.model} {c.tokens_per_s:g} tok/s = {c.bandwidth / GB:.1f} GB/s" for c in v73)
    return ChipBandwidth(bw, f"SA8255P (v73) {low.build} at context {low.context}: {figures}; the lower x "
                             f"{FP16_ACTIVATIONS_FACTOR:.2f} for fp16 activations (Snapdragon 8 Elite w4 / w4a16)")  # fmt: skip


@dataclass(frozen=True)
class DecodeEstimate:
    weight_bytes: int
    kv_bytes: int
    bandwidth: float
    derivation: str

    @property
    def step_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.bandwidth / self.step_bytes

    def line(self) -> str:
        return (f"decode speed: estimate, not measured: ~{self.tokens_per_s:.0f} tok/s ({self.step_bytes / 1e6:.1f} MB read "
                f"per step: weights {self.weight_bytes / 1e6:.1f} MB + KV {self.kv_bytes / 1e6:.1f} MB, at "
                f"{self.bandwidth / GB:.1f} GB/s effective, calibrated on {self.derivation}); an upper bound for "
                "small models, whose steps are dominated by fixed per-run overhead")  # fmt: skip


def decode_step_bytes(spec: ModelSpec, fmt: WeightFormat, layout: CacheLayout) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of an HTP build reads (module docstring): the body's
    matrices at fmt's bits + 1 (a float32 scale per block of 32; fp16 for float formats), the output
    head as 8-bit blocks + scales (fp16 for float formats), RMSNorm weights and one token-table row in
    fp16; the cache's every slot."""
    d, dh, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * dh, spec.num_kv_heads * dh
    matrices = spec.num_layers * (2 * d * q + 2 * d * kv + 3 * d * i)
    head = spec.vocab_size * d
    small = spec.num_layers * ((q + 2 * kv) if spec.qkv_bias else 0) + spec.num_layers * 2 * d + d + d  # biases, norms, a row
    if spec.sandwich_norms:
        small += spec.num_layers * 2 * d
    if fmt.quantized:
        weights = (matrices * (fmt.bits + 1) + head * (8 + 1)) // 8 + 2 * small
    else:
        weights = 2 * (matrices + head + small)
    cache = uint8_cache_bytes(layout) if layout.quantized else layout.cache_bytes
    return weights, cache


def estimate(spec: ModelSpec, fmt: WeightFormat, layout: CacheLayout, htp_arch: int) -> DecodeEstimate:
    w, kv = decode_step_bytes(spec, fmt, layout)
    chip = chip_bandwidth(htp_arch)
    return DecodeEstimate(w, kv, chip.bandwidth, chip.derivation)
