"""Baseline engines for `cabinlm bench`: the same scripted dialogue, measured the same way, on engines
cabinlm is compared with (the names, configurations and install commands are in bench/catalog.py).

    hf         transformers, greedy decoding with its default growing cache (DynamicCache), float32
               weights de-quantized from the GGUF. Runs until done, the model's max positions or a time limit.
    llama.cpp  llama-cpp-python (low-level API) on the GGUF file itself, n_ctx = context.
    ort-genai  onnxruntime-genai, models built by its model builder from the same (de-quantized) weights:
               int4, int4 with an int8 KV cache where the builder offers one, fp32.

Every run happens in a child process (`python -m cabinlm.bench.baselines NAME ...`), so its memory is
measured alone and torch is never loaded into the caller; the child writes the Trace (or its error) as
JSON. Importing this module imports none of torch, transformers, llama_cpp or onnxruntime_genai.

Where things are (imports go down this list, never up):

    baselines.py  this module: the caller's API (run_baseline, run_fixed_context) and the child's body
    peers.py      the engines (transformers, llama.cpp, ort-genai and its model builder)
    prepare.py    the model file, the cache, the one-time float32 save of the GGUF
    child.py      running a child process; its failure as an error with the child's own error line
    catalog.py    names, configurations, packages, install commands, `available`, the error classes
    protocol.py   the token script, the engine interface and the two drivers (dialogue, fixed context)

The protocol (the same token stream for every engine; the template pieces come from the model's chat
template, resolved the way the cabinlm export does):

    system_prefix SYSTEM system_suffix                                  (fed with the first turn)
    [last reply token if cut by max_new] assistant_suffix               (closes the previous reply)
    user_prefix USER-TEXT user_suffix assistant_prefix                  (the new turn: one timed prefill)
    reply: the first token comes from the prefill's logits; each further token is one timed step
           (feed the previous token, greedy argmax). A stop token ends the reply and is not fed by itself
           (the assistant_suffix, which starts with it, is fed with the next turn).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from cabinlm.bench.catalog import (  # noqa: F401 - re-exported: the caller's whole API is here
    BASELINES,
    CONFIGS,
    INSTALL,
    BaselineError,
    BaselineUnavailable,
    available,
)
from cabinlm.bench.child import ERROR, KINDS, PROGRESS, failure, run_child
from cabinlm.bench.peers import open_engine
from cabinlm.bench.prepare import prepare, prepare_here, resolve_model
from cabinlm.bench.protocol import Script, dialogue, fixed_context
from cabinlm.bench.trace import Trace, summarize
from cabinlm.contract.errors import CabinlmError

# --------------------------------------------------------------------------------------------------
# Caller side: no heavy imports


def run_baseline(
    name: str,
    model_path: str | Path,
    *,
    tokens: int,
    threads: int,
    context: int = 1024,
    max_new: int = 128,
    seed: int = 0,
    config: str | None = None,
    time_limit_s: float = 900,
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """The scripted dialogue on baseline NAME, in a child process. config=None runs every configuration
    of the baseline (one child each) and returns the fastest by mean decode latency; the others'
    summaries are in trace.config["others"]."""
    args = ["--tokens", str(tokens), "--context", str(context), "--max-new", str(max_new), "--seed", str(seed),
            "--time-limit", str(time_limit_s)]  # fmt: skip
    return _run_configs(name, model_path, threads, config, args, progress)


def run_fixed_context(
    name: str,
    model_path: str | Path,
    *,
    context: int,
    decode: int = 128,
    threads: int,
    config: str | None = None,
    time_limit_s: float = 900,
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """Fill the context with `context` tokens of dialogue (one timed prefill), then decode `decode`
    tokens greedily (stop tokens ignored), each timed. config=None: all configurations, the fastest."""
    args = ["--fixed-context", "--context", str(context), "--decode", str(decode), "--time-limit", str(time_limit_s)]
    return _run_configs(name, model_path, threads, config, args, progress)


def _ran_its_course(t: Trace) -> bool:
    """Done, or stopped by a limit of the protocol (full context, max positions, time) and not by a failure."""
    return t.stopped == "done" or t.stopped.startswith(("context full", "reached", "time limit"))


def fastest(traces: list[Trace]) -> Trace:
    """The trace with the lowest mean decode latency (the most decoded tokens per second of decode time,
    summarize's decode_tok_s_overall); the others' summaries go in config["others"]. Not the median: a
    call that chose n tokens (speculative decoding, llama.cpp gguf-lookup) counts each at 1/n of its
    time, so such a configuration's median is low whenever most tokens come from calls that accepted
    drafts, even where the calls that accept none cost so much more that it decodes fewer tokens a
    second than plain decoding. Configurations that ran their course are preferred over ones an engine
    failure cut short (ort-genai's int8 KV cache, for one, cannot go past the first turn of a dialogue)."""
    timed = [t for t in traces if t.decode_ms]
    if not timed:
        raise BaselineError("no configuration decoded a token")
    timed = [t for t in timed if _ran_its_course(t)] or timed
    best = min(timed, key=lambda t: statistics.fmean(t.decode_ms))
    best.config["fastest_of"] = [t.config.get("name") for t in traces]
    best.config["others"] = [summarize(t) for t in traces if t is not best]
    return best


def _run_configs(name: str, model_path: str | Path, threads: int, config: str | None, args: list[str],
                 progress: Callable[[str], None] | None) -> Trace:  # fmt: skip
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    if config is not None and config not in CONFIGS[name]:
        raise ValueError(f"{name} has no configuration {config!r}; it has: {', '.join(CONFIGS[name])}")
    path = resolve_model(model_path)  # a wrong model file is said first, whatever is installed
    reason = available(name)
    if reason:
        raise BaselineUnavailable(f"{name}: {reason}")
    if config is not None:
        return _spawn(name, path, threads, config, args, progress)
    traces, errors = [], []
    for c in CONFIGS[name]:
        try:
            traces.append(_spawn(name, path, threads, c, args, progress))
        except BaselineUnavailable:
            raise
        except BaselineError as e:  # one configuration failing (e.g. unsupported here) does not hide the rest
            # The first line of a failure names the child's own error (bench/child.py).
            errors.append({"config": c, "error": str(e).splitlines()[0]})
            if progress:
                progress(f"{name} {c}: failed: {errors[-1]['error']}")
    if not traces:
        lines = "\n".join(f"  {e['config']}: {e['error']}" for e in errors)
        raise BaselineError(f"{name}: every configuration failed:\n{lines}")
    best = fastest(traces)
    best.config["others"] += errors
    return best


def _spawn(name: str, path: Path, threads: int, config: str, args: list[str],
           progress: Callable[[str], None] | None) -> Trace:  # fmt: skip
    """One configuration in a child process; its Trace, or its error raised here as the same class."""
    with tempfile.TemporaryDirectory(prefix="cabinlm-baseline-") as tmp:
        out = Path(tmp) / "trace.json"
        cmd = [sys.executable, "-m", "cabinlm.bench.baselines", name, "--model", str(path), "--threads", str(threads),
               "--config", config, "--out", str(out), *args]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        result = run_child(cmd, env=env, progress=progress)
        data = json.loads(out.read_text()) if out.exists() else None
    if data and "error" in data:
        err = data["error"]
        raise KINDS.get(err["type"], BaselineError)(err["message"])
    if not result.ok or data is None:
        raise failure(f"{name} ({config})", result)
    return Trace.from_dict(data)


# --------------------------------------------------------------------------------------------------
# Child side: the run itself (python -m cabinlm.bench.baselines NAME ...)


def run_here(name: str, path: Path, *, threads: int, config: str | None = None, context: int = 1024,
             tokens: int = 0, max_new: int = 128, seed: int = 0, time_limit_s: float = 900,
             fixed: bool = False, decode: int = 128, log: Callable[[str], None] = lambda s: None,
             on_reply: Callable[[int, str], None] | None = None) -> Trace:  # fmt: skip
    """One run in this process (the child's body; tests call it too)."""
    config = config or CONFIGS[name][0]
    folder = prepare(path, log)
    script = Script.load(folder)
    t = time.perf_counter()
    # Fixed-context mode sizes bounded caches for the fill plus the decoded tokens.
    n_ctx = context + decode + 1 if fixed else context
    engine = open_engine(name, path, script, folder, threads, config, n_ctx, log)
    load_s = time.perf_counter() - t
    try:
        if fixed:
            trace = fixed_context(engine, script, context=context, decode=decode, time_limit_s=time_limit_s)
        else:
            trace = dialogue(engine, script, tokens=tokens, max_new=max_new, seed=seed, time_limit_s=time_limit_s,
                             log=log, on_reply=on_reply)  # fmt: skip
    finally:
        engine.close()
    trace.load_s = round(load_s, 3)
    # The machine's load when the run ended: other processes on the cores skew every engine's timings
    # (llama.cpp's spinning thread pool worst of all), so a reader can tell a quiet run from a busy one.
    trace.config.update(threads=threads, model=str(path), loadavg_1m=round(os.getloadavg()[0], 2))
    if name != "hf" or fixed:
        trace.config.setdefault("context", context)
    return trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cabinlm.bench.baselines", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=[*BASELINES, "prepare"])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None)
    p.add_argument("--time-limit", type=float, default=900)
    p.add_argument("--fixed-context", action="store_true")
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--out", default=None, help="write the Trace as JSON here (default: print the summary)")
    p.add_argument("--replies", default=None, help="also write the reply texts (JSON list) here")
    a = p.parse_args(argv)

    def log(s: str) -> None:
        print(f"{PROGRESS}{s}", file=sys.stderr, flush=True)

    replies: list[str] = []
    try:
        path = resolve_model(a.model)
        if a.name == "prepare":
            print(prepare_here(path))  # the same as python -m cabinlm.bench.prepare
            return 0
        if a.config is not None and a.config not in CONFIGS[a.name]:
            raise BaselineError(f"{a.name} has no configuration {a.config!r}; it has: {', '.join(CONFIGS[a.name])}")
        reason = available(a.name)
        if reason:
            raise BaselineUnavailable(f"{a.name}: {reason}")
        trace = run_here(a.name, path, threads=a.threads, config=a.config, context=a.context, tokens=a.tokens,
                         max_new=a.max_new, seed=a.seed, time_limit_s=a.time_limit, fixed=a.fixed_context,
                         decode=a.decode, log=log, on_reply=lambda i, s: replies.append(s))  # fmt: skip
    except CabinlmError as e:
        if a.out:
            Path(a.out).write_text(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}))
        print(f"{ERROR}{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.replies:
        Path(a.replies).write_text(json.dumps(replies, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(trace.to_dict()))
    else:
        print(json.dumps(summarize(trace), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
