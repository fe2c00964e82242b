"""Vision-language builds on the HTP, in Qualcomm's x86 simulator (docs/results.md#the-htp-in-the-simulator): per tiny
test family and chip, the vision tower's compile time and binary size, its image embeddings against
the CPU's over several frames, the seconds per frame in the simulator and on the CPU; and, for the
M-RoPE families, the HTP decoder's per-token NLL against the cpu build of the same fp16-KV export
through eviction with the frame pinned. The towers and decoders are the tests' tiny random models
(tests/conftest.py, tests/test_idefics3.py): the figures say how the compiler and fp16 treat these
graphs, not how a real model runs on a chip; the seconds are an emulator's.

    python benchmarks/vlm_htp.py --out out/vlm-htp --records vlm-htp.jsonl
    python benchmarks/vlm_htp.py --out out/vlm-htp8 --kv int8 --families qwen2_vl --records vlm-htp.jsonl

--records FILE appends one record per family and chip, with the HTP build's provenance (bench/records.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FAMILIES = ("llava", "smolvlm", "qwen2_vl", "qwen2_5_vl")
PROFILES = ("sa8775p", "sa8295p")
LAYOUT = dict(kv="fp16", sink=4, pinned=12, window=64, chunk=16)
FRAME = (32, 24)  # (width, height): the Qwen2-VL test folders' frame; the others resize it


def folder_for(family: str, tmp: Path) -> Path:
    from conftest import make_tiny_llava, make_tiny_qwen2_vl
    from test_idefics3 import make_tiny_idefics3

    if family == "llava":
        return make_tiny_llava(tmp, "clip")
    if family == "smolvlm":
        return make_tiny_idefics3(tmp, "smolvlm", seed=1)
    return make_tiny_qwen2_vl(tmp, family=family)


def seconds_per_frame(encoder, frames) -> float:
    encoder.encode(frames[0])  # the first run loads the graph
    t = time.perf_counter()
    for f in frames:
        encoder.encode(f)
    return (time.perf_counter() - t) / len(frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="work folder (exports and builds)")
    ap.add_argument("--records", type=Path, default=None, help="append one record per family and chip here")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=150, help="text tokens after the frame (M-RoPE NLL)")
    ap.add_argument("--kv", choices=("fp16", "int8"), default="fp16", help="the export's KV (int8: the HTP's uint8 cache)")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    args = ap.parse_args()
    from cabinlm.bench.provenance import load_average, utc_now
    from cabinlm.bench.records import Recorder

    rec = Recorder("benchmarks/vlm_htp.py")

    from cabinlm.engines.build import build_artifact
    from cabinlm.export import ExportOptions, export_loaded
    from cabinlm.export.models import load_model
    from cabinlm.profiles import load_profile
    from cabinlm.runtime import Decoder, stream_perplexity
    from vlm_checks import TEXT, picture

    frames = [picture(*FRAME, seed=100 + i) for i in range(args.frames)]
    rows = []
    for family in args.families:
        src = args.out / f"src-{family}"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        loaded = load_model(str(folder_for(family, src)))
        art = args.out / f"art-{family}"
        export_loaded(loaded, art, ExportOptions(verify=False, gate=False, **{**LAYOUT, "kv": args.kv}))
        builds = {p: build_artifact(art, load_profile(p), args.out / f"{family}-{p}") for p in ("cpu", *PROFILES)}
        cpu = Decoder(builds["cpu"])
        ids = loaded.tokenizer.backend_tokenizer.encode(TEXT * 4).ids[: args.tokens]
        mrope = cpu.manifest.vision.mrope
        ref_nll = np.asarray(stream_perplexity(cpu, ids, frame=cpu.vision.encode(frames[0])).nll) if mrope else None
        for profile in PROFILES:
            b = builds[profile]
            start, load = utc_now(), load_average()
            record = json.loads((b / "manifest.json").read_text())["build"]["qnn"]["vision"]
            dec = Decoder(b)
            errors = []
            for f in frames:
                got, ref = dec.vision.encode(f).astype(np.float64), cpu.vision.encode(f).astype(np.float64)
                errors.append(float(np.abs(got - ref).max() / np.abs(ref).max()))
            row = {"family": family, "profile": profile, "kv": args.kv, "tower_runs_on": record["runs_on"],
                   "tower_compile_seconds": record.get("compile_seconds"),
                   "tower_binary_bytes": (b / record["binary"]).stat().st_size if "binary" in record else None,
                   "tower_vision_onnx_bytes": sum((art / n).stat().st_size for n in ("vision.onnx", "vision.onnx.data")),
                   "image_tokens": dec.manifest.vision.image_tokens,
                   "embedding_relative_error_max": round(max(errors), 6),
                   "embedding_relative_error_median": round(float(np.median(errors)), 6),
                   "frame_seconds_simulator": round(seconds_per_frame(dec.vision, frames), 4),
                   "frame_seconds_cpu": round(seconds_per_frame(cpu.vision, frames), 4)}  # fmt: skip
            if mrope:
                nll = np.asarray(stream_perplexity(dec, ids, frame=dec.vision.encode(frames[0])).nll)
                d = np.abs(nll - ref_nll)
                row.update(decoder_nll_abs_diff_max=round(float(d.max()), 5), decoder_nll_abs_diff_mean=round(float(d.mean()), 5),
                           evicted=int(dec.cache.evicted), tokens=len(ids))  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            asked = ("family", "profile", "kv")
            rec.add({**{k: row[k] for k in asked}, "frames": args.frames}, {k: v for k, v in row.items() if k not in asked},
                    utc_start=start, loadavg_start=load, artifact=b)  # fmt: skip
    rec.write_to(args.records)


if __name__ == "__main__":
    main()
