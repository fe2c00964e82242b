"""What a vision-language artifact's runtime needs to turn a camera frame into image tokens: the
vision graph's geometry and the image processor as plain, checked numbers. Standard library only;
part of the manifest (cabinlm.contract.manifest re-exports both classes)."""

from __future__ import annotations

from dataclasses import dataclass


def _sizes(name: str, d, keys: tuple[frozenset, ...]) -> dict[str, int] | None:
    """None, or a dict with exactly one of the key sets, each a positive int."""
    if d is None:
        return None
    if not isinstance(d, dict) or frozenset(d) not in keys or not all(type(v) is int and 0 < v < 1 << 16 for v in d.values()):
        raise ValueError(f"vision.preprocess.{name}: expected one of {[sorted(k) for k in keys]} with positive sizes, got {d!r}")
    return dict(d)


@dataclass(frozen=True)
class ImagePreprocess:
    """The model's image processor, resolved at export into plain numbers (runtime/vision.py applies it):
    resize to a shortest edge or to height x width (a PIL resampling filter), center crop, rescale,
    normalize per channel. None: the step is skipped."""

    resize: dict[str, int] | None  # {"shortest_edge": n} or {"height": h, "width": w}
    resample: int = 3  # PIL.Image.Resampling
    crop: dict[str, int] | None = None  # {"height": h, "width": w}
    rescale: float | None = None
    mean: tuple[float, ...] | None = None  # 3 channels
    std: tuple[float, ...] | None = None
    # Qwen2-VL: the frame cut into the processor's flattened patches, (N, 3 * temporal * patch^2) in
    # merge-window order (runtime/vision.py); None: the (1, 3, H, W) image itself.
    patchify: dict[str, int] | None = None  # {"patch": p, "merge": m, "temporal": t}
    # Idefics3 / SmolVLM: before `resize`, the frame is resized so that its longest edge is this many
    # pixels (the aspect ratio kept, the other side rounded up to even; runtime/vision.py
    # longest_edge_size), as its processor does; None: no such step.
    longest_edge: int | None = None

    def __post_init__(self) -> None:
        hw = frozenset({"height", "width"})
        if self.longest_edge is not None and (type(self.longest_edge) is not int or not 0 < self.longest_edge < 1 << 16):
            raise ValueError(f"vision.preprocess.longest_edge: a positive number of pixels, got {self.longest_edge!r}")
        object.__setattr__(self, "patchify", _sizes("patchify", self.patchify, (frozenset({"patch", "merge", "temporal"}),)))
        object.__setattr__(self, "resize", _sizes("resize", self.resize, (frozenset({"shortest_edge"}), hw)))
        object.__setattr__(self, "crop", _sizes("crop", self.crop, (hw,)))
        if type(self.resample) is not int or not 0 <= self.resample <= 5:
            raise ValueError(f"vision.preprocess.resample: a PIL filter number 0..5, got {self.resample!r}")
        if self.rescale is not None:
            object.__setattr__(self, "rescale", float(self.rescale))
        if (self.mean is None) != (self.std is None):
            raise ValueError("vision.preprocess: mean and std go together")
        if self.mean is not None:
            object.__setattr__(self, "mean", tuple(float(x) for x in self.mean))
            object.__setattr__(self, "std", tuple(float(x) for x in self.std))
            if len(self.mean) != 3 or len(self.std) != 3 or not all(x > 0 for x in self.std):
                raise ValueError("vision.preprocess: mean and std hold 3 channels, std positive")


@dataclass(frozen=True)
class VisionSpec:
    """The vision graph of a vision-language model and how to prepare its input."""

    image_size: int
    patch_size: int
    image_tokens: int  # rows of the vision graph's image_embeds, slots of the cache's image region
    embed_dim: int
    image_token_id: int  # the placeholder id HF processors repeat image_tokens times
    preprocess: ImagePreprocess
    graph: str = "vision.onnx"  # role "vision_graph" in files
    # Qwen2-VL (multimodal RoPE; docs/vlm.md). () for LLaVA-style models.
    frame: tuple[int, ...] = ()  # (height, width) of every frame the vision graph takes, in pixels
    grid: tuple[int, ...] = ()  # the image tokens as (rows, cols), row-major: M-RoPE's grid offsets
    mrope_section: tuple[int, ...] = ()  # the decoder's RoPE frequency pairs per position component (t, h, w)
    # The token ids the model's processor puts around the image tokens when it expands one image
    # placeholder (Qwen2-VL: <|vision_start|> before, <|vision_end|> after); () for LLaVA.
    image_prefix: tuple[int, ...] = ()
    image_suffix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.preprocess, dict):  # as read from JSON
            object.__setattr__(self, "preprocess", ImagePreprocess(**self.preprocess))
        for name in ("frame", "grid", "mrope_section", "image_prefix", "image_suffix"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or not all(type(x) is int and 0 <= x < 1 << 31 for x in v):
                raise ValueError(f"vision.{name}: a list of non-negative whole numbers, got {v!r}")
            object.__setattr__(self, name, tuple(v))
        if self.mrope_section:
            if len(self.mrope_section) != 3 or len(self.grid) != 2 or len(self.frame) != 2:
                raise ValueError("vision: M-RoPE needs mrope_section (t, h, w), grid (rows, cols) and frame (height, width)")
            if self.grid[0] * self.grid[1] != self.image_tokens:
                raise ValueError(f"vision.grid {list(self.grid)} does not hold image_tokens {self.image_tokens}")
            if self.preprocess.patchify is None:
                raise ValueError("vision: an M-RoPE model's frames are patchified (preprocess.patchify)")

    @property
    def mrope(self) -> bool:
        """The decoder takes (3, tokens) positions: Qwen2-VL's multimodal RoPE."""
        return bool(self.mrope_section)
