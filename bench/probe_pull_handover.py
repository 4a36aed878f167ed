"""Probe another hand-over for background builds on this host: the worker pulls the build from the build process's
own memory instead of a ``/dev/shm`` file (issue 39 item 4; a feasibility and cost probe, not a loader).

Today a build process reads an adapter's bytes into a shared ``/dev/shm`` file and the worker stages that file to the
GPU through pinned bounce chunks. On the H200 host, ``preadv`` into such a file took 0.276 s for 1.6 GB against
0.084 s into touched anonymous memory (4 threads, ``probe_build_h200_r26.json``): tmpfs pages there are 4 KiB
(shmem THP off). The alternative timed here, in one run:

- ``shm``: a child process ``preadv``s the file into a populated ``/dev/shm`` file (4 threads); this process maps
  that file fresh and stages it through ``transport.staging._copy_through_pinned`` (today's path);
- ``pull``: the child ``preadv``s into anonymous memory (``MADV_HUGEPAGE``, touched first); this process copies it
  with ``process_vm_readv`` (1 and 4 threads) into a pinned host buffer, then one host-to-device copy.

It also records what decides whether ``pull`` can work: the kernel, ``/proc/sys/kernel/yama/ptrace_scope``, shmem
and anonymous THP settings, and whether ``process_vm_readv`` from parent to child is allowed here (a container's
seccomp profile may refuse it). Each case checks the GPU bytes against the file. No stock counterpart.

Usage: python bench/probe_pull_handover.py [--mib 1584] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402

# The child: reads the file into memory of the given kind with 4 threads, says where it is and how long it took,
# then waits for a line on stdin before it exits (its memory stays readable until then).
_CHILD = r"""
import mmap, os, sys, time, torch
from concurrent.futures import ThreadPoolExecutor
path, kind, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "shm":
    dst = torch.from_file(sys.argv[4], shared=True, size=n, dtype=torch.uint8)
else:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    dst = torch.frombuffer(m, dtype=torch.uint8)
dst.view(-1, 4096)[:, 0].fill_(0)  # populated (the spare is, today)
fd = os.open(path, os.O_RDONLY)
step = (n + 3) // 4
def part(i):
    view = memoryview(dst.numpy())[i * step:min(n, (i + 1) * step)]
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], i * step + done)
t0 = time.perf_counter()
with ThreadPoolExecutor(4) as pool:
    list(pool.map(part, range(4)))
print(dst.data_ptr(), time.perf_counter() - t0, flush=True)
sys.stdin.readline()
"""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                                      ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _pull(pid: int, remote: int, local: int, n: int) -> None:
    libc = _libc()
    done = 0
    while done < n:
        take = min(n - done, 1 << 30)
        lo, re = _Iovec(local + done, take), _Iovec(remote + done, take)
        got = libc.process_vm_readv(pid, ctypes.byref(lo), 1, ctypes.byref(re), 1, 0)
        if got <= 0:
            raise OSError(ctypes.get_errno(), "process_vm_readv: " + os.strerror(ctypes.get_errno()))
        done += got


def _child(path: str, kind: str, n: int, shm: str = "") -> tuple[subprocess.Popen[str], int, float]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, path, kind, str(n), shm], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ptr, seconds = proc.stdout.readline().split()
    return proc, int(ptr), float(seconds)


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait()


def _shm_case(path: str, n: int, gpu: Any, stream: Any, tmp: str) -> dict[str, float]:
    import torch

    from vllm_lora_ext.transport import staging

    shm = os.path.join(tmp, "handover")
    proc, _, read_s = _child(path, "shm", n, shm)
    buf = torch.from_file(shm, shared=True, size=n, dtype=torch.uint8)
    t0 = time.perf_counter()
    size = n // 48
    staging._copy_through_pinned(gpu, [(i * size, buf[i * size:(i + 1) * size]) for i in range(48)], stream)
    stage_s = time.perf_counter() - t0
    _finish(proc)
    os.unlink(shm)
    return {"read_s": read_s, "stage_s": stage_s, "total_s": read_s + stage_s}


def _pull_case(path: str, n: int, gpu: Any, stream: Any, pinned: Any, threads: int) -> dict[str, float]:
    import torch

    proc, remote, read_s = _child(path, "anon", n)
    step = (n + threads - 1) // threads
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: _pull(proc.pid, remote + i * step, pinned.data_ptr() + i * step,
                                      min(n, (i + 1) * step) - i * step), range(threads)))
    pull_s = time.perf_counter() - t0
    with torch.cuda.stream(stream):
        gpu.copy_(pinned, non_blocking=True)
    stream.synchronize()
    h2d_s = time.perf_counter() - t0 - pull_s
    _finish(proc)
    return {"read_s": read_s, "pull_s": pull_s, "h2d_s": h2d_s, "total_s": read_s + pull_s + h2d_s}


def _facts() -> dict[str, str]:
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError as err:
            return f"unreadable: {err}"
    huge = [line for line in read("/proc/meminfo").splitlines() if line.startswith("Huge")]
    return {"kernel": os.uname().release, "ptrace_scope": read("/proc/sys/kernel/yama/ptrace_scope"),
            "shmem_thp": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "anon_thp": read("/sys/kernel/mm/transparent_hugepage/enabled"), "hugetlb": "; ".join(huge)}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1584)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = args.mib << 20
    facts = _facts()
    print(facts, flush=True)
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    stream = torch.cuda.Stream()
    results: dict[str, list[dict[str, float]]] = {"shm": [], "pull 1 thread": [], "pull 4 threads": []}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        src = os.path.join(tmp, "adapter.bin")  # the adapter file, in the page cache as a warm load finds it
        with open(src, "wb") as f:
            f.write(torch.arange(1 << 20).remainder_(251).to(torch.uint8).numpy().tobytes() * args.mib)
        expect = torch.from_file(src, shared=False, size=n, dtype=torch.uint8)[::4099].clone()
        for _ in range(args.reps):
            results["shm"].append(_shm_case(src, n, gpu, stream, tmp))
            assert torch.equal(gpu[::4099].cpu(), expect)
            gpu.zero_()
            for threads in (1, 4):
                try:
                    results[f"pull {threads} thread" + ("s" if threads > 1 else "")].append(
                        _pull_case(src, n, gpu, stream, pinned, threads))
                except OSError as err:
                    facts["pull_refused"] = str(err)
                    break
                assert torch.equal(gpu[::4099].cpu(), expect)
                gpu.zero_()
    rows = []
    for case, runs in results.items():
        if runs:
            rows.append([case] + [f"{median([r.get(k, 0.0) for r in runs]):.4f}"
                                  for k in ("read_s", "stage_s", "pull_s", "h2d_s", "total_s")])
    print_table(rows, ["case", "child read s", "stage s", "pull s", "h2d s", "total s"])
    write_json("probe_pull_handover", {"mib": args.mib, "reps": args.reps, "facts": facts, "results": results},
               args.out)


if __name__ == "__main__":
    main()
