"""``vllm-lora mix SRC=W [SRC=W ...] -o DIR``: write the exact weighted mix as a standard PEFT adapter."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.errors import MixError
from vllm_lora_ext.offline_ops import mix_adapter_files
from vllm_lora_ext.sources import resolve_source


def add_parser(sub: Any) -> None:
    p = sub.add_parser("mix", help="write Σ w·s·B·A of several adapters (rank concatenation) as one PEFT adapter")
    p.add_argument("items", nargs="+", help="NAME_OR_SOURCE=WEIGHT (names from --config, else sources)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--config", default=None, help="deployment config (names -> sources, default weights)")
    p.add_argument("--base-config", default=None, help="the base model's config.json (needed for 3D MoE inputs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dep = read_deployment_config(args.config) if args.config else None
    pairs = []
    for item in args.items:
        name, eq, weight = item.rpartition("=")
        if not eq:
            name, weight = item, ""
        if dep is not None and name in dep.adapters:
            source, default = dep.adapters[name].source.canonical(), dep.adapters[name].weight
        else:
            source, default = name, 1.0
        try:
            w = float(weight) if weight else default
        except ValueError:
            raise MixError(f"Weight {weight!r} in {item!r} is not a number; write NAME=0.7.") from None
        pairs.append((resolve_source(source), w))
    base = json.loads(open(args.base_config).read()) if args.base_config else None
    out = mix_adapter_files(pairs, args.output, base_config=base)
    print(f"wrote {out} (rank-concatenated mix of {len(pairs)} adapters)")
    return 0
