"""Process-wide thread pools for the plugin's reads, scans and copies, whose threads run torch's CPU ops alone.

Two costs are avoided. Starting a pool's threads for every load, milliseconds of each read; pools are lent
and kept ([`lent_pool`]). And nested parallelism: a vLLM engine process keeps torch's default intra-op
parallelism (an OpenMP team of one thread per core; vLLM lowers it to one only for its multi-process executor),
so each of a pool's threads would start a team of that size for every op large enough, 4 × 16 threads on a
16-core host, all copying memory at once. A pool thread here runs its ops on one OpenMP thread: the parallelism
is the pool's. Even with torch's default of 2 threads, a mix's 281 MiB composite on 4 copy threads takes about
1.4 times as long with the default in each thread as with one, and a 12-layer 2D expert adapter's build too.

The setting is OpenMP's per-thread one (``omp_set_num_threads`` on the pool's thread), made after torch's own
per-thread set-up of it (which runs once, on the thread's first use of torch's thread count);
``torch.set_num_threads`` would change the whole process's default.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, TypeVar

from vllm_lora_ext._util import run_all

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["copy_threads", "intra_op_threads", "lent_pool", "one_intra_op_thread", "run_in_pool", "start_pools"]

logger = logging.getLogger(__name__)

_IDLE: dict[tuple[str, int], list[ThreadPoolExecutor]] = {}
_IDLE_PID = [os.getpid()]
_LOCK = threading.Lock()
_MAX_IDLE = 4  # idle pools kept per name and size (concurrent loads each hold one while they run)


@contextlib.contextmanager
def lent_pool(name: str, workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of ``workers`` threads named ``name`` for the caller alone while the block runs, whose threads run
    torch ops on one OpenMP thread each ([`one_intra_op_thread`]).

    An idle pool made earlier in this process is lent if there is one, else a new one is made; it is kept for the
    next caller afterwards (at most four idle per name and size). Callers at the same time get pools of their
    own, as each load had before pools were kept, so that concurrent loads (a new mix's components, background
    builds) do not queue behind each other. A forked child makes its own (the parent's threads do not exist
    there). Everything given to the pool must be finished or cancelled before the block ends.
    """
    key = (name, workers)
    pid = os.getpid()
    with _LOCK:
        if _IDLE_PID[0] != pid:  # a forked child: the pools it inherited have no threads
            _IDLE.clear()
            _IDLE_PID[0] = pid
        idle = _IDLE.get(key)
        pool = idle.pop() if idle else None
    if pool is None:
        pool = ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=one_intra_op_thread)
    try:
        yield pool
    finally:
        if not (_IDLE_PID[0] == pid and _keep_idle(key, pool)):
            pool.shutdown(wait=False)


def run_in_pool(name: str, workers: int, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]`` on a pool lent for the call ([`lent_pool`]), results in order.

    If one call raises, the calls not started yet are dropped and the running ones finish before the error
    reaches the caller: nothing of this work is left running once it returns or raises.
    """
    with lent_pool(name, workers) as pool:
        return run_all(pool, fn, items)


def start_pools(wanted: Iterable[tuple[str, int]]) -> None:
    """Make the kept pools ``wanted`` (``(name, threads)``) with all their threads started, each set to one OpenMP
    thread, so that the first load lends them ready (a worker's start-up: finding the OpenMP runtime reads the
    process's memory map, 13 ms in a vLLM engine). Best effort: a pool whose threads do not all start (the host's
    thread limit, an initializer that raised, 5 s passed) is shut down and not kept; start-up goes on."""
    for name, workers in wanted:
        pool = ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=one_intra_op_thread)
        gate = threading.Barrier(workers)  # every task waits for all: each runs on a thread of its own
        futures = []
        try:
            for _ in range(workers):
                futures.append(pool.submit(gate.wait, 5.0))
            for future in futures:
                future.result()
        except Exception:  # noqa: BLE001 - start-up goes on; the first load makes its pool itself
            gate.abort()
            pool.shutdown(wait=False, cancel_futures=True)
            logger.debug("pool %s: not every thread started", name, exc_info=True)
            continue
        if not _keep_idle((name, workers), pool):
            pool.shutdown(wait=False)


def _keep_idle(key: tuple[str, int], pool: ThreadPoolExecutor) -> bool:
    """Keep ``pool`` idle under ``key`` for this process (at most `_MAX_IDLE` a key); whether it was kept."""
    if getattr(pool, "_broken", False):  # a thread's initializer raised: the pool takes no more work
        return False
    pid = os.getpid()
    with _LOCK:
        if _IDLE_PID[0] != pid:  # a forked child: the pools it inherited have no threads
            _IDLE.clear()
            _IDLE_PID[0] = pid
        idle = _IDLE.setdefault(key, [])
        if len(idle) >= _MAX_IDLE:
            return False
        idle.append(pool)
        return True


def copy_threads(cores: int) -> int:
    """OpenMP threads that fill GPU staging's pinned chunks (``staging._copy_through_pinned``) on a host of
    ``cores``, at most: half of them, up to 16 (8 on a 16-core host), or fewer where the thread has fewer.

    Each chunk's fill is one parallel copy that ends when its slowest thread does. A team of every core (torch's
    default in a TP=1 engine) shares cores with the engine thread, the API server and the build process while
    requests decode, and waits at every chunk for a thread the scheduler put off: on the 16-core H200 host a
    1,584 MiB span took 0.039 s alone and 0.41 s beside three spinning processes (r34,
    ``probe_stage_copy_h200_r34.json``), and 0.095-0.109 s in the serving engine under 32 decoding requests (r35).
    Half the cores (up to 16) leave the others to them; alone, 4 threads took twice as long as 16 (r29)."""
    return max(1, min(16, cores // 2))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run torch's CPU ops on the calling thread on at most ``n`` OpenMP threads while the block runs, then give
    the thread its own count back (the rest of the process keeps its setting). Never more than the thread has:
    where vLLM or the user set fewer (vLLM 0.33's workers run torch on one thread unless ``OMP_NUM_THREADS`` is
    set; TP > 1 workers share the cores), that count stays. Does nothing where torch's OpenMP runtime is not
    found."""
    import torch

    omp = _openmp()
    before = torch.get_num_threads()  # (torch's own per-thread set-up first: see `one_intra_op_thread`)
    if omp is None or before <= n:
        yield
        return
    omp.omp_set_num_threads(max(1, n))
    try:
        yield
    finally:
        omp.omp_set_num_threads(before)


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
