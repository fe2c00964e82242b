"""Export: MODEL -> DIR/{manifest.json, decoder.onnx, decoder.onnx.data, tokenizer.json}.

The only part of cabinlm that imports torch and transformers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cabinlm import __version__
from cabinlm.errors import CabinlmError, LayoutError
from cabinlm.export.decoder import build_decoder
from cabinlm.export.graph import save_model
from cabinlm.export.models import LoadedModel, decoder_weights, load_model
from cabinlm.export.template import PLAIN, resolve_chat_template
from cabinlm.manifest import MANIFEST_NAME, CacheLayout, FileEntry, KVDType, Manifest

GRAPH_FILE = "decoder.onnx"
GRAPH_DATA_FILE = "decoder.onnx.data"
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class ExportOptions:
    sink: int = 4
    pinned: int = 124  # sink + pinned = 128 slots for the first tokens and the system prompt
    window: int = 1020
    chunk: int = 64
    kv: KVDType = KVDType.FP32
    opset: int = 17
    verify: bool = True  # compare the graph with transformers on a short prompt and record it


def make_layout(spec, opts: ExportOptions) -> CacheLayout:
    layout = CacheLayout(
        sink=opts.sink,
        pinned=opts.pinned,
        window=opts.window,
        chunk=opts.chunk,
        layers=spec.num_layers,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_dtype=KVDType(opts.kv),
    )
    if layout.max_position > spec.max_positions:
        room = spec.max_positions - opts.sink - opts.pinned - opts.chunk
        raise LayoutError(
            f"sink {opts.sink} + pinned {opts.pinned} + window {opts.window} + chunk {opts.chunk} = "
            f"{layout.max_position} positions, but the model has only {spec.max_positions}; "
            f"use --window {room} or less"
        )
    return layout


def stop_ids(loaded: LoadedModel, chat) -> list[int]:
    """Token ids that end a reply: the model's EOS ids and the special token closing a turn."""
    ids: set[int] = set()
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    for e in eos if isinstance(eos, list) else [eos]:
        if e is not None:
            ids.add(int(e))
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    if chat.assistant_suffix.strip():
        first = loaded.tokenizer.backend_tokenizer.encode(chat.assistant_suffix, add_special_tokens=False).ids
        specials = set(loaded.tokenizer.all_special_ids)
        if first and first[0] in specials:
            ids.add(int(first[0]))
    return sorted(ids)


def export_loaded(
    loaded: LoadedModel, out: str | Path, opts: ExportOptions, log: Callable[[str], None] = lambda s: None
) -> Manifest:
    """Write the artifact for an already loaded model (tests reuse one load for several exports)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CabinlmError(f"{out}: exists and is not a folder; choose another -o")
    out.mkdir(parents=True, exist_ok=True)
    layout = make_layout(loaded.spec, opts)
    if opts.kv not in (KVDType.FP32, KVDType.FP16):
        raise LayoutError(f"--kv {KVDType(opts.kv).value} is not available yet; use fp32 or fp16")
    # The manifest goes last: a folder without one is never mistaken for a finished export.
    (out / MANIFEST_NAME).unlink(missing_ok=True)

    try:
        chat = resolve_chat_template(loaded.tokenizer)
    except ValueError as e:
        log(f"chat template not usable ({e}); using a plain User:/Assistant: template")
        chat = PLAIN

    t0 = time.perf_counter()
    weights = decoder_weights(loaded)
    builder = build_decoder(loaded.spec, layout, weights, opset=opts.opset)
    log(f"built the decoder graph: {len(builder.nodes)} nodes, {layout.slots} cache slots")
    save_model(builder.model(), out / GRAPH_FILE, GRAPH_DATA_FILE)
    del builder, weights
    loaded.tokenizer.backend_tokenizer.save(str(out / TOKENIZER_FILE))
    log(f"wrote {out / GRAPH_FILE} and its weights in {time.perf_counter() - t0:.1f}s")

    manifest = Manifest(
        model=loaded.spec,
        cache=layout,
        chat=chat,
        stop_ids=stop_ids(loaded, chat),
        files={
            "graph": FileEntry.of(out, GRAPH_FILE),
            "graph_data": FileEntry.of(out, GRAPH_DATA_FILE),
            "tokenizer": FileEntry.of(out, TOKENIZER_FILE),
        },
        opset=opts.opset,
        quality={"kv": KVDType(opts.kv).value},
        cabinlm_version=__version__,
    )
    if opts.verify:
        manifest.quality["dense_check"] = verify_against_transformers(loaded, out, manifest)
        log(f"checked against transformers: max |logit diff| {manifest.quality['dense_check']['max_abs_logit_diff']:.2e}")
    manifest.save(out)
    return manifest


def export_model(
    source: str, out: str | Path, opts: ExportOptions, log: Callable[[str], None] = lambda s: None
) -> Manifest:
    loaded = load_model(source, log)
    return export_loaded(loaded, out, opts, log)


def verify_against_transformers(loaded: LoadedModel, out: Path, manifest: Manifest, n: int = 24) -> dict:
    """Run a short prompt through the exported graph (in chunks) and through transformers, densely."""
    import torch

    from cabinlm.runtime.session import Decoder

    text = "The car's assistant answers briefly. What is the tire pressure of the front left wheel?"
    ids = loaded.tokenizer.backend_tokenizer.encode(text).ids[:n]
    dec = Decoder(out, manifest=manifest)
    ours = dec.feed(np.asarray(ids, dtype=np.int64), all_logits=True)
    with torch.no_grad():
        ref = loaded.model(torch.tensor([ids])).logits[0].float().numpy()
    diff = float(np.abs(ours - ref).max())
    return {"tokens": len(ids), "max_abs_logit_diff": diff}
