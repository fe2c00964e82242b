"""The target bundle: everything a board with TensorRT needs to build the engine, made on any machine.

    smol-build-orin-x/
      manifest.json          build.backend "tensorrt", build.tensorrt.state "bundle": the exact engine
                             settings (spec.TensorRTSettings)
      decoder.trt.onnx       the TensorRT-ready graph (graph.py: fp16-safe RMSNorm; for
      decoder.trt.onnx.data  strongly typed targets, fp16 weight products) and its weights
      tokenizer.json         [vision.onnx, ...]: as exported
      README.txt             how to finish on the target, and the settings in words

On the target, `cabinlm build smol-build-orin-x` builds decoder.engine in place (a bundle is an
unfinished build: completing it is what it is for) and turns the manifest's state into "engine"
(engine.py); `cabinlm doctor smol-build-orin-x` checks the board first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

import onnx

from cabinlm.contract.files import FileRole
from cabinlm.engines.builder import BuildError, BuildRequest
from cabinlm.engines.onnxruntime.offline import read_graph
from cabinlm.engines.output import BuildOutput
from cabinlm.engines.tensorrt.api import api_era, precision_flags, profile_shapes, token_profiles, workspace_bytes
from cabinlm.engines.tensorrt.compat import check_model, errors, format_report, parse_version
from cabinlm.engines.tensorrt.graph import fp16_matmuls, fp16_safe_norms
from cabinlm.contract.buildspec import BuildSpec
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import Manifest
from cabinlm.contract.engines.tensorrt import ApiEra, EngineState, TensorRTSettings

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

GRAPH, DATA = "decoder.trt.onnx", "decoder.trt.onnx.data"
README = "README.txt"


def finish_instruction(bundle: Path, settings: TensorRTSettings, profile_name: str) -> str:
    """The one line that says how to finish on the target."""
    return (f"to finish, copy {bundle} to the {profile_name} board (TensorRT {settings.target_version} and its GPU) "
            f"and run `cabinlm build {bundle.name}` there; `cabinlm doctor {bundle.name}` checks the board first")


def plan_settings(profile: DeviceProfile, manifest: Manifest, norms: int) -> TensorRTSettings:
    """The engine settings for a profile: its TensorRT version's API era, the precision flags the KV
    dtype needs, the token profiles of the chunk, the workspace from the profile."""
    target = parse_version(profile.engine_version or "")
    era = api_era(target)
    precision = precision_flags(era, manifest.cache.kv_dtype)  # CabinlmError: a KV dtype the era cannot run
    return TensorRTSettings(
        state=EngineState.BUNDLE,
        target_version=str(profile.engine_version),
        api_era=era,
        strongly_typed=era is ApiEra.STRONGLY_TYPED,
        precision=precision,
        profiles=token_profiles(manifest.cache.chunk),
        workspace_bytes=workspace_bytes(profile),
        fp16_safe_norms=norms,
    )


def write_bundle(request: BuildRequest, output: BuildOutput) -> BuildSpec:
    """Write the bundle for the request's profile into the output folder and return its BuildSpec. The
    graph must have passed the compatibility check (builder.py); the rewritten graph is checked again here."""
    artifact, manifest, profile, log, out = request.artifact, request.manifest, request.profile, request.log, output.folder
    model = read_graph(artifact, manifest)
    norms = fp16_safe_norms(model, manifest.cache.layers, manifest.model.rms_norm_eps)
    settings = plan_settings(profile, manifest, norms)
    log(f"rewrote {norms} RMSNorms so that no intermediate can overflow fp16 (each row scaled by its largest value first)")
    if settings.strongly_typed:
        n = fp16_matmuls(model)
        log(f"strongly typed TensorRT {settings.target_version}: {n} weight products in fp16 in the graph, the rest fp32")
    bad = errors(check_model(model, profile))
    if bad:
        raise BuildError(f"the rewritten graph fails the TensorRT {profile.engine_version} check:\n"
                         + format_report(bad, profile))  # fmt: skip
    (out / DATA).unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(out / GRAPH), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA,
                    size_threshold=1024)  # fmt: skip
    del model
    output.add(FileRole.GRAPH, GRAPH)
    output.add(FileRole.GRAPH_DATA, DATA)
    # as exported (the camera encoder runs on ONNX Runtime)
    output.copy(FileRole.TOKENIZER)
    output.copy_if_present(FileRole.VISION_GRAPH, FileRole.VISION_DATA)
    output.quality["tensorrt"] = "bundle: no engine built yet"
    spec = BuildSpec(backend=BackendKind.TENSORRT, profile=profile.name, engine="tensorrt",
                     engine_version=str(profile.engine_version), facts=settings)  # fmt: skip
    (out / README).write_text(readme(out, settings, profile, manifest))
    return spec


def readme(out: Path, s: TensorRTSettings, profile: DeviceProfile, manifest: Manifest) -> str:
    """The bundle's settings in words, for whoever carries it to the car. manifest: the export's (its graph I/O is the bundle's)."""
    assert s is not None
    lines = [
        f"cabinlm TensorRT bundle for profile {profile.name}: {profile.chip}",
        "",
        finish_instruction(out, s, profile.name),
        "",
        "The engine will be built with (manifest.json, build.tensorrt):",
        f"  TensorRT {s.target_version}, API era {s.api_era.value}"
        + (" (strongly typed network: precision from the graph)" if s.strongly_typed else
           f" (weakly typed network, precision flags: {', '.join(s.precision) or 'none'})"),
        f"  workspace memory pool limit: {s.workspace_bytes >> 20} MiB; timing cache: {s.timing_cache}",
        f"  graph: {GRAPH} ({s.fp16_safe_norms} RMSNorms rewritten fp16-safe)",
    ]
    for i, p in enumerate(s.profiles):
        lines.append(f"  optimization profile {i} ({p.name}): tokens {p.min_tokens}..{p.max_tokens}, tuned for {p.opt_tokens}")
        for shape in profile_shapes(manifest.io, manifest.cache, p):
            lines.append(f"    {shape.name}: min {shape.min} opt {shape.opt} max {shape.max}")
    lines += ["", "This bundle was made without TensorRT. Until `cabinlm build` runs on the target, nothing of it has "
              "run under TensorRT (docs/tensorrt.md)."]  # fmt: skip
    return "\n".join(lines) + "\n"
