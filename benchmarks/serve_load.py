"""A short load run of `cabinlm serve` (docs/results.md#serve-under-load): N clients at once, each its
own seat and its own multi-turn conversation, over the OpenAI API with the real `openai` client,
against a server this script starts on a 127.0.0.1 port and stops at the end.

    python benchmarks/serve_load.py BUILD --clients 4 --seconds 180 [--max-tokens 48] [--turns 8]
                                    [--threads 2] [--records FILE]

Each client streams its replies (greedy) and sends the whole history every time, as OpenAI clients
do, so every request but the first of a conversation extends its seat; after --turns exchanges it
starts a new conversation on the same seat (which then starts over: the rebuild path). Bounded:
requests start only during --seconds and stop at --max-requests; every request has a timeout; the
server is stopped (and killed if it does not stop) at the end.

Reports time to first token and whole-reply latency percentiles, decode tokens per second per
client and in total, the error count, and the server's resident memory at start, every 10 s, once
every seat's window has turned over, and at the end (read from /proc; the server is its own process).
--records FILE appends the run as one record (bench/records.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import openai

from cabinlm.bench.provenance import utc_now
from served import server_rss_mb, serving
from cabinlm.bench.records import Recorder, flat
from cabinlm.bench.script import SYSTEM, user_turns




def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=180, help="requests start only within this time")
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--turns", type=int, default=24, help="exchanges per conversation before a new one")
    ap.add_argument("--threads", type=int, default=2, help="the server's ONNX Runtime threads")
    ap.add_argument("--records", type=Path, default=None, help="append the run's record here")
    a = ap.parse_args()

    options = ["--seats", str(a.clients), "--threads", str(a.threads), "--model-name", "m"]
    with serving(a.build, options, "serve_load") as (port, pid):
        run(a, port, pid)


def run(a, port: int, pid: int) -> None:
    utc_start = utc_now()
    load_at_start = os.getloadavg()[0]
    rss = [(0.0, server_rss_mb(pid))]
    records: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop = threading.Event()

    def client(i: int) -> None:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        turns = user_turns(seed=i)
        messages: list[dict] = []
        while not stop.is_set() and time.monotonic() - t0 < a.seconds:
            with lock:
                if len(records) + len(errors) >= a.max_requests:
                    return
            if len(messages) >= 1 + 2 * a.turns:
                messages = []
            if not messages:
                messages = [{"role": "system", "content": SYSTEM}]
            messages.append({"role": "user", "content": next(turns)})
            start = time.monotonic()
            first, text, usage = None, [], None
            try:
                stream = api.chat.completions.create(model="m", messages=messages, max_tokens=a.max_tokens, user=f"client{i}",
                                                     stream=True, stream_options={"include_usage": True})  # fmt: skip
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.monotonic()
                        text.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        usage = chunk.usage
            except openai.OpenAIError as e:
                with lock:
                    errors.append(f"client {i}: {type(e).__name__}: {e}")
                messages = []
                continue
            end = time.monotonic()
            messages.append({"role": "assistant", "content": "".join(text)})
            extra = usage.model_extra["cabinlm"]
            with lock:
                records.append({
                    "client": i, "t": round(start - t0, 3), "ttft_s": round((first or end) - start, 4),
                    "total_s": round(end - start, 4), "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens, "history": extra["history"],
                    "cache_tokens": extra["cache_tokens"], "evicted_tokens": extra["evicted_tokens"],
                })  # fmt: skip

    def sample() -> None:
        while not stop.wait(10):
            rss.append((round(time.monotonic() - t0, 1), server_rss_mb(pid)))
            with lock:
                done, failed = len(records), len(errors)
            print(f"{rss[-1][0]:6.0f} s  {done} requests, {failed} errors, server RSS {rss[-1][1]:.1f} MiB", flush=True)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=a.seconds + 300)
    stop.set()
    wall = time.monotonic() - t0
    rss.append((round(wall, 1), server_rss_mb(pid)))

    ttft = [r["ttft_s"] * 1000 for r in records]
    total = [r["total_s"] * 1000 for r in records]
    extended = [r for r in records if r["history"] == "extended"]
    tokens = sum(r["completion_tokens"] for r in records)
    per_client = [sum(r["completion_tokens"] for r in records if r["client"] == i) / wall for i in range(a.clients)]
    # Each seat's cache buffers are allocated at start but their pages are touched only as the cache
    # fills, so memory climbs until every seat's window has turned over once; from then on it must stay.
    full_at = [min((r["t"] + r["total_s"] for r in records if r["client"] == i and r["evicted_tokens"]), default=None)
               for i in range(a.clients)]  # fmt: skip
    all_full = None if None in full_at else max(full_at)
    rss_full = next((m for t, m in rss if all_full is not None and t >= all_full), None)
    result = {
        "config": {"build": a.build, "clients": a.clients, "seconds": a.seconds, "max_tokens": a.max_tokens,
                   "turns": a.turns, "threads": a.threads},  # fmt: skip
        # this machine is shared: about the core count means the run had the machine to itself
        "loadavg_1m": {"start": load_at_start, "end": os.getloadavg()[0]},
        "requests": len(records),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": round(wall, 1),
        "ttft_ms": {q: round(percentile(ttft, p), 1) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "reply_ms": {q: round(percentile(total, p), 1) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "completion_tokens": tokens,
        "decode_tok_s_total": round(tokens / wall, 2),
        "decode_tok_s_per_client": [round(x, 2) for x in per_client],
        "prompt_tokens_median": {"extended": statistics.median([r["prompt_tokens"] for r in extended]) if extended else None,
                                 "rebuilt": statistics.median([r["prompt_tokens"] for r in records if r["history"] == "rebuilt"] or [0])},  # fmt: skip
        "windows_full_at_s": None if all_full is None else round(all_full, 1),
        "rss_mb": {"start": round(rss[0][1], 1), "windows_full": None if rss_full is None else round(rss_full, 1),
                   "end": round(rss[-1][1], 1), "max": round(max(m for _, m in rss), 1)},  # fmt: skip
        "rss_samples": rss,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))
    rec = Recorder("benchmarks/serve_load.py")
    params = {k: v for k, v in result["config"].items() if k not in ("build", "threads")}
    figures = {k: v for k, v in flat(result).items() if not k.startswith(("config.", "loadavg_1m."))}
    rec.add(params, figures, utc_start=utc_start, loadavg_start=load_at_start, artifact=a.build, threads=a.threads)
    rec.write_to(a.records)


if __name__ == "__main__":
    main()
