"""The TensorRT backend's host side, on the CPU: the device buffer plan and the commit copies
(numpy), then the whole backend driven by the Decoder against a FAKE engine and a FAKE device.

What the fakes stand for, and what they cannot show: FakeCuda keeps "device" memory in numpy byte
arrays and does what cuMemcpy2D / cuMemcpyHtoD would; FakeContext reads its inputs at the addresses
the backend bound with set_tensor_address, at the shapes it set with set_input_shape, runs the
bundle's graph on ONNX Runtime, and writes the outputs at the bound addresses. So these tests check
the backend's bindings, buffer offsets, commit copies, seats and session buffers. They say nothing
about TensorRT itself (parsing, kernels, fp16 numerics): that needs a GPU with TensorRT
(tests/test_tensorrt.py::test_engine_on_a_gpu_matches_onnxruntime, marked gpu)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
from conftest import make_tiny_model

from cabinlm.engines.backend import StepOutput
from cabinlm.engines.build import build_artifact
from cabinlm.contract.layout import CacheLayout
from cabinlm.contract.manifest import FileEntry, load_manifest
from cabinlm.profiles import load_profile
from cabinlm.runtime import Decoder, Dialogue, open_artifact
from cabinlm.runtime.persist import load_session, save_session
from cabinlm.engines.ort_graph import backend as exported
from cabinlm.engines.tensorrt import backend as trt_backend
from cabinlm.engines.tensorrt.cuda_mem import DeviceInfo
from cabinlm.engines.tensorrt.device_plan import DevicePlan, apply_copy, slot_runs
from cabinlm.contract.io_spec import decoder_io
from cabinlm.engines.tensorrt.api import profile_shapes, runtime_shapes, token_profiles
from cabinlm.contract.engines.tensorrt import EngineState, GpuInfo
from cabinlm.contract.slots import SlotTable
from cabinlm.runtime.perplexity import chunked_perplexity


# -- the plan, with numpy only ---------------------------------------------------------------------


def test_slot_runs_split_at_the_ring_wrap_and_at_gaps():
    assert slot_runs(np.array([5, 6, 7])) == [(5, 0, 3)]
    assert slot_runs(np.array([78, 79, 16, 17])) == [(78, 0, 2), (16, 2, 2)]  # the ring wraps
    assert slot_runs(np.array([3, 9, 10])) == [(3, 0, 1), (9, 1, 2)]


@pytest.mark.parametrize("kv", ["fp16", "int8"])
@pytest.mark.parametrize("slots,tokens", [([20, 21, 22], 3), ([78, 79, 16, 17], 5), ([40], 1), ([7, 30], 4)])
def test_commit_copies_write_what_the_onnxruntime_backend_writes(kv, slots, tokens):
    """The 2D copies over the packed new-K/V block put every layer's, every head's token where the
    ONNX Runtime backend's numpy write puts it, including a commit of a prefix (speculative)."""
    lay = CacheLayout(sink=4, pinned=12, window=64, chunk=8, layers=3, kv_heads=2, head_dim=16, kv_dtype=kv)
    plan = DevicePlan(lay, decoder_io(lay, 50, "int32"), 50)
    L, H, N, D = lay.buffer_shape
    rng = np.random.default_rng(0)
    slots = np.array(slots)
    dt = plan.kv_dtype
    cache = {"keys": rng.integers(0, 100, (L, H, N, D)).astype(dt), "values": rng.integers(0, 100, (L, H, N, D)).astype(dt)}
    new = {k: rng.integers(0, 100, (L, H, tokens, D)).astype(dt) for k in cache}  # packed: layer l at l*H*t*D
    if lay.quantized:
        cache["value_scales"] = rng.random((L, H, N, 1)).astype(np.float16)
        new["scales"] = rng.random((L, H, tokens, 1)).astype(np.float16)
    expected = {k: v.copy() for k, v in cache.items()}
    for k, block in zip(expected, ("keys", "values", "scales")):
        exported.write_slots(expected[k], list(new[block]), slots)  # what the CPU backend does
    device = {k: v.reshape(-1).view(np.uint8).copy() for k, v in cache.items()}
    copies = plan.commit_copies(slots, tokens)
    assert len(copies) == len(slot_runs(slots)) * len(cache)  # one 2D copy per run and buffer, all layers at once
    for c in copies:
        apply_copy(device[c.cache], new[c.block].reshape(-1).view(np.uint8), c)
    for k in cache:
        np.testing.assert_array_equal(device[k].view(expected[k].dtype).reshape(expected[k].shape), expected[k])


def test_the_plan_binds_per_layer_views_and_packs_outputs_by_token_count():
    lay = CacheLayout(sink=4, pinned=0, window=12, chunk=4, layers=2, kv_heads=3, head_dim=8, kv_dtype="fp16")
    plan = DevicePlan(lay, decoder_io(lay, 10, "int32"), 10)
    cache = plan.cache_addresses({"keys": 1000, "values": 5000})
    assert cache["key_cache.1"] - cache["key_cache.0"] == 3 * 16 * 8 * 2  # H*N*D*es
    out = plan.output_addresses(3, 0, 10_000, 20_000, None)
    assert out["new_key.1"] - out["new_key.0"] == 3 * 3 * 8 * 2  # H*t*D*es: rows (l, h) share one pitch
    assert all(s.offset % 256 == 0 for s in plan.inputs.values())
    assert plan.inputs["attention_mask"].shape == (4, 16 + 4) and plan.inputs["input_ids"].dtype == np.int32
    with pytest.raises(ValueError, match="1..4"):
        plan.output_addresses(5, 0, 0, 0, None)


# -- the backend over fakes ------------------------------------------------------------------------


class FakeCuda:
    """Device memory as numpy byte arrays at fake addresses (see the module docstring)."""

    stream = 7

    def __init__(self):
        self.blocks: list[tuple[int, np.ndarray]] = []
        self.next = 1 << 20
        self.allocs = 0

    def info(self):
        return DeviceInfo("Fake GPU", "8.7", "12.6", "fake", 1 << 30)

    def alloc(self, nbytes):
        base = self.next
        self.blocks.append((base, np.zeros(max(nbytes, 1), dtype=np.uint8)))
        self.next += (nbytes // 4096 + 2) * 4096
        self.allocs += 1
        return base

    def host(self, nbytes):
        self.allocs += 1
        return np.zeros(nbytes, dtype=np.uint8)

    def at(self, ptr, nbytes):
        for base, mem in self.blocks:
            if base <= ptr and ptr + nbytes <= base + len(mem):
                return mem[ptr - base : ptr - base + nbytes]
        raise AssertionError(f"access outside any allocation: {ptr:#x} + {nbytes}")

    def htod(self, dst, src, stream):
        self.at(dst, src.nbytes)[:] = src.reshape(-1).view(np.uint8)

    def dtoh(self, dst, src, stream):
        dst.reshape(-1).view(np.uint8)[:] = self.at(src, dst.nbytes)

    def copy_2d(self, dst, dst_pitch, src, src_pitch, width, height, stream):
        for r in range(height):
            self.at(dst + r * dst_pitch, width)[:] = self.at(src + r * src_pitch, width)

    def memset(self, dst, nbytes, stream):
        self.at(dst, nbytes)[:] = 0

    def sync(self, stream):
        pass


class FakeContext:
    def __init__(self, engine, index):
        self.engine, self.index = engine, index
        self.addresses, self.shapes = {}, {}

    def set_optimization_profile_async(self, index, stream):
        return index == self.index

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def set_input_shape(self, name, shape):
        profile = self.engine.settings.profiles[self.index]
        tokens = shape[0] if name != "logit_rows" else None
        if tokens is not None and not profile.covers(tokens):
            return False  # TensorRT refuses shapes outside the context's profile
        self.shapes[name] = tuple(shape)
        return True

    def execute_async_v3(self, stream):
        e, cuda = self.engine, self.engine.cuda
        feeds = {}
        for t in e.manifest.io.inputs:
            shape = self.shapes.get(t.name, t.shape)
            dtype = np.dtype(e.dtypes[t.dtype])
            n = int(np.prod(shape)) * dtype.itemsize
            feeds[t.name] = cuda.at(self.addresses[t.name], n).view(dtype).reshape(shape).copy()
        outs = e.session.run(None, feeds)
        for spec, value in zip(e.manifest.io.outputs, outs):
            cuda.at(self.addresses[spec.name], value.nbytes)[:] = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        e.runs[self.index] += 1
        return True


class FakeEngine:
    dtypes = {"float": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64, "bool": np.bool_,
              "int8": np.int8}  # fmt: skip

    def __init__(self, folder, manifest, cuda):
        self.manifest, self.cuda, self.settings = manifest, cuda, manifest.runtime_spec.facts
        self.session = ort.InferenceSession(str(folder / manifest.files["graph"].path), providers=["CPUExecutionProvider"])
        self.runs = [0] * len(self.settings.profiles)
        self.num_optimization_profiles = len(self.settings.profiles)
        self.io = [(t.name, "INPUT", t.dtype) for t in manifest.io.inputs] + [(t.name, "OUTPUT", t.dtype) for t in manifest.io.outputs]
        self.num_io_tensors = len(self.io)
        self._next = 0

    def get_tensor_name(self, i):
        return self.io[i][0]

    def get_tensor_mode(self, name):
        return type("Mode", (), {"name": dict((n, m) for n, m, _ in self.io)[name]})()

    def get_tensor_dtype(self, name):
        names = {"float": "FLOAT", "float16": "HALF", "int32": "INT32", "int64": "INT64", "int8": "INT8", "bool": "BOOL"}
        return type("DType", (), {"name": names[dict((n, d) for n, _, d in self.io)[name]]})()

    def create_execution_context(self):
        self._next += 1
        return FakeContext(self, self._next - 1)


class FakeRuntime:
    def __init__(self, folder, manifest, cuda):
        self.engine = FakeEngine(folder, manifest, cuda)

    def deserialize_cuda_engine(self, data):
        assert data == b"fake engine"
        return self.engine


def fake_engine_build(art: Path, out: Path) -> Path:
    """The orin-x bundle of an export, turned into an "engine" build whose engine is fake."""
    out = build_artifact(art, load_profile("orin-x"), out)
    m = load_manifest(out)
    (out / "decoder.engine").write_bytes(b"fake engine")
    s = dataclasses.replace(m.build.facts, state=EngineState.ENGINE, built_with="8.6.11.4", gpu=GpuInfo("Fake GPU", "8.7"),
                            graph_sha256=m.files["graph"].sha256)  # fmt: skip
    m.build = dataclasses.replace(m.build, facts=s)
    m.files["engine"] = FileEntry.of(out, "decoder.engine")
    m.save(out)
    return out


def onnxruntime_manifest(out: Path):
    """The build's manifest without its build: the bundle's graph on ONNX Runtime (the reference)."""
    m = load_manifest(out)
    m.build = None
    return m


@pytest.fixture(scope="module")
def engine_build(load, tiny_qwen2_dir, export_to, tmp_path_factory) -> tuple[Path, Path]:
    """(export, build): the bundle for orin-x, turned into an "engine" build whose engine is fake."""
    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=48, chunk=16, kv="fp16", index_dtype="int32")
    return art, fake_engine_build(art, tmp_path_factory.mktemp("trt") / "b")


@pytest.fixture
def fake_tensorrt(monkeypatch):
    """open_backend loads the build through load_engine with the fakes; returns the FakeCuda."""
    cuda = FakeCuda()

    def load(folder, manifest):
        return trt_backend.load_engine(folder, manifest, FakeRuntime(folder, manifest, cuda), "8.6.11.4", cuda)

    monkeypatch.setattr(trt_backend, "load_tensorrt", load)
    return cuda


def test_the_backend_runs_the_dialogue_semantics_of_the_cpu_backend(engine_build, fake_tensorrt, long_text):
    """Prefill chunks (profile 1), single-token decode (profile 0), hundreds of evictions through the
    ring, a pinned system prompt: the same logits as the ONNX Runtime backend on the same graph."""
    art, out = engine_build
    from cabinlm.runtime import Tokenizer

    ids = Tokenizer(out / "tokenizer.json").encode(long_text, add_special_tokens=True)[:260]
    dec = Decoder(out)
    assert isinstance(dec.backend, trt_backend.TensorRTBackend) and dec.device == "tensorrt-cuda"
    ref_manifest = onnxruntime_manifest(out)  # the bundle's graph on ONNX Runtime
    ref = Decoder(out, ref_manifest)
    np.testing.assert_allclose(dec.feed(np.asarray(ids[:10]), pin=True), ref.feed(np.asarray(ids[:10]), pin=True), atol=1e-4)
    np.testing.assert_allclose(dec.feed(np.asarray(ids[10:40]), all_logits=True),
                               ref.feed(np.asarray(ids[10:40]), all_logits=True), atol=1e-4)  # fmt: skip
    allocs = fake_tensorrt.allocs
    for t in ids[40:]:
        np.testing.assert_allclose(dec.step(np.array([t]))[0], ref.step(np.array([t]))[0], atol=1e-4)
    assert fake_tensorrt.allocs == allocs  # no allocation per step
    runs = dec.backend.loaded.engine.runs
    assert runs[0] == len(ids) - 40 and runs[1] >= 2  # decode on profile 0, prefill chunks on profile 1
    ppl_trt = chunked_perplexity(Decoder(out), ids).ppl
    assert ppl_trt == pytest.approx(chunked_perplexity(Decoder(out, ref_manifest), ids).ppl, rel=1e-5)


def test_buffers_mirror_the_device_cache_and_restore_it(engine_build, fake_tensorrt):
    art, out = engine_build
    dec = Decoder(out)
    dec.feed(np.arange(1, 30), all_logits=False)
    saved = {k: v.copy() for k, v in dec.backend.buffers().items()}
    assert set(saved) == {"keys", "values"} and saved["keys"].shape == dec.layout.buffer_shape
    assert saved["keys"].any() and dec.backend.nbytes() == sum(v.nbytes for v in saved.values())
    state = dec.cache.state()
    before = dec.step(np.array([5]))[0].copy()
    # restore the saved bytes and the table: the next step gives the same logits again
    for k, v in dec.backend.buffers().items():
        np.copyto(v, saved[k])
    dec.cache.restore(state)
    dec.backend.restored()
    np.testing.assert_allclose(dec.step(np.array([5]))[0], before, atol=1e-6)


def test_seats_share_the_contexts_and_keep_their_own_caches(engine_build, fake_tensorrt):
    art, out = engine_build
    a = Decoder(out)
    b = a.seat()
    la = a.step(np.array([3]))[0].copy()
    b.feed(np.arange(1, 20), all_logits=False)  # the other seat runs in between: the contexts are re-bound
    a2 = Decoder(out)
    a2.step(np.array([3]))
    np.testing.assert_allclose(a.step(np.array([4]))[0], a2.step(np.array([4]))[0], atol=1e-5)
    assert a.backend.loaded is b.backend.loaded and a.backend.dev["keys"] != b.backend.dev["keys"]
    assert la.shape == (a.manifest.model.vocab_size,)


def test_an_engine_from_another_tensorrt_or_gpu_is_refused(engine_build):
    art, out = engine_build
    m = load_manifest(out)
    cuda = FakeCuda()
    with pytest.raises(trt_backend.BackendError, match="built with TensorRT 8.6.11.4, this is 10.3.0.30"):
        trt_backend.load_engine(out, m, FakeRuntime(out, m, cuda), "10.3.0.30", cuda)
    cuda.info = lambda: DeviceInfo("Other", "9.0", "12.6", "fake", 1)
    with pytest.raises(trt_backend.BackendError, match=r"SM 8.7.*SM 9.0"):
        trt_backend.load_engine(out, m, FakeRuntime(out, m, cuda), "8.6.11.4", cuda)


# -- the local layers' rings (per-layer cache geometry: Gemma 3) -----------------------------------
# What the one-kind tests above cannot catch: a layer bound to a view of the other kind's buffer, the
# new-K/V blocks packed by layer index (Gemma 3's local, global, local interleaves the kinds, so one
# 2D copy per kind would take the other kind's rows), ring slots taken for slot-map slots or the
# reverse, a ring run's copy that misses the global layers' rows in front of it, the ring inputs
# left unstaged (the graph then reads the previous step's ranks and window).

RING_LAYOUT = dict(sink=2, pinned=6, window=9, chunk=5, layers=3, kv_heads=2, head_dim=8, local_window=7,
                   local_layers=(0, 2))  # fmt: skip


def test_local_layers_bind_views_of_the_rings_and_their_own_inputs():
    lay = CacheLayout(**RING_LAYOUT, kv_dtype="int8")
    plan = DevicePlan(lay, decoder_io(lay, 50, "int32"), 50)
    H, R, D = lay.kv_heads, lay.local_slots, lay.head_dim
    names = ["keys", "values", "value_scales", "local_keys", "local_values", "local_value_scales"]
    assert list(plan.cache_bytes()) == names
    assert sum(plan.cache_bytes().values()) == lay.cache_bytes
    bases = {name: (i + 1) << 20 for i, name in enumerate(plan.cache_bytes())}
    cache = plan.cache_addresses(bases)
    assert cache["key_cache.1"] == bases["keys"] and cache["value_scale.1"] == bases["value_scales"]  # the global layer
    assert cache["key_cache.0"] == bases["local_keys"] and cache["value_cache.0"] == bases["local_values"]
    assert cache["key_cache.2"] == bases["local_keys"] + H * R * D  # int8: 1 byte per element
    assert cache["value_scale.2"] == bases["local_value_scales"] + H * R * 2
    with pytest.raises(ValueError, match="local_keys"):
        plan.cache_addresses({"keys": 1, "values": 2, "value_scales": 3})
    inputs = plan.inputs
    assert inputs["local_attention_mask"].shape == (5, R + 5) and inputs["local_cache_position_ids"].shape == (R,)
    assert inputs["local_position_ids"].dtype == np.int32 and all(s.offset % 256 == 0 for s in inputs.values())
    out = plan.output_addresses(3, 0, 0, 0, 0)  # packed by kind: the global layer, then the local layers
    assert [out[f"new_key.{layer}"] for layer in (1, 0, 2)] == [0, H * 3 * D, 2 * H * 3 * D]
    assert [out[f"new_value_scale.{layer}"] for layer in (1, 0, 2)] == [0, H * 3 * 2, 2 * H * 3 * 2]
    with pytest.raises(ValueError, match="ring slots"):
        plan.commit_copies(np.array([3]), 1)  # a layout with local layers commits into the rings too
    with pytest.raises(ValueError, match="local_slots outside"):
        plan.commit_copies(np.array([3]), 1, np.array([R]))
    assert runtime_shapes(plan.io, lay, 3, 1)["local_attention_mask"] == (3, R + 3)
    prefill = {s.name: s for s in profile_shapes(plan.io, lay, token_profiles(lay.chunk)[1])}["local_attention_mask"]
    assert (prefill.min, prefill.opt, prefill.max) == ((2, R + 2), (5, R + 5), (5, R + 5))


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_ring_commits_write_what_the_onnxruntime_backend_writes(kv):
    """Random chunks, pinned spans and prefixes of chunks (a verified draft keeps its first tokens),
    through ring and window turnover: the 2D copies over the packed blocks leave every buffer, rings
    included, byte for byte as the ONNX Runtime backend's own commit leaves its arrays."""
    lay = CacheLayout(**RING_LAYOUT, kv_dtype=kv)
    plan = DevicePlan(lay, decoder_io(lay, 50, "int32"), 50)
    table, rng = SlotTable(lay), np.random.default_rng(1)
    cpu = SimpleNamespace(layout=lay, bufs=exported.allocate(lay))  # ExportedGraphBackend.commit reads these two
    device = {name: np.zeros(n, dtype=np.uint8) for name, n in plan.cache_bytes().items()}
    assert list(device) == list(cpu.bufs)  # the same buffers by name and order: session files hold the same
    L, H, D = lay.layers, lay.kv_heads, lay.head_dim
    kv_dtype, wraps = np.dtype(lay.kv_dtype.numpy_name), 0
    for _ in range(60):
        t = int(rng.integers(1, lay.chunk + 1))
        pin = bool(rng.random() < 0.1) and table.pinned_free >= t
        kept = t if pin or rng.random() < 0.6 else int(rng.integers(1, t + 1))
        p = table.plan(kept, pin)  # the plan of the tokens kept: a prefix of the t that ran
        news = [[rng.integers(-100, 100, (H, t, D)).astype(kv_dtype) for _ in range(L)] for _ in range(2)]
        news.append([rng.random((H, t, 1)).astype(np.float16) for _ in range(L)] if lay.quantized else [])
        exported.ExportedGraphBackend.commit(cpu, p, StepOutput(np.zeros(0), tuple(news)))
        addresses = plan.output_addresses(t, 0, 0, 0, 0 if lay.quantized else None)  # where the engine writes them
        blocks = {"keys": np.zeros(plan.new_kv_bytes, np.uint8), "values": np.zeros(plan.new_kv_bytes, np.uint8),
                  "scales": np.zeros(max(plan.new_scales_bytes, 1), np.uint8)}  # fmt: skip
        for block, name, per_layer in zip(blocks, ("new_key", "new_value", "new_value_scale"), news):
            for layer, x in enumerate(per_layer):
                at = addresses[f"{name}.{layer}"]
                blocks[block][at : at + x.nbytes] = x.reshape(-1).view(np.uint8)
        copies = plan.commit_copies(p.slots, t, p.local_slots)
        runs = len(slot_runs(p.slots)) + len(slot_runs(p.local_slots))
        assert len(copies) == runs * (3 if lay.quantized else 2)  # per run and buffer, every layer of a kind at once
        wraps += len(slot_runs(p.local_slots)) > 1
        for c in copies:
            apply_copy(device[c.cache], blocks[c.block], c)
        for name, buf in cpu.bufs.items():
            assert np.array_equal(device[name].view(buf.dtype).reshape(buf.shape), buf), name
        table.advance(p)
    assert wraps >= 5 and table.evicted > 0


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")  # local layers 0, 2 (window 20), global 1


GEMMA_LAYOUT = dict(sink=4, pinned=60, window=96, chunk=8, index_dtype="int32")
W = 20


@pytest.fixture(scope="module", params=["fp16", "int8"])
def gemma_export(request, load, tiny_gemma_dir, export_to) -> Path:
    return export_to(load(str(tiny_gemma_dir)), kv=request.param, **GEMMA_LAYOUT)


@pytest.fixture(scope="module")
def gemma_engine(gemma_export, tmp_path_factory) -> Path:
    """A tiny Gemma 3's orin-x build with a fake engine: rings of 20 slots beside a 4 + 60 + 96 slot map."""
    return fake_engine_build(gemma_export, tmp_path_factory.mktemp("trt-gemma") / "b")


def test_the_gemma_bundle_graph_is_the_export(gemma_export, gemma_engine):
    """The bundle's rewrites (fp16-safe RMSNorm: Gemma 3's six norms per layer, q / k per head) keep
    the export's function, rings included: the bundle's graph on ONNX Runtime against the export."""
    bundle, export = Decoder(gemma_engine, onnxruntime_manifest(gemma_engine)), Decoder(gemma_export)
    assert load_manifest(gemma_engine).build.facts.fp16_safe_norms == 6 * 3 + 1
    ids = np.random.default_rng(5).integers(3, 300, 90)
    np.testing.assert_allclose(bundle.feed(ids[:30], all_logits=True), export.feed(ids[:30], all_logits=True), atol=1e-3)
    for t in ids[30:]:  # the rings turn over three times
        np.testing.assert_allclose(bundle.step(np.array([t])), export.step(np.array([t])), atol=1e-3)


def test_the_backend_runs_the_rings_as_the_onnxruntime_backend(gemma_engine, fake_tensorrt):
    """The decisive one: the backend's host logic (bindings by kind, the ring inputs staged, commits
    into the rings) with the fake engine running the bundle's graph, against the ONNX Runtime
    backend on the same graph, step by step: a pinned system prompt, prefill chunks that wrap the
    rings, a verified draft that keeps a prefix, a later pinned span, hundreds of decode steps
    (the rings turn over 20 times, the window evicts). Every step's logits and, at the end, every
    buffer, byte for byte."""
    out = gemma_engine
    dec, ref = Decoder(out), Decoder(out, onnxruntime_manifest(out))
    assert isinstance(dec.backend, trt_backend.TensorRTBackend) and dec.layout.local_layers == (0, 2)
    assert dec.layout.local_slots == W
    ids = np.random.default_rng(3).integers(3, 300, 400)
    pos = 0

    def both(f):
        a, b = f(dec), f(ref)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
        return a

    both(lambda d: d.feed(ids[:14], pin=True))  # 4 to the sink, 10 pinned
    both(lambda d: d.feed(ids[14:45], all_logits=True))  # 4 chunks: the rings wrap inside the third
    pos = 45
    for accepted in (2, 5, 1):  # a verification of 5 tokens that keeps `accepted`: a prefix of its ring slots
        logits = both(lambda d: d.verify(ids[pos : pos + 5], lambda _: accepted)[0])
        assert logits.shape == (5, dec.manifest.model.vocab_size)
        pos += accepted
    for _ in range(60):
        both(lambda d: d.step(ids[pos : pos + 1]))
        pos += 1
    both(lambda d: d.feed(ids[pos : pos + 9], pin=True))  # a pinned span younger than the rings
    pos += 9
    allocs = fake_tensorrt.allocs
    while pos < 330:
        both(lambda d: d.step(ids[pos : pos + 1]))
        pos += 1
    both(lambda d: d.feed(ids[pos:], all_logits=True))
    assert fake_tensorrt.allocs == allocs  # no allocation per step
    assert dec.cache.seen == ref.cache.seen == len(ids)  # every token fed once (rejected drafts are not)
    assert dec.cache.seen > 10 * W and dec.cache.evicted > 2 * GEMMA_LAYOUT["window"]
    mine, theirs = dec.backend.buffers(), ref.backend.buffers()
    assert list(mine) == list(theirs) and dec.backend.nbytes() == dec.layout.cache_bytes == ref.backend.nbytes()
    for name, buf in theirs.items():
        assert mine[name].dtype == buf.dtype and mine[name].shape == buf.shape, name
        np.testing.assert_array_equal(mine[name], buf, err_msg=name)
    runs = dec.backend.loaded.engine.runs
    assert runs[0] >= 260 and runs[1] >= 15  # decode on profile 0, prefill chunks and verifications on profile 1


TURNS = ["check the route and the weather", "play some music", "how far is it to the charging station",
         "check the route", "thanks, check the route and the weather again"]  # fmt: skip


def test_a_session_saved_from_the_engine_resumes_the_rings_exactly(gemma_engine, fake_tensorrt, tmp_path):
    """Session files through buffers() / restored(): the rings are in the file under the ONNX Runtime
    backend's names, and a dialogue resumed from it replies as the one that never stopped, after the
    rings have turned over."""
    out = gemma_engine

    def dialogue() -> Dialogue:
        dec, tok = open_artifact(out, verify=False)
        return Dialogue(dec, tok, system="Answer briefly.", max_new_tokens=12)

    whole = dialogue()
    assert isinstance(whole.decoder.backend, trt_backend.TensorRTBackend)
    expected = [whole.ask(t).reply for t in TURNS]
    first = dialogue()
    for t in TURNS[:2]:
        first.ask(t)
    assert first.decoder.cache.seen > 2 * W  # the rings have turned over before the save
    save_session(tmp_path / "s", first)
    resumed = dialogue()
    load_session(tmp_path / "s", resumed)
    saved, back = first.decoder.backend.buffers(), resumed.decoder.backend.buffers()
    onnxruntime = Decoder(out, onnxruntime_manifest(out)).backend.buffers()
    assert list(saved) == list(onnxruntime) and {k: (v.dtype, v.shape) for k, v in saved.items()} == \
        {k: (v.dtype, v.shape) for k, v in onnxruntime.items()}  # fmt: skip
    assert saved["local_keys"].any()
    for name, buf in saved.items():
        assert np.array_equal(back[name], buf), name
    assert [resumed.ask(t).reply for t in TURNS[2:]] == expected[2:]


def test_the_plan_names_the_bindings_off_256_byte_alignment():
    """TensorRT's header asks for 256-byte aligned tensor addresses; what the packed layout gives is
    known before any board runs it: Gemma 3 270M's geometry (1 KV head x 256) in fp16 is aligned
    everywhere, SmolLM2's (3 x 64) decode step puts every odd layer's new K/V at 384 bytes."""
    gemma = CacheLayout(sink=4, pinned=124, window=1024, chunk=256, layers=18, kv_heads=1, head_dim=256, kv_dtype="fp16",
                        local_window=512, local_layers=tuple(i for i in range(18) if i % 6 != 5))  # fmt: skip
    plan = DevicePlan(gemma, decoder_io(gemma, 1000, "int32"), 1000)
    assert [plan.unaligned_bindings(t) for t in (1, 7, 256)] == [[], [], []]
    int8 = dataclasses.replace(gemma, kv_dtype="int8")  # a decode step's value scales: 2 bytes per layer, all
    assert DevicePlan(int8, decoder_io(int8, 1000, "int32"), 1000).unaligned_bindings(1) == \
        [f"new_value_scale.{layer}" for layer in range(18) if layer != 5]  # but the first global layer's (block 0)
    smol = CacheLayout(sink=4, pinned=124, window=1024, chunk=256, layers=30, kv_heads=3, head_dim=64, kv_dtype="fp16")
    odd = DevicePlan(smol, decoder_io(smol, 1000, "int32"), 1000).unaligned_bindings(1)
    assert odd == [f"{kind}.{layer}" for layer in range(1, 30, 2) for kind in ("new_key", "new_value")]


def test_greedy_drafting_on_the_engine_gives_the_plain_replies(gemma_engine, fake_tensorrt):
    """Drafts verified on the engine (every row's logits, a prefix of the rows committed into the
    slot map and the rings) give the replies plain decoding gives, as on the ONNX Runtime backend."""
    from cabinlm.runtime.speculative import PromptLookupDrafting

    def dialogue(drafting) -> Dialogue:
        dec, tok = open_artifact(gemma_engine, verify=False)
        return Dialogue(dec, tok, system="Answer briefly.", max_new_tokens=12, drafting=drafting)

    plain, spec = dialogue(None), dialogue(PromptLookupDrafting())
    assert spec.decoder.backend.verifies_drafts
    turns = TURNS * 2
    expected = [plain.ask(t).reply for t in turns]
    results = [spec.ask(t) for t in turns]
    assert [r.reply for r in results] == expected and sum(r.drafted_tokens for r in results) > 0
    assert spec.decoder.cache.seen > 3 * W
