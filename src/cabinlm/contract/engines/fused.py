"""What a fused cpu build is, as typed data (manifest "build.fused"), and the choices `cabinlm build`
offers for it. Standard library only."""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from cabinlm.contract.io_spec import DecoderIO, DecoderShape, fused_decoder_io

from cabinlm.contract.engines.static import SharedWeights


class _Named(str, enum.Enum):
    """A choice that reads as its value (in messages, f-strings and the manifest's JSON)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Kernel(_Named):
    """Whose kernel a fused build's graph runs for a part (attention, block matmuls, LM head): what
    the manifest records once AUTO has been decided."""

    ONNXRUNTIME = "onnxruntime"  # ONNX Runtime's contrib operator (GroupQueryAttention, MatMulNBits)
    CABINLM = "cabinlm"  # cabinlm's own, from the build's kernel library (ai.cabinlm)


class AttentionKernel(_Named):
    """Fused cpu builds: which kernel computes the attention over the cache."""

    AUTO = "auto"  # cabinlm's for int8 KV where its library is built, ONNX Runtime's otherwise (fp32 KV too)
    CABINLM = "cabinlm"  # kernels/int8_kv_attention.cc (int8 KV: a prefill chunk about twice as fast; fp32 KV: FloatKVAttention)
    ONNXRUNTIME = "onnxruntime"  # com.microsoft::GroupQueryAttention


class MatmulKernel(_Named):
    """Fused cpu builds: which kernel computes the layers' matmuls over GGUF Q4_1 blocks."""

    AUTO = "auto"  # cabinlm's wherever its library compiles (every CPU), ONNX Runtime's otherwise
    CABINLM = "cabinlm"  # kernels/block_q4_matmul.cc: the 4-bit blocks and minimums read as exported
    ONNXRUNTIME = "onnxruntime"  # com.microsoft::MatMulNBits (the blocks as --minimums says)


class Minimums(_Named):
    """Fused cpu builds: how GGUF Q4_1 blocks (4-bit codes plus a float block minimum) run."""

    INT8 = "int8"  # 8-bit codes with an integer zero point, the minimum rounded to 1/34 of a step
    EXACT = "exact"  # 4-bit codes plus blocksum(x) @ minimum (two more kernels per matrix)


# The block matmuls' paths (kernels/block_matmul.h, cabinlm_block_q4_isa()): a library holds one, chosen
# by the compiler's -march; every one gives the plain C++ path's ("generic") results bit for bit.
MATMUL_ISAS = ("avx512-vnni", "avx-vnni", "avx2", "neon-i8mm", "neon-dotprod", "generic")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MARCH = re.compile(r"[a-z0-9][a-z0-9_.+-]*")  # a compiler -march value: native, x86-64-v3, armv8.2-a+dotprod


@dataclass(frozen=True)
class KernelLibrary:
    """cabinlm's kernel library as a build holds it (manifest "build.fused.kernels"): compiled by
    `cabinlm build` for the profile's CPU, written into the build folder and listed in the manifest's
    files as "kernel_library". The runtime checks every fact here before it registers the file and
    never compiles anything (engines/ort_fused/kernel_library.py)."""

    file: str  # in the build folder; the manifest's files list it with the same sha256
    sha256: str  # of the file as compiled: a damaged or replaced library is refused before it is opened
    ort_api: int  # onnxruntime C API version compiled against (kApiVersion): needs onnxruntime >= 1.{ort_api}
    machine: str  # the CPU architecture the code is for, as platform.machine() names it (x86_64, aarch64)
    march: str  # the compiler's -march ("native": the build machine's CPU, resolved below in cpu_flags)
    # The CPU's features the code may use (/proc/cpuinfo flag names, from the compiler's predefined
    # macros for `march`): a CPU lacking one would stop the process with SIGILL, so it is refused.
    cpu_flags: tuple[str, ...]
    matmul_isa: str  # the block matmuls' path in this library (kernels.ISAS): "avx512-vnni", "avx-vnni", "avx2", "neon-i8mm", "neon-dotprod" or "generic"
    compiler: str  # the first line of the compiler's --version

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.file):
            raise ValueError(f"kernels.file must be a file name in the build folder, got {self.file!r}")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"kernels.sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if isinstance(self.ort_api, bool) or not isinstance(self.ort_api, int) or not 1 <= self.ort_api < 1000:
            raise ValueError(f"kernels.ort_api must be an onnxruntime C API version (1..999), got {self.ort_api!r}")
        if not isinstance(self.march, str) or not _MARCH.fullmatch(self.march):
            raise ValueError(f"kernels.march must be a compiler -march value, got {self.march!r}")
        object.__setattr__(self, "cpu_flags", tuple(self.cpu_flags) if isinstance(self.cpu_flags, list) else self.cpu_flags)
        if not isinstance(self.cpu_flags, tuple) or not all(isinstance(f, str) and f for f in self.cpu_flags):
            raise ValueError(f"kernels.cpu_flags must be a list of CPU feature names, got {self.cpu_flags!r}")
        if self.matmul_isa not in MATMUL_ISAS:
            raise ValueError(f"kernels.matmul_isa must be one of {', '.join(MATMUL_ISAS)}, got {self.matmul_isa!r}")
        for name in ("machine", "compiler"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"kernels.{name} must be a non-empty string, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "cpu_flags": list(self.cpu_flags)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelLibrary:
        if not isinstance(d, dict):
            raise TypeError(f"build.fused.kernels: expected an object, got {type(d).__name__}")
        return cls(**d)


@dataclass(frozen=True)
class FusedSettings:
    """The fused cpu decoder's choices (engines/ort_fused/graph.py)."""

    KEY: ClassVar[str] = "fused"  # where a build's manifest holds these facts ("build.fused")

    accuracy_level: int = 4  # MatMulNBits activations: 4 = int8, 0 = float32
    minimums: Minimums = Minimums.INT8  # how GGUF Q4_1 block minimums run
    # AttentionKernel: "onnxruntime" (GroupQueryAttention, writing the cache through its present
    # outputs) or "cabinlm" (kernels/int8_kv_attention.cc, int8 or fp32 KV: registered from the build's
    # kernel library at load, writing the cache in place). Builds before it: "onnxruntime".
    attention_kernel: Kernel = Kernel.ONNXRUNTIME
    # MatmulKernel: "onnxruntime" (MatMulNBits for every quantized matrix) or "cabinlm"
    # (kernels/block_q4_matmul.cc for the Q4_1 matrices, from the same library). Builds before it: "onnxruntime".
    matmul_kernel: Kernel = Kernel.ONNXRUNTIME
    # cabinlm's attention kernel takes each row's slot and rotates the sink / pinned keys itself, per
    # row (io_spec.fused_decoder_io(steps=True)): a chunk's rows can be its one-token steps after the
    # window has turned over, so drafts are verified for the whole dialogue. Builds before it: False.
    step_rows: bool = False
    # The compiled library the graph's ai.cabinlm operators run from, where own_kernels; None for
    # builds without them, and for builds made before the library came with the build (the runtime
    # refuses those with "run `cabinlm build` again").
    kernels: KernelLibrary | None = None
    # Seats decoding together: the batch sizes B >= 2 of the build's batched graphs (files
    # "graph_seats{B}", io_spec.seats_io: B seats' rows through every weight matmul in one run, the
    # attention per seat over its own cache), cabinlm's attention kernel only. Every graph of the build
    # then reads its weights from one memory map of the weights file (`shared_weights`: where each lies
    # in it), so they are held once. Builds before it: none.
    seat_batches: tuple[int, ...] = ()
    shared_weights: SharedWeights | None = None
    # The LM head: "onnxruntime" (MatMulNBits; the batched graphs end at the final norm and share the
    # head graph "graph_head", io_spec.head_io) or "cabinlm" (kernels/block_q8_matmul.cc, the head's
    # int8 blocks read in place by every graph: the batched graphs end in logits, no head graph).
    # Builds before it: "onnxruntime".
    head_kernel: Kernel = Kernel.ONNXRUNTIME
    # The weights each graph's session packs a copy of (ONNX Runtime's MatMulNBits, MatMul and Gemm
    # weights; cabinlm's kernels and gathers read theirs in place), in bytes, by the graph's role in the
    # manifest's files ("graph", "graph_seats{B}", "graph_head"): what the planner and the seat limit
    # count beside the weights file. Builds before it: None.
    packed_bytes: dict[str, int] | None = None
    # A build of an export with switchable adapter inputs (--lora-rank) whose graphs pack no weights
    # (cabinlm's block matmuls): every decoder graph also as a twin without the adapter inputs and
    # nodes (files "graph_plain", "graph_plain_seats{B}"), reading the same map of the weights file
    # (shared_weights), which a seat without an adapter runs (a batch of such seats too). Builds
    # before it, and builds whose graphs pack weights: False (the adapter graph fed zeros).
    plain_graphs: bool = False

    @property
    def own_kernels(self) -> bool:
        """The graph holds cabinlm's own operators (ai.cabinlm): the session registers the build's kernel library."""
        return self.attention_kernel == "cabinlm" or self.matmul_kernel == "cabinlm"

    def __post_init__(self) -> None:
        if isinstance(self.accuracy_level, bool) or self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level!r}")
        if self.minimums not in ("int8", "exact"):
            raise ValueError(f"minimums must be int8 or exact, got {self.minimums!r}")
        object.__setattr__(self, "minimums", Minimums(self.minimums))
        for name in ("attention_kernel", "matmul_kernel", "head_kernel"):
            if getattr(self, name) not in ("onnxruntime", "cabinlm"):
                raise ValueError(f"{name} must be onnxruntime or cabinlm, got {getattr(self, name)!r}")
            object.__setattr__(self, name, Kernel(getattr(self, name)))
        if self.head_kernel == "cabinlm" and self.matmul_kernel != "cabinlm":
            raise ValueError(f"head_kernel must be onnxruntime, or cabinlm with matmul_kernel cabinlm, got {self.head_kernel.value!r}")
        if not isinstance(self.step_rows, bool) or (self.step_rows and self.attention_kernel != "cabinlm"):
            raise ValueError(f"step_rows: true only with cabinlm's attention kernel, got {self.step_rows!r}")
        if self.kernels is not None and not self.own_kernels:
            raise ValueError("kernels: a build without cabinlm's kernels lists no kernel library")
        batches = tuple(self.seat_batches) if isinstance(self.seat_batches, (list, tuple)) else self.seat_batches
        object.__setattr__(self, "seat_batches", batches)
        if not isinstance(batches, tuple) or any(isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 64
                                                 for b in batches) or list(batches) != sorted(set(batches)):  # fmt: skip
            raise ValueError(f"seat_batches must be increasing batch sizes 2..64, got {self.seat_batches!r}")
        if batches and not self.step_rows:
            raise ValueError("seat_batches: batched graphs take cabinlm's attention kernel with step rows")
        if not isinstance(self.plain_graphs, bool):
            raise ValueError(f"plain_graphs must be true or false, got {self.plain_graphs!r}")
        if (bool(batches) or self.plain_graphs) != (self.shared_weights is not None):
            raise ValueError("shared_weights comes with seat_batches or plain_graphs (their graphs share the weights)")
        packed = self.packed_bytes
        if packed is not None and (not isinstance(packed, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in packed.items())):  # fmt: skip
            raise ValueError(f"packed_bytes must map graph roles to byte counts >= 0, got {packed!r}"[:200])

    def decoder_io(self, shape: DecoderShape) -> DecoderIO:
        """The fused graph's contract: the cache written through present outputs where ONNX Runtime's
        GroupQueryAttention runs, in place by cabinlm's kernel otherwise (step_rows: a chunk's rows as steps)."""
        return fused_decoder_io(shape.layout, shape.num_heads, shape.vocab_size, self.attention_kernel == "onnxruntime",
                                self.step_rows, shape.embed_dim, lora=shape.lora)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("minimums", "attention_kernel", "matmul_kernel", "head_kernel"):
            d[name] = getattr(self, name).value
        d["kernels"] = self.kernels.to_dict() if self.kernels is not None else None
        d["seat_batches"] = list(self.seat_batches)
        d["shared_weights"] = self.shared_weights.to_dict() if self.shared_weights is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FusedSettings:
        if not isinstance(d, dict):
            raise TypeError(f"build.fused: expected an object, got {type(d).__name__}")
        kernels = d.get("kernels")  # absent: a build made before the library came with the build
        shared = d.get("shared_weights")  # absent (with seat_batches): a build made before seats decoded together
        return cls(**{**d, "kernels": KernelLibrary.from_dict(kernels) if kernels is not None else None,
                      "shared_weights": SharedWeights.from_dict(shared) if shared is not None else None})
