"""A bundle -> a TensorRT engine, with NVIDIA's Python API, on the target (TensorRT and a GPU here).

NOT RUN UNDER TENSORRT: no machine of this project has TensorRT. Every TensorRT call below is
type-checked against NVIDIA's tensorrt-stubs 10.13 (tests/test_tensorrt_types.py); the version
switches are the pure functions of engines/tensorrt/api.py, unit-tested. docs/tensorrt.md says what ran.

    builder  = Builder(logger)
    network  = builder.create_network(flags)         8.x: 1 << EXPLICIT_BATCH; 10.x: 0; 10.15+: 1 << STRONGLY_TYPED
    parser   = OnnxParser(network, logger)
    parser.parse_from_file(graph)                    every error reported with its node
    config   = builder.create_builder_config()
    config.set_memory_pool_limit(WORKSPACE, n)       the profile's tensorrt_workspace_mib
    config.set_flag(FP16 / INT8 / FP8)               weakly typed eras only
    config.add_optimization_profile(p) per TokenProfile, p.set_shape(input, min, opt, max)
    config.set_timing_cache(create_timing_cache(previous bytes or b""), ignore_mismatch=False)
    engine   = builder.build_serialized_network(network, config)
    -> decoder.engine, timing.cache (kept for the next build), the manifest in state "engine"
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import onnx

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import BuildError
from cabinlm.engines.tensorrt.api import api_era, network_flag_names, parse_installed_version, parser_error_line, profile_shapes
from cabinlm.engines.tensorrt.compat import check_file, errors, format_report
from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.manifest import FileEntry, Manifest
from cabinlm.contract.engines.tensorrt import ApiEra, EngineState, GpuInfo, TensorRTSettings

if TYPE_CHECKING:  # the stubs; at run time the module is imported by import_tensorrt
    import tensorrt as trt


class TensorRTUnavailable(BuildError):
    """TensorRT or an NVIDIA GPU is missing here; `details` says what was checked."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def effective_era(planned: ApiEra, installed: tuple[int, int]) -> ApiEra:
    """The API era a build uses: the bundle's plan, adapted to the TensorRT installed. A TensorRT 8
    plan on TensorRT 10 drops the explicit-batch flag (10 has no other kind); a weakly typed plan
    stays weakly typed on 10.15+ (deprecated there, not removed); TensorRT 11 builds strongly typed
    networks only, and a strongly typed plan needs TensorRT 10."""
    era = api_era(installed)
    if planned is ApiEra.STRONGLY_TYPED:
        if installed < (10, 0):
            raise CabinlmError(f"this bundle is for a strongly typed network (TensorRT 10.15+); TensorRT "
                               f"{installed[0]}.{installed[1]} cannot build it: make the bundle for this board's profile")  # fmt: skip
        return ApiEra.STRONGLY_TYPED
    if installed >= (11, 0):
        raise CabinlmError(f"this bundle is for a weakly typed network (precision flags); TensorRT {installed[0]}."
                           f"{installed[1]} builds strongly typed networks only: make the bundle for a profile with "
                           "engine_version 10.15 or newer")  # fmt: skip
    return ApiEra.TRT8 if era is ApiEra.TRT8 else ApiEra.TRT10


def _parser_errors(parser: trt.OnnxParser, graph: Path) -> list[str]:
    """Every parser error as a line naming its node (10.x: name and operator; 8.6: the index, named
    here from the graph file)."""
    model = onnx.load(str(graph), load_external_data=False)
    lines = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = e.node()
        name = op = ""
        if hasattr(e, "node_name"):  # TensorRT 10
            name, op = e.node_name(), e.node_operator()
        elif 0 <= node < len(model.graph.node):
            name, op = model.graph.node[node].name, model.graph.node[node].op_type
        lines.append(parser_error_line(i, str(e.code()), e.desc(), node, name, op))
    return lines


def build_engine(folder: Path, manifest: Manifest, log: Callable[[str], None]) -> Manifest:
    """Build the bundle in `folder` into an engine, in place; returns the manifest in state "engine"."""
    from cabinlm.engines.backend import BackendError
    from cabinlm.engines.tensorrt.cuda_mem import open_cuda

    build = manifest.runtime_spec
    s = build.facts_as(TensorRTSettings)
    if s is None:
        raise BuildError(f"{folder}: not a TensorRT build")
    missing = TensorRTUnavailable(f"this machine has no TensorRT (the tensorrt Python package): run `cabinlm build "
                                  f"{folder}` on the target (TensorRT {s.target_version} and its GPU)")  # fmt: skip
    try:
        import tensorrt as trt
    except ImportError as e:
        raise missing from e
    if not hasattr(trt, "Builder"):  # a `tensorrt` folder of type stubs only (tensorrt-stubs), no library
        raise missing
    try:
        gpu = open_cuda().info()
    except BackendError as e:
        raise TensorRTUnavailable(f"TensorRT {trt.__version__} is installed but no GPU answers: {e}") from e
    installed = parse_installed_version(trt.__version__)
    era = effective_era(s.api_era, installed)
    graph = folder / manifest.files[FileRole.GRAPH].path
    if installed < tuple(int(x) if x != "x" else 0 for x in s.target_version.split(".")[:2]):
        # An older TensorRT than the bundle was checked for: check the graph against this one.
        bad = errors(check_file(graph, f"{installed[0]}.{installed[1]}"))
        if bad:
            raise BuildError(f"{graph} was checked for TensorRT {s.target_version}, but TensorRT {trt.__version__} is "
                             f"installed and cannot parse it:\n{format_report(bad, f'{installed[0]}.{installed[1]}')}")  # fmt: skip
    log(f"TensorRT {trt.__version__} ({era.value} API) on {gpu.name} (SM {gpu.compute_capability}), CUDA driver "
        f"{gpu.driver_version} through {gpu.library}")  # fmt: skip

    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Enum members are looked up only when used: 8.6 has no STRONGLY_TYPED, FP8 or BF16.
    creation = {"EXPLICIT_BATCH": lambda: trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH,
                "STRONGLY_TYPED": lambda: trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED}
    network = builder.create_network(sum(1 << int(creation[name]()) for name in network_flag_names(era)))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):  # reads the external weights next to the graph
        lines = _parser_errors(parser, graph)
        raise BuildError(f"TensorRT {trt.__version__}'s ONNX parser refused {graph} ({len(lines)} errors):\n" + "\n".join(lines))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, s.workspace_bytes)
    flags = {"fp16": lambda: trt.BuilderFlag.FP16, "bf16": lambda: trt.BuilderFlag.BF16,
             "int8": lambda: trt.BuilderFlag.INT8, "fp8": lambda: trt.BuilderFlag.FP8, "tf32": lambda: trt.BuilderFlag.TF32}
    precision = () if era is ApiEra.STRONGLY_TYPED else s.precision
    for name in precision:
        config.set_flag(flags[name]())
    for token_profile in s.profiles:
        profile = builder.create_optimization_profile()
        for shape in profile_shapes(manifest.io, manifest.cache, token_profile):
            profile.set_shape(shape.name, trt.Dims(list(shape.min)), trt.Dims(list(shape.opt)), trt.Dims(list(shape.max)))
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"TensorRT refused optimization profile {token_profile.name!r}")
    cache_path = folder / s.timing_cache
    previous = cache_path.read_bytes() if cache_path.exists() else b""
    timing = config.create_timing_cache(previous)
    if not config.set_timing_cache(timing, False):
        raise BuildError(f"{cache_path}: TensorRT refused the timing cache (from another TensorRT or GPU?); delete it and build again")
    log(f"building the engine ({', '.join(precision) or 'precision from the graph'}; {len(s.profiles)} optimization "
        f"profiles; workspace {s.workspace_bytes >> 20} MiB{'; timing cache reused' if previous else ''})")  # fmt: skip
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"TensorRT {trt.__version__} could not build the engine (its log above says why)")
    engine_path = folder / s.engine_file
    tmp = engine_path.with_suffix(".tmp")
    tmp.write_bytes(memoryview(serialized))
    tmp.replace(engine_path)
    cache_path.write_bytes(memoryview(config.get_timing_cache().serialize()))
    seconds = time.perf_counter() - t0
    log(f"wrote {engine_path} ({engine_path.stat().st_size / 1e6:.1f} MB) in {seconds:.0f} s; timing cache {cache_path}")

    built = TensorRTSettings(
        state=EngineState.ENGINE, target_version=s.target_version, api_era=era, strongly_typed=era is ApiEra.STRONGLY_TYPED,
        precision=precision, profiles=s.profiles, workspace_bytes=s.workspace_bytes, fp16_safe_norms=s.fp16_safe_norms,
        engine_file=s.engine_file, timing_cache=s.timing_cache, built_with=str(trt.__version__),
        gpu=GpuInfo(gpu.name, gpu.compute_capability), graph_sha256=FileEntry.of(folder, manifest.files[FileRole.GRAPH].path).sha256,
    )  # fmt: skip
    return engine_manifest(folder, manifest, built, seconds)


def engine_manifest(folder: Path, manifest: Manifest, settings: TensorRTSettings, seconds: float) -> Manifest:
    """The manifest of a finished engine build: state "engine", the engine file with its checksum."""
    import dataclasses

    from cabinlm.engines.output import save_validated

    build = dataclasses.replace(manifest.runtime_spec, facts=settings, engine_version=settings.built_with)
    files = {**manifest.files, FileRole.ENGINE: FileEntry.of(folder, settings.engine_file)}
    quality = dataclasses.replace(manifest.quality, build={**(manifest.quality.build or {}),
                                  "tensorrt": f"engine built with TensorRT {settings.built_with}",
                                  "engine_seconds": round(seconds, 1)})  # fmt: skip
    return save_validated(dataclasses.replace(manifest, files=files, build=build, quality=quality), folder)
