"""Probe: what a mix's CPU composite copy costs on this host, by memory kind, thread count and where the weight goes.

The composite of 4 r16 adapters on 7B shapes (281 MiB, 224 modules) is concatenated with ``concat_many``
(the weight on A since round 9) and, for comparison, with round 8's form (the weight on B, written into a
few columns of every row), into: new tensors (``torch.empty``), a fresh huge-page ``HostArena`` (what
``composite.host_concat`` uses), and an arena whose pages were touched before. The process keeps torch's default
intra-op threads, as a one-GPU vLLM engine does; with 4 copy threads, each copy thread runs its ops on one OpenMP
thread (``pools.py``, round 9) or, as before, on torch's default. Cases are interleaved; medians of ``--reps``.
There is no stock counterpart: stock vLLM has no mixes (its equivalent, loading the saved composite, is timed by
``bench_new_mix.py``).

Usage: python bench/probe_mix_copy.py [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_mix import seven_b_adapters  # noqa: E402


def _weight_on_b(jobs: Any, alloc: Any, workers: int) -> dict:
    """Round 8's composite: A = cat(A_i), B = cat(c_i·B_i), each part scaled into its columns of B."""
    import torch

    from vllm_lora_ext.transport.pools import run_in_pool

    def one(key: Any) -> tuple[Any, Any]:
        parts, dim_a, dim_b = jobs[key]
        ra = sum(int(p[0].shape[dim_a]) for p in parts)
        a_shape, b_shape = list(parts[0][0].shape), list(parts[0][1].shape)
        a_shape[dim_a], b_shape[dim_b] = ra, ra
        a = alloc(tuple(a_shape), torch.bfloat16) if alloc else torch.empty(a_shape, dtype=torch.bfloat16)
        b = alloc(tuple(b_shape), torch.bfloat16) if alloc else torch.empty(b_shape, dtype=torch.bfloat16)
        off = 0
        for pa, pb, c in parts:
            r = int(pa.shape[dim_a])
            a.narrow(dim_a, off, r).copy_(pa)
            torch.mul(pb, c, out=b.narrow(dim_b, off, r))
            off += r
        return a, b

    if workers <= 1:
        return {k: one(k) for k in jobs}
    return dict(zip(jobs, run_in_pool("probe-mix", workers, one, list(jobs))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from vllm_lora_ext.transport.arena import HostArena
    from vllm_lora_ext.mixing import composite_shapes, concat_many

    from vllm_lora_ext.transport import pools

    one_thread = pools.one_intra_op_thread
    ads = seven_b_adapters()
    jobs = {k: ([(ad[k][0], ad[k][1], w) for ad, w in zip(ads, [0.4, 0.3, 0.2, 0.1])], 0, 1) for k in ads[0]}
    need = sum(math.prod(a) * 2 + math.prod(b) * 2 + 128 for a, b, _ in composite_shapes(jobs).values())

    def memory(kind: str) -> tuple[Any, Any]:
        if kind == "torch.empty":
            return None, None
        arena = HostArena(need)
        if kind == "touched arena":
            assert arena.buffer is not None
            arena.buffer.fill_(0)
        return arena, arena.empty

    def run(form: str, kind: str, workers: int, omp: str = "-") -> float:
        # the pools' threads get their OpenMP setting when made: make them again for each setting
        pools.one_intra_op_thread = one_thread if omp != "torch default" else (lambda: None)
        pools._IDLE.clear()
        arena, alloc = memory(kind)
        t0 = time.perf_counter()
        if form == "weight on A":
            done = concat_many(jobs, dtype=torch.bfloat16, alloc=alloc, workers=workers, pools=pools)
        else:
            done = _weight_on_b(jobs, alloc, workers)
        dt = time.perf_counter() - t0
        if arena is not None:
            arena.close()
        del done
        return dt

    cases: list[tuple[str, str, int, str]] = [
        (f, k, w, o) for f in ("weight on A", "weight on B (round 8)") for k in ("torch.empty", "fresh arena",
                                                                                "touched arena")
        for w, o in ((1, "-"), (4, "one"), (4, "torch default"))]
    times: dict[tuple[str, str, int, str], list[float]] = {c: [] for c in cases}
    for c in cases:  # warm-up: first-time costs of each path
        run(*c)
    for _ in range(args.reps):
        for c in cases:
            times[c].append(run(*c))
    rows = [[f, k, w, o, median(ts) * 1000] for (f, k, w, o), ts in times.items()]
    print_table(rows, ["composite form", "memory", "copy threads", "OpenMP threads each", "ms (median)"])
    write_json("probe_mix_copy", {"composite_bytes": need, "reps": args.reps, "torch_threads": torch.get_num_threads(),
                                  "ms": {" / ".join(map(str, c)): [t * 1000 for t in ts] for c, ts in times.items()},
                                  "table": rows}, args.out)


if __name__ == "__main__":
    main()
