"""``vllm-lora convert SRC --to 2d|3d -o DIR``: rewrite an adapter's MoE blocks in the other layout (same delta)."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_lora_ext.cli import positive_int
from vllm_lora_ext.offline_ops import base_config_for, convert_adapter
from vllm_lora_ext.summary import load_config
from vllm_lora_ext.outputs import check_output_dir
from vllm_lora_ext.sources import resolve_source


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="rewrite MoE expert weights as 2D per-expert or PEFT 3D fused keys")
    p.add_argument("source")
    p.add_argument("--to", choices=["2d", "3d"], required=True)
    p.add_argument("-o", "--output", required=True, help="output folder (PEFT format); new or empty")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder or over the source")
    p.add_argument("--base-config", default=None,
                   help="the base model's config.json, its folder, or hf:org/model (needed for 3D inputs)")
    p.add_argument("--num-experts", type=positive_int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolved = resolve_source(args.source)
    out = check_output_dir(args.output, inputs=[resolved.weights_path], force=args.force)
    base, base_from = base_config_for(load_config(resolved), args.base_config)
    if base_from and not args.base_config:
        print(f"base config: {base_from}")
    convert_adapter(resolved, out, to=args.to, base_config=base, num_experts=args.num_experts)
    print(f"wrote {out}")
    return 0
