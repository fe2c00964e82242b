"""A TensorRT engine on an NVIDIA GPU, behind the backend interface (the graph contract of
io_spec.decoder_io, as engines/ort_graph/backend.py runs it on ONNX Runtime).

NOT RUN UNDER TENSORRT: no machine of this project has TensorRT (docs/tensorrt.md). The TensorRT
calls are type-checked against NVIDIA's stubs (tests/test_tensorrt_types.py) and the host-side logic
ran on the CPU against a fake engine and a fake device (tests/test_tensorrt_backend.py).

Load (once): deserialize the engine; one execution context per optimization profile (decode:
1 token, prefill: 2..chunk tokens; engines/tensorrt/api.token_profiles); per dialogue, the device
buffers of engines/tensorrt/device_plan.py (the cache: the global layers' slot map and, for a model
with its own sliding-window layers, their rings; the inputs; the outputs), allocated once.

One step, all on one CUDA stream, no allocation:

    run     inputs -> page-locked host block -> device (one copy per input, the used bytes only;
            the rings' local_position_ids, local_cache_position_ids, local_attention_mask too);
            bind by name (set_tensor_address: the cache views, the inputs, this step's outputs),
            set_input_shape for the token count, execute_async_v3; logits rows -> host; sync.
            The engine writes only the output blocks: the cache is untouched until commit.
    commit  the chunk's new K/V (still on the device) into their slots: one cuMemcpy2DAsync per run
            of consecutive slots and per buffer, covering every layer of a kind (the global layers
            into plan.slots, the local layers into their ring slots plan.local_slots); sync.

buffers(): the cache lives on the device. Session files get host mirrors (keys, values
[, value_scales] [, local_keys, local_values [, local_value_scales]]: the ONNX Runtime backend's
names, order and shapes), allocated on the first call and refreshed from the device by every call;
`restored()` copies the mirrors back. Invariant: between steps the device cache is the truth, the
mirrors are a copy made at the last buffers().
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NVIDIA's stubs (tests/test_tensorrt_types.py); at run time imported in load_tensorrt
    import tensorrt as trt

import numpy as np

from cabinlm.contract import io_spec as io
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import Manifest
from cabinlm.engines.backend import Backend, BackendError, StepOutput, exported_graph_verifies_drafts
from cabinlm.engines.tensorrt.cuda_mem import Cuda, open_cuda
from cabinlm.engines.tensorrt.device_plan import DevicePlan
from cabinlm.contract.slots import SlotTable, StepPlan
from cabinlm.contract.engines.tensorrt import EngineState, TensorRTSettings

# TensorRT DataType member name -> the graph contract's dtype name (io_spec.TensorSpec.dtype)
ENGINE_DTYPES = {"FLOAT": "float", "HALF": "float16", "INT32": "int32", "INT64": "int64", "INT8": "int8",
                 "BOOL": "bool", "UINT8": "uint8", "FP8": "float8e4m3fn"}  # fmt: skip


def needs(settings: TensorRTSettings) -> str:
    return f"this build needs TensorRT {settings.built_with or settings.target_version} and an NVIDIA GPU"


def tensorrt_missing(settings: TensorRTSettings) -> BackendError:
    return BackendError(
        f"{needs(settings)}; the tensorrt Python package is not installed here (it comes with DRIVE OS / "
        "JetPack; `pip install tensorrt` needs NVIDIA's package index). Run it on the target, or build the "
        "export for the cpu profile to run it here"
    )


def check_engine_io(names: dict[str, tuple[str, str]], manifest: Manifest, where: Path) -> None:
    """names: the engine's I/O tensors, name -> ("input" | "output", ENGINE_DTYPES value). The engine
    must have exactly the manifest's graph contract."""
    want = {t.name: ("input", t.dtype) for t in manifest.io.inputs}
    want.update({t.name: ("output", t.dtype) for t in manifest.io.outputs})
    for name, (mode, dtype) in want.items():
        got = names.get(name)
        if got is None:
            raise BackendError(f"{where}: the engine has no {mode} {name!r} that the manifest declares; run `cabinlm build` again")
        if got != (mode, dtype):
            raise BackendError(f"{where}: engine tensor {name!r} is {got[0]} {got[1]}, the manifest says {mode} {dtype}; "
                               "run `cabinlm build` again")  # fmt: skip
    extra = sorted(set(names) - set(want))
    if extra:
        raise BackendError(f"{where}: the engine has I/O the manifest does not declare ({', '.join(extra)}); rebuild")


@dataclass
class LoadedEngine:
    """What every dialogue on one loaded engine shares: the engine, its contexts, the CUDA device."""

    manifest: Manifest
    settings: TensorRTSettings
    engine: trt.ICudaEngine
    contexts: list[trt.IExecutionContext]  # one per optimization profile (settings.profiles)
    cuda: Cuda
    version: str  # tensorrt.__version__
    # which backend's addresses and shapes each context holds now (seats share the contexts)
    bound: list[tuple[int, int, int] | None] = field(default_factory=list)


def load_tensorrt(folder: Path, manifest: Manifest) -> LoadedEngine:
    """Deserialize the build's engine on GPU 0; BackendError (one line) for anything missing."""
    build = manifest.runtime_spec
    settings = build.facts_as(TensorRTSettings)
    if settings is None:
        raise BackendError(f"{folder}: the manifest names the tensorrt backend without its TensorRT settings; rebuild")
    if settings.state is EngineState.BUNDLE:
        raise BackendError(f"{folder} is a TensorRT bundle without its engine: run `cabinlm build {folder}` on the target "
                           f"(TensorRT {settings.target_version} and its GPU); `cabinlm doctor {folder}` checks the board first")
    try:
        import tensorrt as trt
    except ImportError as e:
        raise tensorrt_missing(settings) from e
    if not hasattr(trt, "Runtime"):  # a `tensorrt` folder of type stubs only (tensorrt-stubs), no library
        raise tensorrt_missing(settings)
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    return load_engine(folder, manifest, runtime, str(trt.__version__), open_cuda())


def load_engine(folder: Path, manifest: Manifest, runtime: trt.Runtime, version: str, cuda: Cuda) -> LoadedEngine:
    """load_tensorrt with the TensorRT runtime and CUDA given (tests pass fakes of both)."""
    settings = manifest.runtime_spec.facts_as(TensorRTSettings)
    assert settings is not None and settings.gpu is not None
    if version != settings.built_with:
        raise BackendError(f"{folder}: the engine was built with TensorRT {settings.built_with}, this is {version}; "
                           f"engines run only on the TensorRT that built them: run `cabinlm build {folder}` again here")
    info = cuda.info()
    if info.compute_capability != settings.gpu.compute_capability:
        raise BackendError(f"{folder}: the engine was built for {settings.gpu.name} (SM {settings.gpu.compute_capability}), "
                           f"this GPU is {info.name} (SM {info.compute_capability}): run `cabinlm build {folder}` again here")
    data = (folder / settings.engine_file).read_bytes()
    engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(data)
    if engine is None:
        raise BackendError(f"{folder / settings.engine_file}: TensorRT could not deserialize the engine; rebuild it")
    if engine.num_optimization_profiles != len(settings.profiles):
        raise BackendError(f"{folder}: the engine has {engine.num_optimization_profiles} optimization profiles, the "
                           f"manifest {len(settings.profiles)}; rebuild")  # fmt: skip
    names = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        mode = "input" if engine.get_tensor_mode(name).name == "INPUT" else "output"
        dtype = engine.get_tensor_dtype(name).name
        names[name] = (mode, ENGINE_DTYPES.get(dtype, dtype))
    check_engine_io(names, manifest, folder)
    contexts = []
    for index in range(len(settings.profiles)):
        context: trt.IExecutionContext | None = engine.create_execution_context()
        if context is None:
            raise BackendError(f"{folder}: TensorRT could not create an execution context (GPU memory?)")
        if index and not context.set_optimization_profile_async(index, cuda.stream):
            raise BackendError(f"{folder}: TensorRT refused optimization profile {index}")
        contexts.append(context)
    cuda.sync(cuda.stream)
    return LoadedEngine(manifest, settings, engine, contexts, cuda, version, [None] * len(contexts))


class TensorRTBackend(Backend):
    """io_spec.decoder_io as a TensorRT engine; the cache and every step's tensors on the device."""

    kind = BackendKind.TENSORRT

    def __init__(self, loaded: LoadedEngine, table: SlotTable):
        super().__init__(loaded.manifest, table)
        self.loaded = loaded
        m, cuda = self.manifest, loaded.cuda
        self.plan = plan = DevicePlan(self.layout, m.io, m.model.vocab_size)
        self.cuda = cuda
        # device buffers, allocated once (device_plan.py's table)
        sizes = plan.cache_bytes()
        self.dev = {name: cuda.alloc(n) for name, n in sizes.items()}
        for name, n in sizes.items():
            cuda.memset(self.dev[name], n, cuda.stream)
        self.dev_inputs = cuda.alloc(plan.inputs_bytes)
        self.dev_logits = cuda.alloc(plan.logits_bytes)
        self.dev_new = {"keys": cuda.alloc(plan.new_kv_bytes), "values": cuda.alloc(plan.new_kv_bytes)}
        if plan.scales_shape is not None:
            self.dev_new["scales"] = cuda.alloc(plan.new_scales_bytes)
        # page-locked host staging: the inputs block and the logits
        self.host_inputs = cuda.host(plan.inputs_bytes)
        self.host_logits = cuda.host(plan.logits_bytes).view(np.float32).reshape(self.layout.chunk, m.model.vocab_size)
        self._views = {name: self.host_inputs[s.offset : s.offset + s.nbytes].view(s.dtype) for name, s in plan.inputs.items()}
        self._fixed = {**plan.cache_addresses(self.dev), **plan.input_addresses(self.dev_inputs)}
        self._mirrors: dict[str, np.ndarray] | None = None
        self._rows = np.arange(self.layout.chunk, dtype=np.dtype(m.index_dtype))
        if m.vision is not None:  # constant inputs of text chunks, made once
            self._no_embeds = np.zeros((self.layout.chunk, m.vision.embed_dim), dtype=np.float32)
            self._no_image = np.zeros(self.layout.chunk, dtype=bool)
            self._all_image = np.ones(self.layout.chunk, dtype=bool)
        cuda.sync(cuda.stream)

    @property
    def device(self) -> str:
        return "tensorrt-cuda"

    @property
    def verifies_drafts(self) -> bool:
        return exported_graph_verifies_drafts(self.layout)  # the exported graph's contract, as on ONNX Runtime

    def seat(self, table: SlotTable) -> TensorRTBackend:
        return type(self)(self.loaded, table)

    # -- a step ------------------------------------------------------------------------------------

    def _stage(self, name: str, values: np.ndarray) -> None:
        """Write one input into its host slot and queue its used bytes to the device."""
        view = self._views[name][: values.size]
        view[...] = values.reshape(-1)
        offset = self.plan.inputs[name].offset
        self.cuda.htod(self.dev_inputs + offset, self.host_inputs[offset : offset + view.nbytes], self.cuda.stream)

    def _bind(self, index: int, tokens: int, rows: int) -> trt.IExecutionContext:
        """The context for this step with this dialogue's addresses and the step's shapes, set only
        when they changed (a context serves every seat, one step at a time)."""
        from cabinlm.engines.tensorrt.api import runtime_shapes

        loaded, context = self.loaded, self.loaded.contexts[index]
        key = (id(self), tokens, rows)
        if loaded.bound[index] == key:
            return context
        outputs = self.plan.output_addresses(tokens, self.dev_logits, self.dev_new["keys"], self.dev_new["values"],
                                             self.dev_new.get("scales"))  # fmt: skip
        for name, address in {**self._fixed, **outputs}.items():
            if not context.set_tensor_address(name, address):
                raise BackendError(f"TensorRT refused the address of {name!r}")
        for name, shape in runtime_shapes(self.manifest.io, self.layout, tokens, rows).items():
            if not context.set_input_shape(name, shape):
                raise BackendError(f"TensorRT refused shape {shape} for {name!r} (optimization profile {index})")
        loaded.bound[index] = key
        return context

    def run(self, plan: StepPlan, ids: np.ndarray, all_logits: bool, embeds: np.ndarray | None) -> StepOutput:
        n = plan.tokens
        rows = n if all_logits and n > 1 else 1
        index = self.loaded.settings.profile_for(n)
        self._stage(io.INPUT_IDS, np.asarray(ids))
        self._stage(io.POSITION_IDS, plan.position_ids)
        self._stage(io.CACHE_POSITION_IDS, plan.cache_position_ids)
        self._stage(io.ATTENTION_MASK, plan.attention_mask)
        self._stage(io.LOGIT_ROWS, self._rows[:n] if rows > 1 else self._rows[n - 1 : n])
        if self.layout.local_layers:  # the local layers' rings: their own ranks and window (StepPlan.local_*)
            self._stage(io.LOCAL_POSITION_IDS, plan.local_position_ids)
            self._stage(io.LOCAL_CACHE_POSITION_IDS, plan.local_cache_position_ids)
            self._stage(io.LOCAL_ATTENTION_MASK, plan.local_attention_mask)
        if self.manifest.vision is not None:
            image = embeds is not None  # text tokens: zero rows, which the mask tells the graph not to read
            self._stage(io.IMAGE_EMBEDS, np.asarray(embeds, dtype=np.float32) if image else self._no_embeds[:n])
            self._stage(io.IMAGE_MASK, self._all_image[:n] if image else self._no_image[:n])
        elif embeds is not None:
            raise ValueError("this model has no vision input")
        context = self._bind(index, n, rows)
        if not context.execute_async_v3(self.cuda.stream):
            raise BackendError(f"TensorRT execute_async_v3 failed for a chunk of {n} tokens")
        self.cuda.dtoh(self.host_logits[:rows].reshape(-1).view(np.uint8), self.dev_logits, self.cuda.stream)
        self.cuda.sync(self.cuda.stream)
        return StepOutput(self.host_logits[:rows], n)  # a view, valid until the next run

    def commit(self, plan: StepPlan, out: StepOutput) -> None:
        """The first plan.tokens of the step's out.new tokens into their slots (and the local layers'
        into their ring slots), on the device."""
        cuda = self.cuda
        local = plan.local_slots if self.layout.local_layers else None
        for c in self.plan.commit_copies(plan.slots, int(out.new), local):
            cuda.copy_2d(self.dev[c.cache] + c.dst_offset, c.dst_pitch, self.dev_new[c.block] + c.src_offset,
                         c.src_pitch, c.width, c.height, cuda.stream)  # fmt: skip
        cuda.sync(cuda.stream)

    # -- the cache as host arrays -----------------------------------------------------------------

    def buffers(self) -> dict[str, np.ndarray]:
        """Host mirrors of the device cache, refreshed from the device now (module docstring)."""
        plan, cuda = self.plan, self.cuda
        if self._mirrors is None:  # keys, values [, value_scales] [, local_keys, local_values [, local_value_scales]]
            self._mirrors = {name: cuda.host(int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)
                             for name, (dtype, shape) in plan.cache_buffers().items()}  # fmt: skip
        for name, mirror in self._mirrors.items():
            cuda.dtoh(mirror.reshape(-1).view(np.uint8), self.dev[name], cuda.stream)
        cuda.sync(cuda.stream)
        return self._mirrors

    def restored(self) -> None:
        """The mirrors were overwritten from a session file: they become the device cache."""
        if self._mirrors is None:
            raise BackendError("restored() without buffers(): nothing to copy to the device")
        for name, mirror in self._mirrors.items():
            self.cuda.htod(self.dev[name], mirror.reshape(-1).view(np.uint8), self.cuda.stream)
        self.cuda.sync(self.cuda.stream)

    def nbytes(self) -> int:
        """The device cache's bytes, the rings included (= layout.cache_bytes), from the plan (no copy to the host)."""
        return int(sum(self.plan.cache_bytes().values()))


def unavailable() -> str | None:
    """Why a TensorRT engine cannot run here: no tensorrt library (type stubs are not one), or no GPU."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt package is not installed (it comes with DRIVE OS / JetPack)"
    import tensorrt as trt

    if not hasattr(trt, "Runtime"):
        return "only TensorRT's type stubs are installed, not TensorRT"
    try:
        open_cuda()
    except BackendError as e:
        return str(e)
    return None


def open_backend(folder: Path, manifest: Manifest, table: SlotTable, threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> TensorRTBackend:
    """threads, session_config: not applied (TensorRT schedules the GPU itself)."""
    return TensorRTBackend(load_tensorrt(folder, manifest), table)
