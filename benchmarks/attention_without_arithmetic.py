"""A measuring device, not a build to run: a copy of a fused cpu build whose attention kernel leaves out
some of its work on the cache, to see what that work costs inside whole decode steps (and so what
making it cheaper could gain at most). Its logits are meaningless; only its timings mean something.

    python benchmarks/attention_without_arithmetic.py BUILD OUT [--drop qk pv keys]

    qk    the Q K products of a plain tile (its scores become its bias plus one converted key value,
          so that the keys are still converted and read)
    pv    the P V sums of a plain tile read in one pass (a decode step's): its values are not read
    keys  the conversion of a plain tile's cached keys to float (with qk: the keys are not read at all;
          the read-ahead still asks for them)

OUT gets BUILD's files and the kernel library compiled from this checkout's sources with those
lines taken out (each edit must match the source exactly once, or the script stops), its manifest's
hashes set to the new library's. Then, for example:

    python benchmarks/seats_steps_ab.py BUILD OUT --fill 600 1140 --pinned 19
    python benchmarks/attention_seats.py BUILD/libcabinlm_kernels.so OUT/libcabinlm_kernels.so --filled 1148
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from cabinlm.engines.ort_fused.kernels import HEADERS, LIBRARY, SOURCES
from cabinlm.engines.ort_fused.kernels.compiler import FLAGS, find_compiler

KERNEL = "int8_kv_attention.cc"
EDITS = {
    "qk": ("store(scores.data() + (b * G + r) * stride + j0, qk_tile(V16, q[b][r], keys, D) + bv);",
           "store(scores.data() + (b * G + r) * stride + j0, bv + keys[r]);"),
    "pv": ("pv_many(V16, weights, V + j0 * D, kTile, D, sums, B * G);\n      } else {",
           "\n      } else {"),
    "keys": ("rows_to_float(V16, K0 + j0 * D, kLanes, keys);", ""),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--drop", nargs="+", choices=sorted(EDITS), default=["qk", "pv"])
    a = ap.parse_args()
    shutil.copytree(a.build, a.out, dirs_exist_ok=False)
    with tempfile.TemporaryDirectory() as work:
        for f in (*SOURCES, *HEADERS):
            shutil.copy(f, work)
        kernel = Path(work) / KERNEL
        text = kernel.read_text()
        for name in a.drop:
            old, new = EDITS[name]
            if text.count(old) != 1:
                raise SystemExit(f"--drop {name}: {KERNEL} no longer holds {old!r} once; update EDITS")
            text = text.replace(old, new)
        kernel.write_text(text)
        cxx = find_compiler(None)
        library = a.out / LIBRARY
        subprocess.run([cxx.path, *FLAGS, "-march=native", "-o", str(library), *(str(Path(work) / f.name) for f in SOURCES)],
                       check=True)  # fmt: skip
    data = library.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    manifest = json.loads((a.out / "manifest.json").read_text())
    manifest["files"]["kernel_library"].update(bytes=len(data), sha256=digest)
    manifest["build"]["fused"]["kernels"]["sha256"] = digest
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"{a.out}: {a.build} with the attention's {', '.join(a.drop)} left out (timings only: its logits are meaningless)")


if __name__ == "__main__":
    main()
