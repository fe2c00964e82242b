"""KV memory per token and in total for each built-in profile (docs/benchmarks.md), from the planner.

    python benchmarks/kv_per_profile.py [MODEL]      (default smollm2-135m; reads only its metadata)
"""

import sys

from cabinlm.export.models import spec_for
from cabinlm.profiles import list_profiles, load_profile
from cabinlm.profiles.planner import plan

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
spec = spec_for(model)
fp32_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
print(f"{model}: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} dims; "
      f"fp32 KV = {fp32_per_token} B/token\n")
print("| profile | KV | B/token (with scales) | vs fp32 | KV at W=1020 (1148 slots) | largest window | KV there | total / budget |")
print("|---|---|---|---|---|---|---|---|")
for name in list_profiles():
    prof = load_profile(name)
    for kv in prof.kv_dtypes:
        fixed = plan(spec, prof, kv=kv.value, window=1020)
        big = plan(spec, prof, kv=kv.value)
        print(f"| {name} | {fixed.kv}{' (default)' if kv == prof.default_kv else ''} | {fixed.kv_bytes_per_token:,} | {fixed.kv_bytes_per_token / fp32_per_token:.3f} | "
              f"{fixed.kv_bytes / 2**20:.1f} MiB | {big.window} | {big.kv_bytes / 2**20:.1f} MiB | "
              f"{big.total_bytes / 2**20:.0f} / {big.budget_bytes / 2**20:.0f} MiB |")
