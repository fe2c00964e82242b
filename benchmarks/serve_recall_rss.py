"""`cabinlm serve` with the recall region active over hundreds of turns (docs/results.md#recall): the
server's resident memory against the turn, two seats each with its own archive, over the OpenAI API.

    python benchmarks/serve_recall_rss.py BUILD [--turns 200] [--max-tokens 24] [--archive-mb 0.04]
                                          [--threads 1] [--records FILE]

BUILD is a build of an artifact exported with --recall R. The script starts `cabinlm serve BUILD
--seats 2 --recall-archive-mb MB` on a 127.0.0.1 port (stopped, or killed, at the end), and two
clients, the driver and a passenger, take turns: each sends its whole history every time (so every
request extends its seat) with a user message from the scripted car dialogue (bench/script.py, one
seed per seat). A small --archive-mb makes each archive reach its bound and drop its oldest messages
within the run, so the memory measured is that of an archive that has stopped growing.

Reports the server's RSS (from /proc) after every turn, how many turns' usage.cabinlm.recall named a
refreshed region, and the RSS growth over the run's second half; --records FILE appends the run as one
record (bench/records.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path

from cabinlm.bench.provenance import utc_now
from served import server_rss_mb, serving
from cabinlm.bench.records import Recorder
from cabinlm.bench.script import user_turns

SEATS = ("driver", "passenger")




def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--turns", type=int, default=200, help="turns per seat")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--archive-mb", type=float, default=0.04, help="each seat's archive bound (--recall-archive-mb)")
    ap.add_argument("--threads", type=int, default=1, help="the server's ONNX Runtime threads")
    ap.add_argument("--records", type=Path, default=None, help="append the run's record here")
    a = ap.parse_args()

    options = ["--seats", "2", "--threads", str(a.threads), "--model-name", "m", "--recall-archive-mb", str(a.archive_mb)]
    with serving(a.build, options, "serve_recall_rss") as (port, pid):
        run(a, port, pid)


def run(a, port: int, pid: int) -> None:
    utc_start, load_at_start, t0 = utc_now(), os.getloadavg()[0], time.monotonic()
    messages = {seat: [] for seat in SEATS}
    script = {seat: user_turns(seed=k + 1) for k, seat in enumerate(SEATS)}
    rss, refreshed, recalled_turn1, region_tokens = [], 0, 0, []
    for turn in range(1, a.turns + 1):
        for seat in SEATS:
            messages[seat].append({"role": "user", "content": next(script[seat])})
            r = post(port, {"model": "m", "messages": messages[seat], "max_tokens": a.max_tokens, "user": seat})
            messages[seat].append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            recall = r["usage"]["cabinlm"]["recall"]
            if recall is None:
                raise SystemExit(f"{a.build}: usage.cabinlm.recall is null: export the model with --recall R")
            refreshed += bool(recall["refreshed"])
            recalled_turn1 += 1 in recall["turns"]
            region_tokens.append(recall["tokens"])
        rss.append(server_rss_mb(pid))
        if turn % 25 == 0:
            print(f"turn {turn}: server RSS {rss[-1]:.1f} MB, regions refreshed {refreshed}", flush=True)
    half = len(rss) // 2
    figures = {
        "rss_mb_turn_1": round(rss[0], 1), "rss_mb_half": round(rss[half - 1], 1), "rss_mb_end": round(rss[-1], 1),
        "rss_mb_max": round(max(rss), 1), "rss_growth_mb_second_half": round(max(rss[half:]) - max(rss[:half]), 2),
        "regions_refreshed": refreshed, "regions_with_turn_1": recalled_turn1,
        "region_tokens_mean": round(sum(region_tokens) / len(region_tokens), 1), "seconds": round(time.monotonic() - t0, 1),
    }  # fmt: skip
    print(json.dumps(figures))
    params = {"turns_per_seat": a.turns, "seats": len(SEATS), "max_tokens": a.max_tokens, "archive_mb": a.archive_mb}
    rec = Recorder("benchmarks/serve_recall_rss.py")
    rec.add(params, figures, utc_start=utc_start, loadavg_start=load_at_start, artifact=a.build, threads=a.threads)
    rec.write_to(a.records)


if __name__ == "__main__":
    main()
