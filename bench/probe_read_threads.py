"""Probe how many threads an MoE adapter's build should read its blocks on, on this host's CPU.

The worker's build (``building.build_adapter``: header, plan, reads into a huge-page host arena, checks, pack)
reads MoE blocks on ``read_blocks``' pool, 4 threads by default (a 16-core H200 host, round 5, 2D: 1 thread
3.0 s, 4 threads 1.6 s, 8 threads 2.7 s, when each key cost more Python than now). A 3D block is a few large
reads and transposes that release the GIL, so it may take more. This times the same builds of the
Qwen3-30B-A3B-shaped 2D and 3D adapters (48 layers, r16) at several pool sizes, interleaved, in one process
after one warm-up build of each, with the plugin's defaults otherwise (scans on their own pool). No GPU, no
stock counterpart: it only picks the default. Each build's factors are compared bitwise with the first.

``--bound`` also times 3D builds whose B is read untransposed (wrong values: the bound an offload of that
transpose could reach); ``--gpu`` times 3D builds that transpose B on this machine's GPU
(``build_adapter(transpose_on=...)``), interleaved with the CPU's and checked bitwise against them.

Usage: python bench/probe_read_threads.py [--threads 2,4,6,8,12] [--reps 5] [--layers 48] [--bound] [--gpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_moe_load import E, H, I, make_adapter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="2,4,6,8,12")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--forms", default="3d,2d")
    ap.add_argument("--bound", action="store_true",
                    help="also time 3D builds whose B is read as it lies, untransposed and unscaled (wrong values): "
                         "the bound any offload of that transpose could reach, before its transfers")
    ap.add_argument("--gpu", action="store_true",
                    help="also time 3D builds whose B is transposed on this machine's GPU (4 threads), bitwise checked")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from vllm_lora_ext import building
    from vllm_lora_ext.building import BuildJob, build_adapter
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks
    from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter

    threads = [int(x) for x in args.threads.split(",")]
    blocks = [f"model.layers.{layer}.mlp.experts" for layer in range(args.layers)]
    model = ModelSpec(frozenset(), moe={p: MoESpec(p, E, H, I) for p in blocks}, max_rank=16)
    tmp = Path(tempfile.mkdtemp(prefix="probe-threads-"))
    times: dict[str, dict[int, list[float]]] = {}
    same: dict[str, bool] = {}
    for form in args.forms.split(","):
        folder = make_adapter(tmp / form, args.layers, form)
        job = BuildJob(str(folder), "probe", model, dtype=torch.bfloat16)

        def build(n: int, on: torch.device | None = None) -> tuple[float, list[torch.Tensor]]:
            def with_workers(*a, options: ReadOptions = ReadOptions(), **k):  # noqa: ANN002, ANN003, ANN202
                return read_blocks(*a, options=dataclasses.replace(options, workers=n), **k)

            building.read_blocks = with_workers  # type: ignore[attr-defined]
            try:
                gc.collect()
                t0 = time.perf_counter()
                built = build_adapter(job, PeftKeyRouter(), transpose_on=on)
                dt = time.perf_counter() - t0
            finally:
                building.read_blocks = read_blocks  # type: ignore[attr-defined]
            return dt, [t for p in blocks for side in built.moe[p][:2] for t in side]

        if form == "3d" and args.bound:
            times["3d-B-untransposed"] = {4: []}
            for rep in range(args.reps):
                with _b_as_it_lies():
                    dt = build(4)[0]
                times["3d-B-untransposed"][4].append(dt)
                print(f"3d, B untransposed, 4 threads: {dt:.3f} s", flush=True)
        _, reference = build(threads[0])  # warm-up: imports, pools, the page cache
        same[form] = True
        times[form] = {n: [] for n in threads}
        gpu = torch.device("cuda", torch.cuda.current_device()) if args.gpu and form == "3d" else None
        if gpu is not None:
            build(4, gpu)  # warm-up: the streams, the allocator
            times["3d-B-on-gpu"] = {4: []}
            same["3d-B-on-gpu"] = True
        for rep in range(args.reps):
            for n in (threads if rep % 2 == 0 else threads[::-1]):
                dt, got = build(n)
                times[form][n].append(dt)
                same[form] = same[form] and all(torch.equal(x, y) for x, y in zip(got, reference))
                del got
                print(f"{form} {n} threads: {dt:.3f} s", flush=True)
                if gpu is not None and n == 4:
                    dt, got = build(4, gpu)
                    times["3d-B-on-gpu"][4].append(dt)
                    same["3d-B-on-gpu"] = same["3d-B-on-gpu"] and all(torch.equal(x, y) for x, y in zip(got, reference))
                    del got
                    print(f"3d, B on the GPU, 4 threads: {dt:.3f} s", flush=True)
        del reference
    rows = []
    for form, by_n in times.items():
        base = median(times[form.split("-")[0]][4]) if 4 in times.get(form.split("-")[0], {}) else None
        for n, ts in by_n.items():
            rows.append([form, n, median(ts), min(ts), max(ts), (median(ts) / base) if base else "-"])
    print_table(rows, ["layout", "threads", "median s", "min s", "max s", "/ its layout at 4 threads"])
    print("every build bitwise equal to the first:", same)
    write_json("read_threads", {"layers": args.layers, "reps": args.reps, "times": times, "table": rows,
                                "bitwise_equal": same}, args.out)


def _b_as_it_lies() -> Any:
    """A context in which ``SafetensorsReader.read_transposed`` reads the tensor's bytes into its result as they lie."""
    import contextlib
    import math
    import os

    import torch

    from vllm_lora_ext import reader

    real = reader.SafetensorsReader.read_transposed

    def as_it_lies(self: Any, key: str, cols: int, into: Any = None, *, scale: Any = None, dtype: Any = None) -> Any:
        dt = reader.torch_dtype_of(self.header.dtypes[key], key=key)
        rows = math.prod(self.header.shapes[key]) // cols
        out = into((cols, rows), dt) if into is not None else torch.empty((cols, rows), dtype=dt)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            reader._preadv_exactly(fd, [memoryview(out.view(-1).view(torch.uint8).numpy())],
                                   self.header.offsets[key][0], path=self.path, key=key)
        finally:
            os.close(fd)
        return out

    @contextlib.contextmanager
    def patched() -> Any:
        reader.SafetensorsReader.read_transposed = as_it_lies  # type: ignore[method-assign]
        try:
            yield
        finally:
            reader.SafetensorsReader.read_transposed = real  # type: ignore[method-assign]

    return patched()


if __name__ == "__main__":
    main()
