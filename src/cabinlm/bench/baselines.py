"""Baseline engines for `cabinlm bench`: the same scripted dialogue, measured the same way, on engines
cabinlm is compared with.

    hf         transformers, greedy decoding with its default growing cache (DynamicCache), float32
               weights de-quantized from the GGUF. Runs until done, the model's max positions or a time limit.
    llama.cpp  llama-cpp-python (low-level API) on the GGUF file itself, n_ctx = context.
    ort-genai  onnxruntime-genai, models built by its model builder from the same (de-quantized) weights:
               int4, int4 with an int8 KV cache where the builder offers one, fp32.

Every run happens in a child process (`python -m cabinlm.bench.baselines NAME ...`), so its memory is
measured alone and torch is never loaded into the caller; the child writes the Trace as JSON.
Importing this module imports none of torch, transformers, llama_cpp or onnxruntime_genai.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cabinlm.bench.script import SYSTEM, user_turns
from cabinlm.bench.trace import Trace, summarize
from cabinlm.errors import CabinlmError, ModelError
from cabinlm.runtime.memory import rss_mb

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

RSS_EVERY = 64  # tokens between memory samples
FILL_REPLY = "Sure. I have taken care of that for you, and I will tell you if anything changes on the way."
PREPARE_VERSION = 1


class BaselineError(CabinlmError):
    """A baseline engine cannot run, or its run failed."""


class BaselineUnavailable(BaselineError):
    """The optional package a baseline needs is not installed (the message has the install command)."""


class ContextFull(Exception):
    """The engine cannot go on (its context is full, or it refuses more): the message is the honest
    one-line reason, recorded in trace.stopped."""


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


@dataclass
class Script:
    """The dialogue as token ids, rendered with the model's tokenizer (tokenizers only: no transformers)."""

    system: list[int]
    assistant_suffix: list[int]
    stop_ids: set[int]
    max_positions: int
    _tok: object
    _chat: dict

    @classmethod
    def load(cls, folder: Path) -> Script:
        from cabinlm.runtime.tokenizer import Tokenizer

        meta = json.loads((folder / "cabinlm_baseline.json").read_text())
        tok = Tokenizer(folder / "tokenizer.json")
        chat = meta["chat"]
        system = tok.encode(chat["system_prefix"]) + tok.encode_text(SYSTEM) + tok.encode(chat["system_suffix"])
        return cls(system=system, assistant_suffix=tok.encode(chat["assistant_suffix"]),
                   stop_ids=set(meta["stop_ids"]), max_positions=int(meta["max_positions"]), _tok=tok, _chat=chat)  # fmt: skip

    def user(self, text: str) -> list[int]:
        c, tok = self._chat, self._tok
        return tok.encode(c["user_prefix"]) + tok.encode_text(text) + tok.encode(c["user_suffix"] + c["assistant_prefix"])  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)  # type: ignore[attr-defined]

    def fill(self, n: int, seed: int = 0) -> list[int]:
        """n tokens of dialogue: the system prompt, then user turns each answered by a fixed reply."""
        ids = list(self.system)
        reply = self._tok.encode_text(FILL_REPLY) + self.assistant_suffix  # type: ignore[attr-defined]
        turns = user_turns(seed)
        while len(ids) < n:
            ids += self.user(next(turns)) + reply
        return ids[:n]


class Engine:
    """feed(ids) -> greedy next token; step(token) -> greedy next token; context: tokens in the engine."""

    name = ""
    context = 0
    config: dict

    def feed(self, ids: list[int]) -> int:
        raise NotImplementedError

    def step(self, token: int) -> int:
        return self.feed([token])

    def close(self) -> None:
        pass


class HFEngine(Engine):
    name = "hf"

    def __init__(self, folder: Path, script: Script, threads: int, config: str, limit: int | None):
        import torch
        from transformers import AutoModelForCausalLM, DynamicCache

        self._threads_before = torch.get_num_threads()  # restored on close (tests run engines in-process)
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.cache = DynamicCache(config=self.model.config)
        self.max_positions = script.max_positions
        self.config = {"name": config, "weights": "float32 (de-quantized from the GGUF)", "kv": "float32 DynamicCache",
                       "attn": self.model.config._attn_implementation, "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__}  # fmt: skip

    def feed(self, ids: list[int]) -> int:
        if self.context + len(ids) > self.max_positions:
            raise ContextFull(f"reached the model's {self.max_positions} positions (transformers cannot go past them)")
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.context += len(ids)
        return int(out.logits[0, -1].argmax())

    def close(self) -> None:
        self.torch.set_num_threads(self._threads_before)


class LlamaCppEngine(Engine):
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, config: str, n_ctx: int):
        import ctypes

        import numpy as np

        try:
            import llama_cpp as L
        except Exception as e:  # noqa: BLE001 - a broken build: say so with the install command
            raise BaselineUnavailable(f"llama-cpp-python does not import ({e}): {INSTALL['llama.cpp']}") from e
        self.L, self.np, self.ctypes = L, np, ctypes
        self.log: deque[str] = deque(maxlen=20)

        @L.llama_log_callback
        def _log(level, text, user_data):  # keep llama.cpp's messages (the last ones explain a failure)
            s = text.decode("utf-8", "replace").strip()
            if s:
                self.log.append(s)

        self._log_cb = _log
        L.llama_log_set(_log, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ModelError(f"{path}: llama.cpp cannot load this GGUF ({'; '.join(list(self.log)[-3:])})")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = min(512, n_ctx)
        cp.n_ubatch = min(512, n_ctx)
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        kv = "f16"
        if config == "gguf-kv8":
            cp.type_k = L.GGML_TYPE_Q8_0
            cp.type_v = L.GGML_TYPE_Q8_0
            _set_flash_attn(L, cp, True)
            kv = "q8_0"
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BaselineError(f"llama.cpp cannot create a context ({'; '.join(list(self.log)[-3:])})")
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.n_batch = int(cp.n_batch)
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self.config = {"name": config, "weights": "the GGUF file as is", "kv": kv, "n_ctx": self.n_ctx,
                       "n_batch": self.n_batch, "llama_cpp_python": L.__version__}  # fmt: skip

    def feed(self, ids: list[int]) -> int:
        L = self.L
        for i in range(0, len(ids), self.n_batch):
            chunk = ids[i : i + self.n_batch]
            arr = (L.llama_token * len(chunk))(*chunk)
            rc = L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                why = "no free KV-cache slot" if rc == 1 else "error"
                raise ContextFull(
                    f"context full at {self.context} tokens (n_ctx {self.n_ctx}): llama_decode returned {rc} ({why}) "
                    f"for {len(chunk)} more tokens; llama.cpp's library does not shift or evict by itself"
                    + (f" [{self.log[-1]}]" if self.log else "")
                )
            self.context += len(chunk)
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def _set_flash_attn(L, cp, on: bool) -> None:
    names = {f[0] for f in type(cp)._fields_}
    if "flash_attn_type" in names:  # newer llama.cpp: an enum (auto / disabled / enabled)
        cp.flash_attn_type = getattr(L, "LLAMA_FLASH_ATTN_TYPE_ENABLED", 1) if on else 0
    else:
        cp.flash_attn = on


def ort_genai_dir(path: Path, config: str) -> Path:
    return cache_root() / model_key(path) / f"ort-genai-{config}"


def build_ort_genai(path: Path, hf: Path, config: str, log: Callable[[str], None] = lambda s: None) -> Path:
    """Build (once) the ort-genai model of a configuration with its model builder, from the prepared folder.

    int4-kv8: the builder's int8 KV cache (kv_cache_quant_scheme=int8_per_channel) needs calibrated
    per-layer scales; they come from the package's own calibration tool run on the int4 model."""
    out = ort_genai_dir(path, config)
    if (out / "genai_config.json").exists():
        return out
    precision = {"int4": "int4", "int4-kv8": "int4", "fp32": "fp32"}[config]
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    t = time.perf_counter()
    steps = []
    try:
        extra: list[str] = []
        if config == "int4-kv8":
            base = build_ort_genai(path, hf, "int4", log)
            scales = tmp / "kv_scales.json"
            cal = [sys.executable, "-m", "onnxruntime_genai.models.quantization.kv_cache_calibration", "--model",
                   str(base), "--tokenizer", str(hf), "--out", str(scales), "--quant-type", "int8_per_channel",
                   "--num-seqs", "8"]  # fmt: skip
            log(f"calibrating the int8 KV-cache scales (once): {' '.join(cal[2:])}")
            _check_run(cal, f"ort-genai {config}: KV-cache calibration")
            steps.append(cal[1:])
            extra = ["--extra_options", "kv_cache_quant_scheme=int8_per_channel", f"kv_cache_scale_file={scales}"]
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp), "-p", precision,
               "-e", "cpu", "-c", str(tmp / "hf-cache"), *extra]  # fmt: skip
        log(f"building the ort-genai {config} model (once): {' '.join(cmd[2:])}")
        _check_run(cmd, f"ort-genai {config}: the model builder")
        if not (tmp / "genai_config.json").exists():
            raise BaselineError(f"ort-genai {config}: the model builder wrote no genai_config.json")
        steps.append(cmd[1:])
        shutil.rmtree(tmp / "hf-cache", ignore_errors=True)
        steps = [[a.replace(str(tmp), str(out)) for a in step] for step in steps]
        info = {"cmd": steps[-1], "steps": steps, "seconds": round(time.perf_counter() - t, 1)}
        (tmp / "cabinlm_build.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise BaselineError(f"{what} failed (exit {proc.returncode}):\n{tail}")


class OrtGenaiEngine(Engine):
    name = "ort-genai"

    def __init__(self, folder: Path, threads: int, config: str, max_length: int):
        try:
            import onnxruntime_genai as og
        except Exception as e:  # noqa: BLE001
            raise BaselineUnavailable(f"onnxruntime-genai does not import ({e}): {INSTALL['ort-genai']}") from e
        self.og = og
        cfg = og.Config(str(folder))
        # eos_token_id: the harness decides when a reply ends (the script's stop ids, as for every engine).
        # With the model's own EOS, ort-genai's search ends on it and leaves it out of the sequence, and
        # the next append_tokens then runs it at a position the sequence does not hold; a plain token id
        # (the last of the vocabulary) that never ends a reply keeps sequence and cache in step.
        vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
        overlay = {"model": {"eos_token_id": vocab - 1,
                             "decoder": {"session_options": {"intra_op_num_threads": threads,
                                                             "inter_op_num_threads": 1}}}}  # fmt: skip
        cfg.overlay(json.dumps(overlay))
        self.model = og.Model(cfg)
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False)
        self.generator = og.Generator(self.model, params)
        self.max_length = max_length
        self._sampled: int | None = None  # chosen by generate_next_token; its forward pass has not run yet
        self.config = {"name": config, "max_length": max_length, "onnxruntime_genai": og.__version__,
                       "built_with": json.loads((folder / "cabinlm_build.json").read_text())["cmd"]}  # fmt: skip

    def _next(self) -> int:
        self.generator.generate_next_token()
        self._sampled = int(self.generator.get_next_tokens()[0])
        return self._sampled

    def feed(self, ids: list[int]) -> int:
        # The token generate_next_token chose last is already in ort-genai's sequence, its forward pass not
        # yet run. The protocol feeds it again at the start of the next prompt (the reply's last token when
        # max_new cut it, or the stop token that starts assistant_suffix), so it is rewound first and the
        # whole prompt is appended in one call. (Letting append_tokens run it first, as ort-genai 0.18 does
        # on its own, leaves the cache one token out of step: the replies then differ from a fresh prefill
        # of the same tokens. With rewind they match transformers token for token.)
        if self._sampled is not None:
            try:
                self.generator.rewind_to(self.generator.token_count() - 1)
            except Exception as e:  # noqa: BLE001
                raise ContextFull(f"ort-genai cannot continue the dialogue at {self.context} tokens (turn 2 onward): "
                                  f"rewind_to failed: {_first_line(e)}") from e  # fmt: skip
            self._sampled = None
        try:
            self.generator.append_tokens(ids)
        except Exception as e:  # noqa: BLE001 - ort-genai raises RuntimeError-like errors
            msg = _first_line(e)
            if "exceeds max length" in msg:
                raise ContextFull(f"context full at {self.context} tokens: ort-genai append_tokens refuses {len(ids)} "
                                  f"more past max_length {self.max_length} ({msg})") from e  # fmt: skip
            raise ContextFull(f"ort-genai append_tokens failed at {self.context} tokens: {msg}") from e
        self.context += len(ids)
        return self._next()

    def step(self, token: int) -> int:
        # generate_next_token runs the forward pass of the token chosen last, then picks the next one.
        if self.generator.is_done():
            if self.generator.token_count() < self.max_length:
                raise ContextFull(f"the ort-genai generator ended at {self.context} tokens on its own (eos id)")
            raise ContextFull(f"context full at {self.context} tokens: the ort-genai generator is done "
                              f"(max_length {self.max_length}, counting the token it chose last)")  # fmt: skip
        try:
            nxt = self._next()
        except Exception as e:  # noqa: BLE001
            raise ContextFull(f"ort-genai generate_next_token failed at {self.context} tokens "
                              f"(max_length {self.max_length}): {_first_line(e)}") from e  # fmt: skip
        self.context += 1
        return nxt


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _engine(name: str, path: Path, script: Script, folder: Path, threads: int, config: str, n_ctx: int,
            log: Callable[[str], None]) -> Engine:  # fmt: skip
    if name == "hf":
        return HFEngine(folder, script, threads, config, None)
    if name == "llama.cpp":
        return LlamaCppEngine(path, threads, config, n_ctx)
    if name == "ort-genai":
        built = build_ort_genai(path, folder, config, log)
        return OrtGenaiEngine(built, threads, config, n_ctx)
    raise ValueError(name)


class _Recorder:
    """Counts processed tokens and samples RSS each time the count crosses a multiple of RSS_EVERY. The
    first sample follows the first prefill (every engine has touched all its weights by then: hf and
    llama.cpp map their weight files lazily, so a sample right after loading would understate them)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.next_rss = 0

    def add(self, n: int) -> None:
        t = self.trace
        t.tokens += n
        if t.tokens >= self.next_rss:
            t.rss.append((t.tokens, round(rss_mb(), 2)))
            self.next_rss = (t.tokens // RSS_EVERY + 1) * RSS_EVERY


def dialogue(engine: Engine, script: Script, *, tokens: int, max_new: int = 128, seed: int = 0,
             time_limit_s: float = 900, log: Callable[[str], None] = lambda s: None,
             on_reply: Callable[[int, str], None] | None = None) -> Trace:  # fmt: skip
    """The scripted multi-turn dialogue on one engine (in this process)."""
    trace = Trace(engine=engine.name, config=dict(engine.config))
    trace.config.update(max_new=max_new, seed=seed, time_limit_s=time_limit_s)
    rec = _Recorder(trace)
    turns = user_turns(seed)
    pending = list(script.system)
    t0 = time.perf_counter()
    perf = time.perf_counter

    def over_time() -> bool:
        if perf() - t0 > time_limit_s:
            trace.stopped = f"time limit {time_limit_s:g} s"
            return True
        return False

    while trace.tokens < tokens and not over_time():
        prompt = pending + script.user(next(turns))
        t = perf()
        try:
            token = engine.feed(prompt)
        except ContextFull as e:
            trace.stopped = str(e)
            break
        trace.prefill.append((len(prompt), perf() - t))
        rec.add(len(prompt))
        trace.turns += 1
        reply: list[int] = []
        unfed: list[int] = []
        stop = False
        for i in range(max_new):
            if token in script.stop_ids:
                break
            reply.append(token)
            if i == max_new - 1:
                unfed = [token]  # fed with the next prompt
                break
            if trace.tokens >= tokens or over_time():
                stop = True
                break
            t = perf()
            try:
                nxt = engine.step(token)
            except ContextFull as e:
                trace.stopped = str(e)
                stop = True
                break
            trace.decode_ms.append((perf() - t) * 1000.0)
            trace.decode_context.append(engine.context)
            rec.add(1)
            token = nxt
        if on_reply:
            on_reply(trace.turns, script.decode(reply))
        log(f"turn {trace.turns}: {trace.tokens} tokens, context {engine.context}, reply {len(reply)} tokens")
        if stop:
            break
        pending = unfed + script.assistant_suffix
    if trace.tokens and (not trace.rss or trace.rss[-1][0] != trace.tokens):
        trace.rss.append((trace.tokens, round(rss_mb(), 2)))
    return trace


def fixed_context(engine: Engine, script: Script, *, context: int, decode: int = 128,
                  time_limit_s: float = 900) -> Trace:  # fmt: skip
    """Fill `context` tokens in one timed prefill, then `decode` timed greedy steps (stop tokens ignored)."""
    trace = Trace(engine=engine.name, config=dict(engine.config))
    trace.config.update(mode="fixed_context", context=context, decode=decode)
    rec = _Recorder(trace)
    ids = script.fill(context)
    t0 = time.perf_counter()
    try:
        token = engine.feed(ids)
    except ContextFull as e:
        trace.stopped = str(e)
        return trace
    trace.prefill.append((len(ids), time.perf_counter() - t0))
    rec.add(len(ids))
    trace.turns = 1
    for _ in range(decode):
        if time.perf_counter() - t0 > time_limit_s:
            trace.stopped = f"time limit {time_limit_s:g} s"
            break
        t = time.perf_counter()
        try:
            token = engine.step(token)
        except ContextFull as e:
            trace.stopped = str(e)
            break
        trace.decode_ms.append((time.perf_counter() - t) * 1000.0)
        trace.decode_context.append(engine.context)
        rec.add(1)
    if trace.tokens and (not trace.rss or trace.rss[-1][0] != trace.tokens):
        trace.rss.append((trace.tokens, round(rss_mb(), 2)))
    return trace


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
