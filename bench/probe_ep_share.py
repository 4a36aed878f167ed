"""Probe (issue 12 P2, 2D): what an EP rank would spend if it parsed and checked only its share of the header.

Today every EP rank parses the whole header, checks every entry against the file and plans every key (no key is
dropped silently), then reads only its experts' bytes. At EP=8 the header and plan then cost more than the read.
A design the plugin does not have, and whose trade-off is the owner's to choose: every worker must build an
adapter before a request is admitted, so EP ranks could split the header's checks, each parsing and checking a
1/EP slice of the entries plus its own experts' entries (and every non-expert entry), so that together they
check everything.

This probe times the work such a rank would do, in one process, interleaved with today's build of the same rank:

- **today**: `build_adapter` of rank 0 at EP (header, plan and checks of every key, the read of its experts);
- its **header + plan** alone (`read_header`, `plan_adapter`), so that **read** = today − header + plan;
- **share**: the header's bytes split into entries at their ``]},"`` boundaries (a probe: it assumes
  safetensors' own compact form, and the key pattern below), the bulk parse and checks of the rank's slice
  (`_check_header_in_bulk`, as `read_header` runs them), the entries of the rank's experts found by one search of
  the header for their key endings, and every entry whose key has no ``.experts.``, parsed and planned with `plan_adapter`;
- **estimate** = share + read, against today's EP=1 build in the same process.

It builds no loader and checks nothing of its own output beyond the key counts; it measures a cost, not a
feature. No stock counterpart: stock vLLM has no such split either.

Usage: python bench/probe_ep_share.py [--layers 12] [--ep 8] [--reps 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import operator
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_moe_load import ALPHA, E, H, I, R, make_adapter  # noqa: E402


def main() -> None:
    import struct

    import torch

    from vllm_lora_ext.building import BuildJob, build_adapter
    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter, plan_adapter
    from vllm_lora_ext.headers import _check_header_in_bulk, read_header

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = make_adapter(Path(tempfile.mkdtemp(prefix="probe-ep-share-")) / "2d", args.layers, "2d")
    path = folder / "adapter_model.safetensors"
    blocks = [f"model.layers.{layer}.mlp.experts" for layer in range(args.layers)]
    moe = {p: MoESpec(p, E, H, I) for p in blocks}
    local = tuple(range(E // args.ep))

    def spec(ep: int) -> ModelSpec:
        return ModelSpec(frozenset(), moe=moe, local_experts={p: local for p in blocks} if ep > 1 else {},
                         max_rank=16)

    config = config_from_dict({"r": R, "lora_alpha": ALPHA})
    ids = "|".join(map(str, local))
    own = re.compile(rf"\.experts\.(?:{ids})\.[^.\"]+\.lora_[AB]\.weight\":\{{".encode())  # this rank's experts

    def today(ep: int) -> float:
        t = time.perf_counter()
        build_adapter(BuildJob(str(folder), "probe", spec(ep), dtype=torch.bfloat16), PeftKeyRouter())
        return time.perf_counter() - t

    def header_and_plan() -> float:
        t = time.perf_counter()
        h = read_header(path)
        plan_adapter(h.shapes, config, spec(args.ep), router=PeftKeyRouter(), dtypes=h.dtypes)
        return time.perf_counter() - t

    counts: dict[str, int] = {}

    def share() -> float:
        t = time.perf_counter()
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            body = f.read(n).rstrip(b" ")
        parts = body[2:-1].split(b']},"')  # entry texts: 'key":{"dtype":...,"data_offsets":[s,e' 
        cut = len(parts) // args.ep  # rank 0's slice
        # the slice parsed and checked as the header is (every check runs; its end is not the file's: it answers None)
        _check_header_in_bulk(b'{"' + b']},"'.join(parts[:cut]) + b"]}}", 0)
        # this rank's experts' entries, found where their keys end (a literal-led search), each cut out whole,
        # then every entry whose key has no ".experts." (C-level passes over the entry texts)
        mine = [body[body.rfind(b'"', 0, m.start()) + 1:body.find(b"]}", m.end())] for m in own.finditer(body)]
        mine += itertools.compress(parts, map(operator.not_, map(operator.contains, parts, itertools.repeat(b".experts."))))
        entries = json.loads(b'{"' + b']},"'.join(mine) + b"]}}")
        shapes = {k: tuple(v["shape"]) for k, v in entries.items()}
        plan_adapter(shapes, config, spec(args.ep), router=PeftKeyRouter(), dtypes={k: v["dtype"] for k, v in entries.items()})
        counts.update(entries=len(parts), slice=cut, own=len(entries))
        return time.perf_counter() - t

    for f in (today, header_and_plan, share):  # warm every path once
        f(args.ep) if f is today else f()
    times: dict[str, list[float]] = {k: [] for k in ("today EP=1", f"today EP={args.ep}", "header + plan", "share")}
    for _ in range(args.reps):
        times["today EP=1"].append(today(1))
        times[f"today EP={args.ep}"].append(today(args.ep))
        times["header + plan"].append(header_and_plan())
        times["share"].append(share())
    med = {k: median(v) for k, v in times.items()}
    read = med[f"today EP={args.ep}"] - med["header + plan"]
    estimate = med["share"] + read
    rows = [[k, v * 1e3, v / med["today EP=1"]] for k, v in med.items()]
    rows += [["read (today − header + plan)", read * 1e3, read / med["today EP=1"]],
             ["estimate (share + read)", estimate * 1e3, estimate / med["today EP=1"]]]
    print_table(rows, ["what", "ms (median)", "/ today EP=1"])
    print("entries:", counts, f"(own: the {len(local)} local experts' keys of every layer, and no other key)")
    write_json("ep_share", {"layers": args.layers, "ep": args.ep, "reps": args.reps, "seconds": times,
                            "median_ms": {k: v * 1e3 for k, v in med.items()}, "read_ms": read * 1e3,
                            "estimate_ms": estimate * 1e3, "estimate_over_ep1": estimate / med["today EP=1"],
                            "today_over_ep1": med[f"today EP={args.ep}"] / med["today EP=1"], "counts": counts},
               args.out)


if __name__ == "__main__":
    main()
