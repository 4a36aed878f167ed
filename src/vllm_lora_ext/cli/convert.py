"""``vllm-lora convert SRC --to 2d|3d -o DIR``: rewrite an adapter's MoE blocks in the other layout (same delta)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_lora_ext.cli._args import add_base_config, add_output, add_source, positive_int, resolve_offline
from vllm_lora_ext.outputs import claim_output


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="rewrite MoE expert weights as 2D per-expert or PEFT 3D fused keys",
                       description="Rewrite an adapter's MoE blocks as 2D per-expert keys or PEFT 3D fused keys; the "
                                   "delta is kept exactly, dense modules are copied. Each block's E, H, I and projection "
                                   "names are recorded in the output's weight file, so it converts back without "
                                   "--base-config (3D -> 2D -> 3D bit for bit). PEFT's 3D gate_up_proj has one lora_A "
                                   "for gate and up: 2D experts whose gate and up A differ become one A of twice the "
                                   "rank (the delta is the same; serving needs that --max-lora-rank). A dense "
                                   "adapter, or one already in that layout, is refused.")
    add_source(p)
    p.add_argument("--to", choices=["2d", "3d"], required=True, help="the layout to write")
    add_output(p, folder="output folder (PEFT format)", over="over the source")
    add_base_config(p, needed_for="sizes of 3D inputs")
    p.add_argument("--num-experts", type=positive_int, default=None, metavar="N", help="the expert count, where nothing else says it")
    p.add_argument("--rename", action="store_true",
                   help="name 2D projections gate_proj/up_proj/down_proj (default: keep the source's, e.g. w1/w3/w2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rename and args.to != "2d" and not getattr(args, "quiet", False):
        print("note: --rename has no effect with --to 3d: it names 2D projections (3D keys have one name each)",
              file=sys.stderr)
    resolved = resolve_offline(args.source)  # before torch is imported: a bad or missing source answers at once
    with claim_output(args.output, inputs=[resolved.weights_path], force=args.force) as out:  # and a bad output
        from vllm_lora_ext.offline_ops import base_config_for, require_safetensors
        from vllm_lora_ext.offline_writes import convert_adapter
        from vllm_lora_ext.summary import load_config

        require_safetensors(resolved, name=args.source)
        base, base_from = base_config_for(load_config(resolved, name=args.source), args.base_config)
        if base_from and not args.base_config:
            print(f"base config: {base_from}")
        written = convert_adapter(resolved, out, to=args.to, base_config=base, num_experts=args.num_experts,
                                  rename=args.rename, name=args.source)
    def top_rank(config: Any) -> int:
        return max([config.r, *config.rank_pattern.values()])

    rank = top_rank(load_config(resolve_offline(str(written)), name="output"))
    print(f"wrote {out.path}" + (f" (rank {rank}: gate and up had different lora_A, which 3D's gate_up_proj shares; "
                                 f"serve with --max-lora-rank that high)"
                                 if rank > top_rank(load_config(resolved, name=args.source)) else ""))
    return 0
