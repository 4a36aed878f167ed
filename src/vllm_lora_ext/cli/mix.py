"""``vllm-lora mix SRC=W [SRC=W ...] -o DIR``: write the exact weighted mix as a standard PEFT adapter."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.errors import MixError
from vllm_lora_ext.mixing import MAX_MIX_COMPONENTS, check_weight, parse_weight
from vllm_lora_ext.offline_ops import load_base_config, mix_adapter_files
from vllm_lora_ext.outputs import check_output_dir
from vllm_lora_ext.sources import resolve_source


def add_parser(sub: Any) -> None:
    p = sub.add_parser("mix", help="write Σ w·s·B·A of several adapters (rank concatenation) as one PEFT adapter")
    p.add_argument("items", nargs="+", help="NAME_OR_SOURCE=WEIGHT (names from --config, else sources)")
    p.add_argument("-o", "--output", required=True, help="output folder; new or empty")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder or over a source")
    p.add_argument("--config", default=None, help="deployment config (names -> sources, default weights)")
    p.add_argument("--base-config", default=None,
                   help="the base model's config.json, its folder, or hf:org/model (needed for 3D MoE inputs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if len(args.items) > MAX_MIX_COMPONENTS:
        raise MixError(f"{len(args.items)} adapters is more than the {MAX_MIX_COMPONENTS} one mix may have.")
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
        w = parse_weight(weight, name=name) if weight else check_weight(default, name=name)
        pairs.append((resolve_source(source), w))
    out = check_output_dir(args.output, inputs=[r.weights_path for r, _ in pairs], force=args.force)
    base = load_base_config(args.base_config) if args.base_config else None
    mix_adapter_files(pairs, out, base_config=base)
    print(f"wrote {out} (rank-concatenated mix of {len(pairs)} adapters)")
    return 0
