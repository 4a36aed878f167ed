"""Probe the host paths a background build's bytes can take to the worker's staging copy (issue 39 item 4).

Today the build process reads an adapter into a shared ``/dev/shm`` file (its spare: pages taken and mapped for
writing) and the worker copies that file's bytes through pinned chunks to the GPU after the build. r31 copied each
block while the build ran instead (4cd47ef): the build slowed from 0.32-0.47 s to 0.49-0.63 s and the copy beside it
ran at 3.4-7.4 GB/s, so it was reverted (``results/no_stall_h200_r31_prestage.json``). This probe measures, on the
host alone, what the two fight over and which path is fastest, so that the next design is chosen on numbers:

- ``build``: a child process at nice 5 (as the build process) reads a page-cached file into its memory with 4 threads,
  32 MiB blocks, and reports each block done: into a populated shared ``/dev/shm`` file (``shm``, today's), into
  anonymous memory on transparent huge pages (``anon``), or into a ``memfd`` advised to use huge pages (``memfd``;
  whether it got them is reported, from ``/proc/<pid>/smaps``).
- ``copy``: this process copies every block into a bounce buffer (the pinned chunks' stand-in: two touched 32 MiB
  buffers, used in turn) by a ``method``: a private or shared mapping of the file (``mmap_private``,
  ``mmap_shared``), ``preadv`` from it (``pread``), or ``process_vm_readv`` from the child (``vm_readv``, ``anon``
  only), on 1 or 4 threads; ``after`` the build, or ``beside`` it, each block as soon as it is reported.

Each row: the build's time, the copy's time and rate, and what was left to copy when the build ended (``lag``).
No CUDA and no vLLM are needed; it has no stock counterpart (stock vLLM has no build process). The copies after the
build repeat, without a GPU, what ``probe_pull_handover.py`` timed in r29 (``results/probe_pull_handover_h200_r29.json``:
today's path 0.387 s, the pull from anonymous memory on 4 threads 0.289 s); what is new here is the copy beside the
build, and what it costs the build.

Usage: python bench/probe_stage_paths.py [--mib 1600] [--reps 3] [--dir /dev/shm] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

BLOCK = 32 << 20
READERS = 4
CASES = [("shm", "mmap_private"), ("shm", "mmap_shared"), ("shm", "pread"), ("anon", "vm_readv"),
         ("memfd", "pread"), ("memfd", "mmap_shared")]


# ------------------------------------------------------------------------------------------------ the child

def _huge_pages(addr: int) -> int:
    """Huge-page bytes of this process's mapping that starts at ``addr`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            inside = int(head[0].split("-")[0], 16) == addr
        elif inside and head and head[0] in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
            total += int(head[1]) << 10
    return total


def _child(kind: str, source: str, size: int, where: str) -> None:
    """Build: read ``source`` into memory of ``kind`` on 4 threads, 32 MiB blocks, reporting each on stdout."""
    os.nice(5)
    out = sys.stdout
    if kind == "anon":
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        name = ""
    else:
        if kind == "memfd":
            fd = os.memfd_create("probe-stage", 0)
            name = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            name = os.path.join(where, f"probe-stage-{os.getpid()}")
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        if kind == "memfd":
            buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    for off in range(0, size, 4096):  # pages taken and mapped for writing, as a spare is
        view[off] = 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    huge = _huge_pages(addr)
    print(f"ready {os.getpid()} {addr} {huge} {name}", file=out, flush=True)
    src = os.open(source, os.O_RDONLY)
    lock = threading.Lock()
    blocks = list(range(-(-size // BLOCK)))
    sys.stdin.readline()  # go
    t0 = time.perf_counter()

    def reader(r: int) -> None:
        for i in blocks[r::READERS]:
            lo, hi = i * BLOCK, min(size, (i + 1) * BLOCK)
            got = lo
            while got < hi:
                got += os.preadv(src, [view[got:hi]], got)
            with lock:
                print(f"block {lo} {hi - lo}", file=out, flush=True)

    with ThreadPoolExecutor(READERS) as pool:
        list(pool.map(reader, range(READERS)))
    print(f"done {time.perf_counter() - t0:.6f}", file=out, flush=True)
    sys.stdin.readline()  # kept mapped until the parent has copied
    if kind == "shm":
        os.unlink(name)


# ------------------------------------------------------------------------------------------------ the parent

class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)


def _vm_read(pid: int, local: int, remote: int, n: int) -> None:
    while n:
        got = _LIBC.process_vm_readv(pid, ctypes.byref(_IOVec(local, n)), 1, ctypes.byref(_IOVec(remote, n)), 1, 0)
        if got <= 0:
            raise OSError(ctypes.get_errno(), "process_vm_readv")
        local, remote, n = local + got, remote + got, n - got


class _Copier:
    """Copies blocks of the child's memory into two bounce buffers, in turn, on ``threads`` threads a block."""

    def __init__(self, method: str, ready: list[str], size: int, threads: int) -> None:
        self.method, self.size, self.threads = method, size, threads
        self.pid, self.addr, self.name = int(ready[1]), int(ready[2]), (ready[4] if len(ready) > 4 else "")
        self.bounce = [mmap.mmap(-1, BLOCK) for _ in range(2)]
        for b in self.bounce:
            b.write(b"\1" * BLOCK)
        self.k = 0
        self.fd = os.open(self.name, os.O_RDONLY) if method == "pread" else None
        if method.startswith("mmap"):
            fd = os.open(self.name, os.O_RDONLY if method == "mmap_private" else os.O_RDWR)
            flags = mmap.MAP_PRIVATE if method == "mmap_private" else mmap.MAP_SHARED
            self.map: Any = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            os.close(fd)
            self.src = memoryview(self.map)
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def copy(self, off: int, n: int) -> None:
        dst = self.bounce[self.k]
        self.k ^= 1
        step = -(-n // self.threads)
        parts = [(off + i * step, min(step, n - i * step), i * step) for i in range(self.threads) if i * step < n]
        if self.pool is None:
            for p in parts:
                self._part(dst, *p)
        else:
            list(self.pool.map(lambda p: self._part(dst, *p), parts))

    def _part(self, dst: Any, off: int, n: int, at: int) -> None:
        view = memoryview(dst)[at:at + n]
        if self.method == "vm_readv":
            _vm_read(self.pid, ctypes.addressof(ctypes.c_char.from_buffer(dst)) + at, self.addr + off, n)
        elif self.method == "pread":
            got = 0
            while got < n:
                got += os.preadv(self.fd, [view[got:]], off + got)
        else:
            view[:] = self.src[off:off + n]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        if self.fd is not None:
            os.close(self.fd)
        if self.method.startswith("mmap"):
            self.src.release()
            self.map.close()


def _one(source: str, size: int, where: str, case: tuple[str, str], threads: int, beside: bool) -> dict[str, Any]:
    kind, method = case
    child = subprocess.Popen([sys.executable, __file__, "--child", kind, source, str(size), where],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        ready = child.stdout.readline().split()
        copier = _Copier(method, ready, size, threads)
        child.stdin.write("go\n")
        child.stdin.flush()
        t0 = time.perf_counter()
        pending, built, t_built, copy_s = [], None, 0.0, 0.0
        for line in child.stdout:
            word = line.split()
            if word[0] == "block":
                if beside:
                    t = time.perf_counter()
                    copier.copy(int(word[1]), int(word[2]))
                    copy_s += time.perf_counter() - t
                else:
                    pending.append((int(word[1]), int(word[2])))
            elif word[0] == "done":
                built, t_built = float(word[1]), time.perf_counter()
                break
        t = time.perf_counter()
        for off, n in pending:
            copier.copy(off, n)
        copy_s += time.perf_counter() - t
        end = time.perf_counter()
        copier.close()
        return {"build_s": built, "copy_s": copy_s, "lag_s": end - t_built, "total_s": end - t0,
                "copy_gb_s": size / copy_s / 1e9 if copy_s else None, "huge_bytes": int(ready[3])}
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1600)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    size = args.mib << 20
    settings = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            settings[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            settings[name] = "unknown"
    results: dict[str, Any] = {"thp": settings, "cpus": os.cpu_count(), "mib": args.mib, "runs": {}}
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "adapter.bin")
        with open(source, "wb") as f:
            chunk = os.urandom(BLOCK)
            for _ in range(-(-size // BLOCK)):
                f.write(chunk)
        with open(source, "rb") as f:  # in the page cache, as an adapter read before is
            while f.read(BLOCK):
                pass
        for rep in range(args.reps):  # the cases interleaved rep by rep
            for case in CASES:
                for threads in (1, 4):
                    for beside in (False, True):
                        key = f"{case[0]} {case[1]} {threads}t {'beside' if beside else 'after'}"
                        try:
                            got = _one(source, size, args.dir, case, threads, beside)
                        except Exception as err:  # a path this host lacks (memfd, ptrace): reported, not fatal
                            got = {"error": f"{type(err).__name__}: {err}"}
                        results["runs"].setdefault(key, []).append(got)
    for key, runs in results["runs"].items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append([key, runs[0]["error"][:60], "", "", "", ""])
            continue
        med = {k: statistics.median(r[k] for r in ok) for k in ("build_s", "copy_s", "lag_s", "total_s")}
        results.setdefault("median", {})[key] = {**med, "huge_bytes": ok[0]["huge_bytes"]}
        rows.append([key, med["build_s"], med["copy_s"], size / med["copy_s"] / 1e9, med["lag_s"], med["total_s"]])
    print(f"THP {settings}, {os.cpu_count()} cpus, {args.mib} MiB, medians of {args.reps}")
    print_table(rows, ["case (memory, method, threads, when)", "build s", "copy s", "copy GB/s", "lag s", "total s"])
    write_json("probe_stage_paths", results, args.out)


if __name__ == "__main__":
    main()
