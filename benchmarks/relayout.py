"""Copy an artifact with the same cache slots split differently between sinks and pinned slots.

    python benchmarks/relayout.py SRC DST --sink 0 --pinned 128

The graph depends only on the slot count (sink + pinned + image + window), so S=4/P=124 and S=0/P=128
run the same decoder.onnx; only the runtime's policy differs (pinned slots stay empty unless a span
is pinned). The StreamingLLM table uses it to compare window-only with sink + window on one graph.
"""

import argparse
import dataclasses
import shutil
from pathlib import Path

from cabinlm.manifest import FileEntry, load_manifest

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("dst")
ap.add_argument("--sink", type=int, required=True)
ap.add_argument("--pinned", type=int, required=True)
a = ap.parse_args()
src, dst = Path(a.src), Path(a.dst)
m = load_manifest(src)
if a.sink + a.pinned != m.cache.sink + m.cache.pinned:
    raise SystemExit(f"sink + pinned must stay {m.cache.sink + m.cache.pinned} (the graph's slot count)")
dst.mkdir(parents=True, exist_ok=True)
for entry in m.files.values():
    target = dst / entry.path
    if not target.exists():
        shutil.copy2(src / entry.path, target)  # a copy: onnx refuses external data with several hard links
cache = dataclasses.replace(m.cache, sink=a.sink, pinned=a.pinned)
dataclasses.replace(m, cache=cache, files={k: FileEntry.of(dst, v.path) for k, v in m.files.items()}).save(dst)
print(f"{dst}: sink {a.sink} + pinned {a.pinned} + window {cache.window} = {cache.slots} slots")
