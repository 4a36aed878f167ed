"""``vllm-lora fetch SOURCE...``: download adapters into the Hugging Face cache and print the pinned sources."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_lora_ext.errors import DiskCacheFullError
from vllm_lora_ext.sources import fetch_source


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fetch", help="pre-download adapters into the HF cache (for offline serving)",
                       description="Download each adapter's weight file and config into the Hugging Face cache and "
                                   "print the source pinned to its commit. Run it where the Hub is reachable, then "
                                   "serve with HF_HUB_OFFLINE=1. With HF_HUB_OFFLINE=1 set, it only reports sources "
                                   "already cached. Every source is tried; the exit code is 1 if any failed.")
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="hf:org/repo[@rev][:path] sources")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="HF cache folder (default: huggingface_hub's, from HF_HOME or "
                                                     "HF_HUB_CACHE)")
    p.add_argument("--json", action="store_true", help="print one JSON object per source")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failed, held = 0, []
    try:
        for source in args.sources:
            failed += _fetch_one(args, source, held)
    finally:
        for h in held:
            h.release()
    return 1 if failed else 0


def _fetch_one(args: argparse.Namespace, source: str, held: list[Any]) -> int:
    """Fetch and report ``source``; return 1 if it failed. A fetched ``hf:`` revision stays held until the command
    ends, so that a later source's download cannot evict it under a disk bound (that download is refused instead,
    and the command exits 1): every revision reported fetched is in the cache when the command ends."""
    import sys
    import traceback

    from vllm_lora_ext.cli._args import one_line, said_beside_own
    from vllm_lora_ext.diskholds import hold

    try:
        r = fetch_source(source, cache_dir=args.cache_dir)
        if r.source.kind == "hf" and r.source.repo_id and r.commit:
            try:
                held.append(hold(r.source.repo_id, r.commit, why="fetched by vllm-lora fetch",
                                 cache_dir=args.cache_dir))
            except OSError:  # a cache this command cannot write: nothing here evicts from it either
                pass
            if not all(p is None or p.exists() for p in (r.weights_path, r.config_path)):  # evicted before the hold
                r = fetch_source(source, cache_dir=args.cache_dir)  # (held now: fetched again, it stays)
    except Exception as err:  # the other sources are still fetched (or checked offline); Ctrl-C still stops
        if isinstance(err, DiskCacheFullError):  # never raises: the sources after it are still fetched
            err = said_beside_own(err, held, done="fetched", fewer="fetch fewer sources", cache_dir=args.cache_dir)
        if getattr(args, "verbose", 0) > 1:
            traceback.print_exc()
        if args.json:
            print(json.dumps({"source": source, "error": one_line(err)}))
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    record = {"source": source, "pinned": r.source.canonical(), "commit": r.commit,
              "weights": str(r.weights_path), "config": str(r.config_path) if r.config_path else None,
              "config_rule": r.config_rule, "config_note": r.config_note}
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{source} -> {record['pinned']}\n  weights {record['weights']}\n  config  {record['config']} "
              f"[{record['config_rule']}]" + (f"\n          {r.config_note}" if r.config_note else ""))
    return 0
