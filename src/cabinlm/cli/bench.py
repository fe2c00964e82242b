"""`cabinlm bench`: a long scripted dialogue through the runtime timed token by token, one seat or
--seats N, with its peers (--baseline), rounds, records and their comparison (`bench compare`)."""

from __future__ import annotations

import json
import math
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from cabinlm.contract.files import FileRole
from cabinlm.cli.common import info
from cabinlm.contract.errors import CabinlmError, OptionError


class BaselineChoice(str, Enum):
    hf = "hf"
    llama_cpp = "llama.cpp"
    ort_genai = "ort-genai"


def bench(
    artifact: Optional[Path] = typer.Argument(
        None, metavar="BUILD", show_default=False,
        help="Folder written by `cabinlm export` or `cabinlm build`; or the word `compare`, then records files.",
    ),
    files: Optional[list[Path]] = typer.Argument(
        None, metavar="[RECORDS]...", show_default=False,
        help="After `compare`: two records files (A.jsonl B.jsonl), or one that holds two builds' records.",
    ),
    tokens: int = typer.Option(2000, help="Tokens to process in all (prompts + replies)."),
    threads: int = typer.Option(2, help="CPU threads, for cabinlm and for every baseline."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    records: Optional[Path] = typer.Option(
        None, "--records", metavar="FILE", help="Append one record per measured run or round to FILE (JSON lines: the "
        "figures, the parameters, and the provenance: cabinlm's commit, the build's manifest and kernel library "
        "hashes, the CPU, the load average; benchmarks/README.md lists every field).",
    ),
    rounds: int = typer.Option(
        1, "--rounds", help="Run the dialogue this many times, each round in a fresh process and a record of its own "
        "(with --seats: the same as --repeat).",
    ),
    alternate: Optional[tuple[Path, Path]] = typer.Option(
        None, "--alternate", metavar="BUILD_A BUILD_B", show_default=False,
        help="Two builds take turns, round by round (A, B, A, B, ...; --rounds of each), then their comparison: "
        "medians, ranges and each round's ratio B/A. In place of BUILD.",
    ),
    plot: Optional[Path] = typer.Option(None, help="Draw latency and memory against tokens into this PNG (matplotlib)."),
    baseline: list[BaselineChoice] = typer.Option(
        [], help="Also run this peer on the same model and threads: hf (transformers, growing cache), "
        "llama.cpp (llama-cpp-python, same GGUF), ort-genai (onnxruntime-genai's own builder). Repeatable.",
    ),
    context: Optional[int] = typer.Option(None, help="Context of llama.cpp / ort-genai. [default: cabinlm's cache slots]"),
    baseline_config: Optional[str] = typer.Option(
        None, help="One baseline configuration (llama.cpp: gguf, gguf-kv8, gguf-lookup; ort-genai: int4, int4-kv8, "
        "fp32); default: all, the fastest (lowest mean decode latency) reported."
    ),
    max_new: int = typer.Option(128, help="Longest reply per turn."),
    seed: int = typer.Option(0, help="Seed of the scripted user turns."),
    time_limit: float = typer.Option(1800, help="Seconds each engine may run before it is stopped."),
    model: Optional[str] = typer.Option(None, help="Model the baselines load [default: the artifact's source]."),
    trace_out: Optional[Path] = typer.Option(None, "--trace", help="Write every per-token sample (JSON) here."),
    seats: int = typer.Option(
        1, help="Seats talking at once (2 or more): N scripted dialogues on the one loaded model, rounds of a turn each, "
        "decoded together (one batched run per step, each seat's drafts verified in it) and in turns, then as streams "
        "(each seat at its own pace: its next prompt rides in the runs with the others' steps); aggregate and "
        "per-seat decode tok/s, time to first token, RSS; --tokens then bounds the tokens decoded per seat and mode.",
    ),
    scaling: bool = typer.Option(
        False, "--scaling", help="With --seats N: also run 1, 2, 4, ... seats below N (seat k on script k), together "
        "and as streams, and report each count's aggregate tok/s against one seat's.",
    ),
    repeat: int = typer.Option(
        1, "--repeat", help="With --seats: run the whole set (every mode, and --scaling's counts) this many times, one "
        "repetition after the other, and report each figure's median and range and each repetition's own ratio to "
        "one seat (a machine's speed drifts over minutes; a ratio is taken within a repetition).",
    ),
    adapter: Optional[str] = typer.Option(
        None, "--adapter", metavar="NAME", help="A build with switchable LoRA adapters: the dialogue with adapter NAME "
        "active (default: the base model); with --rounds or --alternate, every round's. With --seats N: NAME for "
        "every seat, or N names comma-separated, seat i taking the i-th (A1,A2,A3,A4).",
    ),
    speculative: Optional[bool] = typer.Option(
        None, "--speculative/--no-speculative",
        help="Draft reply tokens by prompt lookup and verify them in chunks, as `cabinlm chat` does (the same "
        "greedy replies; a call that keeps n tokens counts each at 1/n of its time; with --seats, every seat "
        "drafts, together and in turns). [default: as chat: on for the fused cpu build]",
    ),
) -> None:
    """A long scripted in-car dialogue (seeded user turns, greedy replies) through the runtime,
    timing every token and sampling process memory.

    Reports median decode and prefill tokens/s, p50/p99 per-token latency (and medians over the first
    and last 1000 decoded tokens), memory at start and end with its slope per 1000 tokens, and the
    tokens evicted. --baseline runs a peer engine on the same dialogue, model and threads, each in its
    own process; a peer whose context fills stops there, and says so. --records keeps every run as a
    record with its provenance; `compare` sets two records files side by side. Figures measured on
    this project's machines: docs/results.md.

    Examples:

      cabinlm bench out/smol-build --tokens 20000 --baseline llama.cpp --plot bench.png

      cabinlm bench out/smol-build --rounds 3 --records today.jsonl

      cabinlm bench compare yesterday.jsonl today.jsonl    # medians, ranges, B/A per round

      cabinlm bench --alternate out/build-a out/build-b --rounds 4 --records ab.jsonl
    """
    from cabinlm.bench import baselines as bl
    from cabinlm.bench.records import Recorder
    from cabinlm.bench.rounds import DialogueParams, record_trace
    from cabinlm.bench.provenance import load_average, utc_now

    if artifact is not None and str(artifact) == "compare" and alternate is None:
        if not files or len(files) > 2:
            raise OptionError("bench compare takes two records files (A.jsonl B.jsonl), or one that holds two builds")
        _compare(files)
        return
    if files:
        raise OptionError(f"unexpected arguments after {artifact}: {' '.join(map(str, files))} (records files go "
                          "after the word `compare`)")  # fmt: skip
    if alternate is not None:
        if artifact is not None:
            raise OptionError("--alternate takes the two builds in place of BUILD: cabinlm bench --alternate A B")
        if seats != 1 or baseline or plot is not None or trace_out is not None or json_out:
            raise OptionError("--alternate compares two builds' dialogues: no --seats, --baseline, --plot, --trace or --json")
    elif artifact is None:
        raise OptionError("bench needs a BUILD folder, `compare A.jsonl B.jsonl`, or --alternate BUILD_A BUILD_B")
    from cabinlm.bench.runner import model_for_baselines, report, run_cabinlm, summaries
    from cabinlm.bench.runner import plot as draw
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.runtime.assembly import check_adapter
    from cabinlm.runtime.limits import check_count, check_output_file, check_threads

    # Checked before any engine runs (each refusal one line, exit 2).
    check_count("tokens", tokens, 1)
    check_threads(threads)
    check_count("max-new", max_new, 1)
    check_count("context", context, 1)
    if not (math.isfinite(time_limit) and time_limit > 0):
        raise OptionError(f"--time-limit must be a positive number of seconds, got {time_limit!r}")
    check_output_file("plot", plot)
    check_output_file("trace", trace_out)
    check_output_file("records", records)
    check_count("rounds", rounds, 1)
    given = DialogueParams(tokens=tokens, threads=threads, max_new=max_new, seed=seed, speculative=speculative,
                           time_limit_s=time_limit, adapter=adapter)  # fmt: skip
    if adapter is not None and baseline:
        raise OptionError("--adapter: the baselines run the base model; no --baseline with it")
    if adapter is not None and seats == 1 and "," in adapter:
        raise OptionError(f"--adapter {adapter}: one seat takes one adapter; a name per seat goes with --seats N")
    if alternate is not None:
        for build in alternate:
            check_adapter(adapter, load_manifest(build))  # a wrong path, a broken manifest or an unknown adapter fails here
        _alternate(list(alternate), given, rounds, records)
        return
    assert artifact is not None  # checked above
    m = load_manifest(artifact)  # a wrong path or a broken manifest fails here, before any run
    if seats == 1:
        check_adapter(adapter, m)
    if seats >= 2 and rounds > 1:  # --rounds and --repeat: the same repetition of the seats' runs
        if repeat not in (1, rounds):
            raise OptionError(f"--rounds {rounds} and --repeat {repeat} disagree; with --seats they are one option")
        repeat = rounds
    elif rounds > 1 and (baseline or plot is not None or trace_out is not None):
        raise OptionError("--rounds repeats cabinlm's dialogue alone: no --baseline, --plot or --trace with it")
    if scaling and seats < 2:
        raise OptionError("--scaling goes with --seats 2 or more (the counts it compares: 1, 2, 4, ... up to N)")
    check_count("repeat", repeat, 1)
    if repeat > 1 and seats < 2:
        raise OptionError("--repeat goes with --seats 2 or more (it repeats the seats' runs)")
    rec = Recorder("cabinlm bench --seats" if seats != 1 else "cabinlm bench")
    if seats != 1:
        from cabinlm.bench.seats import MODES, SCALING_MODES, scaling_counts, seat_adapters, report as seats_report
        from cabinlm.bench.seats_child import run_in_child
        from cabinlm.runtime.limits import check_seat_count

        check_seat_count(seats)
        names = seat_adapters(adapter, seats, m)
        if any(b.value != "llama.cpp" for b in baseline) or plot is not None or trace_out is not None:
            raise OptionError("--seats takes --baseline llama.cpp only, and no --plot or --trace yet")
        peer = bool(baseline)
        if peer and (reason := bl.available("llama.cpp")):
            raise CabinlmError(f"--baseline llama.cpp: {reason}")
        from cabinlm.bench.script import SYSTEM
        from cabinlm.runtime.limits import check_system_prompt
        from cabinlm.runtime.tokenizer import Tokenizer

        system = SYSTEM
        try:  # the scripted dialogue's system prompt, pinned where the cache's pinned slots hold it
            check_system_prompt(SYSTEM, m, Tokenizer(Path(artifact) / m.files[FileRole.TOKENIZER].path), None)
        except OptionError:
            info(f"the bench's system prompt does not fit the {m.cache.sink + m.cache.pinned} pinned slots: none pinned")
            system = ""
        turns = max(1, math.ceil(tokens / max_new))
        info(f"cabinlm: {seats} seats at once through {artifact}, {turns} rounds of one turn each (replies up to {max_new} "
             f"tokens), {threads} threads; decoded together, in turns, then as streams (each seat at its own pace)"
             + (f"; seat adapters {', '.join(names)}" if names else ""))  # fmt: skip

        def seats_run(n: int, mode: str, r: int, **kw: object) -> dict:
            """One mode's run in its own process, recorded (round R of --repeat)."""
            start, load = utc_now(), load_average()
            done = run_in_child(artifact, n, turns, max_new, threads, seed, mode, time_limit, system,
                                speculative=speculative, adapters=names[:n], **kw)  # type: ignore[arg-type]  # fmt: skip
            params = {"runner": "llama.cpp" if mode == "llama.cpp" else "cabinlm", "seats": n, "mode": mode,
                      "turns": turns, "max_new": max_new, "seed": seed, "drafting": given.params()["drafting"]}  # fmt: skip
            if names:  # seat i's adapter, in the record (a record's params are words and numbers) and the report
                done["adapters"] = list(names[:n])
                params["adapters"] = ",".join(names[:n])
            rec.add(params, done, utc_start=start, loadavg_start=load, artifact=artifact, threads=threads, round=r,
                    engine="llama.cpp" if mode == "llama.cpp" else None)  # fmt: skip
            return done

        runs: list[dict] = []
        for r in range(repeat):
            if repeat > 1:
                info(f"cabinlm: repetition {r + 1} of {repeat}")
            rep = [seats_run(seats, mode, r) for mode in MODES]
            for n in scaling_counts(seats) if scaling else ():
                info(f"cabinlm: {n} {'seat' if n == 1 else 'seats'} (--scaling), {' and '.join(SCALING_MODES)}")
                rep += [seats_run(n, mode, r) for mode in SCALING_MODES]
            runs += [dict(d, repeat=r) for d in rep] if repeat > 1 else rep
        if peer:  # llama.cpp: the seats' sequences in one batch, decoding the replies cabinlm decoded together
            from cabinlm.bench.prepare import resolve_model

            gguf = resolve_model(model or model_for_baselines(Path(artifact)))
            info(f"llama.cpp: {seats} sequences in one batch on {gguf}, the same turns and replies")
            runs.append(seats_run(seats, "llama.cpp", 0, gguf=gguf, replies=runs[0]["warmup_replies"] + runs[0]["replies"]))
        if records is not None:
            info(f"wrote {len(rec.records)} records to {rec.write(records)}")
        if json_out:
            typer.echo(json.dumps({"seats": [{k: v for k, v in r.items() if k not in ("replies", "warmup_replies")} for r in runs]}, indent=1))
            return
        for line in seats_report(runs):
            typer.echo(line)
        return
    for b in baseline:
        reason = bl.available(b.value)
        if reason:
            raise CabinlmError(f"--baseline {b.value}: {reason}")
    last = [0.0]

    def progress(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] > 2.0:
            last[0] = now
            info(msg)

    info(f"cabinlm: {tokens} tokens through {artifact} ({m.weights} weights, {m.cache.kv_dtype.value} KV, "
          f"{m.cache.slots} slots, {threads} threads)")  # fmt: skip
    if rounds > 1:  # each round in a process of its own
        from cabinlm.bench.rounds import take_turns
        from cabinlm.bench.trace import summarize

        done = take_turns(rec, [artifact], given, rounds, log=info)
        if records is not None:
            info(f"wrote {len(rec.records)} records to {rec.write(records)}")
        if json_out:
            typer.echo(json.dumps({"rounds": [summarize(t) for _, t in done]}, indent=1))
            return
        for r, (_, t) in enumerate(done):
            typer.echo(f"round {r + 1} of {rounds}:")
            for line in report(summarize(t)):
                typer.echo(line)
        return
    start, load = utc_now(), load_average()
    trace = run_cabinlm(artifact, tokens=tokens, threads=threads, max_new=max_new, seed=seed,
                        time_limit_s=time_limit, speculative=speculative, adapter=adapter, log=progress)  # fmt: skip
    record_trace(rec, trace, given, artifact=artifact, utc_start=start, loadavg_start=load)
    others = []
    ctx = context or m.cache.slots
    source = model or model_for_baselines(Path(artifact))
    for b in baseline:
        info(f"{b.value}: {tokens} tokens on {source}, context {ctx}, {threads} threads")
        start, load = utc_now(), load_average()
        others.append(bl.run_baseline(b.value, source, tokens=tokens, threads=threads, context=ctx, max_new=max_new,
                                      seed=seed, config=baseline_config, time_limit_s=time_limit, progress=progress))  # fmt: skip
        record_trace(rec, others[-1], given, artifact=None, utc_start=start, loadavg_start=load,
                     extra={"context": ctx, "config": others[-1].config.get("name")})  # fmt: skip
    if records is not None:
        info(f"wrote {len(rec.records)} records to {rec.write(records)}")
    out = summaries(trace, others)
    if trace_out is not None:
        trace_out.write_text(json.dumps({"cabinlm": trace.to_dict(), "baselines": [t.to_dict() for t in others]}))
    if plot is not None:
        draw([trace, *others], plot, title=f"{m.model.source}: {m.weights} weights, {m.cache.kv_dtype.value} KV, "
             f"window {m.cache.window}, {threads} thread{'s' if threads != 1 else ''}")  # fmt: skip
        info(f"wrote {plot}")
    if json_out:
        typer.echo(json.dumps(out, indent=1))
        return
    from cabinlm.bench.trace import summarize

    for t in [trace, *others]:
        for line in report(summarize(t)):
            typer.echo(line)
    for engine, s in out.get("same_span", {}).items():
        typer.echo(f"cabinlm over the span {engine} ran ({s['tokens']} tokens, {s['decoded_tokens']} decoded): "
                   f"decode {s['decode_tok_s']} tok/s (median), prefill {s['prefill_tok_s']} tok/s")  # fmt: skip


def _compare(files: list[Path]) -> None:
    """`cabinlm bench compare`: two records files, or one that holds two builds' records."""
    from cabinlm.bench import compare, records

    if len(files) == 2:
        a, b = records.read(files[0]), records.read(files[1])
        what = (str(files[0]), str(files[1]))
    else:
        a, b = compare.split_by_build(records.read(files[0]), str(files[0]))
        what = (f"{files[0]} (first build)", f"{files[0]} (second build)")
    done = compare.compare(a, b, *what)
    typer.echo(f"A: {what[0]}\nB: {what[1]}")
    for line in compare.lines(done):
        typer.echo(line)


def _alternate(builds: list[Path], given, rounds: int, out: Optional[Path]) -> None:
    """`cabinlm bench --alternate A B`: the builds take turns, round by round; then their comparison."""
    from cabinlm.bench import compare
    from cabinlm.bench.records import Recorder
    from cabinlm.bench.rounds import take_turns

    rec = Recorder("cabinlm bench")
    info(f"cabinlm: {given.tokens} tokens through {builds[0]} and {builds[1]} in turns, {rounds} "
         f"round{'s' * (rounds != 1)} each, {given.threads} threads")  # fmt: skip
    done = take_turns(rec, builds, given, rounds, log=info)
    if out is not None:
        info(f"wrote {len(rec.records)} records to {rec.write(out)}")
    a = [r for r, _ in done[0::2]]
    b = [r for r, _ in done[1::2]]
    typer.echo(f"A: {builds[0]}\nB: {builds[1]}")
    for line in compare.lines(compare.compare(a, b, str(builds[0]), str(builds[1]))):
        typer.echo(line)
