"""``vllm-lora convert SRC --to 2d|3d -o DIR``: rewrite an adapter's MoE blocks in the other layout (same delta)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_lora_ext.offline_ops import convert_adapter
from vllm_lora_ext.sources import resolve_source


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="rewrite MoE expert weights as 2D per-expert or PEFT 3D fused keys")
    p.add_argument("source")
    p.add_argument("--to", choices=["2d", "3d"], required=True)
    p.add_argument("-o", "--output", required=True, help="output folder (PEFT format)")
    p.add_argument("--base-config", default=None, help="the base model's config.json (needed for 3D inputs)")
    p.add_argument("--num-experts", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = json.loads(open(args.base_config).read()) if args.base_config else None
    out = convert_adapter(resolve_source(args.source), args.output, to=args.to, base_config=base,
                          num_experts=args.num_experts)
    print(f"wrote {out}")
    return 0
