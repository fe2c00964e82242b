"""The on-car runtime: numpy, onnxruntime and tokenizers only (never torch or transformers).

open_runtime(RuntimeConfig(...)) is how the commands open an artifact (runtime/assembly.py: every
check, then the seats' decoders and dialogues); open_artifact loads one decoder and the tokenizer."""

from __future__ import annotations

from pathlib import Path

from cabinlm.manifest import Manifest, load_manifest, verify_checksums
from cabinlm.engines.backend import Backend, BackendError
from cabinlm.runtime.decoder import Decoder, seats_together, step_seats
from cabinlm.runtime.dialogue import Dialogue, TurnResult
from cabinlm.runtime.perplexity import PerplexityResult, stream_perplexity, token_nll
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.slots import SlotTable, StepPlan
from cabinlm.runtime.tokenizer import StreamDecoder, Tokenizer
from cabinlm.runtime.tools import shown_markers
from cabinlm.runtime.assembly import Runtime, RuntimeConfig, open_runtime


def open_artifact(folder: str | Path, threads: int | None = None, verify: bool = True, *,
                  manifest: Manifest | None = None, tokenizer: Tokenizer | None = None) -> tuple[Decoder, Tokenizer]:
    """Load an exported artifact: its decoder (with fresh cache buffers) and its tokenizer.

    verify: check every file's sha256 against the manifest first (about 0.5 s for 540 MB), so that
    an edited or swapped graph, weights or tokenizer file is refused instead of run.
    manifest, tokenizer: the folder's own, when the caller read them already (runtime/assembly.py
    checks options with them before anything heavy loads)."""
    m = manifest if manifest is not None else load_manifest(folder)
    if verify:
        verify_checksums(folder, m)
    tok = tokenizer if tokenizer is not None else Tokenizer(Path(folder) / m.files["tokenizer"].path)
    shown = shown_markers(m.chat)
    if shown:  # a call opener that is a control token shows in replies' text (runtime/tools.py)
        tok.show(shown)
    return Decoder(folder, manifest=m, threads=threads), tok


__all__ = [
    "Backend",
    "BackendError",
    "Decoder",
    "Dialogue",
    "Manifest",
    "PerplexityResult",
    "Runtime",
    "RuntimeConfig",
    "Sampler",
    "SlotTable",
    "StepPlan",
    "StreamDecoder",
    "Tokenizer",
    "TurnResult",
    "load_manifest",
    "open_artifact",
    "open_runtime",
    "seats_together",
    "step_seats",
    "stream_perplexity",
    "token_nll",
]
