"""The model every baseline loads, and the one-time preparation of it.

Baselines take a GGUF file (or a built-in model name): llama.cpp loads it as is; the others load its
float32 transformers save, made once per file into the cache and named by the file's hash:

    $CABINLM_CACHE/baselines/<stem>-<sha256[:12]>/
        hf/                    config, safetensors, tokenizer, cabinlm_baseline.json (chat pieces,
                               stop ids, max positions): the script's tokenizer for every baseline
        ort-genai-<config>/    the ort-genai builder's output (bench/peers.py)

The save runs in its own process (`python -m cabinlm.bench.prepare --model FILE`: transformers and torch
are loaded there only). Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from cabinlm.bench.catalog import INSTALL, PACKAGES, PREPARE_MODULES, BaselineUnavailable, first_line
from cabinlm.bench.child import ERROR, check
from cabinlm.contract.errors import CabinlmError, ModelError

PREPARE_VERSION = 2  # 2: the chat pieces carry the BOS a model needs first (Template.start)
META = "cabinlm_baseline.json"  # written last: its presence marks a complete save


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


def resolve_model(model_path: str | Path) -> Path:
    """The GGUF file a baseline loads: a path to one, or a built-in model name (fetched once)."""
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


def prepare(path: Path, log: Callable[[str], None] = lambda s: None) -> Path:
    """The prepared folder of a GGUF, made once in a child process: the input of the ort-genai builder
    and of the hf baseline, and the tokenizer every baseline renders the script with."""
    folder = prepared_dir(path)
    if (folder / META).exists():
        return folder
    log(f"preparing {path.name} for the baselines (once): de-quantizing with transformers into {folder}")
    check([sys.executable, "-m", "cabinlm.bench.prepare", "--model", str(path)],
          f"preparing {path} with transformers", progress=log)  # fmt: skip
    if not (folder / META).exists():
        raise ModelError(f"preparing {path} exited 0 but wrote no {folder / META}; delete {folder.parent} and retry")
    return folder


def prepare_here(path: Path) -> Path:
    """The preparation itself, in this process (loads torch and transformers)."""
    for m in PREPARE_MODULES:
        if importlib.util.find_spec(m) is None:
            raise BaselineUnavailable(f"{PACKAGES[m]} is not installed (needed to read the GGUF): {INSTALL['hf']}")
    from cabinlm.export import stop_ids
    from cabinlm.export.models import load_model
    from cabinlm.export.template import resolve_chat_template

    folder = prepared_dir(path)
    try:
        loaded = load_model(str(path))
    except CabinlmError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged GGUF fails deep in the gguf reader with any error
        raise ModelError(f"{path}: transformers cannot load this GGUF ({type(e).__name__}: {first_line(e)})") from e
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
            "chat": {k: getattr(chat, k) for k in ("bos", "system_prefix", "system_suffix", "user_prefix", "user_suffix",
                                                    "assistant_prefix", "assistant_suffix")},  # fmt: skip
            "stop_ids": stop_ids(loaded, chat),
            "max_positions": int(loaded.spec.max_positions),
            "vocab_size": int(loaded.spec.vocab_size),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder


def main(argv: list[str] | None = None) -> int:
    """`python -m cabinlm.bench.prepare --model FILE`: prints the prepared folder. A CabinlmError is
    reported as one `error: KIND: MESSAGE` line on stderr (bench/child.py raises it again)."""
    p = argparse.ArgumentParser(prog="python -m cabinlm.bench.prepare", description=prepare.__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file or a built-in model name")
    a = p.parse_args(argv)
    try:
        print(prepare_here(resolve_model(a.model)))
    except CabinlmError as e:
        print(f"{ERROR}{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
