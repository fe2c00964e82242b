"""KV bytes of a model with local sliding-window layers, per profile and window, with per-layer cache
geometry (local layers on rings of w - 1 slots) and without it (every layer on the sink + pinned +
window slot map): CacheLayout's byte counts, which tests/test_local_layers.py checks against the
runtime's buffers (docs/benchmarks.md).

    python benchmarks/kv_local_layers.py [MODEL] [--pinned 124] [--windows 1024 4096 8192]
"""

import argparse

from cabinlm.export.models import spec_for
from cabinlm.layout import CacheLayout
from cabinlm.profiles import list_profiles, load_profile

p = argparse.ArgumentParser()
p.add_argument("model", nargs="?", default="gemma3-270m")
p.add_argument("--pinned", type=int, default=124)
p.add_argument("--windows", type=int, nargs="+", default=[1024, 4096, 8192])
a = p.parse_args()

spec = spec_for(a.model)
print(f"{a.model}: {spec.num_layers} layers ({len(spec.local_layers)} local, window {spec.sliding_window}), "
      f"{spec.num_kv_heads} KV heads x {spec.head_dim} dims; pinned {a.pinned}, each profile's sink and chunk\n")
print("| profile | KV | window | slots | KV, one slot map for all layers | KV, local layers on rings | ratio |")
print("|---|---|---:|---:|---:|---:|---:|")
skipped = []
for name in list_profiles():
    prof = load_profile(name)
    if prof.engine.value == "tensorrt":  # its builds refuse per-layer geometry (engines/tensorrt/builder.py)
        skipped.append(name)
        continue
    for kv in prof.kv_dtypes:
        for w in a.windows:
            geometry = dict(sink=prof.default_sink, pinned=a.pinned, window=w, chunk=prof.default_chunk,
                            layers=spec.num_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, kv_dtype=kv)
            local = CacheLayout(**geometry, **spec.local_geometry(prof.default_sink + a.pinned + w + prof.default_chunk))
            uniform = local.uniform()
            print(f"| {name} | {kv.value}{' (default)' if kv == prof.default_kv else ''} | {w} | {local.slots} | "
                  f"{uniform.cache_bytes / 2**20:.1f} MiB | {local.cache_bytes / 2**20:.1f} MiB | "
                  f"{uniform.cache_bytes / local.cache_bytes:.2f}x |")
print(f"\n(not shown: {', '.join(skipped)}: TensorRT builds do not lay out the local rings yet and refuse such a model)")
