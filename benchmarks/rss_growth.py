"""Where resident memory grows over a long run, without the benchmark's own trace lists
(docs/benchmarks.md, section 5).

    python benchmarks/rss_growth.py BUILD --decode 16000      # the decoder alone: greedy single steps
    python benchmarks/rss_growth.py BUILD --turns 400 [--tracemalloc]   # the chat runtime (Dialogue)

Prints RSS every 2,000 steps / 25 turns. --tracemalloc also compares Python's heap after turn 20
with the end (numpy arrays included), to tell Python-side growth from native allocations.
"""

import argparse
import tracemalloc

import numpy as np

from cabinlm.bench.script import user_turns
from cabinlm.runtime import Decoder, Tokenizer
from cabinlm.runtime.dialogue import Dialogue
from cabinlm.runtime.memory import rss_mb

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("--decode", type=int, default=0, help="single-token steps after a full cache")
ap.add_argument("--turns", type=int, default=0, help="scripted dialogue turns (replies of up to 48 tokens)")
ap.add_argument("--tracemalloc", action="store_true")
a = ap.parse_args()
dec = Decoder(a.build, threads=2)
print(f"loaded: {rss_mb():.1f} MiB", flush=True)
if a.decode:
    dec.feed(np.arange(100, 100 + dec.layout.slots + 2 * dec.layout.chunk) % dec.manifest.model.vocab_size)
    token = np.array([500])
    for t in range(a.decode + 1):
        logits = dec.step(token)
        token = np.array([int(np.argmax(logits[-1]))])
        if t % 2000 == 0:
            print(f"step {t}: {rss_mb():.1f} MiB", flush=True)
if a.turns:
    chat = Dialogue(dec, Tokenizer(f"{a.build}/tokenizer.json"), max_new_tokens=48)
    turns, tokens, before = user_turns(0), 0, None
    if a.tracemalloc:
        tracemalloc.start()
    for i in range(a.turns + 1):
        r = chat.ask(next(turns))
        tokens += r.prompt_tokens + r.new_tokens
        if i == 20 and a.tracemalloc:
            before = tracemalloc.take_snapshot()
        if i % 25 == 0:
            print(f"turn {i}: {tokens} tokens, {rss_mb():.1f} MiB", flush=True)
    if before is not None:
        grown = tracemalloc.take_snapshot().compare_to(before, "lineno")
        print(f"Python heap since turn 20: {sum(s.size_diff for s in grown) / 2**20:+.2f} MiB; largest:")
        for s in grown[:5]:
            print(f"  {s}")
