"""What a Qualcomm HTP build is, as typed data (manifest "build.qnn"): the chip and compiler the
context binaries were made for and by, their precision, and what the build measured. Standard library
only; written by engines/qnn_htp/builder.py, read by engines/qnn_htp/backend.py and `cabinlm plan`.

    "qnn": {
      "qairt_version": "2.51.0.260929181845",   the QNN SDK that compiled the binaries
      "htp_arch": 73, "soc_model": 52, "chip": "Qualcomm SA8775P ...",
      "activations": "fp16", "weights": "int4",  what the HTP computes in / holds
      "kv_cache": "uint8",                     the cache the binaries read and write: fp16, or uint8 (zero
      "kv_scales": {"key_cache.0": 0.031, ...}   point 128, one scale per tensor, the new K/V quantized
                                               with the cache's own scale: the runtime copies bytes)
      "rotated_keys": true,                    the uint8 cache holds keys rotated at their virtual
                                               positions (engines/qnn_htp/rotated_graph.py; the runtime
                                               keeps the sink / pinned keys' un-rotated copy)
      "weight_sharing": true,                  prefill and decode graphs share one weights copy
      "binaries": ["decoder.prefill.ctx_qnn.bin"],
      "compile_seconds": 31.2, "peak_host_bytes": 2400000000,
      "rewrites": {...}, "check": {"correlation": 0.9999, "same_top1": true, "max_abs_diff": 0.02}
    }
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cabinlm.contract.io_spec import DecoderIO, DecoderShape

QNN_PROVIDER = "QNNExecutionProvider"
# Manifest roles ending in SIMULATOR ("graph_simulator", "context_binary_simulator", ...) are the
# unshared twin a weight-sharing build carries for Qualcomm's x86 simulator.
SIMULATOR = "_simulator"
PRECISIONS = ("fp16", "int16", "int8", "int4")  # int16: --activations a16 (engines/qnn_htp/qdq.py)
KV_CACHES = ("fp16", "uint8")
KV_ZERO_POINT = 128  # uint8 KV: symmetric around 128 (Qualcomm's own uint8 past_key/value pad with 128)
WEIGHT_SHARING_MIN_ARCH = 73  # QNN shares weights between the graphs of one context from HTP v73 on


def shares_weights(htp_arch: int) -> bool:
    """Whether an HTP of this architecture holds the prefill and decode graphs over one weights copy
    (one context binary), or needs a binary, and a weights copy, per graph (v68). The builder and the
    planner both ask here."""
    return htp_arch >= WEIGHT_SHARING_MIN_ARCH


def uint8_cache_bytes(layout) -> int:
    """The bytes of an int8-KV layout's cache as the HTP holds it (a uint8 cache, engines/qnn_htp/
    graph.uint8_kv): K and V, one byte each, for every slot and ring; no per-token value scales, and
    the one scale per tensor lives in the binaries. Half of the same layout in fp16. The planner and
    the tests ask here."""
    per_token = 2 * layout.kv_heads * layout.head_dim  # one layer's K + V at one byte
    return layout.cache_bytes // layout.layer_bytes_per_token * per_token


def rotated_keys_possible(layout, mrope: bool = False, vision: bool = False) -> bool:
    """Whether the HTP's uint8 cache of this layout holds rotated keys (rotated_graph.py): an int8-KV
    text model without local layers. Others keep un-rotated keys (the rewrite covers one RoPE table
    over every layer). The builder and the planner both ask here."""
    return layout.quantized and not (mrope or vision or layout.image or layout.local_layers)


def builds_rotated_keys(manifest) -> bool:
    """Whether an HTP build of this export caches rotated keys: rotated_keys_possible for its layout and
    vision (fp16 and 16-bit activations alike). builder.py and qdq.a16_float_graph both ask here."""
    vlm = manifest.vision is not None
    return rotated_keys_possible(manifest.cache, mrope=vlm and manifest.vision.mrope, vision=vlm)


def key_source_bytes(layout) -> int:
    """The fp16 un-rotated copy of the sink, pinned and recall keys a rotated-key uint8 cache keeps
    beside it (engines/qnn_htp/backend.py): (layers, kv_heads, sink + pinned + recall, head_dim) x 2 bytes
    (every slot before the window: a rotated-key layout has no image region)."""
    return layout.layers * layout.kv_heads * layout.window_start * layout.head_dim * 2


@dataclass(frozen=True)
class QnnSettings:
    """A QNN HTP build's facts: the chip and compiler its context binaries were made for and by."""

    KEY: ClassVar[str] = "qnn"  # where a build's manifest holds these facts ("build.qnn")

    qairt_version: str
    htp_arch: int
    soc_model: int
    chip: str
    activations: str  # what the HTP computes in
    weights: str  # what the binaries hold for the weight matrices
    weight_sharing: bool
    binaries: tuple[str, ...]  # context binary files (their checksums are under manifest "files")
    compile_seconds: float = 0.0
    peak_host_bytes: int = 0  # peak resident memory of the build process
    rewrites: dict[str, int] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    kv_cache: str = "fp16"  # KV_CACHES
    kv_scales: dict[str, float] = field(default_factory=dict)  # uint8: cache input name -> its scale (tied)
    rotated_keys: bool = False  # uint8: the cache holds keys rotated at their virtual positions
    # a vision-language build's camera encoder: {"runs_on": "htp", "binary": ..., "check": ...} or
    # {"runs_on": "cpu", "reason": ...} (engines/qnn_htp/vision_build.py); {} for a text model
    vision: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "binaries", tuple(self.binaries))
        for name in ("htp_arch", "soc_model", "peak_host_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"build.qnn.{name}: expected a non-negative integer, got {v!r}")
        for name in ("qairt_version", "chip"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"build.qnn.{name}: expected a string")
        for name in ("activations", "weights"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"build.qnn.{name}: one of {PRECISIONS}, got {getattr(self, name)!r}")
        if not isinstance(self.weight_sharing, bool):
            raise ValueError("build.qnn.weight_sharing: expected true or false")
        if not self.binaries or not all(isinstance(b, str) and b.endswith(".bin") and "/" not in b and "\\" not in b
                                        and not b.startswith(".") for b in self.binaries):  # fmt: skip
            raise ValueError(f"build.qnn.binaries: expected .bin file names in the build folder, got {self.binaries!r}")
        if isinstance(self.compile_seconds, bool) or not isinstance(self.compile_seconds, (int, float)):
            raise ValueError("build.qnn.compile_seconds: expected a number")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"build.qnn.kv_cache: one of {KV_CACHES}, got {self.kv_cache!r}")
        if not isinstance(self.kv_scales, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.kv_scales.values()):  # fmt: skip
            raise ValueError("build.qnn.kv_scales: expected {cache tensor: positive scale}")
        if not isinstance(self.rotated_keys, bool) or (self.rotated_keys and self.kv_cache != "uint8"):
            raise ValueError(f"build.qnn.rotated_keys: true or false, true only with a uint8 cache, got {self.rotated_keys!r}")
        if (self.kv_cache == "uint8") != bool(self.kv_scales):
            raise ValueError("build.qnn.kv_scales: a uint8 cache has one scale per cache tensor, an fp16 cache none")
        if not isinstance(self.vision, dict) or (self.vision and self.vision.get("runs_on") not in ("htp", "cpu")):
            raise ValueError(f"build.qnn.vision: expected {{}} or {{\"runs_on\": \"htp\" or \"cpu\", ...}}, got {self.vision!r}")
        if not isinstance(self.rewrites, dict) or not isinstance(self.check, dict):
            raise ValueError("build.qnn.rewrites and build.qnn.check: expected objects")

    def decoder_io(self, shape: DecoderShape) -> DecoderIO:
        """The exported contract, over the cache the binaries read and write (uint8, keys rotated or not)."""
        return shape.exported(cache_dtype=self.kv_cache if self.kv_cache != "fp16" else None, rotated_keys=self.rotated_keys)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["binaries"] = list(self.binaries)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QnnSettings:
        if not isinstance(d, dict):
            raise TypeError(f"build.qnn: expected an object, got {type(d).__name__}")
        return cls(**d)
