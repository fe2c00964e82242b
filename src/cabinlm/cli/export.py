"""`cabinlm export`, `cabinlm profiles` and `cabinlm plan`: what to build, for which device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cabinlm.cli.common import choices, info, load_profile, weight_formats
from cabinlm.contract.precision import KVDType, WeightFormat

GRAPH_WEIGHTS = (WeightFormat.FP32, WeightFormat.INT8, WeightFormat.INT4)  # what an exported graph holds
HEAD_WEIGHTS = (WeightFormat.INT8, WeightFormat.INT4)  # widths of a quantized export's token table


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
    recall: Optional[int] = typer.Option(
        None, help="Recall-region slots R: text the runtime recalls from the dialogue's own past before each user turn "
        "(docs/design.md, \"The recall region\"); 0 = none. [default: 0]"
    ),
    kv: Optional[KVDType] = typer.Option(
        None, help="KV storage: fp32, fp16, or int8 / fp8 (E4M3) at 1/4 of fp32. [default: fp32, or the profile's]"
    ),
    weights: Optional[WeightFormat] = typer.Option(
        None,
        parser=weight_formats(*GRAPH_WEIGHTS),
        metavar=choices(*GRAPH_WEIGHTS),
        help="Weight storage: fp32, or int8 / int4 in blocks of 32. A .gguf's blocks are imported: with int4, "
        "Q4_0/Q4_1/Q4_K as 4-bit and Q5_0/Q5_1/Q5_K/Q8_0 exactly as 8-bit (Q6_K re-rounded to 8-bit blocks); "
        "with int8, every type as 8-bit. [default: fp32, or the profile's for CPU targets]",
    ),
    head: Optional[WeightFormat] = typer.Option(
        None,
        parser=weight_formats(*HEAD_WEIGHTS),
        metavar=choices(*HEAD_WEIGHTS),
        help="Token table and output projection of int8/int4 weights: int8, or int4 (as onnxruntime-genai's int4 "
        "models hold it: a little faster, at a perplexity cost; docs/results.md, \"KV and weight formats\"). "
        "A .gguf's own table is kept when its blocks have that width. [default: int8, or the file's]",
    ),
    calib: Optional[Path] = typer.Option(
        None, help="Calibration text for int8/fp8 KV (default: built-in prose + in-car dialogue)."
    ),
    max_ppl_increase: float = typer.Option(
        2.0, help="Quality gate for int8/fp8 KV: largest perplexity increase over fp32 KV, in percent."
    ),
    force: bool = typer.Option(False, help="Finish the export even if the quality gate fails."),
    verify: bool = typer.Option(True, help="Check the graph's logits against transformers on a short prompt."),
    lora: Optional[str] = typer.Option(
        None, metavar="DIR[:SCALE]",
        help="Merge a LoRA adapter into the weights before they are quantized: a PEFT folder (adapter_config.json + "
        "adapter_model.safetensors) or a llama.cpp GGUF LoRA file, scaled by SCALE (default 1.0) on top of its own "
        "alpha / r. Example: --lora my-adapter:0.8. Checked against the model first; docs/lora.md.",
    ),
    lora_rank: int = typer.Option(
        0, "--lora-rank", metavar="R",
        help="Switchable LoRA adapters: give the graph adapter inputs of maximum rank R on --lora-targets, so that "
        "`cabinlm build --adapter NAME=DIR` prepares adapters a seat selects at run time (none: exactly the base "
        "model). cpu profile only; docs/lora.md.",
    ),
    lora_targets: str = typer.Option(
        "all", "--lora-targets", metavar="LIST",
        help="With --lora-rank: the projections that take adapter inputs, e.g. q,v or q,k,v,o; 'all' = "
        "q,k,v,o,gate,up,down.",
    ),
) -> None:
    """Export MODEL to a fixed-shape sink + rolling-window decoder graph (plain ONNX) with its manifest.

    With --profile, the window (the largest that fits the device's memory budget) and the KV precision
    come from `cabinlm plan` unless given; what the device cannot run is refused.

    With --kv int8 or fp8, keys get per-channel scales calibrated on --calib text and values per-token
    scales; the export then measures perplexity against fp32 KV on held-back text (eviction active)
    and refuses to finish when it rises by more than --max-ppl-increase percent, unless --force.

    With --lora DIR[:SCALE], a LoRA adapter (PEFT folder or GGUF LoRA file) is checked against the model
    and merged into its float weights before anything is quantized, so every engine runs it, e.g.
    `cabinlm export my-model -o out --weights int4 --lora my-adapter:0.8`.
    """
    from cabinlm.export import ExportRequest, export_for_profile, export_model  # torch lives behind this import
    from cabinlm.export.lora import LoraRequest, parse_targets
    from cabinlm.export.options import make_layout

    # Checked here, before a profile is planned or the model is loaded.
    request = ExportRequest(sink=sink, pinned=pinned, window=window, chunk=chunk, kv=kv, weights=weights, head=head,
                            calib=calib, max_ppl_increase=max_ppl_increase, force=force, verify=verify, recall=recall,
                            lora=None if lora is None else LoraRequest.parse(lora), lora_rank=lora_rank,
                            lora_targets=parse_targets(lora_targets))  # fmt: skip
    if profile is not None:
        m = export_for_profile(model, out, load_profile(profile), request, log=info)  # plans from the config first
    else:
        opts = request.options()
        spec, _, image = model_facts(model)
        make_layout(spec, opts, image=image)  # the geometry against the model's config, before its weights load
        m = export_model(model, out, opts, log=info)
    lay = m.cache
    typer.echo(
        f"exported {m.model.source} ({m.model.architecture}, {m.model.num_layers} layers) to {out}: "
        f"sink {lay.sink} + pinned {lay.pinned}" + (f" + recall {lay.recall}" if lay.recall else "")
        + f" + window {lay.window} slots, chunk {lay.chunk}, "
        f"{lay.kv_dtype.value} KV = {lay.cache_bytes / 2**20:.1f} MiB, {m.weights} weights"
        + (f", LoRA {m.quality.lora['source']} merged" if m.quality.lora is not None else "")
        + (f", adapter inputs of rank {m.lora.rank} ({','.join(t.removesuffix('_proj') for t in m.lora.targets)})"
           if m.lora else "")
    )


def profiles(json_out: bool = typer.Option(False, "--json", help="Print the profiles as JSON.")) -> None:
    """List the built-in device profiles (pass one to --profile, or a .toml file of your own)."""
    from cabinlm.profiles import list_profiles

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


def plan(
    model: str = typer.Argument(
        "smollm2-135m", help="A config.json (no weights needed), a model folder, a .gguf file, a built-in name, or "
        "an artifact (a folder `cabinlm export` or `cabinlm build` wrote: its own cache and what its build holds)."
    ),
    profile: Optional[str] = typer.Option(
        None, help="Device profile name or .toml file. [default: an artifact's own, else cpu]"
    ),
    kv: Optional[KVDType] = typer.Option(None, help="KV precision [default: the profile's]."),
    sink: Optional[int] = typer.Option(None, help="Sink tokens [default: the profile's]."),
    pinned: Optional[int] = typer.Option(None, help="Pinned slots (system prompt). [default: 124]"),
    chunk: Optional[int] = typer.Option(None, help="Prefill chunk [default: the profile's]."),
    window: Optional[int] = typer.Option(None, help="Check this window instead of searching the largest."),
    lora_rank: Optional[int] = typer.Option(
        None, "--lora-rank", metavar="R", help="Plan switchable LoRA adapter inputs of rank R (as `cabinlm export "
        "--lora-rank`) [default: the largest --adapter's rank]; an artifact's own are planned without it.",
    ),
    adapter: list[Path] = typer.Option(
        [], "--adapter", metavar="FILE_OR_DIR", help="An adapter (a PEFT folder or a GGUF LoRA file) seats will use: "
        "its cost in memory. Repeatable.",
    ),
    recall: Optional[int] = typer.Option(None, help="Recall-region slots R (a multiple of 16), counted as `cabinlm "
                                         "export --recall R` lays them out. [default: 0]"),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Memory breakdown of MODEL on a device profile, and the largest window that fits its budget; of an
    artifact, its own cache layout and, for a build, the weights as its kernels hold them (and its
    switchable adapters)."""
    from cabinlm.export.options import ExportOptions, ExportRequest, check_profile_request
    from cabinlm.contract.manifest import MANIFEST_NAME
    from cabinlm.profiles.planner import format_plan, plan as make_plan

    if (Path(model).expanduser() / MANIFEST_NAME).is_file():
        p = artifact_plan(Path(model).expanduser(), profile, kv=kv, sink=sink, pinned=pinned, chunk=chunk,
                          window=window, recall=recall, **{"lora-rank": lora_rank, "adapter": adapter or None})  # fmt: skip
    else:
        # the values alone first (as `cabinlm export` checks them), then against the model's config
        pinned = ExportOptions.pinned if pinned is None else pinned
        request = ExportRequest(sink=sink, pinned=pinned, window=window, chunk=chunk, kv=kv, recall=recall)
        spec, vision, image = model_facts(model)
        device = load_profile(profile or "cpu")
        check_profile_request(spec, device, request, image)
        lora, sizes = planned_adapters(spec, lora_rank, adapter, vision > 0)
        p = make_plan(spec, device, kv=kv, sink=sink, chunk=chunk, pinned=pinned, window=window,
                      vision_params=vision, image_tokens=image, lora=lora, adapters=sizes, recall=recall or 0)  # fmt: skip
    if json_out:
        typer.echo(json.dumps(p.to_dict()))
    else:
        typer.echo(format_plan(p))
    if not p.fits:
        raise typer.Exit(1)


def planned_adapters(spec, rank: int | None, paths: list[Path], vision: bool):
    """`cabinlm plan`'s switchable adapter inputs (SwitchableLora, or None) and adapters ((name, file
    bytes) each): each adapter read and checked against the model (one line for a bad one); the rank
    --lora-rank's, else the largest adapter's, which must not be above --lora-rank."""
    from cabinlm.contract.errors import OptionError
    from cabinlm.contract.adapters import TARGETS
    from cabinlm.export.lora import check_adapter, read_adapter, switchable

    read = [check_adapter(read_adapter(p), spec) for p in paths]
    if rank is not None and rank < 1:
        raise OptionError(f"--lora-rank must be 1 or more, got {rank}")
    top = max((a.rank for a in read), default=0)
    if rank is not None and top > rank:
        big = next(a for a in read if a.rank == top)
        raise OptionError(f"--adapter {big.source}: rank {top} is above --lora-rank {rank}; raise --lora-rank or leave "
                          "it out")  # fmt: skip
    lora = switchable(spec, rank or top, TARGETS, vision)
    return lora, tuple((Path(a.source).name, a.file.stat().st_size) for a in read)


def artifact_plan(folder: Path, profile: str | None, **layout):
    """The plan of an artifact (profiles/planner.plan_for_manifest): the cache layout it was exported with
    and, for a build, the weights as its kernels hold them (its manifest's build facts), on `profile`
    (default: the profile it was built or exported for, else cpu). A layout option is refused: the
    artifact's layout is fixed."""
    from cabinlm.contract.errors import OptionError
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles import ProfileError, list_profiles
    from cabinlm.profiles.planner import plan_for_manifest

    given = [f"--{name}" for name, value in layout.items() if value is not None]
    if given:
        raise OptionError(f"{' '.join(given)}: {folder} is an artifact, whose cache layout and adapter inputs are "
                          "fixed when it is exported; leave the option out, or plan the model it came from with it")  # fmt: skip
    m = load_manifest(folder)
    own = m.build.profile if m.build is not None and m.build.profile else (m.target.profile if m.target is not None else None)
    if profile is None and own and own not in list_profiles():
        raise ProfileError(f"{folder} was made for profile {own!r}, which is not a built-in profile; pass the .toml "
                           "file it was made with as --profile")  # fmt: skip
    return plan_for_manifest(m, load_profile(profile or own or "cpu"))


def model_facts(model: str):
    """MODEL's ModelSpec, vision-tower parameters and image tokens, without loading its weights: a
    config.json or a model folder is read with the standard library (no torch); a .gguf file or a
    built-in name through its metadata."""
    from cabinlm.source.config import image_tokens_from_config, spec_from_config, vision_params_from_config

    path = Path(model).expanduser()
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()):
        return spec_from_config(path), vision_params_from_config(path), image_tokens_from_config(path)
    from cabinlm.export.models import spec_for

    return spec_for(model, log=info), 0, 0
