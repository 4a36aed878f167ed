"""Probe (issue 12 P2): where an EP rank's build of a 2D expert adapter goes, against EP=1's, phase by phase.

``bench_ep_read.py`` times a rank's whole build. This probe splits the same builds (``build_adapter``, the worker's
own, in one process, EP=1 and EP=8 interleaved) into the header (`SafetensorsReader`), the plan (`plan_adapter`),
the host arena, the MoE read (`read_blocks`, its ``preadv`` time summed over the reading threads) and the pack, and
then times bare reads of the same bytes, one thread, ``preadv`` into memory of three kinds:

- **arena**: a new huge-page host arena (what a build reads into);
- **new**: a new ``torch.empty`` (4 KiB pages);
- **touched**: memory already written once (no page faults).

for all of the file's tensor bytes (EP=1) and for the runs of the rank's experts (EP=8), so that a rank's read rate
can be put beside EP=1's. It is a probe: no stock counterpart (stock's phases differ), nothing here is a loader.

With ``--workers 1,2``, the rank's build is also timed with that many reading threads (``read_blocks``'s own choice
is 4 on a host with 4 or more cores).

Usage: python bench/probe_ep_phases.py [--layers 12] [--ep 8] [--reps 7] [--workers 1,2] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PhaseTimes, median, print_table, write_json  # noqa: E402
from bench_moe_load import E, H, I, make_adapter  # noqa: E402


def main() -> None:
    import torch

    import vllm_lora_ext.building as building
    import vllm_lora_ext.reader as reader
    from vllm_lora_ext.building import BuildJob, build_adapter
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.transport.arena import HostArena
    from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--folder", default=None, help="an adapter made by bench_moe_load.make_adapter (2D) to reuse")
    ap.add_argument("--workers", default="", help="also time the rank's build with these read_blocks thread counts "
                                                   "(e.g. 1,2; default: the build's own choice only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a serving process runs torch

    if args.folder:
        folder = Path(args.folder)
    else:
        folder = make_adapter(Path(tempfile.mkdtemp(prefix="probe-ep-")) / "2d", args.layers, "2d")
        os.sync()
    path = folder / "adapter_model.safetensors"

    acc = PhaseTimes()
    timed = acc.timed

    building.SafetensorsReader = timed("header", building.SafetensorsReader)
    building.plan_adapter = timed("plan", building.plan_adapter)
    # the build makes its host arena with Arena.anonymous: that alone is timed (its annotations are not evaluated)
    building.Arena = SimpleNamespace(anonymous=timed("arena", building.Arena.anonymous),  # type: ignore[assignment]
                                     in_file=building.Arena.in_file)
    threads: dict[str, int | None] = {"workers": None}
    read_blocks = building.read_blocks

    def read_blocks_with(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if threads["workers"] is not None:
            k["options"] = dataclasses.replace(k["options"], workers=threads["workers"])
        return read_blocks(*a, **k)

    building.read_blocks = timed("read_blocks", read_blocks_with)
    building.pack_block = timed("pack", building.pack_block)
    reader._preadv_exactly = timed("preadv (sum over threads)", reader._preadv_exactly)

    blocks = [f"model.layers.{layer}.mlp.experts" for layer in range(args.layers)]

    def model(ep: int) -> ModelSpec:
        return ModelSpec(frozenset(), moe={p: MoESpec(p, E, H, I) for p in blocks},
                         local_experts={p: tuple(range(E // ep)) for p in blocks} if ep > 1 else {}, max_rank=16)

    def build(ep: int, workers: int | None = None) -> dict[str, float]:
        acc.clear()
        threads["workers"] = workers
        t = time.perf_counter()
        built = build_adapter(BuildJob(str(folder), "probe", model(ep), dtype=torch.bfloat16), PeftKeyRouter())
        acc["total"] = time.perf_counter() - t
        acc["bytes"] = built.bytes_read
        del built
        return dict(acc)

    for ep in (1, args.ep):  # warm: imports, allocator, pools
        build(ep)
    runs: dict[int, list[dict[str, float]]] = {1: [], args.ep: []}
    sweep = [int(w) for w in args.workers.split(",") if w]
    by_workers: dict[int, list[dict[str, float]]] = {w: [] for w in sweep}
    for r in range(args.reps):
        for ep in ((1, args.ep) if r % 2 == 0 else (args.ep, 1)):
            runs[ep].append(build(ep))
        for w in sweep:
            by_workers[w].append(build(args.ep, w))

    # Bare reads of the same bytes: all of the tensors (EP=1); the rank's experts' runs (EP=ep).
    hdr = reader.read_header(path)
    local = {str(e) for e in range(E // args.ep)}
    spans = sorted(hdr.offsets[k] for k in hdr.offsets if k.split(".experts.")[1].split(".")[0] in local)
    runs_rank: list[list[int]] = []
    for a, b in spans:
        if runs_rank and runs_rank[-1][1] == a:
            runs_rank[-1][1] = b
        else:
            runs_rank.append([a, b])
    first, last = min(o[0] for o in hdr.offsets.values()), max(o[1] for o in hdr.offsets.values())
    cases = {"EP=1": [[first, last]], f"EP={args.ep}": runs_rank}
    fd = os.open(path, os.O_RDONLY)
    bare: dict[str, dict[str, list[float]]] = {}
    touched = {name: torch.ones(sum(b - a for a, b in rr), dtype=torch.uint8) for name, rr in cases.items()}

    def read_into(buf: torch.Tensor, rr: list[list[int]]) -> None:
        view = memoryview(buf.numpy())
        at = 0
        for a, b in rr:
            n = b - a
            got = 0
            while got < n:  # 1 GiB at most a call
                got += os.preadv(fd, [view[at + got:at + min(n, got + (1 << 30))]], a + got)
            at += n

    try:
        for r in range(args.reps):
            for name, rr in (cases.items() if r % 2 == 0 else reversed(cases.items())):
                nbytes = sum(b - a for a, b in rr)
                for kind in ("arena", "new", "touched"):
                    t = time.perf_counter()
                    if kind == "arena":
                        arena = HostArena(nbytes + 4096)
                        read_into(arena.empty((nbytes,), torch.uint8), rr)
                    elif kind == "new":
                        read_into(torch.empty(nbytes, dtype=torch.uint8), rr)
                    else:
                        read_into(touched[name], rr)
                    bare.setdefault(name, {}).setdefault(kind, []).append(time.perf_counter() - t)
                    if kind == "arena":
                        arena.close()
                        del arena
    finally:
        os.close(fd)

    phases = ["total", "header", "plan", "arena", "read_blocks", "preadv (sum over threads)", "pack"]
    rows = []
    med = {ep: {p: median([x.get(p, 0.0) for x in runs[ep]]) * 1e3 for p in phases} for ep in runs}
    for p in phases:
        rows.append([p, med[1][p], med[args.ep][p], med[args.ep][p] / med[1][p] if med[1][p] else "-"])
    print_table(rows, ["phase (build_adapter)", "EP=1 ms", f"EP={args.ep} ms", "ratio"])
    if sweep:
        print_table([[w, median([x["total"] for x in by_workers[w]]) * 1e3,
                      median([x["read_blocks"] for x in by_workers[w]]) * 1e3] for w in sweep],
                    [f"EP={args.ep} read threads", "total ms", "read_blocks ms"])
    rows2 = []
    for name, rr in cases.items():
        nbytes = sum(b - a for a, b in rr)
        for kind in ("arena", "new", "touched"):
            ms = median(bare[name][kind]) * 1e3
            rows2.append([name, len(rr), nbytes / 2**20, kind, ms, nbytes / ms / 1e6])
    print_table(rows2, ["bytes of", "preadv runs", "MiB", "into", "ms", "GB/s"])
    write_json("ep_phases", {"layers": args.layers, "ep": args.ep, "reps": args.reps, "builds": runs, "rank_builds_by_read_threads": by_workers,
                             "build_median_ms": med, "bare_seconds": bare, "bare_table": rows2,
                             "bytes_read": {ep: runs[ep][0]["bytes"] for ep in runs}}, args.out)


if __name__ == "__main__":
    main()
