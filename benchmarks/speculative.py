"""Speculative decoding by prompt lookup against plain decoding on one build: the same scripted
dialogue twice (greedy), alternating, with the replies checked equal; decode tokens per second of
each turn, drafted and accepted tokens.

    python benchmarks/speculative.py BUILD [--dialogue demo/dialogue.txt] [--rounds 2] [--max-new 128] [--threads 2]
    python benchmarks/speculative.py BUILD --passages tests/data/prose.txt [--turns 5] [--words 80]

    python benchmarks/speculative.py BUILD --scripted 1150 [--rounds 3]

--scripted N: `cabinlm bench`'s seeded in-car dialogue (bench/runner.run_cabinlm) for N tokens, plain
and speculative alternating: median per-token and overall decode tok/s, drafted and accepted, the
replies checked equal. (1150 tokens: about the span the peers hold in 1148 positions, while the
window fills.)

--passages: natural text instead of the demo's turns: each turn asks for a summary of the next
`--words` words of the file (from its first paragraph of prose on), so drafts can only come from
the passages and the replies themselves.
"""

import argparse
import statistics
import time

from cabinlm.runtime import Dialogue, open_artifact
from cabinlm.runtime.speculative import PromptLookupDrafting

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("--dialogue", default="demo/dialogue.txt")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--max-new", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--passages", default=None, help="a text file: summarize passages of it instead of --dialogue")
ap.add_argument("--scripted", type=int, default=0, help="tokens of the bench's scripted dialogue instead")
ap.add_argument("--turns", type=int, default=5)
ap.add_argument("--words", type=int, default=80)
a = ap.parse_args()
if a.scripted:
    import numpy as np

    from cabinlm.bench.runner import run_cabinlm

    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(a.rounds):
        for spec in (False, True):
            replies: list[str] = []
            t = run_cabinlm(a.build, tokens=a.scripted, threads=a.threads, max_new=a.max_new, speculative=spec,
                            on_reply=lambda turn, text, replies=replies: replies.append(text))  # fmt: skip
            runs[spec].append((t, replies))
    assert all(r == runs[False][0][1] for _, r in runs[False] + runs[True]), "speculative replies differ from plain ones"
    print(f"{a.build}: the bench's scripted dialogue, {a.scripted} tokens, up to {a.max_new} new tokens a turn, "
          f"{a.threads} threads, {a.rounds} alternating rounds")  # fmt: skip
    print("| decoding | decoded tokens | median per-token decode tok/s (per round) | overall decode tok/s (per round) "
          "| drafted | accepted |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for spec in (False, True):
        ts = [t for t, _ in runs[spec]]
        med = ", ".join(f"{1000 / np.median(t.decode_ms):.1f}" for t in ts)
        tot = ", ".join(f"{1000 * len(t.decode_ms) / np.sum(t.decode_ms):.1f}" for t in ts)
        print(f"| {'prompt-lookup speculative' if spec else 'plain'} | {len(ts[0].decode_ms)} | {med} | {tot} | "
              f"{ts[0].config.get('drafted', 0)} | {ts[0].config.get('accepted', 0)} |")  # fmt: skip
    raise SystemExit(0)
if a.passages:
    text = open(a.passages, encoding="utf-8").read()
    words = text[text.index("They, who to states") :].split() if "They, who to states" in text else text.split()
    turns = [f"Summarize this passage in two sentences: {' '.join(words[i * a.words : (i + 1) * a.words])}"
             for i in range(a.turns)]  # fmt: skip
    a.dialogue = f"{a.passages} ({a.turns} passages of {a.words} words)"
else:
    turns = [line.strip() for line in open(a.dialogue, encoding="utf-8") if line.strip()]
dec, tok = open_artifact(a.build, threads=a.threads)


def run(spec: bool):
    d = Dialogue(dec, tok, max_new_tokens=a.max_new, drafting=PromptLookupDrafting() if spec else None)
    t0, out = time.perf_counter(), []
    for text in turns:
        out.append(d.ask(text))
    return time.perf_counter() - t0, out


results = {False: [], True: []}
for r in range(a.rounds):
    for spec in (False, True):
        results[spec].append(run(spec))
plain, fast = results[False][0][1], results[True][0][1]
assert [x.reply for x in plain] == [x.reply for x in fast], "speculative replies differ from plain ones"
print(f"{a.build}: {a.dialogue}, {len(turns)} turns, up to {a.max_new} new tokens each, {a.threads} threads, {a.rounds} alternating rounds")
print("| decoding | decoded tokens | median decode tok/s (per turn) | whole dialogue s (per round) | drafted | accepted |")
print("|---|---:|---:|---:|---:|---:|")
for spec in (False, True):
    rounds = results[spec]
    per_turn = [x.decode_tok_s for _, out in rounds for x in out if x.new_tokens > 1]
    label = "prompt-lookup speculative" if spec else "plain"
    out = rounds[0][1]
    print(f"| {label} | {sum(x.new_tokens for x in out)} | {statistics.median(per_turn):.1f} | "
          f"{', '.join(f'{s:.2f}' for s, _ in rounds)} | {sum(x.drafted_tokens for x in out)} | "
          f"{sum(x.accepted_tokens for x in out)} |")
