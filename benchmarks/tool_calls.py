"""Tool calls: what the grammar costs per token, and how often a model calls the right function.

    python benchmarks/tool_calls.py mask BUILD [--rounds 3] [--records FILE]
        decode tok/s of the same requests with a JSON Schema active and with none (plain decoding
        and prompt-lookup drafting, rounds alternating), and the mask's cost per token (µs: the
        bitmask computed, applied to the logits, the token consumed)
    python benchmarks/tool_calls.py accuracy BUILD [BUILD ...] [--records FILE]
        the vehicle simulator's dozen tools (demo/vehicle.py) and two dozen in-car commands, each a
        fresh dialogue, greedy: the share of replies that call the expected function with arguments
        valid against its schema, without the grammar (tool_choice auto, the reply's text parsed)
        and with it (tool_choice required). A build needs pinned slots for the tool list (about 1300
        of SmolLM2's tokens: `make demo` builds one).

Both write records with provenance (cabinlm.bench.records) to --records and print a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demo"))

from vehicle import TOOLS  # noqa: E402

from cabinlm.bench.records import Recorder  # noqa: E402
from cabinlm.runtime.assembly import RuntimeConfig, open_runtime  # noqa: E402
from cabinlm.runtime.assistant import ToolDialogue, grammars_for  # noqa: E402
from cabinlm.runtime.grammar import Constraint  # noqa: E402
from cabinlm.runtime.tools import json_reply_grammar, parse_tools  # noqa: E402

# Each command with the function a driver means by it.
COMMANDS = [
    ("It's cold in here, set the driver's side to 23 degrees.", "set_temperature"),
    ("Make it 19 degrees for the passenger.", "set_temperature"),
    ("Turn the fan up to level 5.", "set_fan"),
    ("Switch the fan off.", "set_fan"),
    ("Turn on the air conditioning.", "set_air_conditioning"),
    ("AC off please.", "set_air_conditioning"),
    ("Open the rear windows a little, about 20 percent.", "open_window"),
    ("Close the driver's window.", "open_window"),
    ("Warm up my seat, level 2.", "set_seat_heating"),
    ("Turn off the passenger seat heating.", "set_seat_heating"),
    ("Take me to Munich central station.", "navigate_to"),
    ("Navigate home and avoid tolls.", "navigate_to"),
    ("Find a fast charger, at least 150 kW.", "find_charging_station"),
    ("Where can I charge along the route?", "find_charging_station"),
    ("Play some jazz on the radio.", "play_media"),
    ("Put on the latest episode of my news podcast.", "play_media"),
    ("Louder, volume 20.", "set_volume"),
    ("Turn the volume down to 5.", "set_volume"),
    ("Make the ambient light blue.", "set_ambient_light"),
    ("Dim the cabin lights to 10 percent, amber.", "set_ambient_light"),
    ("Lock the doors.", "lock_doors"),
    ("Unlock the car.", "lock_doors"),
    ("Open the trunk.", "open_trunk"),
    ("Pop the boot, I need to load the bags.", "open_trunk"),
]

# A JSON reply's schema for the mask's cost: a set_temperature call's arguments.
SCHEMA = TOOLS[0]["function"]["parameters"]
MASK_PROMPTS = ["Set the driver's side to 22 degrees.", "Warm the passenger side up a bit.",
                "The rear is too hot, cool it down.", "Set every zone to 21 degrees."]  # fmt: skip


class TimedConstraint(Constraint):
    """A Constraint that adds up the time its mask and consume take."""

    spent = 0.0
    tokens = 0

    def mask(self, logits):
        t = time.perf_counter()
        try:
            return super().mask(logits)
        finally:
            TimedConstraint.spent += time.perf_counter() - t

    def consume(self, token):
        t = time.perf_counter()
        try:
            super().consume(token)
        finally:
            TimedConstraint.spent += time.perf_counter() - t
            TimedConstraint.tokens += 1


def mask(args) -> None:
    rec = Recorder("benchmarks/tool_calls.py mask")
    rows = {}
    for drafting in (False, True):
        runtime = open_runtime(RuntimeConfig(args.build, threads=args.threads, max_new_tokens=args.max_new_tokens,
                                             speculative=drafting))  # fmt: skip
        d = runtime.dialogues()[0]
        g = grammars_for(d)
        compiled = g.compile(json_reply_grammar(SCHEMA, "schema"))
        for r in range(args.rounds):
            for schema in (False, True):
                TimedConstraint.spent, TimedConstraint.tokens = 0.0, 0
                tokens, seconds = 0, 0.0
                with rec.run({"mode": "schema" if schema else "none", "drafting": drafting,
                              "max_new_tokens": args.max_new_tokens, "prompts": len(MASK_PROMPTS)},
                             artifact=args.build, threads=args.threads, round=r) as figures:  # fmt: skip
                    for prompt in MASK_PROMPTS:
                        d.reset()
                        c = TimedConstraint(g, compiled) if schema else None
                        result = d.ask(prompt, constraint=c)
                        tokens += result.new_tokens
                        seconds += result.new_tokens / result.decode_tok_s if result.decode_tok_s else 0
                    figures["decode_tok_s"] = round(tokens / seconds, 2)
                    figures["tokens"] = tokens
                    if schema:
                        figures["mask_us_per_token"] = round(1e6 * TimedConstraint.spent / max(TimedConstraint.tokens, 1), 1)
                rows.setdefault((drafting, schema), []).append(figures)
    print(f"{'drafting':>9} {'schema':>7} {'decode tok/s (median)':>22} {'runs':>24} {'mask µs/token':>14}")
    for (drafting, schema), runs in rows.items():
        speeds = [f["decode_tok_s"] for f in runs]
        us = statistics.median(f["mask_us_per_token"] for f in runs) if schema else float("nan")
        print(f"{str(drafting):>9} {str(schema):>7} {statistics.median(speeds):>22.1f} "
              f"{', '.join(f'{s:.1f}' for s in speeds):>24} {us:>14.1f}")  # fmt: skip
    for drafting in (False, True):
        none = [f["decode_tok_s"] for f in rows[(drafting, False)]]
        with_schema = [f["decode_tok_s"] for f in rows[(drafting, True)]]
        ratios = [b / a for a, b in zip(none, with_schema)]
        print(f"drafting {drafting}: schema / none = {statistics.median(ratios):.3f} (rounds "
              f"{', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip
    rec.write_to(args.records)


def accuracy(args) -> None:
    import jsonschema

    rec = Recorder("benchmarks/tool_calls.py accuracy")
    tools = parse_tools(TOOLS)
    schemas = {t.name: t.parameters for t in tools}
    for build in args.builds:
        runtime = open_runtime(RuntimeConfig(build, tools=tools, threads=args.threads, max_new_tokens=args.max_new_tokens))
        d = runtime.dialogues()[0]
        assistant = ToolDialogue(d, tools, "auto", parallel=False, system_has_tools=True)
        for mode, choice in (("no grammar", "none"), ("grammar", "required")):
            right = valid = 0
            with rec.run({"mode": mode, "commands": len(COMMANDS), "tools": len(tools)}, artifact=build,
                         threads=args.threads) as figures:  # fmt: skip
                for command, expected in COMMANDS:
                    d.reset()
                    turn = assistant.ask(command, choice=choice)
                    ok = False
                    for call in turn.calls[:1]:
                        try:
                            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                            ok = True
                        except (KeyError, ValueError, jsonschema.ValidationError):
                            pass
                    valid += ok
                    right += ok and turn.calls[0].name == expected
                figures["right_function_valid_args"] = round(right / len(COMMANDS), 3)
                figures["valid_call"] = round(valid / len(COMMANDS), 3)
            print(f"{build.name:40} {mode:>10}: right function, valid arguments {right}/{len(COMMANDS)}; "
                  f"a valid call {valid}/{len(COMMANDS)}")  # fmt: skip
    rec.write_to(args.records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mask", help="the grammar's cost per token and decode tok/s with a schema against none")
    m.add_argument("build", type=Path)
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--max-new-tokens", type=int, default=64)
    a = sub.add_parser("accuracy", help="the share of in-car commands answered with the right, valid call")
    a.add_argument("builds", type=Path, nargs="+")
    a.add_argument("--max-new-tokens", type=int, default=96)
    for p in (m, a):
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--records", type=Path, default=None, help="append the records (JSON lines) to this file")
    args = ap.parse_args()
    np.seterr(all="ignore")
    (mask if args.what == "mask" else accuracy)(args)


if __name__ == "__main__":
    main()
