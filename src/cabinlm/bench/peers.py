"""The peer engines behind the protocol's Engine interface: transformers (growing cache), llama.cpp
(llama-cpp-python's low-level API on the GGUF) and onnxruntime-genai (models its own builder makes,
run here as child processes), and `open_engine`, which picks one by name.

Imported by the child process a baseline runs in (bench/baselines.py); each engine imports its heavy
package when it is made, so importing this module loads none of them. Imports go one way:

    baselines -> peers -> prepare -> child -> catalog
                 peers -> protocol
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from cabinlm.bench.catalog import INSTALL, BaselineError, BaselineUnavailable, first_line
from cabinlm.bench.child import check
from cabinlm.bench.prepare import cache_root, model_key
from cabinlm.bench.protocol import ContextFull, Engine, Script
from cabinlm.contract.errors import ModelError


def open_engine(name: str, path: Path, script: Script, folder: Path, threads: int, config: str, n_ctx: int,
                log: Callable[[str], None] = lambda s: None) -> Engine:  # fmt: skip
    """The engine of baseline NAME in configuration CONFIG: PATH is the GGUF, FOLDER its prepared save
    (bench/prepare.py), N_CTX the context a bounded engine is given."""
    if name == "hf":
        return HFEngine(folder, script, threads, config, None)
    if name == "llama.cpp":
        return LlamaCppEngine(path, threads, config, n_ctx, stop_ids=script.stop_ids)
    if name == "ort-genai":
        built = build_ort_genai(path, folder, config, log)
        return OrtGenaiEngine(built, threads, config, n_ctx)
    raise ValueError(f"unknown baseline {name!r}")


class HFEngine(Engine):
    name = "hf"

    def __init__(self, folder: Path, script: Script, threads: int, config: str, limit: int | None):
        import torch
        from transformers import AutoModelForCausalLM, DynamicCache

        self._threads_before = torch.get_num_threads()  # restored on close (tests run engines in-process)
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.cache = DynamicCache(config=self.model.config)
        self.max_positions = script.max_positions
        self.config = {"name": config, "weights": "float32 (de-quantized from the GGUF)", "kv": "float32 DynamicCache",
                       "attn": self.model.config._attn_implementation, "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__}  # fmt: skip

    def feed(self, ids: list[int]) -> int:
        if self.context + len(ids) > self.max_positions:
            raise ContextFull(f"reached the model's {self.max_positions} positions (transformers cannot go past them)")
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.context += len(ids)
        return int(out.logits[0, -1].argmax())

    def close(self) -> None:
        self.torch.set_num_threads(self._threads_before)


def load_llama_model(L, path: Path) -> tuple[deque[str], object, object]:
    """llama.cpp's log routed into a deque of its last 20 messages (the last ones explain a failure),
    its backend started, and the GGUF at `path` loaded. Returns (log, the log callback, which the
    caller keeps alive as long as llama.cpp may call it, model); ModelError if the GGUF does not load."""
    import ctypes

    log: deque[str] = deque(maxlen=20)

    @L.llama_log_callback
    def callback(level, text, user_data):
        s = text.decode("utf-8", "replace").strip()
        if s:
            log.append(s)

    L.llama_log_set(callback, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    if not model:
        raise ModelError(f"{path}: llama.cpp cannot load this GGUF ({'; '.join(list(log)[-3:])})")
    return log, callback, model


class LlamaCppEngine(Engine):
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, config: str, n_ctx: int, stop_ids: Iterable[int] = ()):
        """stop_ids: the script's (gguf-lookup accepts no draft past one)."""
        import ctypes

        import numpy as np

        try:
            import llama_cpp as L
        except Exception as e:  # noqa: BLE001 - a broken build: say so with the install command
            raise BaselineUnavailable(f"llama-cpp-python does not import ({e}): {INSTALL['llama.cpp']}") from e
        self.L, self.np, self.ctypes = L, np, ctypes
        self.log, self._log_cb, self.model = load_llama_model(L, path)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = min(512, n_ctx)
        cp.n_ubatch = min(512, n_ctx)
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        kv = "f16"
        if config == "gguf-kv8":
            cp.type_k = L.GGML_TYPE_Q8_0
            cp.type_v = L.GGML_TYPE_Q8_0
            _set_flash_attn(L, cp, True)
            kv = "q8_0"
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BaselineError(f"llama.cpp cannot create a context ({'; '.join(list(self.log)[-3:])})")
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.n_batch = int(cp.n_batch)
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self.config = {"name": config, "weights": "the GGUF file as is", "kv": kv, "n_ctx": self.n_ctx,
                       "n_batch": self.n_batch, "llama_cpp_python": L.__version__}  # fmt: skip
        self.stop_ids = frozenset(stop_ids)
        # The tokens in llama.cpp's KV cache, in order (the prompt-lookup drafter's input).
        self.history = np.zeros(self.n_ctx + 1, dtype=np.intc)
        self.drafter = None
        if config == "gguf-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.drafter = LlamaPromptLookupDecoding(**LOOKUP)
            # Counted as the dialogue runs: the trace's config is a shallow copy of this one, so it shares
            # this dict and ends with the final counts.
            self.spec = {"drafter": "llama_cpp.llama_speculative.LlamaPromptLookupDecoding", **LOOKUP,
                         "verify": "one llama_decode of [token, drafts] with the logits of every row, greedy "
                                   "acceptance, the rejected drafts' cells removed with llama_memory_seq_rm",
                         "verified": 0, "drafted": 0, "accepted": 0}  # fmt: skip
            self.config["speculative"] = self.spec

    def _full(self, rc: int, n: int) -> ContextFull:
        why = "no free KV-cache slot" if rc == 1 else "error"
        return ContextFull(
            f"context full at {self.context} tokens (n_ctx {self.n_ctx}): llama_decode returned {rc} ({why}) "
            f"for {n} more tokens; llama.cpp's library does not shift or evict by itself"
            + (f" [{self.log[-1]}]" if self.log else "")
        )

    def _argmax(self, row: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def feed(self, ids: list[int]) -> int:
        L = self.L
        for i in range(0, len(ids), self.n_batch):
            chunk = ids[i : i + self.n_batch]
            arr = (L.llama_token * len(chunk))(*chunk)
            rc = L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                raise self._full(rc, len(chunk))
            self.history[self.context : self.context + len(chunk)] = chunk
            self.context += len(chunk)
        return self._argmax(-1)

    def advance(self, token: int, budget: int) -> list[int]:
        """Prompt lookup (gguf-lookup): draft from the history with llama-cpp-python's own drafter, verify
        [token, d1 .. dk] in one llama_decode with the logits of every row, accept greedily, and remove the
        rejected drafts' cells from the KV cache. Other configurations: one plain step."""
        if self.drafter is None or budget < 2:
            return [self.step(token)]
        pos = self.context
        self.history[pos] = token
        # Drafts: at most budget - 1 (the call returns accepted drafts + the next token), as many as the
        # context has room for beside `token`, none from a stop id on (a reply ends at its stop id).
        drafts: list[int] = []
        for d in self.drafter(self.history[: pos + 1])[: max(0, min(budget - 1, self.n_ctx - pos - 1))]:
            if int(d) in self.stop_ids:
                break
            drafts.append(int(d))
        if not drafts:
            return [self.step(token)]
        L = self.L
        rows = [token, *drafts]
        n = len(rows)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(rows):
                batch.token[i] = t
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = n
            rc = L.llama_decode(self.ctx, batch)
        finally:
            L.llama_batch_free(batch)
        if rc != 0:
            raise self._full(rc, n)
        # Row i's argmax is the token chosen after rows[i]: it must equal draft i + 1 to accept it.
        chosen: list[int] = []
        for i in range(n):
            c = self._argmax(i)
            chosen.append(c)
            if i == n - 1 or c != drafts[i] or c in self.stop_ids:
                break
        accepted = len(chosen) - 1  # every chosen token but the last is a draft that was accepted (and fed)
        kept = pos + 1 + accepted
        if kept < pos + n:
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), 0, kept, -1)
        self.history[pos + 1 : kept] = drafts[:accepted]
        self.context = kept
        self.spec["verified"] += 1
        self.spec["drafted"] += len(drafts)
        self.spec["accepted"] += accepted
        return chosen

    def close(self) -> None:
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


# gguf-lookup's drafter: llama-cpp-python's own LlamaPromptLookupDecoding: the continuation of the first
# earlier occurrence of the history's last 2 tokens (else its last token), its default max_ngram_size;
# num_pred_tokens 2, the value llama-cpp-python's README gives for CPU-only machines (its default, 10,
# it calls good for GPUs: on a CPU each verified row costs most of a decode step, and 10 drafts, mostly
# rejected, ran at less than half the decode rate of 2 here). Fewer where the reply's budget or the
# context leaves less room.
LOOKUP = {"max_ngram_size": 2, "num_pred_tokens": 2}


def _set_flash_attn(L, cp, on: bool) -> None:
    names = {f[0] for f in type(cp)._fields_}
    if "flash_attn_type" in names:  # newer llama.cpp: an enum (auto / disabled / enabled)
        cp.flash_attn_type = getattr(L, "LLAMA_FLASH_ATTN_TYPE_ENABLED", 1) if on else 0
    else:
        cp.flash_attn = on


def ort_genai_dir(path: Path, config: str) -> Path:
    return cache_root() / model_key(path) / f"ort-genai-{config}"


def build_ort_genai(path: Path, hf: Path, config: str, log: Callable[[str], None] = lambda s: None) -> Path:
    """Build (once) the ort-genai model of a configuration with its model builder, from the prepared folder.

    int4-kv8: the builder's int8 KV cache (kv_cache_quant_scheme=int8_per_channel) needs calibrated
    per-layer scales; they come from the package's own calibration tool run on the int4 model."""
    out = ort_genai_dir(path, config)
    if (out / "genai_config.json").exists():
        return out
    precision = {"int4": "int4", "int4-kv8": "int4", "fp32": "fp32"}[config]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    t = time.perf_counter()
    steps = []
    try:
        extra: list[str] = []
        if config == "int4-kv8":
            base = build_ort_genai(path, hf, "int4", log)
            scales = tmp / "kv_scales.json"
            cal = [sys.executable, "-m", "onnxruntime_genai.models.quantization.kv_cache_calibration", "--model",
                   str(base), "--tokenizer", str(hf), "--out", str(scales), "--quant-type", "int8_per_channel",
                   "--num-seqs", "8"]  # fmt: skip
            log(f"calibrating the int8 KV-cache scales (once): {' '.join(cal[2:])}")
            check(cal, f"ort-genai {config}: the KV-cache calibration")
            steps.append(cal[1:])
            extra = ["--extra_options", "kv_cache_quant_scheme=int8_per_channel", f"kv_cache_scale_file={scales}"]
        # the package's builder, given Gemma 3's RoPE in the flat form it reads (bench/ort_genai_builder.py)
        cmd = [sys.executable, "-m", "cabinlm.bench.ort_genai_builder", "-i", str(hf), "-o", str(tmp), "-p", precision,
               "-e", "cpu", "-c", str(tmp / "hf-cache"), *extra]  # fmt: skip
        log(f"building the ort-genai {config} model (once): {' '.join(cmd[2:])}")
        built = check(cmd, f"ort-genai {config}: the model builder")
        if not (tmp / "genai_config.json").exists():
            shown = "\n".join(f"  | {line}" for line in built.tail[-10:])
            raise BaselineError(f"ort-genai {config}: the model builder exited 0 but wrote no genai_config.json "
                                f"(is {hf} a model it supports?); its output ends:\n{shown}")  # fmt: skip
        steps.append(cmd[1:])
        shutil.rmtree(tmp / "hf-cache", ignore_errors=True)
        steps = [[a.replace(str(tmp), str(out)) for a in step] for step in steps]
        info = {"cmd": steps[-1], "steps": steps, "seconds": round(time.perf_counter() - t, 1)}
        (tmp / "cabinlm_build.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class OrtGenaiEngine(Engine):
    name = "ort-genai"

    def __init__(self, folder: Path, threads: int, config: str, max_length: int):
        try:
            import onnxruntime_genai as og
        except Exception as e:  # noqa: BLE001
            raise BaselineUnavailable(f"onnxruntime-genai does not import ({e}): {INSTALL['ort-genai']}") from e
        self.og = og
        cfg = og.Config(str(folder))
        # eos_token_id: the harness decides when a reply ends (the script's stop ids, as for every engine).
        # With the model's own EOS, ort-genai's search ends on it and leaves it out of the sequence, and
        # the next append_tokens then runs it at a position the sequence does not hold; a plain token id
        # (the last of the vocabulary) that never ends a reply keeps sequence and cache in step.
        vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
        overlay = {"model": {"eos_token_id": vocab - 1,
                             "decoder": {"session_options": {"intra_op_num_threads": threads,
                                                             "inter_op_num_threads": 1}}}}  # fmt: skip
        cfg.overlay(json.dumps(overlay))
        self.model = og.Model(cfg)
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False)
        self.generator = og.Generator(self.model, params)
        self.max_length = max_length
        self._sampled: int | None = None  # chosen by generate_next_token; its forward pass has not run yet
        self.config = {"name": config, "max_length": max_length, "onnxruntime_genai": og.__version__,
                       "built_with": json.loads((folder / "cabinlm_build.json").read_text())["cmd"]}  # fmt: skip

    def _next(self) -> int:
        self.generator.generate_next_token()
        self._sampled = int(self.generator.get_next_tokens()[0])
        return self._sampled

    def feed(self, ids: list[int]) -> int:
        # The token generate_next_token chose last is already in ort-genai's sequence, its forward pass not
        # yet run. The protocol feeds it again at the start of the next prompt (the reply's last token when
        # max_new cut it, or the stop token that starts assistant_suffix), so it is rewound first and the
        # whole prompt is appended in one call. (Letting append_tokens run it first, as ort-genai 0.18 does
        # on its own, leaves the cache one token out of step: the replies then differ from a fresh prefill
        # of the same tokens. With rewind they match transformers token for token.)
        if self._sampled is not None:
            try:
                self.generator.rewind_to(self.generator.token_count() - 1)
            except Exception as e:  # noqa: BLE001
                raise ContextFull(f"ort-genai cannot continue the dialogue at {self.context} tokens (turn 2 onward): "
                                  f"rewind_to failed: {first_line(e)}") from e  # fmt: skip
            self._sampled = None
        try:
            self.generator.append_tokens(ids)
        except Exception as e:  # noqa: BLE001 - ort-genai raises RuntimeError-like errors
            msg = first_line(e)
            if "exceeds max length" in msg:
                raise ContextFull(f"context full at {self.context} tokens: ort-genai append_tokens refuses {len(ids)} "
                                  f"more past max_length {self.max_length} ({msg})") from e  # fmt: skip
            raise ContextFull(f"ort-genai append_tokens failed at {self.context} tokens: {msg}") from e
        self.context += len(ids)
        return self._next()

    def step(self, token: int) -> int:
        # generate_next_token runs the forward pass of the token chosen last, then picks the next one.
        if self.generator.is_done():
            if self.generator.token_count() < self.max_length:
                raise ContextFull(f"the ort-genai generator ended at {self.context} tokens on its own (eos id)")
            raise ContextFull(f"context full at {self.context} tokens: the ort-genai generator is done "
                              f"(max_length {self.max_length}, counting the token it chose last)")  # fmt: skip
        try:
            nxt = self._next()
        except Exception as e:  # noqa: BLE001
            raise ContextFull(f"ort-genai generate_next_token failed at {self.context} tokens "
                              f"(max_length {self.max_length}): {first_line(e)}") from e  # fmt: skip
        self.context += 1
        return nxt
