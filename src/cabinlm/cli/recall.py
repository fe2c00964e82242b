"""`cabinlm recall`: a fact said in the first turn, asked about D tokens later, through the real dialogue
path, with and without the artifact's recall region (bench/recall.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cabinlm.cli.common import info


def recall(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export` or `cabinlm build`."),
    facts: Optional[Path] = typer.Option(
        None, help="JSON lines, one fact each: {\"statement\", \"question\", \"choices\": [...], \"answer\"}. "
        "[default: cabinlm's 12 in-car facts]"),
    filler: Optional[Path] = typer.Option(
        None, help="Text the filler turns are cut from; it must hold the largest distance in tokens. "
        "[default: cabinlm's calibration prose, about 6,000 tokens]"),
    distances: str = typer.Option("2000,4000", help="How far back the statement is when the question comes, in "
                                  "tokens, comma-separated."),
    no_recall: bool = typer.Option(False, "--no-recall", help="Only without the recall region (StreamingLLM)."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads (default: all cores)."),
    json_out: bool = typer.Option(False, "--json", help="Print {\"results\": [{\"distance\", \"recall\", \"accuracy\", "
                                  "\"trials\", \"recall_ms_per_turn\"}, ...]}."),
) -> None:
    """Recall against distance: each fact's statement in the first user turn, filler turns (user messages cut
    from --filler, short assistant replies) until it is DISTANCE tokens back, then its question; right when the
    answer is the choice the model's log-likelihood ranks first as the assistant's reply (teacher-forced).
    Accuracy per distance with the recall region (an artifact exported with --recall R) and without, and the
    region's prefill ms per turn. Every input is checked before the model loads."""
    from cabinlm.bench.recall import DEFAULT_FACTS, DEFAULT_FILLER, filler_messages, parse_distances, read_facts, run
    from cabinlm.runtime.assembly import RuntimeConfig, open_runtime

    points = parse_distances(distances)
    fact_list = read_facts(facts or DEFAULT_FACTS)
    runtime = open_runtime(RuntimeConfig(artifact, threads=threads, max_new_tokens=1, speculative=False))
    pieces = filler_messages(runtime.tokenizer, filler or DEFAULT_FILLER, points, runtime.manifest.cache.window)
    d = runtime.dialogues()[0]
    modes = [False] if no_recall or d.recaller is None else [True, False]
    if d.recaller is None and not no_recall:
        info(f"{artifact} has no recall region (export it with --recall R): measuring without recall only")
    results = run(d, fact_list, pieces, points, modes)
    if json_out:
        typer.echo(json.dumps({"results": [r.to_dict() for r in results]}))
        return
    typer.echo("distance  recall  accuracy  trials  recall ms/turn")
    for r in results:
        typer.echo(f"{r.distance:>8}  {'on' if r.recall else 'off':>6}  {r.accuracy:>8.2f}  {r.trials:>6}  "
                   f"{r.recall_ms_per_turn:>14.1f}")
