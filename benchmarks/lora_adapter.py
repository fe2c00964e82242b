"""A random PEFT LoRA adapter for a model, to measure switchable adapters with (docs/lora.md,
"Measured"): PEFT's own get_peft_model and save_pretrained, A and B random (B != 0, so the adapter
moves the model), every attention and MLP projection targeted.

    python benchmarks/lora_adapter.py smollm2-135m out/adapter-a --rank 16 --seed 1
    python benchmarks/lora_adapter.py smollm2-135m out/adapter-b --rank 8 --seed 2 --targets q_proj,v_proj

MODEL: a built-in name, a model folder or a .gguf (as `cabinlm export` takes it). --std sets the
factors' spread: A ~ N(0, std), B ~ N(0, std) (the default keeps the model talking, moved).
"""

from __future__ import annotations

import argparse

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--targets", default=TARGETS, help=f"comma-separated projections [default: {TARGETS}]")
    a = ap.parse_args()
    if a.rank < 1:
        raise SystemExit(f"--rank must be 1 or more, got {a.rank}")
    import torch
    from peft import LoraConfig, get_peft_model

    from cabinlm.export.models import load_model

    base = load_model(a.model).model
    peft = get_peft_model(base, LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=a.targets.split(",")))
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * a.std)
    peft.save_pretrained(a.out)
    print(f"wrote a rank-{a.rank} PEFT adapter for {a.model} ({a.targets}) to {a.out}")


if __name__ == "__main__":
    main()
