"""One artifact opened: its decoder (with fresh cache buffers) and its tokenizer, its files checked."""

from __future__ import annotations

from pathlib import Path

from cabinlm.contract.files import FileRole
from cabinlm.contract.manifest import Manifest, load_manifest, verify_checksums
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.tokenizer import Tokenizer
from cabinlm.runtime.call_styles import shown_markers


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
    tok = tokenizer if tokenizer is not None else Tokenizer(Path(folder) / m.files[FileRole.TOKENIZER].path)
    shown = shown_markers(m.chat)
    if shown:  # a call opener that is a control token shows in replies' text (runtime/tools.py)
        tok.show(shown)
    return Decoder(folder, manifest=m, threads=threads), tok
