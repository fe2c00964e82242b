"""Speculative decoding by prompt lookup against plain decoding on one build (docs/results.md#drafting):
the same scripted dialogue twice (greedy), alternating, with the replies checked equal; decode tokens
per second of each turn, drafted and accepted tokens. --records FILE appends one record per round and
decoding (bench/records.py), which `cabinlm bench compare` reads.

    python benchmarks/speculative.py BUILD [--dialogue demo/dialogue.txt] [--rounds 2] [--max-new 128] [--threads 2]
    python benchmarks/speculative.py BUILD --passages tests/data/prose.txt [--turns 5] [--words 80]

    python benchmarks/speculative.py BUILD --scripted 1150 [--rounds 3]
    python benchmarks/speculative.py BUILD --scripted 4000 --seed 23 --rounds 3 [--records F] [--plot F.png]

--scripted N: `cabinlm bench`'s seeded in-car dialogue (bench/runner.run_cabinlm) for N tokens, plain
and speculative alternating: median per-token and overall decode tok/s, drafted and accepted, the
replies checked equal. (1150 tokens: about the span the peers hold in 1148 positions, while the
window fills.) Also: overall decode tok/s over the last 1000 decoded tokens (long after the window
turned over), drafts before and after the turnover; --plot draws
the decode throughput of each round along the dialogue (1 / the mean per-token time of each 100
decoded tokens), plain against drafting.

--passages: natural text instead of the demo's turns: each turn asks for a summary of the next
`--words` words of the file (from its first paragraph of prose on), so drafts can only come from
the passages and the replies themselves.
"""

import argparse
import statistics
import time
from pathlib import Path

from cabinlm.bench.provenance import load_average, utc_now
from cabinlm.bench.records import Recorder
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
ap.add_argument("--seed", type=int, default=0, help="--scripted: the dialogue's seed")
ap.add_argument("--records", type=Path, default=None, help="append one record per round and decoding here")
ap.add_argument("--plot", default=None, help="--scripted: draw throughput along the dialogue into this PNG")
a = ap.parse_args()
rec = Recorder("benchmarks/speculative.py")
if a.scripted:
    import numpy as np

    from cabinlm.bench.rounds import DialogueParams, record_trace
    from cabinlm.bench.runner import run_cabinlm
    from cabinlm.bench.trace import summarize

    runs: dict[bool, list] = {False: [], True: []}
    for r in range(a.rounds):
        for spec in (False, True):
            replies: list[str] = []
            start, load = utc_now(), load_average()
            t = run_cabinlm(a.build, tokens=a.scripted, threads=a.threads, max_new=a.max_new, speculative=spec,
                            seed=a.seed, on_reply=lambda turn, text, replies=replies: replies.append(text))  # fmt: skip
            record_trace(rec, t, DialogueParams(a.scripted, a.threads, a.max_new, a.seed, spec), artifact=Path(a.build),
                         utc_start=start, loadavg_start=load, round=r)  # fmt: skip
            runs[spec].append((t, replies))
    assert all(r == runs[False][0][1] for _, r in runs[False] + runs[True]), "speculative replies differ from plain ones"
    print(f"{a.build}: the bench's scripted dialogue, {a.scripted} tokens, up to {a.max_new} new tokens a turn, "
          f"{a.threads} threads, {a.rounds} alternating rounds")  # fmt: skip
    print("| decoding | decoded tokens | overall decode tok/s (per round) | last 1k decoded, tok/s (per round) "
          "| median per-token tok/s (per round) | accepted / drafted before the turnover | after |\n"
          "|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for spec in (False, True):
        ts = [t for t, _ in runs[spec]]
        ss = [summarize(t) for t in ts]
        med = ", ".join(f"{s['decode_tok_s']:.1f}" for s in ss)
        tot = ", ".join(f"{s['decode_tok_s_overall']:.1f}" for s in ss)
        last = ", ".join(f"{s['decode_tok_s_last_1k_overall']:.1f}" for s in ss)
        c = ts[0].config
        phases = (f"{c['accepted_before_turnover']} / {c['drafted_before_turnover']} | "
                  f"{c['accepted_after_turnover']} / {c['drafted_after_turnover']}") if spec else "- | -"  # fmt: skip
        print(f"| {'prompt-lookup speculative' if spec else 'plain'} | {len(ts[0].decode_ms)} | {tot} | {last} | {med} | "
              f"{phases} |")  # fmt: skip
    ratio = [summarize(s)["decode_tok_s_overall"] / summarize(p)["decode_tok_s_overall"]
             for (s, _), (p, _) in zip(runs[True], runs[False])]  # fmt: skip
    print(f"drafting / plain, overall decode tok/s, per round: {', '.join(f'{r:.2f}x' for r in ratio)}")
    rec.write_to(a.records)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for spec, color in ((False, "tab:gray"), (True, "tab:blue")):
            for i, (t, _) in enumerate(runs[spec]):
                ms = np.asarray(t.decode_ms)
                k = 100
                rate = [1000 * len(ms[j : j + k]) / ms[j : j + k].sum() for j in range(0, len(ms) - k + 1, k)]
                ax.plot(np.arange(len(rate)) * k + k / 2, rate, color=color, lw=1, alpha=0.8,
                        label=("drafting (prompt lookup)" if spec else "plain") if i == 0 else None)  # fmt: skip
        turned = next((i for i, c in enumerate(runs[False][0][0].decode_context) if c >= runs[False][0][0].decode_context[-1]), None)
        if turned:
            ax.axvline(turned, color="k", ls=":", lw=1)
            ax.annotate(" the window is full", (turned, ax.get_ylim()[1] * 0.95), fontsize=8)
        ax.set_xlabel("decoded tokens")
        ax.set_ylabel("decode tok/s (per 100 decoded tokens)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{a.build}: the bench's scripted dialogue, {a.scripted} tokens, {a.threads} threads", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    raise SystemExit(0)
if a.passages:
    text = open(a.passages, encoding="utf-8").read()
    words = text[text.index("They, who to states") :].split() if "They, who to states" in text else text.split()
    turns = [f"Summarize this passage in two sentences: {' '.join(words[i * a.words : (i + 1) * a.words])}"
             for i in range(a.turns)]  # fmt: skip
    a.dialogue = f"{Path(a.passages).name} ({a.turns} passages of {a.words} words)"
else:
    turns = [line.strip() for line in open(a.dialogue, encoding="utf-8") if line.strip()]
dec, tok = open_artifact(a.build, threads=a.threads)


def run(spec: bool, r: int):
    d = Dialogue(dec, tok, max_new_tokens=a.max_new, drafting=PromptLookupDrafting() if spec else None)
    start, load = utc_now(), load_average()
    t0, out = time.perf_counter(), []
    for text in turns:
        out.append(d.ask(text))
    seconds = time.perf_counter() - t0
    per_turn = [x.decode_tok_s for x in out if x.new_tokens > 1]
    rec.add({"dialogue": Path(a.dialogue).name if not a.passages else a.dialogue, "turns": len(turns), "max_new": a.max_new,
             "drafting": "on" if spec else "off"},
            {"seconds": round(seconds, 3), "decoded_tokens": sum(x.new_tokens for x in out),
             "decode_tok_s_median_turn": statistics.median(per_turn) if per_turn else None,
             "drafted": sum(x.drafted_tokens for x in out), "accepted": sum(x.accepted_tokens for x in out)},
            utc_start=start, loadavg_start=load, artifact=a.build, threads=a.threads, round=r)  # fmt: skip
    return seconds, out


results = {False: [], True: []}
for r in range(a.rounds):
    for spec in (False, True):
        results[spec].append(run(spec, r))
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
rec.write_to(a.records)
