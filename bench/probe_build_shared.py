"""Probe where a build process's build of a 48-layer MoE adapter goes on this host (issue 39 item 4; CPU only).

Times ``building.build_adapter(shared=True, arenas=ArenaSupply(2 GiB))`` as the build process runs it (its spare
file made first, torch on a quarter of the cores up to 4) for the Qwen3-30B-A3B-shaped 2D and 3D adapters of
``bench_moe_load.py``, split into phases by wrapping the functions it calls: the header, the plan, the MoE read
(``read_blocks``; its ``preadv`` time summed over the reading threads), the finiteness scans (summed over the scan
pool), the pack, then ``to_shared`` and ``from_shared``. One build of each layout is profiled (cProfile, the
calling thread). With ``--bare``, it then times ``preadv`` of the same bytes, 1 and 4 threads, into a fresh
``/dev/shm`` file, an allocated one (``Arena.in_file(populate=True)``: the spare) and touched anonymous memory.

``--src DIR`` imports the package from another tree (``git archive <rev> src/vllm_lora_ext``), to time an
earlier version on the same host; run it with and without, alternately, for a before and after (r26 ran
new, old, new, old). ``--worker`` times the build a GPU worker runs in its own thread instead
(``build_adapter(shared=False)``: read into a host arena, torch's default threads, as in ``bench_moe_load.py
--gpu``), with no hand-over; a fused 3D B is transposed on the CPU here, where the worker turns it on its GPU. No stock counterpart: stock vLLM has no build process. Without msgspec (vLLM's
dependency) headers take the entry-by-entry parse, which a serving process does not.

``--readers N`` reads on N threads instead of ``moe_read.default_readers``' 4 (r35 timed 8 on the H200 host, with
``--no-moe-scan``: no faster for a fused 3D adapter, slower for a 2D one; the rule stayed).
``--old-scan-rule`` scans on at most 2 threads, as before r32's ``moe_read.default_scan_workers`` (4 on a 16-core host).
``--no-moe-scan`` builds as a background build on a GPU does since r33 (``BuildJob(scan_moe=False)``: no scan while
read); ``--gpu-scan`` also times that scan where it then runs, on the GPU after staging (needs CUDA).

Usage: python bench/probe_build_shared.py [--layers 48] [--reps 4] [--bare] [--worker] [--src DIR] [--workdir W]
    [--forms 2d,3d] [--old-scan-rule] [--no-moe-scan] [--gpu-scan] [--readers N] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PhaseTimes, median, print_table, write_json  # noqa: E402

ACC = PhaseTimes()
_timed = ACC.timed


def _instrument() -> None:
    import importlib

    import vllm_lora_ext.building as building
    import vllm_lora_ext.reader as reader
    import vllm_lora_ext.validation as validation

    try:
        moe_read: Any = importlib.import_module("vllm_lora_ext.formats.moe_read")
    except ImportError:  # an earlier version (--src)
        moe_read = None

    for module, name, phase in ((building, "SafetensorsReader", "header"), (building, "_planned" if hasattr(building, "_planned") else "plan_adapter", "plan"),
                                (building, "read_blocks", "read_blocks"), (building, "pack_block", "pack"),
                                (reader, "_preadv_exactly", "preadv (sum over threads)"),
                                (validation, "first_nonfinite", "scan (sum over the scan pool)"),
                                (moe_read, "check_finite", "check in block (sum)")):
        if hasattr(module, name):  # an earlier version (--src) may lack one
            setattr(module, name, _timed(phase, getattr(module, name)))


def _worker_builds(job: Any, reps: int) -> tuple[list[dict[str, float]], str]:
    """``build_adapter(shared=False)`` as a GPU worker's thread runs it, ``reps`` times after one untimed."""
    from vllm_lora_ext.building import build_adapter
    from vllm_lora_ext.planning import PeftKeyRouter

    runs = []
    for r in range(reps + 1):
        ACC.clear()
        t = time.perf_counter()
        built = build_adapter(job, PeftKeyRouter(), shared=False)
        ACC["build"] = time.perf_counter() - t
        ACC["host arena"] = float(built.host is not None)
        if built.host is not None:
            built.host.close()
        t = time.perf_counter()
        del built
        ACC["drop the build"] = time.perf_counter() - t
        if r:
            runs.append(dict(ACC))
    return runs, ""


def _builds(job: Any, reps: int) -> tuple[list[dict[str, float]], str]:
    from vllm_lora_ext.building import build_adapter
    from vllm_lora_ext.planning import PeftKeyRouter
    from vllm_lora_ext.transport.arena import ArenaSupply
    from vllm_lora_ext.transport.handover import from_shared, to_shared

    arenas = ArenaSupply(2 * 2**30)
    runs = []
    for r in range(reps + 1):  # the first: imports, pools
        arenas.prepare(wait=True)
        ACC.clear()
        t = time.perf_counter()
        built = build_adapter(job, PeftKeyRouter(), shared=True, arenas=arenas)
        ACC["build"] = time.perf_counter() - t
        t = time.perf_counter()
        shared = to_shared(built, trim=False)
        ACC["to_shared"] = time.perf_counter() - t
        t = time.perf_counter()
        del built
        ACC["drop the build's views"] = time.perf_counter() - t
        t = time.perf_counter()
        handed = from_shared(shared)
        ACC["from_shared"] = time.perf_counter() - t
        if _GPU_SCAN:
            ACC.update(_gpu_scan(handed[0]))
        del handed
        if r:
            runs.append(dict(ACC))
    arenas.prepare(wait=True)
    prof = cProfile.Profile()
    prof.enable()
    built = build_adapter(job, PeftKeyRouter(), shared=True, arenas=arenas)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    if built.arena is not None:
        built.arena.discard()
    arenas.discard()
    return runs, text.getvalue()[-5000:]


_GPU_SCAN: list[bool] = []  # --gpu-scan


def _gpu_scan(built: Any) -> dict[str, float]:
    """The deferred NaN/inf scan as a background build on a GPU runs it once staged (``first_nonfinite`` over the MoE
    factors on the GPU, after a plain copy up here): its seconds, the copy's excluded."""
    import torch

    from vllm_lora_ext.validation import first_nonfinite

    named = {f"{p}.{g}[{i}]": t.to("cuda", non_blocking=False) for p, (a, b, _) in built.moe.items()
             for g, ts in (("lora_a", a), ("lora_b", b)) for i, t in enumerate(ts)}
    torch.cuda.synchronize()
    t = time.perf_counter()
    bad = first_nonfinite(named)
    out = {"GPU scan (first_nonfinite, staged)": time.perf_counter() - t}
    assert bad is None, bad
    return out


def _bare(path: Path) -> dict[str, float]:
    import torch

    from vllm_lora_ext.reader import read_header
    from vllm_lora_ext.transport.arena import Arena

    hdr = read_header(path)
    first, last = min(o[0] for o in hdr.offsets.values()), max(o[1] for o in hdr.offsets.values())
    n = last - first
    fd = os.open(path, os.O_RDONLY)

    def read(view: memoryview, threads: int) -> float:
        chunk = -(-n // threads)

        def one(i: int) -> None:
            a, b = i * chunk, min(n, (i + 1) * chunk)
            got = 0
            while got < b - a:
                got += os.preadv(fd, [view[a + got:b]], first + a + got)

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(threads)))
        return time.perf_counter() - t

    out = {}
    for kind in ("shared file, fresh", "shared file, allocated (the spare)", "anonymous, touched"):
        for threads in (1, 4):
            times = []
            for _ in range(3):
                arena = Arena.in_file(n, None, populate="allocated" in kind) if kind.startswith("shared") else None
                buf = arena.buffer if arena is not None else torch.ones(n, dtype=torch.uint8)
                times.append(read(memoryview(buf.numpy()).cast("B"), threads))
                del buf
                if arena is not None:
                    arena.discard()
            out[f"{kind}, {threads} thread(s)"] = median(times)
    os.close(fd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--bare", action="store_true", help="also time bare preadv into three kinds of memory")
    ap.add_argument("--worker", action="store_true", help="the worker's own build (no build process, no hand-over)")
    ap.add_argument("--src", default=None, help="import vllm_lora_ext from this folder (an earlier version)")
    ap.add_argument("--workdir", default=None, help="reuse (or keep) the adapters written there")
    ap.add_argument("--forms", default="2d,3d")
    ap.add_argument("--old-scan-rule", action="store_true",
                    help="scan threads by r31's rule (at most 2): a before and after of moe_read.default_scan_workers")
    ap.add_argument("--no-moe-scan", action="store_true",
                    help="build with BuildJob(scan_moe=False), as a background build on a GPU does")
    ap.add_argument("--gpu-scan", action="store_true", help="also time that scan on the GPU after the hand-over")
    ap.add_argument("--readers", type=int, default=None,
                    help="read on this many threads, not moe_read.default_readers' (up to 4); no effect with a --src "
                         "tree older than r35, which has no default_readers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gpu_scan:
        _GPU_SCAN.append(True)
    sys.path.insert(0, args.src or str(Path(__file__).resolve().parents[1] / "src"))
    if args.old_scan_rule:
        from vllm_lora_ext.formats import moe_read

        moe_read.default_scan_workers = lambda cores, readers: min(2, cores - readers)
    readers: Any = "moe_read's rule (up to 4)"
    if args.readers is not None:
        from vllm_lora_ext.formats import moe_read

        if hasattr(moe_read, "default_readers"):
            moe_read.default_readers = lambda cores, blocks: max(1, min(args.readers, blocks))
            readers = args.readers
        else:
            print("--readers: this tree has no moe_read.default_readers; it reads on its own rule", flush=True)
    import torch

    import vllm_lora_ext
    from bench_moe_load import E, H, I, make_adapter
    from vllm_lora_ext.building import BuildJob
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.planning import ModelSpec

    if not args.worker:
        from vllm_lora_ext.integration.build_child import _torch_threads

        torch.set_num_threads(_torch_threads())  # as the build process
    _instrument()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="probe-build-"))
    blocks = [f"model.layers.{layer}.mlp.experts" for layer in range(args.layers)]
    model = ModelSpec(frozenset(), moe={p: MoESpec(p, E, H, I) for p in blocks}, max_rank=16)
    result: dict[str, Any] = {"package": vllm_lora_ext.__file__, "layers": args.layers, "reps": args.reps,
                              "worker": args.worker, "torch_threads": torch.get_num_threads(), "forms": {}}
    rows = []
    result["scan_rule"] = "r31 (at most 2)" if args.old_scan_rule else "default_scan_workers"
    result["moe_scan"] = "none (BuildJob(scan_moe=False))" if args.no_moe_scan else "while read"
    result["readers"] = readers
    for form in args.forms.split(","):
        folder = work / form
        if not (folder / "adapter_model.safetensors").exists():
            make_adapter(folder, args.layers, form)
            os.sync()
        job = BuildJob(str(folder), "probe", model, dtype=torch.bfloat16,
                       **({"scan_moe": False} if args.no_moe_scan else {}))
        runs, profile = (_worker_builds if args.worker else _builds)(job, args.reps)
        med = {k: median([r[k] for r in runs]) for k in runs[0]}
        result["forms"][form] = {"median_s": med, "runs": runs, "profile": profile,
                                 "bare_s": _bare(folder / "adapter_model.safetensors") if args.bare else {}}
        rows += [[form, k, v] for k, v in med.items()]
        rows += [[form, f"bare: {k}", v] for k, v in result["forms"][form]["bare_s"].items()]
    print(f"package: {vllm_lora_ext.__file__}")
    print_table(rows, ["layout", "phase (median s; sums over threads exceed the build)", "seconds"])
    write_json("probe_build_shared", result, args.out)


if __name__ == "__main__":
    main()
