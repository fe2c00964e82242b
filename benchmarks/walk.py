"""Which of cabinlm's modules a cpu build and a chat turn pass through: the "rooms" each walk enters.

    python benchmarks/walk.py EXPORT [--json]

EXPORT: a plain export (`cabinlm export ... -o EXPORT`). The script builds it for the cpu profile
into a temporary folder, then opens the build and answers one user turn (16 tokens, greedy), and
reports, for each walk, the cabinlm modules whose functions ran (a profile hook on every call; a
module only imported does not count) and the packages they belong to. Fewer rooms for the same work means the layers do not reach across each
other; the lists say which.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import cabinlm

ROOT = Path(cabinlm.__file__).resolve().parent


def modules_run(work: Callable[[], object]) -> list[str]:
    """The cabinlm modules (dotted names) whose functions ran during work()."""
    seen: set[str] = set()

    def hook(frame, event, arg):
        # a function's frame (CO_OPTIMIZED): not a module's or a class's body run by an import
        if event == "call" and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT):
                rel = path.relative_to(ROOT.parent).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                seen.add(".".join(parts))

    sys.setprofile(hook)
    try:
        work()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def packages(modules: list[str]) -> list[str]:
    return sorted({".".join(m.split(".")[:2]) for m in modules})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile
    from cabinlm.runtime import RuntimeConfig, open_runtime

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "build"
        build = modules_run(lambda: build_artifact(a.export, load_profile("cpu"), out))

        def turn() -> None:
            runtime = open_runtime(RuntimeConfig(out, max_new_tokens=16, temperature=0.0))
            runtime.dialogues()[0].ask("Set the temperature to 21 degrees, please.")

        chat = modules_run(turn)
    result = {"cpu build": {"modules": len(build), "packages": packages(build), "list": build},
              "chat turn": {"modules": len(chat), "packages": packages(chat), "list": chat}}
    if a.json:
        print(json.dumps(result, indent=1))
        return
    for walk, r in result.items():
        print(f"{walk}: {r['modules']} modules in {len(r['packages'])} packages ({', '.join(r['packages'])})")


if __name__ == "__main__":
    main()
