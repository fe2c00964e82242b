"""Seats at once against `cabinlm serve`, as issue 35 measured them: a server with --seats 4 on a
free loopback port, then one openai client alone and then N at once, each its own seat, streamed
greedy replies of --max-tokens, --rounds requests per client (each sending its history, as OpenAI
clients do). Prints one JSON line per phase: completion tokens over the phase's wall time, every
request's time to first token, the 1-minute load average.

    python benchmarks/serve_seats.py out/smollm2-135m-build-cpu --clients 4 [--python PY] [-- SERVE_ARGS]

--python runs the server with another interpreter (e.g. a wrapper that puts an older checkout on
PYTHONPATH, to measure before and after on one machine)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

PROMPTS = ["Tell me about the route to the airport.", "What is the weather like tonight?",
           "Suggest a song for a long drive.", "How do I check the tyre pressure?"]  # fmt: skip


def phase(url: str, clients: int, rounds: int, max_tokens: int, first: int) -> dict:
    import openai

    done: dict[int, tuple[int, list[float]]] = {}

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        tokens, ttft, messages = 0, [], []
        for r in range(rounds):
            t0, first_s, text, count = time.perf_counter(), None, [], 0
            messages.append({"role": "user", "content": PROMPTS[(i + r) % len(PROMPTS)]})
            for chunk in c.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                                   user=f"seat{first + i}", stream=True,
                                                   stream_options={"include_usage": True}):  # fmt: skip
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    first_s = first_s if first_s is not None else time.perf_counter() - t0
                if chunk.usage is not None:
                    count = chunk.usage.completion_tokens
            messages.append({"role": "assistant", "content": "".join(text)})
            tokens += count
            ttft.append(first_s)
        done[i] = (tokens, ttft)

    load = open("/proc/loadavg").read().split()[0]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    total = sum(v[0] for v in done.values())
    return {"clients": clients, "completion_tokens": total, "wall_s": round(wall, 2), "tok_s": round(total / wall, 1),
            "ttft_ms": sorted(round(x * 1e3) for v in done.values() for x in v[1] if x is not None), "load1": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([a.python, "-m", "cabinlm", "serve", a.artifact, "--host", "127.0.0.1", "--port", str(port),
                               "--seats", str(max(4, a.clients)), "--model-name", "m", *a.serve_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.3)
        print(json.dumps(phase(url, 1, a.rounds, a.max_tokens, first=0)), flush=True)
        req = urllib.request.Request(f"{url}/v1/seats/seat0", method="DELETE")  # the lone client's seat, freed
        urllib.request.urlopen(req, timeout=30)
        print(json.dumps(phase(url, a.clients, a.rounds, a.max_tokens, first=0)), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
