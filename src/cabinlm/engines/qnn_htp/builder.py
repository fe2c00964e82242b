"""Qualcomm HTP builds: the decoder compiled by Qualcomm's own compiler (the QNN SDK inside the
`onnxruntime-qnn` plugin) into context binaries, the form a Snapdragon cockpit loads.

    artifact graph ─ graph.htp_ready ─┬─ fix tokens = chunk ─ compile ─ decoder.prefill.ctx.onnx ┐
                                          └─ fix tokens = 1     ─ compile ─ decoder.decode.ctx.onnx  ┴─ *_qnn.bin

Each `.ctx.onnx` holds one EPContext node that points at the binary. CPU fallback is disabled while
compiling: a node the HTP cannot run fails the build, named. On HTP v73 and later the two graphs are
compiled into one context and share one copy of the weights; on v68 each graph holds its own.

On an x86 host the same binaries run in Qualcomm's HTP simulator (backend.py): the
build checks one decode step of the compiled graph there against ONNX Runtime's CPU provider.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx

from cabinlm.contract.files import FileRole, context_binary
from cabinlm.contract.buildspec import BuildSpec, OptimizationLevel, SessionSettings
from cabinlm.engines.builder import Builder, BuildError, BuildRequest
from cabinlm.engines.onnxruntime.offline import fix_tokens, read_graph
from cabinlm.engines.output import BuildOutput
from cabinlm.engines.qnn_htp import plugin as qnn_plugin
from cabinlm.engines.qnn_htp.options import HtpBuildOptions
from cabinlm.engines.qnn_htp.compile import SIM_PAIR, binary_of, compile_pair, profile_provider
from cabinlm.engines.qnn_htp.graph import KV_ZERO_POINT, htp_ready, per_tensor_kv_scales, uint8_kv
from cabinlm.engines.qnn_htp.rotated_graph import rotate_cached_keys, rotated_key_scales
from cabinlm.engines.qnn_htp import qdq
from cabinlm.engines.qnn_htp.qdq import a16_graph, a16_refusal
from cabinlm.engines.qnn_htp.vision_build import place_vision
from cabinlm.contract.engines.qnn import QNN_PROVIDER, SIMULATOR, QnnSettings, builds_rotated_keys, shares_weights
from cabinlm.contract.engines import BackendKind
from cabinlm.contract.manifest import Manifest

if TYPE_CHECKING:
    from cabinlm.profiles import DeviceProfile

PREFILL_CTX, DECODE_CTX = "decoder.prefill.ctx.onnx", "decoder.decode.ctx.onnx"


class QnnBuilder(Builder):
    kind: ClassVar[BackendKind] = BackendKind.QNN_HTP
    options_type: ClassVar[type | None] = HtpBuildOptions

    def targets(self, profile: DeviceProfile) -> bool:
        return profile.execution_provider == QNN_PROVIDER

    def check(self, request: BuildRequest) -> str | None:
        kv = request.manifest.cache.kv_dtype.value
        if kv not in ("fp16", "int8"):
            return (f"it holds {kv} KV; the HTP builds take fp16 KV, or int8 KV (compiled as a uint8 cache with one "
                    f"scale per tensor): re-export with --kv fp16 or --kv int8")  # fmt: skip
        if request.options_for(HtpBuildOptions).activations == "a16":
            return a16_refusal(request.profile, kv)
        return None

    def build(self, request: BuildRequest, output: BuildOutput) -> BuildSpec:
        """Compile the artifact for the profile's HTP (module docstring)."""
        qnn_plugin.require()
        artifact, manifest, profile, log = request.artifact, request.manifest, request.profile, request.log
        options = request.options_for(HtpBuildOptions)
        out = output.folder
        for stale in (PREFILL_CTX, DECODE_CTX, *SIM_PAIR):
            (out / stale).unlink(missing_ok=True)
        for old in out.glob("*_qnn.bin"):
            old.unlink()
        lay = manifest.cache
        t0 = time.perf_counter()
        # a vision-language model's camera encoder: its own context binary, or vision.onnx on the CPU (the reason recorded)
        vision = place_vision(output, profile, log) if manifest.vision is not None else {}
        # the uint8 cache's keys rotated when written (rotated_graph.py): an int8-KV text model without local layers
        rotated_keys = builds_rotated_keys(manifest)
        if options.activations == "a16":  # the calibrated 16-bit QDQ graph (qdq.py), its uint8 cache tied as uint8_kv's
            with tempfile.TemporaryDirectory(prefix="cabinlm-a16-") as work:
                model, rewrites, kv_scales, calibration = a16_graph(artifact, manifest, options.calib, Path(work), log,
                                                                    options.a16_weights)  # fmt: skip
            output.quality["activation_calibration"] = calibration
            ppl_f, ppl_q = rewrites["fidelity_perplexity"]
            form = f"symmetric {options.a16_weights} blocks of 32" if rewrites["weight_blocks"] else f"{qdq.PER_CHANNEL} per channel"
            if options.a16_weights == "int4" and rewrites["weight_blocks_int8"]:
                form += f" ({rewrites['weight_blocks_int8']} of them, the LM head, int8)"
            keys = "; keys rotated when written, QK^T reading them 8-bit" if rotated_keys else ""
            log(f"the graph with 16-bit activations: {rewrites['float_weights']} weight matrices as {form} "
                f"({rewrites['offsets_folded']} Q4_1 offsets folded in), the KV cache as uint8 (zero point {KV_ZERO_POINT}, one "
                f"scale per tensor, the same in and out{keys}); on the CPU, through the runtime over {rewrites['fidelity_tokens']} "
                f"held-out tokens, its logits follow the float graph's at correlation {rewrites['fidelity']:.4f}, perplexity {ppl_q:.4g} "
                f"against {ppl_f:.4g} (16-bit activations are measured in Qualcomm's x86 simulator only, not on an SA8775P)")  # fmt: skip
        else:
            model = read_graph(artifact, manifest)
            rewrites = htp_ready(model)
            log(f"made the graph HTP-ready: {rewrites['rms_norms']} RMSNorms fused (fp16-safe), "
                f"{rewrites['matmul_4bit']} 4-bit and {rewrites['matmul_8bit']} 8-bit weight matrices as MatMulNBits"
                + (", the token table as a float gather" if rewrites["float_embedding"] else ""))  # fmt: skip
            kv_scales = {}
            if lay.quantized:  # int8 KV (check): the uint8 cache, one calibrated scale per tensor (graph.uint8_kv)
                scales_of = rotated_key_scales if rotated_keys else per_tensor_kv_scales  # rotated: the keys' pair bound
                kv_scales = scales_of(manifest.kv_scales.array("keys"), manifest.kv_scales.array("values"), lay.layers)
                uint8_kv(model, kv_scales)
                if rotated_keys:  # the cache holds keys rotated at their virtual positions (rotated_graph.py)
                    rotate_cached_keys(model, lay.head_dim)
                log(f"the KV cache as uint8 (zero point {KV_ZERO_POINT}, one calibrated scale per tensor, the same in and out"
                    + ("; keys rotated when written, the sink / pinned keys re-rotated by the runtime)" if rotated_keys else ")"))  # fmt: skip
        share = shares_weights(profile.htp_arch)
        with tempfile.TemporaryDirectory(prefix="cabinlm-htp-") as tmp:
            sources = []
            for role, tokens in (("prefill", lay.chunk), ("decode", 1)):
                m = onnx.ModelProto()
                m.CopyFrom(model)
                fix_tokens(m, tokens, lay)
                src = Path(tmp) / f"decoder.{role}.onnx"
                onnx.save_model(m, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                                location=src.name + ".data", size_threshold=1024)  # fmt: skip
                sources.append((src, tokens))
                del m
            del model
            if share:
                # The car's binaries share their weights; Qualcomm's x86 simulator cannot load a context
                # with shared weights (it crashes), so the same graphs are also compiled unshared for it.
                # That twin is compiled first: a graph the HTP rejects fails there, before a shared
                # context is open (a failed shared compile leaves the plugin unable to shut down cleanly).
                log("compiling the graphs without weight sharing, for Qualcomm's x86 HTP simulator ...")
                files = compile_pair(sources, out, SIM_PAIR, profile, False, log, simulator=True)
                log("compiling the graphs with shared weights, for the car ...")
                files.update(compile_pair(sources, out, (PREFILL_CTX, DECODE_CTX), profile, True, log))
            else:
                files = compile_pair(sources, out, (PREFILL_CTX, DECODE_CTX), profile, False, log)
            check = _check_decode(sources[1][0], out / files[FileRole.GRAPH_DECODE + (SIMULATOR if share else "")], manifest, profile,
                                  rotated=rotated_keys)  # fmt: skip
        compile_seconds = round(time.perf_counter() - t0, 1)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        binaries = [p for r, p in files.items() if r.startswith(context_binary(0))]
        sdk = binary_of(out / files[FileRole.GRAPH])[1]
        a16 = options.activations == "a16"
        weights = (qdq.PER_CHANNEL or options.a16_weights) if a16 else "fp16" if not (rewrites["matmul_4bit"] or rewrites["matmul_8bit"]) else (
            "int4" if rewrites["matmul_4bit"] else "int8")  # fmt: skip
        settings = QnnSettings(
            qairt_version=sdk.removeprefix("v"), soc_model=profile.soc_model, htp_arch=profile.htp_arch,
            chip=profile.chip, activations="int16" if a16 else "fp16", weights=weights, weight_sharing=share,
            binaries=tuple(binaries), compile_seconds=compile_seconds, peak_host_bytes=int(peak),
            rewrites=dict(rewrites), check=check, kv_cache="uint8" if kv_scales else "fp16", kv_scales=kv_scales,
            rotated_keys=rotated_keys,
            vision=vision,
        )  # fmt: skip
        for role, name in files.items():
            output.add(role, name)
        output.copy(FileRole.TOKENIZER)
        sizes = {b: (out / b).stat().st_size for b in binaries}
        car = [files[r] for r in files if r.startswith(context_binary(0)) and not r.endswith(SIMULATOR)]
        output.quality.update(seconds=compile_seconds, binary_bytes=sizes)
        log(f"context binaries for the car: {', '.join(f'{b} {sizes[b] / 1e6:.1f} MB' for b in car)}"
            + (" (prefill and decode share the weights)" if share else
               f" (HTP v{profile.htp_arch} has no weight sharing between graphs: each holds its own weights)"))  # fmt: skip
        log(f"checked one decode step in the HTP simulator against the CPU: top-1 {'the same' if check['same_top1'] else 'DIFFERENT'}, "
            f"logit correlation {check['correlation']:.5f}, max |diff| {check['max_abs_diff']:.3g}")  # fmt: skip
        return BuildSpec(backend=BackendKind.QNN_HTP, provider=profile_provider(profile),
                         session=SessionSettings(graph_optimization_level=OptimizationLevel.DISABLE),
                         profile=profile.name, engine="qnn", engine_version=settings.qairt_version, facts=settings)  # fmt: skip


def _check_decode(src: Path, ctx: Path, manifest: Manifest, profile: DeviceProfile, min_correlation: float = 0.99,
                  rotated: bool = False) -> dict:
    """One decode step (the first token of a dialogue, empty cache) of the compiled graph in the
    HTP (the simulator on x86) against the same HTP-ready graph on ONNX Runtime's CPU provider. A
    graph that overflows fp16 or was miscompiled has near-random logits: refused. rotated: the graph
    takes the chunk's rotation rows (rotated_graph.py), here position 0's."""
    import onnxruntime as ort

    from cabinlm.contract import io_spec as io

    lay = manifest.cache
    index = np.dtype(manifest.index_dtype)
    mrope = manifest.vision is not None and manifest.vision.mrope  # (3, ...) positions: time, row, column
    feed: dict[str, np.ndarray] = {io.INPUT_IDS: np.array([1], index),
                                   io.POSITION_IDS: np.zeros((3, 1) if mrope else (1,), index),
                                   io.CACHE_POSITION_IDS: np.zeros((3, lay.slots) if mrope else (lay.slots,), index),
                                   io.LOGIT_ROWS: np.array([0], index)}  # fmt: skip
    mask = np.full((1, lay.slots + 1), io.MASK_VALUE, np.float32)
    mask[0, -1] = 0
    feed[io.ATTENTION_MASK] = mask
    if rotated:
        del feed[io.POSITION_IDS], feed[io.CACHE_POSITION_IDS]
        half = lay.head_dim // 2  # angle 0: cos = the RoPE factor, sin = 0
        feed[io.ROPE_COS] = np.full((1, half), manifest.rotary.scale, np.float32)
        feed[io.ROPE_SIN] = np.zeros((1, half), np.float32)
    uint8 = lay.quantized  # the HTP's int8 KV is the uint8 cache of graph.uint8_kv: no value scales
    kv = np.dtype(np.uint8) if uint8 else np.dtype(lay.kv_dtype.numpy_name)
    if lay.local_layers:  # the local rings, empty too
        ring = np.full((1, lay.local_slots + 1), io.MASK_VALUE, np.float32)
        ring[0, -1] = 0
        feed.update({io.LOCAL_POSITION_IDS: np.array([0], index), io.LOCAL_CACHE_POSITION_IDS: np.zeros(lay.local_slots, index),
                     io.LOCAL_ATTENTION_MASK: ring})  # fmt: skip
    for i in range(lay.layers):
        shape = (lay.kv_heads, lay.layer_slots(i), lay.head_dim)
        feed[io.key_cache_name(i)] = np.full(shape, KV_ZERO_POINT if uint8 else 0, kv)
        feed[io.value_cache_name(i)] = np.full(shape, KV_ZERO_POINT if uint8 else 0, kv)
    if manifest.vision is not None:
        feed[io.IMAGE_EMBEDS] = np.zeros((1, manifest.vision.embed_dim), np.float32)
        feed[io.IMAGE_MASK] = np.zeros((1, 1), bool)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run([io.LOGITS], feed)[0][0]
    htp = qnn_plugin.open_context_session(ctx, profile_provider(profile), share=False)
    got = htp.run([io.LOGITS], feed)[0][0]
    corr = float(np.corrcoef(ref.astype(np.float64), got.astype(np.float64))[0, 1]) if np.isfinite(got).all() else 0.0
    check = {"correlation": round(corr, 6), "same_top1": bool(ref.argmax() == got.argmax()),
             "max_abs_diff": round(float(np.abs(ref - got).max()), 4) if np.isfinite(got).all() else None}  # fmt: skip
    if corr < min_correlation:
        raise BuildError(f"the compiled decoder's logits do not follow the graph's (correlation {corr:.3f} over one "
                         f"decode step in the HTP simulator; top-1 {'same' if check['same_top1'] else 'different'}): "
                         "a value overflows fp16 or the compiler changed the meaning; report this")  # fmt: skip
    return check


BUILDER = QnnBuilder()
