"""Baseline engines for `cabinlm bench`: the same scripted dialogue, measured the same way, on engines
cabinlm is compared with.

    hf         transformers, greedy decoding with its default growing cache (DynamicCache), float32
               weights de-quantized from the GGUF. Runs until done, the model's max positions or a time limit.
    llama.cpp  llama-cpp-python (low-level API) on the GGUF file itself, n_ctx = context.
    ort-genai  onnxruntime-genai, models built by its model builder from the same (de-quantized) weights:
               int4, int4 with an int8 KV cache where the builder offers one, fp32.

Every run happens in a child process (`python -m cabinlm.bench.baselines NAME ...`), so its memory is
measured alone and torch is never loaded into the caller; the child writes the Trace as JSON.
Importing this module imports none of torch, transformers, llama_cpp or onnxruntime_genai. The token
script, the engine interface and the drivers are in bench/protocol.py; the engines in bench/peers.py.

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
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable

from cabinlm.bench.protocol import (  # noqa: F401 - the protocol, re-exported for callers
    FILL_REPLY,
    RSS_EVERY,
    ContextFull,
    Engine,
    Script,
    dialogue,
    fixed_context,
)
from cabinlm.bench.trace import Trace, summarize
from cabinlm.errors import CabinlmError, ModelError

BASELINES = ("hf", "llama.cpp", "ort-genai")

# Configurations of each baseline; the first is the default when one is asked for by name only.
CONFIGS: dict[str, tuple[str, ...]] = {
    "hf": ("fp32",),
    # "gguf": the file's own weights (Q4_1 for the built-in model), f16 KV cache (llama.cpp's default).
    # "gguf-kv8": the same with a q8_0 KV cache (needs flash attention in llama.cpp).
    "llama.cpp": ("gguf", "gguf-kv8"),
    "ort-genai": ("int4", "int4-kv8", "fp32"),
}

# Exact install commands (also in the error messages). llama-cpp-python compiles llama.cpp from source.
INSTALL = {
    "hf": "pip install 'cabinlm[export]' -c constraints.txt   (torch, transformers, gguf)",
    "llama.cpp": (
        "CMAKE_ARGS='-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF' CMAKE_BUILD_PARALLEL_LEVEL=2 "
        "pip install llama-cpp-python==0.3.36 -c constraints.txt   (compiles llama.cpp: about 7 min on 2 cores)"
    ),
    "ort-genai": "pip install onnxruntime-genai==0.18.0 -c constraints.txt   (keeps onnxruntime at the pinned version)",
}
_MODULES = {"hf": ("torch", "transformers", "gguf"), "llama.cpp": ("llama_cpp",), "ort-genai": ("onnxruntime_genai",)}
_PACKAGES = {"torch": "torch", "transformers": "transformers", "gguf": "gguf", "llama_cpp": "llama-cpp-python",
             "onnxruntime_genai": "onnxruntime-genai"}  # fmt: skip

PREPARE_VERSION = 1


class BaselineError(CabinlmError):
    """A baseline engine cannot run, or its run failed."""


class BaselineUnavailable(BaselineError):
    """The optional package a baseline needs is not installed (the message has the install command)."""



# --------------------------------------------------------------------------------------------------
# Public interface (caller side: no heavy imports)


def available(name: str) -> str | None:
    """None when the baseline can run here, else a one-line reason with the install command."""
    if name not in BASELINES:
        return f"unknown baseline {name!r}; known: {', '.join(BASELINES)}"
    missing = [m for m in _MODULES[name] if importlib.util.find_spec(m) is None]
    if missing:
        pkgs = ", ".join(_PACKAGES[m] for m in missing)
        return f"{pkgs} {'is' if len(missing) == 1 else 'are'} not installed: {INSTALL[name]}"
    if name == "ort-genai":
        # Building its models needs transformers (the GGUF is de-quantized and saved first).
        for m in ("torch", "transformers", "gguf"):
            if importlib.util.find_spec(m) is None:
                return f"{_PACKAGES[m]} is not installed (needed to build ort-genai models): {INSTALL['hf']}"
    return None


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
    of the baseline (one child each) and returns the fastest by median decode latency; the others'
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
    """The trace with the lowest median decode latency; the others' summaries go in config["others"].
    Configurations that ran their course are preferred over ones an engine failure cut short (ort-genai's
    int8 KV cache, for one, cannot go past the first turn of a dialogue)."""
    timed = [t for t in traces if t.decode_ms]
    if not timed:
        raise BaselineError("no configuration decoded a token")
    timed = [t for t in timed if _ran_its_course(t)] or timed
    best = min(timed, key=lambda t: statistics.median(t.decode_ms))
    best.config["fastest_of"] = [t.config.get("name") for t in traces]
    best.config["others"] = [summarize(t) for t in traces if t is not best]
    return best


def _resolve_model(model_path: str | Path) -> Path:
    path = Path(model_path).expanduser()
    if not path.exists():
        from cabinlm.export.models import ALIASES, fetch_alias  # only for built-in names

        if str(model_path) in ALIASES:
            return fetch_alias(str(model_path))
        raise ModelError(f"{model_path}: no such model file (baselines take a .gguf file or a built-in model name)")
    if path.is_dir() or path.suffix != ".gguf":
        raise ModelError(f"{model_path}: baselines take a .gguf file (the same file every engine loads)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{model_path}: not a GGUF file (no GGUF magic at its start)")
    return path.resolve()


def _run_configs(name, model_path, threads, config, args, progress) -> Trace:
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    if config is not None and config not in CONFIGS[name]:
        raise ValueError(f"{name} has no configuration {config!r}; it has: {', '.join(CONFIGS[name])}")
    path = _resolve_model(model_path)  # a wrong model file is said first, whatever is installed
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
            errors.append({"config": c, "error": str(e).splitlines()[0]})
            if progress:
                progress(f"{name} {c}: failed: {str(e).splitlines()[0]}")
    if not traces:
        raise BaselineError(f"{name}: every configuration failed: {errors}")
    best = fastest(traces)
    best.config["others"] += errors
    return best


def _spawn(name, path, threads, config, args, progress) -> Trace:
    with tempfile.TemporaryDirectory(prefix="cabinlm-baseline-") as tmp:
        out = Path(tmp) / "trace.json"
        cmd = [sys.executable, "-m", "cabinlm.bench.baselines", name, "--model", str(path), "--threads", str(threads),
               "--config", config, "--out", str(out), *args]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        tail: deque[str] = deque(maxlen=40)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip("\n")
            if line.startswith("progress: "):
                if progress:
                    progress(line[len("progress: "):])
            elif line.strip():
                tail.append(line)
        rc = proc.wait()
        data = json.loads(out.read_text()) if out.exists() else None
    if data and "error" in data:
        err = data["error"]
        cls = {"ModelError": ModelError, "BaselineUnavailable": BaselineUnavailable}.get(err["type"], BaselineError)
        raise cls(err["message"])
    if rc != 0 or data is None:
        stderr = "\n".join(tail) or "(no output)"
        raise BaselineError(f"{name} ({config}) failed: the child exited with {rc}; its stderr ends:\n{stderr}")
    return Trace.from_dict(data)


# --------------------------------------------------------------------------------------------------
# Child side: preparation (the de-quantized model folder), the token script, engines, the drivers


def cache_root() -> Path:
    return Path(os.environ.get("CABINLM_CACHE", Path.home() / ".cache" / "cabinlm")) / "baselines"


def model_key(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return f"{path.stem}-{h.hexdigest()[:12]}"


def prepared_dir(path: Path) -> Path:
    """Where the GGUF's float32 transformers save (config, safetensors, tokenizer, template) lives."""
    return cache_root() / model_key(path) / "hf"


def prepare(path: Path, log: Callable[[str], None] = lambda s: None) -> Path:
    """Load the GGUF with transformers (de-quantized to float32) once, and save it with its tokenizer,
    resolved chat-template pieces and stop ids: the input of the ort-genai builder and of the hf baseline,
    and the tokenizer every baseline renders the script with. Runs in its own process (transformers)."""
    folder = prepared_dir(path)
    if (folder / "cabinlm_baseline.json").exists():
        return folder
    log(f"preparing {path.name} for the baselines (once): de-quantizing with transformers into {folder}")
    cmd = [sys.executable, "-m", "cabinlm.bench.baselines", "prepare", "--model", str(path)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if not (folder / "cabinlm_baseline.json").exists():
        lines = proc.stderr.strip().splitlines()
        errs = [ln for ln in lines if ln.startswith("error: ")]
        if errs:  # the child's own CabinlmError: raise the same kind here
            kind, _, message = errs[-1][len("error: "):].partition(": ")
            cls = {"ModelError": ModelError, "BaselineUnavailable": BaselineUnavailable}.get(kind, BaselineError)
            raise cls(message)
        tail = "\n".join(lines[-15:])
        last = lines[-1] if lines else "no output"
        raise BaselineError(f"preparing {path} with transformers failed (exit {proc.returncode}): {last}\n{tail}")
    return folder


def _prepare_here(path: Path) -> Path:
    for m in ("torch", "transformers", "gguf"):
        if importlib.util.find_spec(m) is None:
            raise BaselineUnavailable(f"{_PACKAGES[m]} is not installed (needed to read the GGUF): {INSTALL['hf']}")
    from cabinlm.export import stop_ids
    from cabinlm.export.models import load_model
    from cabinlm.export.template import resolve_chat_template

    folder = prepared_dir(path)
    try:
        loaded = load_model(str(path))
    except CabinlmError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged GGUF fails deep in the gguf reader with any error
        raise ModelError(f"{path}: transformers cannot load this GGUF ({type(e).__name__}: {_first_line(e)})") from e
    chat = resolve_chat_template(loaded.tokenizer)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".hf-"))
    try:
        # transformers marks a GGUF-loaded model as "quantized" (not serializable), though its weights are
        # plain float32 tensors by now: drop the marker and save them as they are.
        model = loaded.model
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        meta = {
            "version": PREPARE_VERSION,
            "gguf": str(path),
            "chat": {k: getattr(chat, k) for k in ("system_prefix", "system_suffix", "user_prefix", "user_suffix",
                                                    "assistant_prefix", "assistant_suffix")},  # fmt: skip
            "stop_ids": stop_ids(loaded, chat),
            "max_positions": int(loaded.spec.max_positions),
            "vocab_size": int(loaded.spec.vocab_size),
        }
        (tmp / "cabinlm_baseline.json").write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _engine(name: str, path: Path, script: Script, folder: Path, threads: int, config: str, n_ctx: int,
            log: Callable[[str], None]) -> Engine:  # fmt: skip
    from cabinlm.bench.peers import HFEngine, LlamaCppEngine, OrtGenaiEngine, build_ort_genai

    if name == "hf":
        return HFEngine(folder, script, threads, config, None)
    if name == "llama.cpp":
        return LlamaCppEngine(path, threads, config, n_ctx)
    if name == "ort-genai":
        built = build_ort_genai(path, folder, config, log)
        return OrtGenaiEngine(built, threads, config, n_ctx)
    raise ValueError(name)


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
    engine = _engine(name, path, script, folder, threads, config, n_ctx, log)
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
        print(f"progress: {s}", file=sys.stderr, flush=True)

    replies: list[str] = []
    try:
        path = _resolve_model(a.model)
        if a.name == "prepare":
            print(_prepare_here(path))
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
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
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
