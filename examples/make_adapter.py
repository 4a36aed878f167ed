"""Write a small demo LoRA adapter (PEFT format) for a Qwen3-MoE-shaped model: attention + MoE experts.

    python examples/make_adapter.py /tmp/demo-adapter [--layout 2d|3d]
    vllm-lora inspect /tmp/demo-adapter            # or --base-config /tmp/demo-adapter/base_config.json

Only torch and safetensors are needed; the tensors are random (seeded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYERS, EXPERTS, HIDDEN, INTER, HEADS_DIM, RANK, ALPHA = 2, 8, 256, 96, 256, 8, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layout", choices=["2d", "3d"], default="2d")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    t: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        p = f"base_model.model.model.layers.{layer}"
        for proj in ("q_proj", "v_proj"):
            t[f"{p}.self_attn.{proj}.lora_A.weight"] = rnd(RANK, HIDDEN)
            t[f"{p}.self_attn.{proj}.lora_B.weight"] = rnd(HEADS_DIM, RANK)
        ex = f"{p}.mlp.experts"
        if args.layout == "2d":
            for e in range(EXPERTS):
                for proj, (d_in, d_out) in (("gate_proj", (HIDDEN, INTER)), ("up_proj", (HIDDEN, INTER)),
                                            ("down_proj", (INTER, HIDDEN))):
                    t[f"{ex}.{e}.{proj}.lora_A.weight"] = rnd(RANK, d_in)
                    t[f"{ex}.{e}.{proj}.lora_B.weight"] = rnd(d_out, RANK)
        else:  # PEFT target_parameters: A (r·E, in) expert-major, B (out, r·E) expert-minor
            t[f"{ex}.base_layer.lora_A.weight"] = rnd(RANK * EXPERTS, HIDDEN)
            t[f"{ex}.base_layer.lora_B.weight"] = rnd(2 * INTER, RANK * EXPERTS)
            t[f"{ex}.lora_A.weight"] = rnd(RANK * EXPERTS, INTER)
            t[f"{ex}.lora_B.weight"] = rnd(HIDDEN, RANK * EXPERTS)
    save_file(t, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
           "bias": "none", "peft_version": "0.21.0"}
    if args.layout == "3d":
        cfg["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    else:
        cfg["target_modules"] += ["gate_proj", "up_proj", "down_proj"]
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "base_config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": EXPERTS,
                                                      "hidden_size": HIDDEN, "moe_intermediate_size": INTER}))
    print(f"wrote {out}: {len(t)} tensors, {args.layout} experts")


if __name__ == "__main__":
    main()
