"""Export: MODEL -> DIR/{manifest.json, decoder.onnx, decoder.onnx.data, tokenizer.json}.

The only part of cabinlm that imports torch and transformers.
"""

from __future__ import annotations

import hashlib

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from cabinlm.contract.files import FileRole
from cabinlm import __version__
from cabinlm.contract.errors import CabinlmError
from cabinlm.export import kvquant
from cabinlm.contract.calibration import calibration_tokens as _calibration
from cabinlm.export.decoder import DecoderWeights, build_decoder
from cabinlm.export.graph import save_model
from cabinlm.source.processor import image_preprocessing
from cabinlm.export.lora import LoraRequest, MergedLora, check_adapter, merge_adapter, read_adapter, switchable
from cabinlm.export.models import LoadedModel, decoder_weights, load_model
from cabinlm.export.options import OptionError  # noqa: F401 - re-exported with the rest of the options API
from cabinlm.export.options import ExportOptions, ExportRequest, make_layout, options_for_profile
from cabinlm.export.vision import build_vision
from cabinlm.export.template import PLAIN, resolve_chat_template
from cabinlm.contract.manifest import (MANIFEST_NAME, FileEntry, KVDType, KVScales, Manifest, Quality, RotaryTables, Target,
                                      VisionSpec)
from cabinlm.source.config import check_attention_window

GRAPH_FILE = "decoder.onnx"
VISION_FILE, VISION_DATA_FILE = "vision.onnx", "vision.onnx.data"
GRAPH_DATA_FILE = "decoder.onnx.data"
TOKENIZER_FILE = "tokenizer.json"


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
    """Write the artifact for an already loaded model (tests reuse one load for several exports).
    opts.lora merges its adapter into `loaded` itself, once: its float weights change (merge_lora)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CabinlmError(f"{out}: exists and is not a folder; choose another -o")
    out.mkdir(parents=True, exist_ok=True)
    switch = switchable(loaded.spec, opts.lora_rank, opts.lora_targets, vision=loaded.vlm)
    if opts.lora is not None:
        merge_lora(loaded, opts.lora, log)
    vision = None
    mrope = loaded.mrope
    if mrope:  # Qwen2-VL: the tower at one frame size, M-RoPE in the decoder
        from cabinlm.export.qwen2_vl import build_qwen2_vl_vision, mrope_section, read_qwen2_vl_processor

        qwen_processor = read_qwen2_vl_processor(loaded.folder, opts.frame, loaded.model.config.vision_config.to_dict())
        vision_graph, geometry = build_qwen2_vl_vision(loaded.model, qwen_processor, opset=17)
        log(f"vision frames: {geometry.frame[1]}x{geometry.frame[0]} pixels, {geometry.grid[0]}x{geometry.grid[1]} image tokens")
    elif loaded.idefics3:  # Idefics3 / SmolVLM: one square frame, the processor without image splitting
        from cabinlm.export.idefics3 import build_idefics3_vision, image_wrapping
        from cabinlm.source.processor import read_idefics3_processor

        cfg = loaded.model.config
        idefics3_processor = read_idefics3_processor(loaded.folder, cfg.vision_config.to_dict(), cfg.scale_factor, opts.frame)
        wrapping = image_wrapping(loaded.tokenizer)  # the tokens around one image, checked before anything is built
        vision_graph, geometry = build_idefics3_vision(loaded.model, idefics3_processor, opset=17)
        log(f"vision frames: {geometry.image_size}x{geometry.image_size} pixels, {geometry.image_tokens} image tokens")
    elif opts.frame is not None:
        raise CabinlmError(f"{loaded.source}: --frame sets a Qwen2-VL model's frame size; this model's is fixed by its processor")
    elif loaded.vlm:  # LLaVA: the tower's square, refused when the processor makes that square another size
        llava_preprocess = image_preprocessing(loaded.folder, square=loaded.model.config.vision_config.image_size)
        vision_graph, geometry = build_vision(loaded.model, opset=17)
    layout = make_layout(loaded.spec, opts, image=geometry.image_tokens if loaded.vlm else 0)
    # Mistral / Phi-3 / Qwen sliding windows: refused when shorter than what one query attends to
    check_attention_window(loaded.model.config.to_dict(), loaded.source, layout.slots + layout.chunk)
    opset = opts.resolved_opset  # ExportOptions refused an opset too old for its KV and weights
    # The manifest goes last: a folder without one is never mistaken for a finished export.
    (out / MANIFEST_NAME).unlink(missing_ok=True)

    try:
        chat = resolve_chat_template(loaded.tokenizer)
    except ValueError as e:
        log(f"chat template not usable ({e}); using a plain User:/Assistant: template")
        chat = PLAIN

    t0 = time.perf_counter()
    weights = decoder_weights(loaded, opts.weights, log, head=opts.head)
    calibration = None
    kv_scales = None
    if layout.quantized:
        calib_ids, heldout_ids, calib_source = _calibration(loaded, chat, opts.calib)
        stats = kvquant.calibrate_kv_amax(loaded.model, loaded.text_model.layers, calib_ids, layout.kv_heads, layout.head_dim)
        weights.key_scales = kvquant.key_scales_from_amax(stats["keys"], layout.kv_dtype)
        # Static scales for engines that cache rotated keys and quantize values per channel
        # (ONNX Runtime's fused attention in cpu builds, engines/ort_fused/graph.py).
        kv_scales = KVScales(
            keys=weights.key_scales.tolist(),
            rotated_keys=kvquant.key_scales_from_amax(stats["rotated_keys"] * kvquant.ROTATED_KEY_HEADROOM, layout.kv_dtype).tolist(),
            values=kvquant.key_scales_from_amax(stats["values"], layout.kv_dtype).tolist(),
        ).check(layout)
        calibration = {"source": calib_source, "tokens": len(calib_ids), "method": "absmax per channel (keys), per token (values)",
                       # which calibration text it was, as tokens: the checksum of the ids (int64, little-endian)
                       "ids_sha256": hashlib.sha256(np.asarray(calib_ids, dtype="<i8").tobytes()).hexdigest()}
        log(f"calibrated {layout.kv_dtype.value} key scales on {len(calib_ids)} tokens ({calib_source})")
    embed_dim = geometry.embed_dim if loaded.vlm else 0
    builder = build_decoder(loaded.spec, layout, weights, opset=opset, index_dtype=opts.index_dtype, embed_dim=embed_dim,
                            mrope_section=mrope_section(loaded.model) if mrope else (), lora=switch)  # fmt: skip
    log(f"built the decoder graph: {len(builder.nodes)} nodes, {layout.slots} cache slots")
    save_model(builder.model(), out / GRAPH_FILE, GRAPH_DATA_FILE)
    del builder
    loaded.tokenizer.backend_tokenizer.save(str(out / TOKENIZER_FILE))
    files = {"graph": GRAPH_FILE, "graph_data": GRAPH_DATA_FILE, "tokenizer": TOKENIZER_FILE}
    if loaded.vlm:
        save_model(vision_graph.model(), out / VISION_FILE, VISION_DATA_FILE)
        files.update(vision_graph=VISION_FILE, vision_data=VISION_DATA_FILE)
        extra = {}
        if mrope:  # the frame, its token grid, the decoder's sections and the tokens around the image
            cfg = loaded.model.config
            extra = dict(frame=geometry.frame, grid=geometry.grid, mrope_section=mrope_section(loaded.model),
                         image_prefix=(int(cfg.vision_start_token_id),), image_suffix=(int(cfg.vision_end_token_id),))  # fmt: skip
        elif loaded.idefics3:  # <fake_token_around_image><global-img> ... <fake_token_around_image>
            extra = dict(image_prefix=wrapping[0], image_suffix=wrapping[1])
        if mrope:
            preprocess = qwen_processor.preprocess()
        elif loaded.idefics3:
            preprocess = idefics3_processor.preprocess()
        else:
            preprocess = llava_preprocess
        vision = VisionSpec(
            image_size=geometry.image_size,
            patch_size=geometry.patch_size,
            image_tokens=geometry.image_tokens,
            embed_dim=geometry.embed_dim,
            image_token_id=int(loaded.model.config.image_token_id),
            preprocess=preprocess,
            graph=VISION_FILE,
            **extra,
        )
        log(f"built the vision graph: {geometry.image_tokens} image tokens per frame")
    log(f"wrote {out / GRAPH_FILE} and its weights in {time.perf_counter() - t0:.1f}s")

    manifest = Manifest(
        model=loaded.spec,
        cache=layout,
        chat=chat,
        stop_ids=stop_ids(loaded, chat),
        files={role: FileEntry.of(out, name) for role, name in files.items()},
        opset=opset,
        quality=Quality(kv=KVDType(opts.kv).value),
        weights=weights.weight_format,
        index_dtype=opts.index_dtype,
        target=Target(opts.profile, opts.plan) if opts.profile else None,
        vision=vision,
        rotary=RotaryTables(tuple(weights.inv_freq.tolist()), float(weights.rope_scaling),
                            tuple(weights.local_inv_freq.tolist()) if weights.local_inv_freq is not None else (),
                            float(weights.local_rope_scaling)),  # fmt: skip
        kv_scales=kv_scales,
        lora=switch,
        cabinlm_version=__version__,
    )
    if switch is not None:
        log(f"adapter inputs of rank {switch.rank} on {', '.join(switch.targets)} "
            f"({switch.bytes_per_adapter(loaded.spec.num_layers, manifest.lora_shapes) / 2**20:.1f} MiB per adapter)")
    if calibration is not None:
        manifest.quality.calibration = calibration
    if weights.weight_source:
        manifest.quality.weights = {"format": weights.weight_format, **weights.weight_source}
    if loaded.lora is not None:
        manifest.quality.lora = loaded.lora.to_dict()
    if calibration is not None and opts.gate:
        gate = quality_gate(loaded, out, manifest, weights, heldout_ids, opts, log)
        manifest.quality.gate = gate
        if not gate["passed"] and not opts.force:
            raise QualityGateError(
                f"{layout.kv_dtype.value} KV raises perplexity by {gate['ppl_increase_pct']:.2f}% over fp32 KV "
                f"({gate['ppl_kv']:.3f} vs {gate['ppl_fp32']:.3f} on {gate['tokens']} held-back tokens), more than "
                f"--max-ppl-increase {opts.max_ppl_increase}%; try another --calib text or --kv, or pass --force"
            )
    if opts.verify:
        manifest.quality.dense_check = verify_against_transformers(loaded, out, manifest)
        log(f"checked against transformers: max |logit diff| {manifest.quality.dense_check['max_abs_logit_diff']:.2e}")
    manifest.save(out)
    return manifest


def export_model(
    source: str, out: str | Path, opts: ExportOptions, log: Callable[[str], None] = lambda s: None
) -> Manifest:
    """Export MODEL with `opts`. The cache geometry is checked against the model's config before any
    weights load, so a window the model cannot hold is refused in a second, not after the load."""
    from cabinlm.export.models import resolve_source, spec_for
    from cabinlm.export.options import check_positions
    from cabinlm.source.config import image_tokens_from_config, read_config

    folder, gguf = resolve_source(source, log)
    image = image_tokens_from_config(folder, opts.frame) if gguf is None else 0
    check_positions(spec_for(source, log), sink=opts.sink, pinned=opts.pinned, chunk=opts.chunk, window=opts.window,
                    image=image, recall=opts.recall)  # fmt: skip
    if gguf is None:  # a model's own sliding window, before the weights load
        config, where = read_config(folder)
        check_attention_window(config, where, opts.sink + opts.pinned + image + opts.recall + opts.window + opts.chunk)
    if opts.lora is not None:  # the adapter against the model's config, before the weights load
        check_adapter(read_adapter(opts.lora.path), spec_for(source, log))
    if opts.lora_rank:  # the adapter inputs against the model's family, before the weights load
        switchable(spec_for(source, log), opts.lora_rank, opts.lora_targets, vision=image > 0)
    loaded = load_model(source, log)
    return export_loaded(loaded, out, opts, log)


def export_for_profile(
    source: str, out: str | Path, profile, request: ExportRequest, log: Callable[[str], None] = lambda s: None
) -> Manifest:
    """Plan MODEL for a device profile (a DeviceProfile) before loading any weights, so that a refusal
    is quick, then export. `request` holds what the user set; the plan decides the rest."""
    from cabinlm.export.models import resolve_source, spec_for
    from cabinlm.source.config import image_tokens_from_config, vision_params_from_config

    folder, gguf = resolve_source(source, log)
    vision = vision_params_from_config(folder) if gguf is None else 0
    image = image_tokens_from_config(folder) if gguf is None else 0
    opts = options_for_profile(spec_for(source, log), profile, request, vision_params=vision, image_tokens=image)
    log(
        f"planned for {profile.name}: sink {opts.sink} + pinned {opts.pinned} + window {opts.window}, "
        f"chunk {opts.chunk}, {opts.kv.value} KV"
    )
    return export_model(source, out, opts, log)


def merge_lora(loaded: LoadedModel, request: LoraRequest, log: Callable[[str], None] = lambda s: None) -> MergedLora:
    """Merge a LoRA adapter into the loaded model's float weights (export/lora.py), so that everything
    the export derives from them (the weights, KV calibration, the checks against transformers) has it.
    A model holds one merged adapter: the same request again is a no-op, another one is refused."""
    if loaded.lora is not None:
        if loaded.lora.request == request:
            return loaded.lora
        raise CabinlmError(f"--lora {request.path}: this loaded model already has {loaded.lora.source} merged into "
                           "its weights; load the model again for another adapter")  # fmt: skip
    adapter = check_adapter(read_adapter(request.path), loaded.spec)
    loaded.lora = merge_adapter(loaded.text_model.layers, adapter, request, log)
    return loaded.lora


def verify_against_transformers(loaded: LoadedModel, out: Path, manifest: Manifest, n: int = 24) -> dict:
    """Run a short prompt through the exported graph (in chunks) and through transformers, densely."""
    import torch

    from cabinlm.runtime.decoder import Decoder

    text = "The car's assistant answers briefly. What is the tire pressure of the front left wheel?"
    ids = loaded.tokenizer.backend_tokenizer.encode(text).ids[:n]
    # Block-quantized weights are checked with float32 activations (accuracy level 0): the weights must
    # be exactly the model's; the int8 activations of the fast path are a separate, measured choice.
    config = {"session.qdq_matmulnbits_accuracy_level": "0"} if manifest.weights != "fp32" else None
    dec = Decoder(out, manifest=manifest, session_config=config)
    ours = dec.feed(np.asarray(ids, dtype=np.int64), all_logits=True)
    with torch.no_grad():
        ref = loaded.model(torch.tensor([ids])).logits[0].float().numpy()
    diff = float(np.abs(ours - ref).max())
    out = {"tokens": len(ids), "max_abs_logit_diff": diff}
    if config:
        out["activations"] = "float32 (MatMulNBits accuracy level 0)"
    return out


class QualityGateError(CabinlmError):
    """Quantized KV lost more quality than allowed; the artifact was not finished."""


def quality_gate(
    loaded: LoadedModel,
    out: Path,
    manifest: Manifest,
    weights: DecoderWeights,
    heldout: list[int],
    opts: ExportOptions,
    log: Callable[[str], None],
) -> dict:
    """Perplexity on held-back text with the exported (quantized) KV and with an fp32-KV twin graph
    of the same layout. Chunks of C tokens; eviction is active once the text outgrows the cache."""
    from dataclasses import replace

    from cabinlm.runtime.perplexity import chunked_perplexity
    from cabinlm.runtime.decoder import Decoder

    ppl_kv = chunked_perplexity(Decoder(out, manifest=manifest), heldout).ppl
    twin_layout = replace(manifest.cache, kv_dtype=KVDType.FP32)
    twin_weights = replace(weights, key_scales=None)
    with tempfile.TemporaryDirectory(dir=out, prefix=".fp32-twin-") as tmp:
        twin_opset = 21 if twin_weights.quantized else 17
        save_model(build_decoder(loaded.spec, twin_layout, twin_weights, opset=twin_opset).model(), Path(tmp) / GRAPH_FILE, GRAPH_DATA_FILE)
        shutil.copy(out / TOKENIZER_FILE, Path(tmp) / TOKENIZER_FILE)
        twin = Manifest(
            model=manifest.model,
            cache=twin_layout,
            chat=manifest.chat,
            stop_ids=manifest.stop_ids,
            files={r: FileEntry.of(Path(tmp), n) for r, n in ((FileRole.GRAPH, GRAPH_FILE), (FileRole.TOKENIZER, TOKENIZER_FILE))},
            opset=twin_opset,
            weights=manifest.weights,
            rotary=manifest.rotary,
        )
        ppl_fp32 = chunked_perplexity(Decoder(tmp, manifest=twin), heldout).ppl
    increase = (ppl_kv / ppl_fp32 - 1.0) * 100.0
    log(f"quality gate: ppl {ppl_kv:.4f} ({manifest.cache.kv_dtype.value} KV) vs {ppl_fp32:.4f} (fp32 KV): {increase:+.3f}%")
    return {
        "tokens": len(heldout),
        "eviction": len(heldout) > manifest.cache.slots,
        "ppl_fp32": ppl_fp32,
        "ppl_kv": ppl_kv,
        "ppl_increase_pct": increase,
        "max_ppl_increase_pct": opts.max_ppl_increase,
        "passed": increase <= opts.max_ppl_increase,
    }
