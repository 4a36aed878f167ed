"""Process-wide thread pools for the plugin's reads, scans and copies, whose threads run torch's CPU ops alone.

Two costs are avoided. Starting a pool's threads for every load: on the 2-core dev VM that took 6-12 ms of a
50 ms expert-parallel read. And nested parallelism: a vLLM engine process keeps torch's default intra-op
parallelism (an OpenMP team of one thread per core; vLLM lowers it to one only for its multi-process executor),
so each of a pool's threads would start a team of that size for every op large enough, 4 × 16 threads on a
16-core host, all copying memory at once. A pool thread here runs its ops on one OpenMP thread: the parallelism
is the pool's. On the dev VM, with torch's default of 2 threads and runs interleaved, a mix's 281 MiB composite
on 4 copy threads took 130-147 ms with the default in each thread and 91-101 ms with one; a 12-layer 2D expert
adapter's build 275-318 ms and 196-229 ms. (The lent GPU hosts have 16 cores; this was not measured there.)

The setting is OpenMP's per-thread one (``omp_set_num_threads`` on the pool's thread), made after torch's own
per-thread set-up of it (which runs once, on the thread's first use of torch's thread count);
``torch.set_num_threads`` would change the whole process's default.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

__all__ = ["one_intra_op_thread", "shared_pool"]

logger = logging.getLogger(__name__)

_POOLS: dict[tuple[str, int], tuple[int, ThreadPoolExecutor]] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads named ``name``, made on first use and kept, whose threads run
    torch ops on one OpenMP thread each ([`one_intra_op_thread`]).

    A forked child gets a new pool (the parent's threads do not exist there). Work given to a shared pool
    must never wait for other work of the same pool: concurrent callers share its threads, and a task
    that waited on the pool could wait forever.
    """
    key = (name, workers)
    pid = os.getpid()
    with _POOLS_LOCK:
        got = _POOLS.get(key)
        if got is None or got[0] != pid:
            got = _POOLS[key] = (pid, ThreadPoolExecutor(workers, thread_name_prefix=name,
                                                         initializer=one_intra_op_thread))
        return got[1]


def one_intra_op_thread() -> None:
    """Make torch's CPU ops on the calling thread run on that thread alone (the rest of the process keeps its
    setting). Does nothing where torch's OpenMP runtime is not found."""
    import torch

    torch.get_num_threads()  # torch sets this thread's OpenMP team size on first use: let it, then override
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(1)


@lru_cache(maxsize=1)
def _openmp() -> Any:
    """The OpenMP runtime this process loaded for torch (GNU, Intel or LLVM), or ``None``."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if line.rstrip().endswith((".so", ".so.1", ".so.5"))]
    except OSError:
        return None
    for path in dict.fromkeys(paths):
        base = os.path.basename(path)
        if base.startswith(("libgomp", "libiomp", "libomp")):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                logger.debug("OpenMP runtime %s not usable", path, exc_info=True)
    return None
