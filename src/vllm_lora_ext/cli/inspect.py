"""``vllm-lora inspect SOURCE``: layout, modules, ranks, scaling, dtypes and bytes of an adapter, and the problems
the loader would refuse it for that show in the adapter itself (``problem:`` lines; ``--strict`` exits 1 when there
is one). Dense modules are checked against the model's own modules only when it loads."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from vllm_lora_ext._util import fmt_bytes
from vllm_lora_ext.cli._args import add_base_config, add_source, plural, positive_int, resolve_offline
from vllm_lora_ext.unapplied import unapplied_on_base

if TYPE_CHECKING:
    from vllm_lora_ext.summary import AdapterSummary


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what an adapter holds (reads headers only, unless --values)",
                       description="Show an adapter's layout, modules, ranks, alpha, scaling, shapes, dtypes and "
                                   "bytes, reading headers only, and a problem: line for what the loader would refuse "
                                   "or scale wrongly in the adapter itself (its files, config, ranks, MoE layout and, "
                                   "with a base config, MoE sizes); dense modules' names and shapes are checked "
                                   "against the model when it loads. A fused 3D adapter's sizes come from "
                                   "--base-config, else from the base model's config.json when its "
                                   "base_model_name_or_path is in the local Hugging Face cache, else from its own "
                                   "shapes where they allow one reading.")
    add_source(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all-modules", action="store_true", help="list every module (default: at most 40 rows)")
    add_base_config(p, needed_for="MoE sizes for 3D adapters")
    p.add_argument("--ep-size", type=positive_int, default=None, metavar="N",
                   help="show what each expert-parallel rank would read")
    p.add_argument("--values", action="store_true",
                   help="also read every factor and report NaN or infinity (the loader refuses them as it reads)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any problem: line is printed")
    p.set_defaults(func=run)


def render(summary: AdapterSummary, *, max_rows: int | None = 40) -> str:
    lines = [
        f"source      {summary.source}",
        f"weights     {summary.weights_path}",
        f"config      {summary.config_path or '(none)'}  [rule: {summary.config_rule}]",
        *([f"            {summary.config_note}"] if summary.config_note else []),
    ]
    if summary.commit:
        lines.append(f"commit      {summary.commit}")
    lines += [
        f"layout      {summary.layout}" + (f"  ({plural(len(summary.layers), 'MoE block')}: "
                                           + ", ".join(sorted(set(summary.layers.values()))) + ")" if summary.layers else ""),
        f"r / alpha   {summary.r} / {summary.lora_alpha:g}" + ("  (rsLoRA)" if summary.use_rslora else ""),
        f"tensors     {summary.num_tensors}, {fmt_bytes(summary.total_bytes)}",
        "",
    ]
    header = ("module", "kind", "rank", "alpha", "scaling", "A shape", "B shape", "dtype", "bytes")
    rows = [(m.module, m.kind, str(m.rank), f"{m.alpha:g}", f"{m.scaling:.4g}", "x".join(map(str, m.shape_a)),
             "x".join(map(str, m.shape_b)), m.dtype, fmt_bytes(m.nbytes)) for m in summary.modules]
    shown = rows if max_rows is None else rows[:max_rows]
    widths = [max(len(r[i]) for r in [header, *shown]) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines.append(fmt.format(*header))
    lines += [fmt.format(*r) for r in shown]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more modules (--all-modules to list them)")
    for p in summary.problems:
        lines.append(f"problem: {p}")
    return "\n".join(lines)


def _moe_report(resolved: Any, base_config: dict | None, ep_size: int | None, *, name: str) -> dict[str, Any]:
    from vllm_lora_ext.errors import ExpertCountError, ExpertLayoutError, VllmLoraExtError
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_plan import plan_experts
    from vllm_lora_ext.offline_ops import ep_read_plan, infer_moe_specs, is_moe_config, recorded_moe_sizes
    from vllm_lora_ext.headers import read_header
    from vllm_lora_ext.summary import load_config

    header = read_header(resolved.weights_path)
    config = load_config(resolved, name=name)
    recorded = recorded_moe_sizes(header.metadata)
    groups = group_moe_keys(header.shapes)
    base_from: str | None = "--base-config" if base_config is not None else None
    if base_config is None:
        from vllm_lora_ext.offline_ops import base_config_for

        base_config, base_from = base_config_for(config, None)
    specs: dict[str, MoESpec] = {}
    notes: dict[str, str] = {}
    unsettled: dict[str, str] = {}
    contradicted: dict[str, str] = {}
    wrong_base: list[str] = []
    if base_config is not None and not is_moe_config(base_config):  # sizes from the adapter's own shapes instead
        wrong_base.append(f"{base_from}: not an MoE model's config (it names no expert count); the MoE blocks' "
                          f"sizes below come from the adapter itself. Pass the MoE base model's config.json.")
        base_config, base_from = None, None
    for prefix, group in groups.items():  # block by block: one ambiguous block leaves the others inspected
        try:
            found, why = infer_moe_specs(group, base_config=base_config, config=config, recorded=recorded,
                                         base_from=base_from or "--base-config")
            specs.update(found)
            notes.update(why)
        except ExpertCountError as err:  # sizes given that contradict the adapter: wrong, not just unknown
            contradicted[prefix] = " ".join(str(err).split())
        except ExpertLayoutError as err:
            unsettled[prefix] = str(err)
    blocks: dict[str, Any] = {prefix: {"contradicted": reason} for prefix, reason in contradicted.items()}
    problems: list[str] = wrong_base + list(contradicted.values())
    for prefix, spec in specs.items():
        try:
            plan = plan_experts(groups[prefix], spec, config=config, adapter=name)
        except VllmLoraExtError as err:  # sizes settled, yet the loader would refuse the block
            problems.append(" ".join(str(err).split()))
            continue
        blocks[prefix] = {"experts": spec.num_experts, "hidden": spec.hidden, "intermediate": spec.intermediate,
                          "layout": plan.layout, "sizes": notes.get(prefix, ""),
                          "2d": sorted({f"{k.role} r={k.rank}" for k in plan.keys_2d}),
                          "3d": [f"{k.role} {k.orientation} r={k.rank}" for k in plan.keys_3d]}
    for prefix, reason in unsettled.items():
        blocks[prefix] = {"unsettled": reason}
    report: dict[str, Any] = {"moe_blocks": blocks, "base_config": base_from, "problems": problems}
    if unsettled or problems:
        ep_size = None  # a read plan needs every block's sizes
    if ep_size:
        report["ep"] = ep_read_plan(header.shapes, header.header_bytes,
                                    {k: v.nbytes for k, v in header.tensors.items()}, specs, ep_size)
    return report


def run(args: argparse.Namespace) -> int:
    resolved = resolve_offline(args.source)  # first: a bad or missing source answers before more is imported
    from vllm_lora_ext.offline_ops import load_base_config, require_safetensors
    from vllm_lora_ext.summary import finite_rule, summarize_adapter

    require_safetensors(resolved, name=args.source)
    finite: list[bool] = []  # --values: set once every factor was read and none held NaN or infinity

    def values_rule() -> None:
        finite_rule(resolved, name=args.source)()
        finite.append(True)

    summary = summarize_adapter(resolved, name=args.source, extra_rules=[values_rule] if args.values else [])
    if finite and not getattr(args, "quiet", False):  # (a NaN or infinity is a problem line below; -q: no notes)
        print("note: --values: every factor was read; none holds NaN or infinity", file=sys.stderr)
    base = load_base_config(args.base_config) if args.base_config else None
    if base is not None:  # modules vLLM would accept and not apply as trained on this base (unapplied.RULES)
        notes, problems = unapplied_on_base([m.module for m in summary.modules], base)
        for line in notes:  # dropped at load by the setting: said, not a problem
            print(line, file=sys.stderr)
        summary.problems.extend(problems)
    moe = _moe_report(resolved, base, args.ep_size, name=args.source) if summary.layout.startswith("moe") else {}
    if args.ep_size and not summary.layout.startswith("moe"):
        print(f"note: --ep-size has no effect: the adapter has no expert weights (layout {summary.layout}); "
              "every rank reads all of it", file=sys.stderr)
    elif args.ep_size and "ep" not in moe:
        print("note: no EP read plan: some MoE block's sizes are not settled (see below); pass --base-config",
              file=sys.stderr)
    summary.problems.extend(moe.pop("problems", []))
    failed = 1 if args.strict and summary.problems else 0
    if args.json:
        print(json.dumps({**summary.to_json(), **moe}, indent=2))
        if failed:  # the problems are in the JSON; stderr still says why the exit code is 1
            print(f"error: {plural(len(summary.problems), 'problem')} (--strict; see \"problems\")", file=sys.stderr)
        return failed
    print(render(summary, max_rows=None if args.all_modules else 40))
    blocks = moe.get("moe_blocks", {})
    if blocks:
        print("")
        if moe.get("base_config"):
            print(f"base config: {moe['base_config']}")
        print("MoE blocks (checked against E, H, I):")
        for prefix, b in list(blocks.items())[: None if args.all_modules else 12]:
            if "contradicted" in b:
                print(f"  {prefix}: the sizes given contradict the adapter (see its problem line)")
                continue
            if "unsettled" in b:
                print(f"  {prefix}: sizes not settled: {b['unsettled']}")
                continue
            parts = ", ".join(b["2d"] + b["3d"])
            print(f"  {prefix}: {b['layout']}  E={b['experts']} H={b['hidden']} I={b['intermediate']}  [{parts}]"
                  f"  ({b['sizes']})")
        if len(blocks) > 12 and not args.all_modules:
            print(f"  ... {len(blocks) - 12} more blocks")
    for r in moe.get("ep", []):
        first = next(iter(r["experts"].values()))
        print(f"EP rank {r['rank']}: experts {first} of each block, reads {fmt_bytes(r['bytes'])}")
    if failed:
        print(f"error: {plural(len(summary.problems), 'problem')} (--strict)", file=sys.stderr)
    return failed
