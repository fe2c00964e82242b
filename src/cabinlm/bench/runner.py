"""`cabinlm bench`: the scripted dialogue through cabinlm's own runtime, on the protocol every
baseline runs (bench/protocol.py: `dialogue` and `fixed_context`), so the figures compare like
with like. Only numpy, onnxruntime and tokenizers are imported here."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from cabinlm.bench import protocol
from cabinlm.bench.script import SYSTEM
from cabinlm.bench.trace import Trace, summarize, truncate
from cabinlm.contract.errors import CabinlmError
from cabinlm.contract.engines.fused import FusedSettings

if TYPE_CHECKING:
    from cabinlm.runtime.assembly import Runtime


class CabinlmEngine(protocol.Engine):
    """The runtime's first seat behind the baselines' engine interface: greedy, the system prompt
    pinned (as `cabinlm chat` pins it), logits for the last token only during prefill, drafting as
    the runtime decided (runtime/assembly.py: the caller's choice, or the backend's default)."""

    name = "cabinlm"

    def __init__(self, runtime: Runtime, system: list[int], stop_ids: Iterable[int] = ()):
        """system: the rendered system prompt, pinned when the first prompt starts with it."""
        from cabinlm.runtime.sampler import Sampler

        self.dec = runtime.decoders[0]
        self.system = list(system)
        self.drafting = runtime.new_drafting()
        self.drafts = {False: [0, 0], True: [0, 0]}  # (drafted, accepted) before / after the window turned over
        self.sampler = Sampler(temperature=0.0)
        self.stop_ids = set(stop_ids)
        lay, m = self.dec.layout, runtime.manifest
        fused = m.runtime_spec.facts_as(FusedSettings)
        self.config = {
            "name": "cabinlm",
            "artifact": str(runtime.config.artifact),
            "weights": m.weights,
            "backend": m.runtime_spec.backend.value,
            "attention_kernel": fused.attention_kernel if fused else None,
            "matmul_kernel": fused.matmul_kernel if fused else None,
            "device": self.dec.device,
            "kv": lay.kv_dtype.value,
            "sink": lay.sink,
            "pinned": lay.pinned,
            "window": lay.window,
            "slots": lay.slots,
            "chunk": lay.chunk,
            "speculative": runtime.drafts,
            "onnxruntime": __import__("onnxruntime").__version__,
        }

    @property
    def context(self) -> int:
        return self.dec.cache.length

    def feed(self, ids: list[int]) -> int:
        ids = list(ids)
        self.drafting.observe(ids)
        if self.dec.cache.seen == 0 and self.system and ids[: len(self.system)] == self.system:
            logits = self.dec.feed(np.asarray(self.system), pin=True)  # the system prompt stays, as in chat
            ids = ids[len(self.system) :]
            if not ids:
                return int(np.argmax(logits))
        return int(np.argmax(self.dec.feed(np.asarray(ids))))

    def step(self, token: int) -> int:
        return int(np.argmax(self.dec.step(np.array([token]))[0]))

    def advance(self, token: int, budget: int) -> list[int]:
        from cabinlm.runtime.reply import advance

        turned = self.dec.cache.evicted > 0  # the window has turned over: a drafter's hard part
        drafted, accepted = self.drafting.drafted, self.drafting.accepted
        chosen = advance(self.dec, self.sampler, token, budget, self.stop_ids, self.drafting)
        phase = self.drafts[turned]
        phase[0] += self.drafting.drafted - drafted
        phase[1] += self.drafting.accepted - accepted
        return chosen


def open_bench_runtime(folder: Path, threads: int, *, system: str, speculative: bool | None,
                       adapter: str | None = None) -> Runtime:  # fmt: skip
    """The artifact opened for one bench engine, as chat opens it (runtime/assembly.py: the same
    checks, the system prompt against the pinned slots included), one seat, no checksums (the load
    is timed)."""
    from cabinlm.runtime.assembly import RuntimeConfig, open_runtime

    return open_runtime(RuntimeConfig(folder, threads=threads, system=system, system_option=None,
                                      speculative=speculative, verify=False, adapter=adapter))  # fmt: skip


def script_for(runtime: Runtime) -> protocol.Script:
    """The dialogue script rendered with the artifact's own tokenizer and chat-template pieces (the
    Dialogue's renderer, runtime/template.py)."""
    from cabinlm.runtime.template import Template

    m, tok = runtime.manifest, runtime.tokenizer
    template = Template(tok, m.chat)
    return protocol.Script(system=template.start(SYSTEM), assistant_suffix=template.closing(),
                           stop_ids=set(m.stop_ids), max_positions=m.model.max_positions, _tok=tok,
                           _chat=dataclasses.asdict(m.chat))  # fmt: skip


def run_cabinlm(
    folder: str | Path,
    *,
    tokens: int,
    threads: int,
    max_new: int = 128,
    seed: int = 0,
    time_limit_s: float = 3600,
    speculative: bool | None = None,
    adapter: str | None = None,
    log: Callable[[str], None] = lambda s: None,
    on_reply: Callable[[int, str], None] | None = None,
) -> Trace:
    """The scripted dialogue of `tokens` tokens through the runtime, in this process (speculative:
    drafting on or off; None: as chat decides, runtime/speculative.drafting_by_default)."""
    t = time.perf_counter()
    runtime = open_bench_runtime(Path(folder), threads, system=SYSTEM, speculative=speculative, adapter=adapter)
    load_s = time.perf_counter() - t
    script = script_for(runtime)
    engine = CabinlmEngine(runtime, script.system, script.stop_ids)
    trace = protocol.dialogue(engine, script, tokens=tokens, max_new=max_new, seed=seed, time_limit_s=time_limit_s,
                        log=log, on_reply=on_reply)  # fmt: skip
    trace.load_s = round(load_s, 3)
    trace.evicted_tokens = int(engine.dec.cache.evicted)
    trace.config.update(threads=threads, loadavg_1m=round(os.getloadavg()[0], 2))
    if adapter is not None:
        trace.config["adapter"] = adapter
    if engine.drafting.drafts:
        (db, ab), (da, aa) = engine.drafts[False], engine.drafts[True]
        trace.config.update(drafted=engine.drafting.drafted, accepted=engine.drafting.accepted,
                            drafted_before_turnover=db, accepted_before_turnover=ab,
                            drafted_after_turnover=da, accepted_after_turnover=aa)  # fmt: skip
    return trace


def fixed_context_cabinlm(folder: str | Path, *, threads: int, decode: int = 128, context: int | None = None) -> Trace:
    """Fill the cache (`context` tokens; default: every slot) and decode `decode` tokens, each timed."""
    runtime = open_bench_runtime(Path(folder), threads, system="", speculative=False)  # one token per timed step
    script = script_for(runtime)
    engine = CabinlmEngine(runtime, [])
    context = engine.dec.layout.slots if context is None else context
    trace = protocol.fixed_context(engine, script, context=context, decode=decode)
    trace.evicted_tokens = int(engine.dec.cache.evicted)
    trace.config.update(threads=threads, loadavg_1m=round(os.getloadavg()[0], 2))
    return trace


def model_for_baselines(folder: Path) -> str:
    """The model file the baselines load: the artifact's source (a built-in name, a .gguf, a folder)."""
    from cabinlm.contract.manifest import load_manifest

    source = load_manifest(folder).model.source
    if not source:
        raise CabinlmError(f"{folder}: the manifest does not say which model it was exported from; pass --model")
    return source


def report(summary: dict) -> list[str]:
    """Human-readable lines for one summary."""
    s = summary
    c = s.get("config") or {}
    fmt = lambda v, unit="": "n/a" if v is None else f"{v}{unit}"  # noqa: E731
    engine = f"{s['engine']} (adapter {c['adapter']})" if c.get("adapter") else s["engine"]
    lines = [
        f"{engine}: {s['tokens']} tokens in {s['turns']} turns ({s['decoded_tokens']} decoded), stopped: {s['stopped']}",
        f"  decode {fmt(s['decode_tok_s_overall'])} tok/s overall, {fmt(s['decode_tok_s_last_1k_overall'])} over the last "
        f"1k decoded ({fmt(s['decode_tok_s'])} median per token)   prefill {fmt(s['prefill_tok_s'])} tok/s",
        f"  per-token latency p50 {fmt(s['latency_ms_p50'], ' ms')}  p99 {fmt(s['latency_ms_p99'], ' ms')}  "
        f"first 1k {fmt(s['latency_ms_first_1k'], ' ms')}  last 1k {fmt(s['latency_ms_last_1k'], ' ms')}",
        f"  memory {fmt(s['rss_mb_start'], ' MiB')} -> {fmt(s['rss_mb_end'], ' MiB')}  "
        f"slope {fmt(s['rss_mb_slope_per_1k'], ' MiB / 1k tokens')}   evicted {s['evicted_tokens']} tokens",
    ]
    if "drafted_after_turnover" in c:
        rate = lambda a, d: f"{a}/{d}" + (f" ({a / d:.0%})" if d else "")  # noqa: E731
        lines.append(f"  drafts accepted: {rate(c['accepted_before_turnover'], c['drafted_before_turnover'])} while the "
                     f"window filled, {rate(c['accepted_after_turnover'], c['drafted_after_turnover'])} after it turned over")
    return lines


def plot(traces: list[Trace], path: str | Path, title: str = "") -> Path:
    """Per-token latency and process memory against tokens processed, one line per engine."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CabinlmError("--plot needs matplotlib: pip install 'cabinlm[bench]' (or pip install matplotlib)") from e
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for t in traces:
        label = t.engine if t.engine == "cabinlm" else f"{t.engine} ({t.config.get('name', '')})"
        # x: tokens processed when each decoded token was produced (prefills advance it in jumps)
        xs = _decode_positions(t)
        ms = np.asarray(t.decode_ms)
        if len(ms):
            k = max(1, len(ms) // 400)  # a rolling median keeps the line readable over 100k tokens
            med = np.array([np.median(ms[i : i + k]) for i in range(0, len(ms), k)])
            ax1.plot(xs[::k][: len(med)], med, label=label, lw=1.2)
        rss = np.asarray(t.rss).reshape(-1, 2)
        if len(rss):
            ax2.plot(rss[:, 0], rss[:, 1], label=label, lw=1.2)
        if t.stopped != "done" and len(rss):
            ax2.annotate("stopped", (rss[-1, 0], rss[-1, 1]), fontsize=8)
    ax1.set_ylabel("decode latency per token (ms)")
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("process memory, RSS (MiB)")
    ax2.set_xlabel("tokens processed (prompts + replies)")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _decode_positions(t: Trace) -> np.ndarray:
    """The running token count at each decoded token, rebuilt from the trace (prefills then decodes
    per turn are interleaved; decode_context is the engine's fill, which saturates for cabinlm)."""
    # Approximation good to one reply: spread prefills evenly between decoded tokens.
    n = len(t.decode_ms)
    if n == 0:
        return np.zeros(0)
    return np.linspace(0, t.tokens, n)


def summaries(trace: Trace, baseline_traces: list[Trace]) -> dict:
    """cabinlm's summary, each baseline's, and, for a baseline that stopped early (its context
    full), cabinlm's summary over the same span: the same prompts and replies at the same cache
    fill, since cabinlm attends only to the slots in use."""
    out = summarize(trace)
    if baseline_traces:
        out["baseline"] = summarize(baseline_traces[0]) if len(baseline_traces) == 1 else None
        out["baselines"] = {b.engine: summarize(b) for b in baseline_traces}
        out["same_span"] = {b.engine: summarize(truncate(trace, len(b.decode_ms), len(b.prefill)))
                            for b in baseline_traces if b.tokens < trace.tokens}  # fmt: skip
    return out
