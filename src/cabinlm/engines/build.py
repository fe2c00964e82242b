"""`cabinlm build`: an exported artifact -> what a device profile's engine loads.

    profile ──> the engines whose builder targets it (engines/registry.py), most preferred first:
                cpu: onnxruntime-fused, else onnxruntime-graph (--attention picks); a static-shape
                CPU profile: onnxruntime-static; Snapdragon: qnn-htp; NVIDIA: tensorrt
    builder.check(request)            the first that can build this artifact (or the one insisted on)
    BuildOutput.prepare(artifact, out) the output folder, refused if it is (in) the input or a file
    builder.build(request, output)    its files, and the typed BuildSpec
    output.finish(spec)               manifest.json, derived and validated as every load validates
    builder.after_save(...)           checks that run the finished build (fused: against the export;
                                      qnn-htp: in Qualcomm's simulator, done inside build)

The output folder is itself an artifact: `cabinlm chat OUT` and `cabinlm perplexity OUT` run it.
A TensorRT bundle (a build whose engine is made on the target) is finished by `cabinlm build BUNDLE`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from cabinlm.contract.adapters import adapter_role
from cabinlm.engines.builder import Attention, BuildError, Builder, BuildRequest
from cabinlm.engines.output import BuildOutput, check_output
from cabinlm.engines.registry import ENGINES, BackendKind

if TYPE_CHECKING:
    from cabinlm.contract.adapters import AdapterRecord
    from cabinlm.profiles import DeviceProfile


class PreparedAdapter(Protocol):
    """An adapter read, checked and padded for the export's inputs (export/adapter_files.py)."""

    record: AdapterRecord

    def save(self, folder: Path) -> str:
        """Write its file into the build folder; the path relative to it."""
        ...


__all__ = ["Attention", "BuildError", "build_artifact", "choose_builder", "engine_choices",
           "default_output"]


def default_output(artifact: Path, profile_name: str) -> Path:
    """Where a build goes without -o: beside the export, never inside it (ARTIFACT-build-PROFILE)."""
    return artifact.parent / f"{artifact.name}-build-{profile_name}"


def choose_builder(request: BuildRequest) -> Builder:
    """The engine that builds this artifact for the request's profile: the most preferred one that can
    (--attention fused / graph insist on one), or a BuildError saying why none can."""
    profile, attention = request.profile, request.attention
    targets = [e.builder() for e in ENGINES.values()]
    targets = sorted((b for b in targets if b.targets(profile)), key=lambda b: -b.preference)
    if not targets:
        raise BuildError(f"no engine of this cabinlm builds for profile {profile.name} (engine {profile.engine.value}, "
                         f"provider {profile.execution_provider})")
    if attention is Attention.GRAPH:
        targets = [b for b in targets if b.kind is not BackendKind.FUSED]
    elif attention is Attention.FUSED:
        if not any(b.kind is BackendKind.FUSED for b in targets):
            raise BuildError(f"--attention fused builds for the cpu profile's engine; {profile.name} uses {targets[0].kind.value}")
        targets = [b for b in targets if b.kind is BackendKind.FUSED]
    why: list[str] = []
    for b in targets:
        reason = b.check(request)
        if reason is None:
            if why:
                request.log(f"kept the exported attention ({why[-1]})" if b.kind is BackendKind.EXPORTED_GRAPH
                            else f"built {b.kind.value}: {why[-1]}")  # fmt: skip
            return b
        if attention is Attention.FUSED and b.kind is BackendKind.FUSED:
            raise BuildError(f"{request.artifact}: the fused attention does not apply: {reason}")
        why.append(reason)
    raise BuildError(f"{request.artifact}: cannot be built for {profile.name}: {'; '.join(why)}")


def build_artifact(artifact: str | Path, profile: DeviceProfile | None, out: str | Path | None = None,
                   log: Callable[[str], None] = lambda s: None, attention: Attention | str = Attention.AUTO,
                   adapters: Sequence[PreparedAdapter] = (), **engine_options: Any) -> Path:
    """Build `artifact` for `profile` (None: cpu) into `out` (default: beside it, ARTIFACT-build-PROFILE).
    A TensorRT bundle (`artifact` made by a tensorrt profile's build) gets its engine built, in place
    unless `out` is given; its profile is the one it was made for.

    cpu builds: attention "auto" fuses the decoder (engines/ort_fused) where the artifact allows and
    keeps the exported graph otherwise; "fused" insists; "graph" keeps the export. engine_options:
    the engines' own choices by name, each routed to the engine whose options_type has the field
    (the fused build's accuracy_level, minimums, attention_kernel, matmul_kernel:
    ort_fused/options.py; the HTP build's activations, calib, a16_weights: qnn_htp/options.py) and
    checked there; a name no engine takes is refused. adapters: switchable LoRA adapters prepared for
    the export's adapter inputs (--lora-rank), one file each in the build (contract/adapters.py),
    listed and checksummed in its manifest."""
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles import load_profile

    try:
        attention = Attention(attention)
    except ValueError as e:
        raise BuildError(str(e)) from e
    options = engine_choices(engine_options)
    artifact = Path(artifact)
    manifest = load_manifest(artifact)
    if manifest.build is not None:
        builder = ENGINES[manifest.build.backend].builder()
        return builder.finish(artifact, manifest, profile, Path(out) if out is not None else None, log)
    profile = profile if profile is not None else load_profile("cpu")  # no --profile: the host CPU
    if manifest.lora is not None and (profile.engine.value != "onnxruntime" or profile.static_shapes
                                      or profile.execution_provider != "CPUExecutionProvider"):  # fmt: skip
        raise BuildError(f"{artifact} has switchable LoRA adapter inputs (export --lora-rank), which profile "
                         f"{profile.name}'s engine does not take; build it for the cpu profile, or export with --lora "
                         "to merge an adapter")  # fmt: skip
    if manifest.cache.kv_dtype not in profile.kv_dtypes:
        raise BuildError(
            f"{artifact} holds {manifest.cache.kv_dtype.value} KV, which profile {profile.name} cannot run "
            f"({', '.join(k.value for k in profile.kv_dtypes)}); re-export with --profile {profile.name}"
        )
    if manifest.opset > profile.max_opset:
        raise BuildError(f"{artifact}: graph opset {manifest.opset} is above {profile.name}'s {profile.max_opset}")
    out = Path(out) if out is not None else default_output(artifact, profile.name)
    check_output(artifact, out)  # before any engine's checks; BuildOutput.prepare checks again as it creates the folder
    targeted = {type(b) for b in _builders() if b.targets(profile)}
    for o in options:  # an engine's choices set for a profile none of whose engines is that one
        owner = next(b for b in _builders() if b.options_type is type(o))
        if type(o).REFUSED_ELSEWHERE and type(owner) not in targeted:  # type: ignore[attr-defined]
            raise BuildError(o.refused(profile))  # type: ignore[attr-defined]
    request = BuildRequest(artifact, manifest, profile, attention, tuple(options), log)
    builder = choose_builder(request)
    if manifest.lora is not None and builder.kind not in (BackendKind.EXPORTED_GRAPH, BackendKind.FUSED):
        raise BuildError(f"{artifact} has switchable LoRA adapter inputs (export --lora-rank), which {builder.kind.value} "
                         "builds do not take; build it for the cpu profile, or export with --lora to merge an adapter")  # fmt: skip
    if adapters and manifest.lora is None:
        raise BuildError(f"--adapter: {artifact} has no adapter inputs; export it with --lora-rank R")
    names = [a.record.name for a in adapters]
    if len(set(names)) != len(names):
        raise BuildError(f"--adapter: the name {next(n for n in names if names.count(n) > 1)!r} is given twice")
    t0 = time.perf_counter()
    output = BuildOutput.prepare(artifact, manifest, out)
    spec = builder.build(request, output)
    if manifest.lora is not None:
        for a in adapters:
            output.add(adapter_role(a.record.name), a.save(output.folder))
            log(f"prepared adapter {a.record.name} ({a.record.format}, rank {a.record.rank}, scale {a.record.scale:g}, "
                f"{', '.join(a.record.targets)})")  # fmt: skip
        output.lora = dataclasses.replace(manifest.lora, adapters=tuple(a.record for a in adapters))
    built = output.finish(spec, profile.name)
    builder.after_save(request, output, built)
    output.update_quality(built, seconds=round(time.perf_counter() - t0, 1))
    return out


def _builders() -> list[Builder]:
    return [e.builder() for e in ENGINES.values()]


def engine_choices(given: dict[str, Any]) -> list[object]:
    """The engines' typed options from `cabinlm build`'s choices by name: one object per engine
    options_type that takes any of them (checked as it is made, one line per refusal), only the
    choices set away from their defaults. A name no engine takes is refused."""
    left = dict(given)
    made: list[object] = []
    for cls in dict.fromkeys(b.options_type for b in _builders() if b.options_type is not None):
        names = {f.name for f in dataclasses.fields(cls)}
        picked = {k: left.pop(k) for k in list(left) if k in names}
        if picked:
            options = cls(**picked)
            if options != cls():
                made.append(options)
    if left:
        raise BuildError(f"no engine takes the build option(s) {', '.join(sorted(left))}")
    return made
