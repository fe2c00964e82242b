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
        "[default: cabinlm's calibration prose, about 6,000 tokens, cycled through so that every distance is reached]"),
    distances: str = typer.Option("2000,8000,32000", help="How far back the statement is when the question comes, "
                                  "in tokens, comma-separated."),
    lead: int = typer.Option(0, help="Filler turns before the statement: with 1 or more the statement "
                             "is not the opening request (which the region always keeps), so only retrieval brings it back."),
    no_recall: bool = typer.Option(False, "--no-recall", help="Only without the recall region (StreamingLLM)."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads (default: all cores)."),
    json_out: bool = typer.Option(False, "--json", help="Print {\"results\": [{\"distance\", \"recall\", \"lead\", "
                                  "\"accuracy\", \"held\", \"trials\", \"recall_ms_per_turn\", \"retrieval_ms_per_turn\"}, ...]}."),
    records: Optional[Path] = typer.Option(
        None, "--records", metavar="FILE", help="Append one record per (distance, recall on / off) to FILE (JSON "
        "lines with provenance: benchmarks/README.md)."),
) -> None:
    """Recall against distance: each fact's statement in the first user turn, filler turns (user messages cut
    from --filler, short assistant replies) until it is DISTANCE tokens back, then its question; right when the
    answer is the choice the model's log-likelihood ranks first as the assistant's reply (teacher-forced).
    Accuracy per distance with the recall region (an artifact exported with --recall R) and without, and the
    region's prefill ms per turn, and how often the region held the statement ("held"). Every input is checked
    before the model loads."""
    from cabinlm.bench import provenance
    from cabinlm.bench.recall import DEFAULT_FACTS, DEFAULT_FILLER, filler_messages, parse_distances, read_facts, run
    from cabinlm.bench.records import Recorder
    from cabinlm.runtime.assembly import RuntimeConfig, open_runtime
    from cabinlm.runtime.limits import check_count, check_output_file

    check_count("lead", lead, 0, 64)
    points = parse_distances(distances)
    fact_list = read_facts(facts or DEFAULT_FACTS)
    check_output_file("records", records)
    runtime = open_runtime(RuntimeConfig(artifact, threads=threads, max_new_tokens=1, speculative=False))
    pieces = filler_messages(runtime.tokenizer, filler or DEFAULT_FILLER, points, runtime.manifest.cache.window,
                             cycle=filler is None)  # fmt: skip
    d = runtime.dialogues()[0]
    modes = [False] if no_recall or d.recaller is None else [True, False]
    if d.recaller is None and not no_recall:
        info(f"{artifact} has no recall region (export it with --recall R): measuring without recall only")
    rec = Recorder("cabinlm recall")
    lay = runtime.manifest.cache
    clock = {"start": provenance.utc_now(), "load": provenance.load_average()}

    def done(r) -> None:  # one record per result, timed from the previous one's end
        params = {"distance": r.distance, "recall": r.recall, "lead": r.lead, "facts": (facts or DEFAULT_FACTS).name,
                  "filler": (filler or DEFAULT_FILLER).name, "sink": lay.sink, "window": lay.window,
                  "region": lay.recall}  # fmt: skip
        figures = {"accuracy": r.accuracy, "held": r.held, "trials": r.trials, "recall_ms_per_turn": r.recall_ms_per_turn,
                   "retrieval_ms_per_turn": r.retrieval_ms_per_turn}  # fmt: skip
        rec.add(params, figures, utc_start=clock["start"], loadavg_start=clock["load"], artifact=artifact,
                threads=threads)  # fmt: skip
        clock.update(start=provenance.utc_now(), load=provenance.load_average())
        if records is not None:  # written as each result completes, so a long run keeps what it measured
            rec.write(records)
            rec.records.clear()

    results = run(d, fact_list, pieces, points, modes, lead=lead, done=done)
    if json_out:
        typer.echo(json.dumps({"results": [r.to_dict() for r in results]}))
        return
    typer.echo("distance  recall  accuracy  held  trials  recall ms/turn  retrieval ms/turn")
    for r in results:
        typer.echo(f"{r.distance:>8}  {'on' if r.recall else 'off':>6}  {r.accuracy:>8.2f}  {r.held:>4.2f}  {r.trials:>6}  "
                   f"{r.recall_ms_per_turn:>14.1f}  {r.retrieval_ms_per_turn:>17.1f}")
