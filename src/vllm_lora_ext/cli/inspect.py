"""``vllm-lora inspect SOURCE``: layout, modules, ranks, scaling, dtypes and bytes of an adapter."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_lora_ext.sources import resolve_source
from vllm_lora_ext.summary import AdapterSummary, summarize_adapter


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what an adapter holds (reads headers only)")
    p.add_argument("source", help="hf:org/repo[@rev][:path], a local adapter folder or .safetensors file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all-modules", action="store_true", help="list every module (default: at most 40 rows)")
    p.set_defaults(func=run)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render(summary: AdapterSummary, *, max_rows: int | None = 40) -> str:
    lines = [
        f"source      {summary.source}",
        f"weights     {summary.weights_path}",
        f"config      {summary.config_path or '(none)'}  [rule: {summary.config_rule}]",
    ]
    if summary.commit:
        lines.append(f"commit      {summary.commit}")
    lines += [
        f"layout      {summary.layout}" + (f"  ({len(summary.layers)} MoE blocks: "
                                           + ", ".join(sorted(set(summary.layers.values()))) + ")" if summary.layers else ""),
        f"r / alpha   {summary.r} / {summary.lora_alpha:g}" + ("  (rsLoRA)" if summary.use_rslora else ""),
        f"tensors     {summary.num_tensors}, {_fmt_bytes(summary.total_bytes)}",
        "",
    ]
    header = ("module", "kind", "rank", "alpha", "scaling", "A shape", "B shape", "dtype", "bytes")
    rows = [(m.module, m.kind, str(m.rank), f"{m.alpha:g}", f"{m.scaling:.4g}", "x".join(map(str, m.shape_a)),
             "x".join(map(str, m.shape_b)), m.dtype, _fmt_bytes(m.nbytes)) for m in summary.modules]
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


def run(args: argparse.Namespace) -> int:
    summary = summarize_adapter(resolve_source(args.source))
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(render(summary, max_rows=None if args.all_modules else 40))
    return 0
