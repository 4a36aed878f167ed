"""Probe what host memory costs on this machine: where an adapter's read and copies spend their time.

Reads a file from the page cache into fresh memory, into memory backed by transparent huge pages (an anonymous
mapping with ``MADV_HUGEPAGE``) and into memory already touched, on 1 and 4 threads; times a composite-sized copy
the same three ways; and, with CUDA, what pinned memory costs (allocation, ``pin_memory()``, registering
memory in place) and host-to-device copies from each kind. No vLLM is needed. This is the measurement behind
the plugin's huge-page host arenas (``vllm_lora_ext.transport.arena``); it has no stock counterpart.

Usage: python bench/probe_host_memory.py [--mib 1600] [--copy-mib 281] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, timeit, write_json  # noqa: E402


def _thp_settings() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            out[name] = "unknown"
    return out


def _huge(n: int) -> Any:
    import torch

    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


def _read_into(fd: int, buf: Any, threads: int) -> None:
    n = buf.numel()
    view = memoryview(buf.numpy())
    step = -(-n // threads)

    def part(i: int) -> None:
        lo, hi = i * step, min(n, (i + 1) * step)
        got = lo
        while got < hi:
            got += os.preadv(fd, [view[got:hi]], got)

    if threads == 1:
        part(0)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(threads)))


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1600)
    ap.add_argument("--copy-mib", type=int, default=281)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.mib << 20
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"thp": _thp_settings(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.bin"
        with path.open("wb") as f:
            chunk = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
            for _ in range(-(-n // len(chunk))):
                f.write(chunk)
        fd = os.open(path, os.O_RDONLY)
        _read_into(fd, torch.empty(n, dtype=torch.uint8), 4)  # warm the page cache
        touched = torch.ones(n, dtype=torch.uint8)
        makers: dict[str, Callable[[], Any]] = {
            "fresh (torch.empty)": lambda: torch.empty(n, dtype=torch.uint8),
            "huge pages (MADV_HUGEPAGE)": lambda: _huge(n),
            "touched before": lambda: touched,
        }
        for threads in (1, 4):
            for label, make in makers.items():  # allocation included: a load allocates what it reads into
                times = timeit(lambda: _read_into(fd, make(), threads), runs=args.reps, warmup=0)
                results[f"read {threads}t {label}"] = times
                rows.append([f"read {args.mib} MiB, {threads} thread(s)", label, median(times), n / median(times) / 1e9])
        os.close(fd)
    m = args.copy_mib << 20
    src = torch.ones(m, dtype=torch.uint8)
    dst = torch.empty(m, dtype=torch.uint8)
    dst.copy_(src)
    for label, make in {"fresh (torch.empty)": lambda: torch.empty(m, dtype=torch.uint8),
                        "huge pages (MADV_HUGEPAGE)": lambda: _huge(m), "touched before": lambda: dst}.items():
        times = timeit(lambda: make().copy_(src), runs=args.reps, warmup=0)
        results[f"copy {label}"] = times
        rows.append([f"copy {args.copy_mib} MiB, 1 thread", label, median(times), m / median(times) / 1e9])
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()
        cases: dict[str, Callable[[], Any]] = {
            "torch.empty(pin_memory=True)": lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True),
            "pin_memory() of a filled tensor": lambda: touched.pin_memory(),
        }
        for label, fn in cases.items():
            times = timeit(fn, runs=args.reps, warmup=0)
            results[f"pin {label}"] = times
            rows.append([f"pinned {args.mib} MiB", label, median(times), n / median(times) / 1e9])
        cudart = torch.cuda.cudart()

        def register() -> None:
            buf = _huge(n)
            buf.fill_(1)
            t0 = time.perf_counter()
            assert int(cudart.cudaHostRegister(buf.data_ptr(), n, 0)) == 0
            results.setdefault("register only", []).append(time.perf_counter() - t0)
            cudart.cudaHostUnregister(buf.data_ptr())

        times = timeit(register, runs=args.reps, warmup=0)
        rows.append([f"pinned {args.mib} MiB", "fill huge pages + cudaHostRegister", median(times),
                     n / median(times) / 1e9])
        rows.append([f"pinned {args.mib} MiB", "cudaHostRegister alone", median(results["register only"]),
                     n / median(results["register only"]) / 1e9])
        gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
        pinned = touched.pin_memory()
        for label, host in {"pinned": pinned, "pageable (touched)": touched}.items():
            def h2d(h: Any = host) -> None:
                gpu.copy_(h, non_blocking=True)
                torch.cuda.synchronize()

            times = timeit(h2d, runs=args.reps, warmup=0)
            results[f"h2d {label}"] = times
            rows.append([f"host to device {args.mib} MiB", label, median(times), n / median(times) / 1e9])
    print_table(rows, ["what", "memory", "median s", "GB/s"])
    print("transparent huge pages:", results["thp"])
    write_json("probe_host_memory", {"results": results, "table": rows}, args.out)


if __name__ == "__main__":
    main()
