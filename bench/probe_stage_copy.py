"""Probe what GPU staging of a build process's hand-over costs on this host, and where (issue 39 item 4; GPU).

A background build's adapter reaches the worker as a ``/dev/shm`` file another process wrote: the worker maps it
(``handover.from_shared``: ``torch.from_file``) and stages it through two pinned bounce chunks
(``transport.staging._copy_through_pinned``), the first touch of every page of the mapping included. The
no-stall bench logs this staging at 0.085-0.116 s for 1.2-1.6 GB on an H200 host (13.7-14.8 GB/s), against 53 GB/s
for a pinned host-to-device copy (``probe_host_memory_h200.json``). This times, on 48 regions of ``--mib`` in all,
each in a fresh mapping of a file written by a child process (so this process has none of its pages mapped), as
the worker sees it:

- ``staging``: ``_copy_through_pinned`` as the worker runs it (since r35 on ``pools.copy_threads`` OpenMP threads,
  half the cores; torch's default intra-op threads before);
- ``--threads 16,8,4``: also ``staging, N copy threads`` (``copy_threads`` made to answer N);
- ``populate, then staging``: ``madvise(MADV_POPULATE_READ)`` over the mapping first (Linux 5.14+), timed with it;
- ``staging, pages mapped``: the same mapping staged a second time (no page faults: the copy and DMA alone);
- ``pageable copy``: ``buffer.copy_(mapping)``, the driver's own staging;
- ``--regions 1152,1``: also ``staging`` over that many regions (a 2D expert adapter's 1,152 factors, as the worker
  copied them region by region until r34; one span, as ``transport.staging._as_stored`` lays a hand-over out now);
- ``--busy K``: K processes spinning on a core each meanwhile (the engine thread, the API server, the build
  process: what shares the host with the worker's staging while requests decode).

Each case checks the GPU buffer against the file's bytes. No stock counterpart: stock vLLM has no hand-over file.

Usage: python bench/probe_stage_copy.py [--mib 1584] [--reps 3] [--regions 1152,1] [--threads 16,8] [--busy K]
       [--cases 'staging;pageable copy']
       [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402

_MADV_POPULATE_READ = 22


def _write_file(path: str, nbytes: int) -> None:
    """Fill ``path`` with ``nbytes`` of a known pattern from a child process, as a build process does."""
    code = ("import sys,torch; n=int(sys.argv[2]); t=torch.from_file(sys.argv[1], shared=True, size=n, "
            "dtype=torch.uint8); p=torch.arange(1 << 20).remainder_(251).to(torch.uint8); "
            "t.view(-1, 1 << 20).copy_(p)")
    subprocess.run([sys.executable, "-c", code, path, str(nbytes)], check=True)


def _regions(buf: Any, count: int) -> list[tuple[int, Any]]:
    """``count`` equal regions covering ``buf``, at the same offsets in the GPU buffer."""
    size = buf.numel() // count
    return [(i * size, buf[i * size:(i + 1) * size]) for i in range(count)]


def _populate(buf: Any) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(buf.data_ptr(), buf.numel(), _MADV_POPULATE_READ) == 0


def _case(name: str, path: str, nbytes: int, gpu: Any, stream: Any) -> float:
    import torch

    from vllm_lora_ext.transport import staging

    buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # a fresh mapping: no page mapped
    rule = staging.copy_threads
    if name.endswith(" copy threads"):
        n = int(name.split(", ")[1].split()[0])
        staging.copy_threads = lambda cores: n  # type: ignore[assignment]
    t0 = time.perf_counter()
    if name == "populate, then staging" and not _populate(buf):
        print("MADV_POPULATE_READ refused (errno %d)" % ctypes.get_errno(), flush=True)
    if name == "staging, pages mapped":
        staging._copy_through_pinned(gpu, _regions(buf, 48), stream)
        t0 = time.perf_counter()
    count = int(name.split(", ")[1].split()[0]) if name.endswith(" regions") else 48
    if name == "pageable copy":
        with torch.cuda.stream(stream):
            gpu.copy_(buf, non_blocking=True)
        stream.synchronize()
    else:
        staging._copy_through_pinned(gpu, _regions(buf, count), stream)
    seconds = time.perf_counter() - t0
    staging.copy_threads = rule  # type: ignore[assignment]
    assert torch.equal(gpu[::4099].cpu(), buf[::4099]), name
    del buf
    return seconds


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1584)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--regions", default="", help="also stage over these many regions (comma-separated)")
    ap.add_argument("--threads", default="", help="also stage on these many copy threads (comma-separated)")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on a core each meanwhile")
    ap.add_argument("--cases", default="", help="only these of the fixed cases (names separated by ';')")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nbytes = args.mib << 20
    cases = ["staging", "populate, then staging", "staging, pages mapped", "pageable copy"]
    if args.cases:
        cases = [c for c in cases if c in args.cases.split(";")]
    cases += [f"staging, {int(n)} regions" for n in args.regions.split(",") if n]
    cases += [f"staging, {int(n)} copy threads" for n in args.threads.split(",") if n]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    times: dict[str, list[float]] = {c: [] for c in cases}
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            path = os.path.join(tmp, "handover")
            _write_file(path, nbytes)
            _case("staging", path, nbytes, gpu, stream)  # warm-up: the pinned chunks, CUDA
            for _ in range(args.reps):  # interleaved
                for c in cases:
                    times[c].append(_case(c, path, nbytes, gpu, stream))
    finally:
        for p in spinners:
            p.kill()
    rows = [[c, f"{median(t):.4f}", f"{args.mib / 1024 / median(t):.1f}"] for c, t in times.items()]
    print_table(rows, ["case", "median s", "GiB/s"])
    from vllm_lora_ext._util import usable_cores
    from vllm_lora_ext.transport.pools import copy_threads

    write_json("probe_stage_copy", {"mib": args.mib, "reps": args.reps, "torch_threads": torch.get_num_threads(),
                                    "copy_threads": copy_threads(usable_cores()),
                                    "busy_processes": args.busy,
                                    "kernel": os.uname().release, "gpu": torch.cuda.get_device_name(),
                                    "seconds": times, "median_s": {c: median(t) for c, t in times.items()}},
               args.out)


if __name__ == "__main__":
    main()
