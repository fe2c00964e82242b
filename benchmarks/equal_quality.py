"""Perplexity beside decode and prefill speed, one row per configuration of cabinlm and of each peer, on
the same held-out token ids, so that a faster configuration that loses quality shows as such
(docs/results.md#kv-and-weight-formats, and #gemma-3 for Gemma 3 builds).

    python benchmarks/equal_quality.py ART [ART ...] [--text tests/data/prose.txt] [--tokens 1024] \
        [--peers hf,llama.cpp,ort-genai] [--threads 2] [--model GGUF] [--speed JSON ...] [--records FILE]

    # perplexity and speed of the demo build and every peer configuration:
    cabinlm bench out/smollm2-135m-build-cpu --tokens 3000 --threads 2 --baseline llama.cpp --json > speed_llamacpp.json
    cabinlm bench out/smollm2-135m-build-cpu --tokens 3000 --threads 2 --baseline ort-genai --json > speed_ortgenai.json
    python benchmarks/equal_quality.py out/smollm2-135m-build-cpu --speed speed_llamacpp.json speed_ortgenai.json \
        --records quality.jsonl

    # the small check: perplexity only, every peer configuration
    python benchmarks/equal_quality.py out/smollm2-135m-build-cpu --tokens 256 --threads 2

--records FILE appends one record per row: the configuration, its perplexity and the speed merged in
(bench/records.py).

The text is tokenized once, with the first artifact's tokenizer (every other artifact's tokenizer, and
the peers' own, the float32 save's tokenizer.json, must give the same ids, or the script stops), and
its first --tokens ids go to every engine: tokens 0..N-2 are fed, and the logits at position i score
token i+1 (N-1 scored tokens each), in float64 through one log-softmax (`nll` below).

    cabinlm      runtime.perplexity.chunked_perplexity(Decoder(ART)): the artifact's own settings (a fused
                 cpu build's int8 activations, its KV dtype), prefill-sized chunks, no pinned tokens. Its
                 cache then holds sink + window tokens (the pinned slots stay empty); past that, window
                 tokens are evicted, and the output says how many (the peers always attend to everything).
    hf           transformers, float32 weights de-quantized from the GGUF (the float32 reference): one
                 forward pass over all the ids.
    llama.cpp    the bench's own context (bench/peers.py LlamaCppEngine: n_batch 512, the configuration's
                 KV type and flash-attention setting), fed with a batch that asks logits for every token.
    ort-genai    the bench's own generator (bench/peers.py OrtGenaiEngine) on the model its builder made
                 (built once if missing); append_tokens(ids) once, then get_output("logits") holds the
                 logits of every appended token.

--peers: a peer's name runs each of its configurations (bench/catalog.py CONFIGS), NAME:CONFIG one of
them, an empty string none. Peers load the model the artifact was exported from (its manifest), as
`cabinlm bench` does; --model names another GGUF.

--speed: `cabinlm bench ... --json` outputs. Each configuration's median decode and prefill tok/s go
beside its perplexity (several files: " / " between the runs): cabinlm's row by the bench's artifact
path, a peer's by engine, configuration and model file; cabinlm's figures over a peer's span (the
bench's same_span) are listed under the table. Each figure is the bench's median over the tokens that
engine processed: a peer stops when its context is full (--json keeps each run's token count and why
it stopped; a stop other than a full context is listed under the table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from cabinlm.bench.catalog import BASELINES, CONFIGS, BaselineError, available
from cabinlm.bench.peers import HFEngine, LlamaCppEngine, OrtGenaiEngine, build_ort_genai
from cabinlm.bench.prepare import prepare, resolve_model
from cabinlm.bench.protocol import Script
from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
from cabinlm.bench.runner import model_for_baselines
from cabinlm.contract.manifest import load_manifest
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.perplexity import chunked_perplexity
from cabinlm.contract.engines.fused import FusedSettings

# MatMulNBits accuracy_level -> the activations' type in its products (ONNX Runtime's contrib op docs).
ACTIVATIONS = {0: "float32", 1: "float32", 2: "float16", 3: "bfloat16", 4: "int8"}


@dataclass
class Row:
    configuration: str
    engine: str
    weights: str
    kv: str
    tokens: int  # ids given to the engine; tokens - 1 of them scored
    ppl: float
    nll_mean: float
    evicted: int = 0  # cabinlm only: window tokens overwritten while the ids went through
    seconds: float = 0.0
    model: str = ""  # the GGUF a peer loaded (matches a speed JSON's baseline); the artifact for cabinlm
    speed: list[dict] = field(default_factory=list)  # one per matching speed JSON entry


def nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(n, vocab) logits of positions 0..n-1 and (n + 1,) ids -> (n,) float64 NLL of ids[i + 1] given
    position i: a log-softmax in float64, each row shifted by its maximum first."""
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or len(ids) != len(z) + 1:
        raise ValueError(f"logits {z.shape} do not score ids of length {len(ids)} (want ({len(ids) - 1}, vocab))")
    z = z - z.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(z)), np.asarray(ids[1:], dtype=np.int64)]


def peer_row(engine: str, config: str, model: Path, weights: str, kv: str, ids: np.ndarray, logits: np.ndarray,
             seconds: float) -> Row:  # fmt: skip
    per_token = nll(logits, ids)
    mean = float(per_token.mean())
    return Row(config, engine, weights, kv, len(ids), float(np.exp(mean)), mean, seconds=seconds, model=str(model))


# --------------------------------------------------------------------------------------------------
# The engines: each gives the (len(ids) - 1, vocab) logits of the fed tokens


def tokenizer_of(folder: Path) -> Tokenizer:
    m = load_manifest(folder)
    return Tokenizer(folder / m.files["tokenizer"].path)


def run_cabinlm(art: Path, ids: np.ndarray, threads: int) -> Row:
    m = load_manifest(art)
    lay = m.cache
    t = time.perf_counter()
    dec = Decoder(art, threads=threads)
    # chunked_perplexity scores with runtime.perplexity.token_nll: the same float64 log-softmax as nll().
    res = chunked_perplexity(dec, ids)
    seconds = time.perf_counter() - t
    w = m.quality.weights or {}
    weights = m.weights
    if w:
        weights += f" ({w.get('imported', 0)} imported, {w.get('quantized', 0)} quantized; head {w.get('head', '?')})"
    fused = m.runtime_spec.facts_as(FusedSettings)
    if fused is not None:
        act = ACTIVATIONS.get(fused.accuracy_level, "?")
        q4_1 = "cabinlm's Q4_1 matmul" if fused.matmul_kernel == "cabinlm" else f"Q4_1 minimums {fused.minimums}"
        weights += f"; fused, {q4_1}, {act} activations (level {fused.accuracy_level})"
    kv = f"{lay.kv_dtype.value}; sink {lay.sink} + window {lay.window} (+ pinned {lay.pinned}, unused here)"
    return Row(str(art), "cabinlm", weights, kv, int(res.tokens), res.ppl, res.nll_mean, int(dec.cache.evicted),
               seconds, str(art.resolve()))  # fmt: skip


def run_hf(path: Path, hf: Path, ids: np.ndarray, threads: int) -> Row:
    t = time.perf_counter()
    engine = HFEngine(hf, Script.load(hf), threads, "fp32", None)
    try:
        torch = engine.torch
        with torch.inference_mode():
            out = engine.model(input_ids=torch.tensor([ids[:-1].tolist()]), use_cache=False)
        logits = out.logits[0].float().numpy()
    finally:
        engine.close()
    c = engine.config
    return peer_row("hf", "fp32", path, c["weights"], f"{c['kv'].split()[0]} (one pass, no cache)", ids, logits,
                    time.perf_counter() - t)  # fmt: skip


def run_llama_cpp(path: Path, config: str, ids: np.ndarray, threads: int) -> Row:
    import gguf

    fed = ids[:-1]
    t = time.perf_counter()
    engine = LlamaCppEngine(path, threads, config, len(fed))
    L = engine.L
    logits = np.empty((len(fed), engine.n_vocab), dtype=np.float32)
    # The bench's context, not llama_cpp.Llama(logits_all=True): Llama(flash_attn=False) turns flash
    # attention off, where the bench's `gguf` context leaves it on auto (on, on this CPU build), and the
    # two give different logits (256 tokens of prose: perplexity 77.6 off, 81.4 on).
    # The engine's feed() asks logits of the last token only (llama_batch_get_one); this batch asks them
    # of every token: (n_tokens,) token, pos, n_seq_id, logits flags, and seq_id[j][0] = sequence 0.
    batch = L.llama_batch_init(engine.n_batch, 0, 1)
    try:
        for start in range(0, len(fed), engine.n_batch):
            chunk = fed[start : start + engine.n_batch]
            batch.n_tokens = len(chunk)
            for j, token in enumerate(chunk):
                batch.token[j] = int(token)
                batch.pos[j] = start + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = 1
            rc = L.llama_decode(engine.ctx, batch)
            if rc != 0:
                raise BaselineError(f"llama.cpp ({config}): llama_decode returned {rc} at token {start} of {len(fed)} "
                                    f"(n_ctx {engine.n_ctx}) [{'; '.join(list(engine.log)[-3:])}]")  # fmt: skip
            ptr = L.llama_get_logits(engine.ctx)  # (outputs of this batch, n_vocab), in batch order
            logits[start : start + len(chunk)] = np.ctypeslib.as_array(ptr, shape=(len(chunk), engine.n_vocab))
        buf = (engine.ctypes.c_char * 32)()  # the file's own type, as llama.cpp read it (3: MOSTLY_Q4_1)
        found = L.llama_model_meta_val_str(engine.model, b"general.file_type", buf, 32) > 0
        ftype = buf.value.decode() if found else ""
    finally:
        L.llama_batch_free(batch)
        engine.close()
    c = engine.config
    fa = " (flash attention on)" if config == "gguf-kv8" else " (flash attention auto)"  # as peers.py sets it
    weights = c["weights"] + (f" ({gguf.LlamaFileType(int(ftype)).name})" if ftype.isdigit() else "")
    return peer_row("llama.cpp", config, path, weights, f"{c['kv']}{fa}", ids, logits, time.perf_counter() - t)


def ort_genai_graph(folder: Path) -> tuple[str, str]:
    """Weights and KV of an ort-genai model, read from its graph (the structure only, not the weights)."""
    import onnx

    g = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    blocks = [n for n in g.node if n.op_type == "MatMulNBits"]
    if blocks:
        attrs = {a.name: a.i for a in blocks[0].attribute}
        level = attrs.get("accuracy_level", 0)
        head = "int4" if any("lm_head" in n.name for n in blocks) else "float"
        table = "int4" if any(n.op_type == "GatherBlockQuantized" for n in g.node) else "float"
        weights = (f"int{attrs.get('bits', 4)} blocks of {attrs.get('block_size', '?')} x{len(blocks)} (head {head}, "
                   f"table {table}), re-quantized from float32; {ACTIVATIONS.get(level, '?')} activations "
                   f"(level {level})")  # fmt: skip
    else:
        weights = "float32 (de-quantized from the GGUF)"
    past = [i for i in g.input if i.name.startswith("past_key_values.")]
    kv = onnx.TensorProto.DataType.Name(past[0].type.tensor_type.elem_type).lower() if past else "?"
    kv = {"float": "float32", "float16": "float16"}.get(kv, kv)
    return weights, kv


def run_ort_genai(path: Path, hf: Path, config: str, ids: np.ndarray, threads: int) -> Row:
    fed = ids[:-1]
    folder = build_ort_genai(path, hf, config, log=lambda s: print(s, file=sys.stderr, flush=True))
    t = time.perf_counter()
    engine = OrtGenaiEngine(folder, threads, config, len(fed))
    engine.generator.append_tokens(fed.astype(np.int32))
    logits = engine.generator.get_output("logits")  # (1, appended tokens, vocab)
    if logits.shape[:2] != (1, len(fed)):
        raise BaselineError(f"ort-genai ({config}): logits {logits.shape} after appending {len(fed)} tokens; "
                            f"expected (1, {len(fed)}, vocab)")  # fmt: skip
    seconds = time.perf_counter() - t
    weights, kv = ort_genai_graph(folder)
    if config == "int4-kv8":
        kv += " per channel (calibrated scales)"
    return peer_row("ort-genai", config, path, weights, kv, ids, logits[0], seconds)


# --------------------------------------------------------------------------------------------------
# Speed from `cabinlm bench --json`


def merge_speed(rows: list[Row], files: list[str]) -> list[str]:
    """Attach each speed figure to its row; the notes to print under the table."""
    notes: list[str] = []
    by_art = {r.model: r for r in rows if r.engine == "cabinlm"}
    plain: dict[str, Row] = {}  # an artifact's runs without drafting: a row of their own, after its row
    by_peer = {(r.engine, r.configuration, r.model): r for r in rows if r.engine != "cabinlm"}
    for f in files:
        d = json.loads(Path(f).read_text())
        art = str(Path(d["config"].get("artifact", "")).resolve())
        entry = lambda s, **kw: {"file": f, "tokens": s["tokens"], "decode_tok_s": s["decode_tok_s"],  # noqa: E731
                                 "decode_tok_s_overall": s.get("decode_tok_s_overall"),
                                 "prefill_tok_s": s["prefill_tok_s"], "stopped": s["stopped"], **kw}  # fmt: skip
        if art in by_art:
            row = by_art[art]
            if d["config"].get("speculative") is False:  # cabinlm bench --no-speculative
                if art not in plain:
                    plain[art] = dataclasses.replace(row, configuration=f"{row.configuration} (--no-speculative)",
                                                     speed=[])  # fmt: skip
                    rows.insert(rows.index(row) + 1, plain[art])
                row = plain[art]
            row.speed.append(entry(d, evicted=d["evicted_tokens"]))
            for peer, s in d.get("same_span", {}).items():
                notes.append(f"{row.configuration} over {peer}'s span ({s['tokens']} tokens, {f}): decode "
                             f"{s['decode_tok_s']} tok/s (median), {s.get('decode_tok_s_overall')} tok/s (overall), "
                             f"prefill {s['prefill_tok_s']} tok/s")  # fmt: skip
        else:
            notes.append(f"{f}: cabinlm ran {d['config'].get('artifact')}, not an artifact given here; left out")
        for b in d.get("baselines", {}).values():
            for s in [b, *b["config"].get("others", [])]:
                if "engine" not in s:  # a configuration that failed in the bench: {"config", "error"}
                    notes.append(f"{f}: {b['engine']} {s['config']} failed in the bench: {s['error']}")
                    continue
                c = s["config"]
                key = (s["engine"], c.get("name"), str(Path(c.get("model", "")).resolve()))
                if key not in by_peer:
                    notes.append(f"{f}: {s['engine']} {c.get('name')} on {c.get('model')} has no perplexity row; "
                                 "left out")  # fmt: skip
                    continue
                by_peer[key].speed.append(entry(s))
                # A full context ends every bounded peer's run (the bench counts it as done: baselines.py
                # _ran_its_course); any other stop cut the figures short, and is said.
                if s["stopped"] != "done" and not s["stopped"].startswith(("context full", "reached", "time limit")):
                    notes.append(f"{s['engine']} {c.get('name')} speed over {s['tokens']} tokens ({f}): {s['stopped']}")
    return notes


# --------------------------------------------------------------------------------------------------


def peer_configs(spec: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, config = item.partition(":")
        if name not in BASELINES:
            raise SystemExit(f"--peers: unknown peer {name!r}; known: {', '.join(BASELINES)}")
        if config and config not in CONFIGS[name]:
            raise SystemExit(f"--peers: {name} has no configuration {config!r}; it has: {', '.join(CONFIGS[name])}")
        out += [(name, c) for c in ([config] if config else CONFIGS[name])]
    return out


def run_peers(peers: list[tuple[str, str]], path: Path, hf: Path, ids: np.ndarray, threads: int,
              log: Callable[[str], None]) -> tuple[list[Row], list[str]]:  # fmt: skip
    """Each peer configuration's row; a peer that is not installed, or a configuration that fails, is a
    note (the others still run)."""
    rows: list[Row] = []
    notes: list[str] = []
    for name, config in peers:
        reason = available(name)
        if reason:
            notes.append(f"{name} {config}: not run: {reason}")
            log(notes[-1])
            continue
        try:
            if name == "hf":
                rows.append(run_hf(path, hf, ids, threads))
            elif name == "llama.cpp":
                rows.append(run_llama_cpp(path, config, ids, threads))
            else:
                rows.append(run_ort_genai(path, hf, config, ids, threads))
        except BaselineError as e:
            notes.append(f"{name} {config}: failed: {str(e).splitlines()[0]}")
            log(notes[-1])
            continue
        log(f"{name} {config}: perplexity {rows[-1].ppl:.4f} ({rows[-1].seconds:.1f} s)")
    return rows, notes


def report(rows: list[Row], notes: list[str], text: Path, n: int, threads: int) -> Row | None:
    """Print the markdown table (and what stands above and below it); the float32 reference row."""
    ref = next((r for r in rows if r.engine == "hf"), None)
    ref = ref or next((r for r in rows if r.engine == "cabinlm" and load_manifest(r.model).weights == "fp32"),
                      None)  # fmt: skip
    print(f"\n{text}: the first {n} tokens ({n - 1} scored), one tokenization for every engine; {threads} threads.")
    for r in rows:
        if r.engine == "cabinlm":
            lay = load_manifest(r.model).cache
            state = (f"{r.evicted} window tokens evicted: its perplexity is over a rolling window of "
                     f"{lay.sink} + {lay.window} tokens, the peers' over the whole span" if r.evicted else
                     f"dense (nothing evicted: {n - 1} fed tokens fit its {lay.sink} + {lay.window} "
                     "unpinned slots), like the peers")  # fmt: skip
            print(f"cabinlm {r.configuration}: {state}.")
    if ref:
        print(f"Δ against {ref.engine} {ref.configuration} (float32 weights).")
    else:
        print("Δ: no float32 reference ran (hf, or a cabinlm fp32 export).")
    print("\n| configuration | engine | weights | KV | perplexity | Δ vs float32 | decode tok/s (median) | "
          "decode tok/s (overall) | prefill tok/s |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    runs = lambda r, k: " / ".join(f"{s[k]:g}" if s[k] is not None else "n/a" for s in r.speed) or "—"  # noqa: E731
    for r in rows:
        delta = "—" if ref is None or r is ref else f"{(r.ppl / ref.ppl - 1) * 100:+.2f}%"
        print(f"| {r.configuration} | {r.engine} | {r.weights} | {r.kv} | {r.ppl:.4f} | {delta} | "
              f"{runs(r, 'decode_tok_s')} | {runs(r, 'decode_tok_s_overall')} | {runs(r, 'prefill_tok_s')} |")  # fmt: skip
    if notes:
        print()
        for note in notes:
            print(f"- {note}")
    return ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", type=Path, help="cabinlm export or build folders")
    ap.add_argument("--text", type=Path, default=Path("tests/data/prose.txt"), help="the held-out text")
    ap.add_argument("--tokens", type=int, default=1024, help="token ids taken from the text's start")
    ap.add_argument("--peers", default="hf,llama.cpp,ort-genai", help="NAME or NAME:CONFIG, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="the GGUF the peers load (default: the first artifact's source)")
    ap.add_argument("--speed", nargs="+", default=[], help="`cabinlm bench --json` outputs to merge")
    ap.add_argument("--records", type=Path, default=None, help="append one record per row here")
    a = ap.parse_args()
    start, load = utc_now(), load_average()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    peers = peer_configs(a.peers)

    text = a.text.read_text(encoding="utf-8")
    ids = np.asarray(tokenizer_of(a.artifacts[0]).encode(text, add_special_tokens=True)[: a.tokens], dtype=np.int64)
    if len(ids) < a.tokens:
        raise SystemExit(f"{a.text} holds {len(ids)} tokens, fewer than --tokens {a.tokens}")
    # The same ids for every engine: each other tokenizer must agree with the first.
    for art in a.artifacts[1:]:
        if tokenizer_of(art).encode(text, add_special_tokens=True)[: a.tokens] != ids.tolist():
            raise SystemExit(f"{art}'s tokenizer splits {a.text} differently from {a.artifacts[0]}'s")

    rows: list[Row] = []
    for art in a.artifacts:
        rows.append(run_cabinlm(art, ids, a.threads))
        log(f"cabinlm {art}: perplexity {rows[-1].ppl:.4f} ({rows[-1].seconds:.1f} s)")
    notes: list[str] = []
    path = None
    if peers:
        path = resolve_model(a.model or model_for_baselines(a.artifacts[0]))
        hf = prepare(path, log)
        if Tokenizer(hf / "tokenizer.json").encode(text, add_special_tokens=True)[: a.tokens] != ids.tolist():
            raise SystemExit(f"the peers' tokenizer ({hf}) splits {a.text} differently from {a.artifacts[0]}'s")
        peer_rows, notes = run_peers(peers, path, hf, ids, a.threads, log)
        rows += peer_rows
    notes = merge_speed(rows, a.speed) + notes

    ref = report(rows, notes, a.text, len(ids), a.threads)
    rec = Recorder("benchmarks/equal_quality.py")
    for r in rows:
        cabin = r.engine == "cabinlm"
        params = {"runner": r.engine, "configuration": Path(r.configuration).name if cabin else r.configuration,
                  "weights": r.weights, "kv": r.kv, "text": a.text.name, "tokens": len(ids)}  # fmt: skip
        figures = {"ppl": r.ppl, "nll_mean": r.nll_mean, "evicted": r.evicted, "seconds": r.seconds,
                   "ppl_over_reference": r.ppl / ref.ppl if ref else None}  # fmt: skip
        for k in ("decode_tok_s", "decode_tok_s_overall", "prefill_tok_s"):  # the first merged speed run's
            figures[k] = r.speed[0].get(k) if r.speed else None
        rec.add(params, figures, utc_start=start, loadavg_start=load, artifact=r.model if cabin else None,
                engine=None if cabin else r.engine, threads=a.threads)  # fmt: skip
    rec.write_to(a.records)


if __name__ == "__main__":
    main()
