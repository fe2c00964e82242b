"""The on-car runtime: numpy, onnxruntime and tokenizers only (never torch or transformers)."""

from __future__ import annotations

from pathlib import Path

from cabinlm.manifest import Manifest, load_manifest, verify_checksums
from cabinlm.engines.backend import Backend, BackendError
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.dialogue import Dialogue, TurnResult
from cabinlm.runtime.perplexity import PerplexityResult, stream_perplexity
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.slots import SlotTable, StepPlan
from cabinlm.runtime.tokenizer import StreamDecoder, Tokenizer


def open_artifact(folder: str | Path, threads: int | None = None, verify: bool = True) -> tuple[Decoder, Tokenizer]:
    """Load an exported artifact: its decoder (with fresh cache buffers) and its tokenizer.

    verify: check every file's sha256 against the manifest first (about 0.5 s for 540 MB), so that
    an edited or swapped graph, weights or tokenizer file is refused instead of run."""
    m = load_manifest(folder)
    if verify:
        verify_checksums(folder, m)
    return Decoder(folder, manifest=m, threads=threads), Tokenizer(Path(folder) / m.files["tokenizer"].path)


__all__ = [
    "Backend",
    "BackendError",
    "Decoder",
    "Dialogue",
    "Manifest",
    "PerplexityResult",
    "Sampler",
    "SlotTable",
    "StepPlan",
    "StreamDecoder",
    "Tokenizer",
    "TurnResult",
    "load_manifest",
    "open_artifact",
    "stream_perplexity",
]
