"""The tool-calling demo: the assistant operates the simulated car (demo/vehicle.py) through
cabinlm's Python API, on a build whose pinned slots hold the tool list.

    python demo/drive.py BUILD [--commands demo/commands.txt] [--choice required|auto]

Each command is one user turn. The grammar makes every call valid against its tool's schema; the
simulator runs it, its result goes back as the next turn, and the model's answer to the result is
printed with what changed in the car. SmolLM2-135M was not trained to call tools, so the demo asks
for a call on every command (--choice required); --choice auto lets the model decide.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from vehicle import TOOLS, Vehicle  # noqa: E402

from cabinlm.runtime.assembly import RuntimeConfig, open_runtime  # noqa: E402
from cabinlm.runtime.assistant import ToolDialogue  # noqa: E402
from cabinlm.runtime.tools import parse_tools  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", type=Path, help="a build (or export) with room for the tool list in its pinned slots")
    ap.add_argument("--commands", type=Path, default=Path(__file__).parent / "commands.txt")
    ap.add_argument("--choice", default="required", choices=["required", "auto"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    tools = parse_tools(TOOLS)
    runtime = open_runtime(RuntimeConfig(args.build, tools=tools, max_new_tokens=args.max_new_tokens,
                                         threads=args.threads))  # fmt: skip
    assistant = ToolDialogue(runtime.dialogues()[0], tools, args.choice, parallel=False, system_has_tools=True)
    car = Vehicle()
    for command in args.commands.read_text(encoding="utf-8").splitlines():
        if not command.strip():
            continue
        print(f"driver: {command}")
        turn = assistant.ask(command)
        if turn.content:
            print(f"assistant: {turn.content}")
        if not turn.calls:
            continue
        before = car.snapshot()
        results = []
        for call in turn.calls:
            result = car.call(call.name, json.loads(call.arguments))
            print(f"  call {call.name}({call.arguments}) -> {result}")
            results.append((call.name, result))
        changed = car.changes(before)
        print(f"  car: {json.dumps(changed) if changed else 'no change'}")
        reply = assistant.answer(results, choice="none")
        print(f"assistant: {reply.content.strip()}")
    print(f"final state: {json.dumps(car.state)}")


if __name__ == "__main__":
    main()
