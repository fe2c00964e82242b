"""Export options: typed, and validated once, before any model is loaded.

    ExportRequest  what the user set explicitly (None: not set)
        .options()                                 -> ExportOptions   the defaults fill the rest
        options_for_profile(spec, profile, request) -> ExportOptions  a device profile's plan does
    check_positions(spec, sink=, pinned=, chunk=, window=)   the geometry against the model's positions
    check_profile_request(spec, profile, request)            the same, the profile's defaults filling in
    make_layout(spec, opts)                                   -> CacheLayout, checked against the model

The model checks need only the ModelSpec (a config.json read by cabinlm.source.config), so that
`cabinlm export` and `cabinlm plan` refuse a geometry the model cannot hold before any weights load.

Every check names the option and the value it got; the command line's flags have the same names
(sink -> --sink), so a message reads the same from the library and from `cabinlm export`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from cabinlm.contract.errors import LayoutError, OptionError
from cabinlm.contract.adapters import TARGETS
from cabinlm.export.lora import LoraRequest
from cabinlm.contract.layout import MAX_DIM, CacheLayout
from cabinlm.contract.manifest import ModelSpec
from cabinlm.contract.precision import KVDType, WeightFormat

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

E = TypeVar("E", bound=enum.Enum)


def _member(kind: type[E], value: E | str, name: str) -> E:
    try:
        return kind(value)
    except ValueError as e:
        raise OptionError(f"--{name} {value!r} is not one of {', '.join(k.value for k in kind)}") from e


def _count(name: str, value: int | None, least: int) -> None:
    """None (not set), or a whole number in least..MAX_DIM: no cache dimension goes beyond MAX_DIM
    (the model's positions, checked once it is known, are usually far fewer)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"--{name} must be a whole number, got {value!r}")
    if value < least:
        raise LayoutError(f"--{name} must be >= {least}, got {value}")
    if value > MAX_DIM:
        raise LayoutError(f"--{name} {value} is beyond any cache (at most {MAX_DIM} slots), and beyond the "
                          "positions of any model cabinlm exports; `cabinlm plan MODEL` shows what fits")  # fmt: skip


def _check(sink: int | None, pinned: int | None, window: int | None, chunk: int | None, weights: WeightFormat | None,
           head: WeightFormat | None, calib: Path | None, max_ppl_increase: float, recall: int | None = 0) -> None:  # fmt: skip
    """The checks ExportOptions and ExportRequest share; a None value is not set (yet) and passes."""
    for name, value, least in (("sink", sink, 0), ("pinned", pinned, 0), ("window", window, 1), ("chunk", chunk, 1),
                               ("recall", recall, 0)):  # fmt: skip
        _count(name, value, least)
    if recall and recall % 16:
        raise LayoutError(f"--recall {recall} must be a multiple of 16; give --recall {-(-recall // 16) * 16}")
    if recall and sink is not None and sink < 1:
        raise LayoutError("--recall needs at least one sink token (--sink 1 or more): the region is fed after the sink")
    if chunk is not None and window is not None and chunk > window:
        # A chunk joins the ring after it has been processed; the ring must hold a whole chunk.
        raise LayoutError(
            f"--chunk {chunk} is larger than --window {window}: a prefill chunk must fit in the window; "
            "lower --chunk or raise --window"
        )
    if weights is not None and not weights.in_graph:
        raise OptionError(
            f"--weights {weights.value}: the exported graph holds fp32, int8 or int4 weights; {weights.value} is a "
            "precision an engine applies when it builds (a profile's weight_dtype), from fp32 weights"
        )
    if head is not None and not head.quantized:
        raise OptionError(f"--head {head.value}: the token table of quantized weights is int8 or int4")
    if head is not None and weights is not None and not weights.quantized:
        raise OptionError(
            f"--head {head.value} sets the width of quantized weights' token table, but the weights are "
            f"{weights.value}: give --weights int8 or int4 too"
        )
    if calib is not None and not calib.is_file():
        raise OptionError(f"--calib {calib}: no such file; give a UTF-8 text file (or leave --calib out)")
    if isinstance(max_ppl_increase, bool) or not isinstance(max_ppl_increase, (int, float)) or not (
        math.isfinite(max_ppl_increase) and max_ppl_increase > 0
    ):
        raise OptionError(
            f"--max-ppl-increase must be a positive number of percent, got {max_ppl_increase!r} "
            "(to keep an export whatever the gate says, pass --force)"
        )


def _check_switchable(rank: int, targets: tuple[str, ...]) -> tuple[str, ...]:
    """--lora-rank 0 (none) or 1..1024, --lora-targets some of the seven projections."""
    if isinstance(rank, bool) or type(rank) is not int or not 0 <= rank <= 1024:
        raise OptionError(f"--lora-rank must be a whole number in 1..1024 (0: no adapter inputs), got {rank!r}")
    targets = tuple(targets)
    if not targets or any(t not in TARGETS for t in targets) or len(set(targets)) != len(targets):
        raise OptionError(f"--lora-targets {','.join(map(str, targets))}: some of {', '.join(TARGETS)}, each once")
    return tuple(t for t in TARGETS if t in targets)


def _check_lora(lora: LoraRequest | None) -> None:
    """A LoRA request names an existing folder or file (what it holds is read by export/lora.py)."""
    if lora is None:
        return
    if not isinstance(lora, LoraRequest):
        raise OptionError(f"lora must be a LoraRequest (LoraRequest.parse('DIR[:SCALE]')), got {lora!r}")
    if not lora.path.exists():
        raise OptionError(f"--lora {lora.path}: no such folder or file; give a PEFT adapter folder or a GGUF LoRA file")


@dataclass(frozen=True)
class ExportOptions:
    """Every option of one export, complete and checked. kv / weights / head also take their values
    as strings ("int8"); they are held as enums."""

    sink: int = 4
    pinned: int = 124  # sink + pinned = 128 slots for the first tokens and the system prompt
    window: int = 1020
    chunk: int = 64
    kv: KVDType = KVDType.FP32
    weights: WeightFormat = WeightFormat.FP32  # what the graph stores: fp32, or int8 / int4 blocks (export/wquant.py)
    head: WeightFormat | None = None  # token table / output projection of quantized weights: None (8 bits), int8, int4
    opset: int | None = None  # None: 17 (TensorRT 8.6 parses it), 19 when fp8 KV needs it, 21 for int8/int4 weights
    verify: bool = True  # compare the graph with transformers on a short prompt and record it
    calib: Path | None = None  # calibration text for int8 / fp8 KV; None: the built-in mix
    max_ppl_increase: float = 2.0  # percent, quantized KV vs fp32 KV on held-back text
    force: bool = False  # write the artifact even when the quality gate fails
    gate: bool = True  # measure the quality gate at all (tests that measure quality themselves skip it)

    index_dtype: str = "int64"  # int32 for TensorRT targets
    profile: str | None = None  # the device profile the layout was planned for
    plan: dict | None = None  # that plan (written into the manifest's "target")
    # Qwen2-VL: every camera frame's (height, width) in pixels, so the vision graph has one shape;
    # None: a size the model's processor keeps, the nearest to a 640x480 frame (source/processor.py
    # default_frame)
    frame: tuple[int, int] | None = None
    lora: LoraRequest | None = None  # a LoRA adapter merged into the float weights before they are quantized
    recall: int = 0  # R: slots of the recall region (docs/design.md, "The recall region"); 0: none
    lora_rank: int = 0  # switchable adapters: the maximum rank of the graph's adapter inputs (0: none)
    lora_targets: tuple[str, ...] = TARGETS  # the projections that take adapter inputs

    def __post_init__(self) -> None:
        _check_lora(self.lora)
        object.__setattr__(self, "lora_targets", _check_switchable(self.lora_rank, self.lora_targets))
        if self.frame is not None:
            f = tuple(self.frame)
            if len(f) != 2 or not all(type(x) is int and 0 < x <= 8192 for x in f):
                raise OptionError(f"frame must be (height, width) in pixels, each 1..8192, got {self.frame!r}")
            object.__setattr__(self, "frame", f)
        object.__setattr__(self, "kv", _member(KVDType, self.kv, "kv"))
        object.__setattr__(self, "weights", _member(WeightFormat, self.weights, "weights"))
        object.__setattr__(self, "head", None if self.head is None else _member(WeightFormat, self.head, "head"))
        if self.calib is not None:
            object.__setattr__(self, "calib", Path(self.calib))
        _check(self.sink, self.pinned, self.window, self.chunk, self.weights, self.head, self.calib,
               self.max_ppl_increase, self.recall)  # fmt: skip
        if self.index_dtype not in ("int64", "int32"):
            raise OptionError(f"index_dtype must be 'int64' or 'int32', got {self.index_dtype!r}")
        if self.opset is not None:
            # DequantizeLinear with block_size arrives in opset 21, float8 QuantizeLinear in 19.
            need, what = (21, f"{self.weights.value} weights need") if self.weights.quantized else (19, "fp8 KV needs")
            if (self.weights.quantized or self.kv is KVDType.FP8) and self.opset < need:
                raise OptionError(f"opset {self.opset} is too old: {what} ONNX opset {need} or newer")

    @property
    def resolved_opset(self) -> int:
        if self.opset is not None:
            return self.opset
        if self.weights.quantized:
            return 21
        return 19 if self.kv is KVDType.FP8 else 17  # 17: TensorRT 8.6 parses it


def _or(value, default):
    return default if value is None else value


@dataclass(frozen=True)
class ExportRequest:
    """What the user set explicitly for an export; None: not set. Checked as it is made, so that a bad
    value is refused before a profile is planned or a model is loaded."""

    sink: int | None = None
    pinned: int | None = None
    window: int | None = None
    chunk: int | None = None
    kv: KVDType | None = None
    weights: WeightFormat | None = None
    head: WeightFormat | None = None
    calib: Path | None = None
    max_ppl_increase: float = 2.0
    force: bool = False
    verify: bool = True
    lora: LoraRequest | None = None
    recall: int | None = None
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        _check_lora(self.lora)
        object.__setattr__(self, "lora_targets", _check_switchable(self.lora_rank, self.lora_targets))
        object.__setattr__(self, "kv", None if self.kv is None else _member(KVDType, self.kv, "kv"))
        weights = None if self.weights is None else _member(WeightFormat, self.weights, "weights")
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "head", None if self.head is None else _member(WeightFormat, self.head, "head"))
        if self.calib is not None:
            object.__setattr__(self, "calib", Path(self.calib))
        _check(self.sink, self.pinned, self.window, self.chunk, self.weights, self.head, self.calib,
               self.max_ppl_increase, self.recall)  # fmt: skip

    def options(self) -> ExportOptions:
        """Without a profile: what was set here, ExportOptions' defaults for the rest."""
        return self.complete(
            sink=_or(self.sink, ExportOptions.sink),
            pinned=_or(self.pinned, ExportOptions.pinned),
            window=_or(self.window, ExportOptions.window),
            chunk=_or(self.chunk, ExportOptions.chunk),
            kv=_or(self.kv, ExportOptions.kv),
            weights=_or(self.weights, ExportOptions.weights),
        )

    def complete(self, *, sink: int, pinned: int, window: int, chunk: int, kv: KVDType, weights: WeightFormat,
                 index_dtype: str = "int64", profile: str | None = None,
                 plan: dict | None = None) -> ExportOptions:  # fmt: skip
        """ExportOptions with this request's other choices and the given layout and precisions."""
        return ExportOptions(
            sink=sink, pinned=pinned, window=window, chunk=chunk, kv=kv, weights=weights, head=self.head,
            verify=self.verify, calib=self.calib, max_ppl_increase=self.max_ppl_increase, force=self.force,
            index_dtype=index_dtype, profile=profile, plan=plan, lora=self.lora, recall=_or(self.recall, 0),
            lora_rank=self.lora_rank, lora_targets=self.lora_targets,
        )  # fmt: skip


def check_positions(spec: ModelSpec, *, sink: int, pinned: int, chunk: int, window: int | None = None,
                    image: int = 0, recall: int = 0) -> None:  # fmt: skip
    """The geometry against the model's positions, from its config alone (no weights).

    Positions are ranks in stream order, so the largest one the graph sees is
    sink + pinned + image + recall + window + chunk - 1, and it must stay below max_position_embeddings.
    window None (a profile's planner searches it): a window of at least one chunk must fit.
    A refusal names the option to change and the value that would fit:
        the window alone is too large       -> --window (the largest that fits)
        sink + pinned + image + chunk are   -> the largest of --sink, --pinned, --chunk, --recall
    """
    limit = spec.max_positions
    fixed = sink + pinned + image + recall + chunk  # every term but the window
    least_window = chunk  # the ring holds a whole chunk (CacheLayout)
    w = least_window if window is None else window
    if fixed + w <= limit:
        return
    image_term = (f" + image {image}" if image else "") + (f" + recall {recall}" if recall else "")
    model = f"the model has only {limit} (its max_position_embeddings)"
    if window is not None and limit - fixed >= least_window:
        raise LayoutError(
            f"--window {window}: sink {sink} + pinned {pinned}{image_term} + window {window} + chunk {chunk} = "
            f"{fixed + window} positions, but {model}; use --window {limit - fixed} or less"
        )
    # Not even a window of one chunk fits: the largest of sink, pinned and chunk must shrink. With
    # the window as given if that is enough; else with a window of one chunk (then the chunk saves
    # two positions a token: it is the least window too); else all three must.
    # The recall region competes as the others do; what it is cut to stays a multiple of 16.
    name, value = max((("sink", sink), ("pinned", pinned), ("chunk", chunk), ("recall", recall)), key=lambda nv: nv[1])
    least = 1 if name == "chunk" else 0
    fits = [value - (fixed + w - limit) for w in ([window] if window is not None else [])]
    excess = fixed + least_window - limit
    fits.append(value - (-(-excess // 2) if name == "chunk" else excess))
    if name == "recall":
        fits = [v - v % 16 for v in fits]
    best = next((v for v in fits if v >= least), None)
    options = "--sink, --pinned, --recall and --chunk" if recall else "--sink, --pinned and --chunk"
    fix = f"give --{name} {best} or less" if best is not None else f"lower {options}"
    raise LayoutError(
        f"--{name} {value}: sink {sink} + pinned {pinned}{image_term} + chunk {chunk} leave no room for a window "
        f"of one chunk ({fixed + least_window} positions), but {model}; {fix}"
    )


def check_profile_request(spec: ModelSpec, profile: DeviceProfile, request: ExportRequest, image_tokens: int = 0) -> None:
    """The KV precision against the profile, then check_positions for what `request` sets, the
    profile's defaults filling in the rest (the window, when not set, is the planner's to choose)."""
    from cabinlm.profiles.planner import resolve_kv

    resolve_kv(profile, request.kv)  # a precision the chip cannot run is the first thing to say
    check_positions(spec, sink=_or(request.sink, profile.default_sink),
                    pinned=_or(request.pinned, ExportOptions.pinned), chunk=_or(request.chunk, profile.default_chunk),
                    window=request.window, image=image_tokens, recall=_or(request.recall, 0))  # fmt: skip


def options_for_profile(spec: ModelSpec, profile: DeviceProfile, request: ExportRequest, vision_params: int = 0,
                        image_tokens: int = 0) -> ExportOptions:  # fmt: skip
    """Export options planned for a device profile (a DeviceProfile). What `request` sets is kept and
    checked; the rest comes from the plan. A KV precision the profile cannot run, a window that does
    not fit its budget, or an opset it cannot parse is refused."""
    from cabinlm.profiles import Engine
    from cabinlm.profiles.planner import PlanError, plan

    if request.lora_rank and (profile.engine != Engine.ONNXRUNTIME or profile.execution_provider != "CPUExecutionProvider"
                              or profile.static_shapes):  # fmt: skip
        raise OptionError(f"--lora-rank: switchable adapters run on the cpu profile's engines; profile {profile.name} "
                          f"({profile.engine.value}, {profile.execution_provider}) does not take adapter inputs: merge "
                          "the adapter with --lora instead")  # fmt: skip
    check_profile_request(spec, profile, request, image_tokens)
    p = plan(spec, profile, kv=request.kv, sink=request.sink, chunk=request.chunk,
             pinned=_or(request.pinned, ExportOptions.pinned), window=request.window, vision_params=vision_params,
             image_tokens=image_tokens, recall=_or(request.recall, 0))  # fmt: skip
    if not p.fits:
        raise PlanError(
            f"window {p.window} needs {p.total_bytes / 2**20:.0f} MiB but profile {profile.name} budgets "
            f"{p.budget_bytes / 2**20:.0f} MiB; leave --window out to use the largest that fits"
        )
    # Block-quantized weights go into the exported graph for ONNX Runtime's CPU provider and for the
    # Qualcomm HTP (whose build turns the blocks into MatMulNBits); TensorRT gets float32 weights and
    # applies the profile's precision when it builds.
    ort = profile.engine == Engine.ONNXRUNTIME
    weights = profile.weight_dtype if ort and profile.weight_dtype.quantized else WeightFormat.FP32
    opts = request.complete(
        sink=p.sink, pinned=p.pinned, window=p.window, chunk=p.chunk, kv=KVDType(p.kv),
        weights=_or(request.weights, weights), index_dtype="int32" if profile.engine == Engine.TENSORRT else "int64",
        profile=profile.name, plan=p.to_dict(),
    )  # fmt: skip
    if opts.resolved_opset > profile.max_opset:
        what = f"{opts.weights.value} weights need" if opts.weights.quantized else f"{opts.kv.value} KV needs"
        raise PlanError(
            f"{what} ONNX opset {opts.resolved_opset}, but profile {profile.name} accepts "
            f"opset {profile.max_opset} at most"
        )
    return opts


def make_layout(spec: ModelSpec, opts: ExportOptions, image: int = 0) -> CacheLayout:
    """The cache layout of an export: the options' geometry on the model's layers and heads, checked
    against the model's positions first (check_positions). Needs only the ModelSpec: `cabinlm export`
    calls it before the weights load."""
    check_positions(spec, sink=opts.sink, pinned=opts.pinned, chunk=opts.chunk, window=opts.window, image=image,
                    recall=opts.recall)  # fmt: skip
    keys = opts.sink + opts.pinned + image + opts.recall + opts.window + opts.chunk  # what one query of the graph attends to
    return CacheLayout(
        **spec.local_geometry(keys),  # local layers get their own ring when their window is shorter than that
        image=image,
        recall=opts.recall,
        sink=opts.sink,
        pinned=opts.pinned,
        window=opts.window,
        chunk=opts.chunk,
        layers=spec.num_layers,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_dtype=opts.kv,
    )
